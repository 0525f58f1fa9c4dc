"""minirt's decode step on the real model: ms per step against batch size and context.

    python benchmarks/decode.py                     # the grid and the profiler's split
    python benchmarks/decode.py --batches 16 --contexts 512 --steps 16
    python benchmarks/decode.py --threads 2         # torch threads (default: torch's choice)
    python benchmarks/decode.py --no-grid --no-choices --vllm   # and vLLM's, side by side

1. The grid: ``B`` requests (1-32) whose prompts are ``C`` tokens long (128-2,048) run
   through ``Engine`` until all of them are decoding; then ``--steps`` more
   ``Engine.step()`` calls are timed, each one decode step for the whole batch (median ms
   per step; tokens/s = B / step time). The prompts share all but their last 16 tokens,
   so filling the batch costs one prefill of C tokens instead of B: every request still
   attends to its own C positions, and nothing in a decode step reads the tree.
2. The profiler's split of one decode step at ``--profile-at`` (batch, context):
   the linear layers (GEMMs), attention, K/V traffic between the pool and attention
   (gathers, writes, appends), every other op, and the time outside any op (Python).
3. The same step built up one change at a time, the eight engines stepped in turn:
   gathering every request's K/V from the pool in every layer with transformers' sdpa
   and seven GEMMs per layer (minirt before), then attention with one query row per
   K/V head, fused q/k/v and gate/up projections, prepacked (oneDNN) weights, the
   working K/V rows run by ``llama_forward`` (no transformers cache, mask or dispatch),
   the shared prefix held and read once for the batch, minirt's decode kernel
   (``minirt/csrc/decode.c``) for attention instead of torch's, and its kernels for
   RMSNorm, RoPE and SiLU times up (``minirt/csrc/layer.c``; minirt now).
4. ``--vllm``: the decode step at serve_bench's shapes (1, 4 and 16 requests behind its 4
   prefixes of 512 tokens, 64 of their own each), through minirt's ``Engine.generate`` and
   then vLLM's offline ``LLM`` (in ``.venv-vllm``, ``benchmarks/vllm_decode.py``), measured
   the same way on both: a call of 34 tokens less one of 2, over 32, fresh prompts each.
5. ``--vllm`` also: those steps' GEMMs alone, minirt's kernels (``kernels.gemv`` on one
   row, oneDNN on its prepacked weights on more) against vLLM's (one process, alternated,
   random weights at the model's shapes: ``vllm_decode.gemm_steps``).
6. Decode attention alone at section 4's shapes, minirt's decode kernel against torch's
   path (``cascade_decode``'s two attention calls and merge), every layer's K/V its own.

Timings on a shared machine are noisy: run it on a quiet one; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
from _setup import print_split, run_in_vllm, timing_model

from minirt.engine import Engine
from minirt.model import ATTENTION, load_model
from minirt.request import Request
from minirt.working_set import WorkingKV

OWN = 16  # tokens of each prompt that differ between requests


def batch_engine(model, batch: int, context: int, steps: int, seed: int = 0) -> Engine:
    """An engine with ``batch`` requests of ``context`` prompt tokens, all decoding."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    shared = torch.randint(1000, vocab, (context - OWN,), generator=gen).tolist()
    capacity = -(-(context + batch * (OWN + steps + 16)) // 1024) * 1024
    engine = Engine(model, capacity=capacity, token_budget=context + batch * OWN)
    for _ in range(batch):
        own = torch.randint(1000, vocab, (OWN,), generator=gen).tolist()
        engine.submit(Request(prompt=shared + own, max_new_tokens=steps + 8,
                              stop_on_eos=False))
    while engine.waiting:
        engine.step()
    engine.step()  # one decode step with the batch complete: warm-up
    return engine


def step_times(engine: Engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = engine.step()
        times.append(time.perf_counter() - start)
        assert not out.admitted and not out.finished, "the batch changed while timed"
    return times


def grid(model, batches: list[int], contexts: list[int], steps: int) -> None:
    print(f"\n1. Decode ms per step (median of {steps} steps; tokens/s in brackets)")
    print(f"{'context':>8} " + " ".join(f"{'B=' + str(b):>16}" for b in batches))
    for c in contexts:
        cells = []
        for b in batches:
            t = statistics.median(step_times(batch_engine(model, b, c, steps), steps))
            cells.append(f"{t * 1e3:7.1f} ({b / t:5.0f}/s)")
        print(f"{c:>8} " + " ".join(f"{x:>16}" for x in cells), flush=True)


def profile_split(model, batch: int, context: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = batch_engine(model, batch, context, steps)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_times(engine, steps)
    wall = (time.perf_counter() - start) / steps
    print(f"\n2. One decode step at B={batch}, context {context}: {wall * 1e3:.1f} ms under the "
          f"profiler (mean of {steps})")
    print_split(prof.key_averages(), wall, steps)


def no_decode_kernel(off: bool = True):
    """A context in which ``cascade_decode`` takes torch's path (two attention calls and
    the log-sum-exp merge) instead of minirt's decode kernel, where ``off``."""
    from unittest import mock

    return mock.patch("minirt.kernels.decode", lambda *a, **k: None) if off else nullcontext()


def no_layer_kernels(off: bool = True):
    """A context in which RMSNorm, RoPE and SiLU times up run as torch's operations
    instead of minirt's kernels (``kernels.rms_norm``, ``rope``, ``silu_mul``), where
    ``off``."""
    from contextlib import ExitStack
    from unittest import mock

    stack = ExitStack()
    if off:
        for name, refusal in (("rms_norm", None), ("rope", False), ("silu_mul", None)):
            stack.enter_context(mock.patch(f"minirt.kernels.{name}",
                                           lambda *a, refusal=refusal, **k: refusal))
    return stack


def decode_attention(model, repeats: int) -> None:
    """Decode attention alone at serve_bench's shapes, minirt's kernel against torch's
    path, every layer with K/V of its own (as in a step, each layer's keys come from
    memory, not from the cache the layer before left), the two alternated."""
    from minirt.attention import PrefixGroups, cascade_decode

    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads, d = cfg.num_key_value_heads, cfg.hidden_size // heads
    gen = torch.Generator().manual_seed(3)
    shapes = {1: (0, 512 + 64 + 24), 4: (0, 512 + 64 + 24), 16: (4, 64 + 24)}  # groups, own keys
    print(f"\n6. Decode attention alone, all {layers} layers of a step, ms (median of "
          f"{repeats}, alternated): serve_bench's batches, 24 tokens into the answers; at 16 "
          "requests, 4 groups of 4 behind 512-token prefixes (at 1 and 4 each request is alone)")
    print(f"   {'requests':>8} {'torch':>8} {'kernel':>8} {'kernel/torch':>13}")
    for b, (g, own) in shapes.items():
        q = torch.randn(layers, b, heads, 1, d, generator=gen)
        k, v = (torch.randn(layers, b, kv_heads, own, d, generator=gen) for _ in range(2))
        pk, pv = (torch.randn(layers, max(g, 1), kv_heads, 512, d, generator=gen)
                  for _ in range(2))
        groups = PrefixGroups.of([list(range(i, b, g)) for i in range(g)], [512] * g)

        def step(q=q, k=k, v=v, pk=pk, pv=pv, groups=groups) -> float:
            start = time.perf_counter()
            for i in range(layers):
                cascade_decode(q[i], k[i], v[i], None, pk[i], pv[i], groups, d ** -0.5)
            return time.perf_counter() - start

        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for kernel in (False, True):
                with no_decode_kernel(not kernel):
                    step()
                    times[kernel].append(step())
        torch_ms, kernel_ms = (statistics.median(times[x]) * 1e3 for x in (False, True))
        print(f"   {b:>8} {torch_ms:8.2f} {kernel_ms:8.2f} {kernel_ms / torch_ms:13.2f}")


def choices(batch: int, context: int, steps: int) -> None:
    """The decode step built up one change at a time, the engines stepped in turn."""
    from unittest import mock

    from minirt.model import fuse_projections

    plain, fused, packed = (load_model(dtype=torch.float32)[0] for _ in range(3))
    fuse_projections(fused, prepack=False)
    fuse_projections(packed)
    variants = {  # name: (model, attention, keep the working K/V, share its prefix,
        #                  minirt's kernels: 0 none, 1 decode attention, 2 and the layer's)
        "gather each layer, transformers' sdpa, 7 GEMMs": (plain, "sdpa", False, False, 0),
        "+ one query row per K/V head": (plain, ATTENTION, False, False, 0),
        "+ q/k/v and gate/up fused (4 GEMMs)": (fused, ATTENTION, False, False, 0),
        "+ prepacked weights": (packed, ATTENTION, False, False, 0),
        "+ working K/V rows, llama_forward": (packed, ATTENTION, True, False, 0),
        "+ shared prefix read once": (packed, ATTENTION, True, True, 0),
        "+ minirt's decode kernel": (packed, ATTENTION, True, True, 1),
        "+ its RMSNorm, RoPE and SiLU kernels (minirt)": (packed, ATTENTION, True, True, 2),
    }
    engines = {}
    for name, (model, attention, keep, share, _) in variants.items():
        model.set_attn_implementation(attention)
        # Engine() fuses the model it serves; the unfused variants must stay unfused.
        with mock.patch("minirt.engine.fuse_projections", lambda m: 0):
            engines[name] = engine = batch_engine(model, batch, context, steps + 2)
        if not keep:
            engine.lifecycle.working = None
        elif not share:  # every position in the rows: no prefix is ever long enough
            engine.lifecycle.working = WorkingKV(engine.pool, min_prefix=sys.maxsize)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(steps):
        for name, (model, attention, keep, _, kernel) in variants.items():
            model.set_attn_implementation(attention)
            # Without the working rows a decode step is transformers' forward over the
            # pool (chapter 04's PoolCache), as it was before llama_forward.
            with (mock.patch("minirt.forward.is_llama", lambda m, keep=keep: keep),
                  no_decode_kernel(kernel < 1), no_layer_kernels(kernel < 2)):
                times[name] += step_times(engines[name], 1)
    plain.set_attn_implementation(ATTENTION)
    outputs = {tuple(tuple(j.output_ids) for j in e.running) for e in engines.values()}
    print(f"\n3. The decode step at B={batch}, context {context}, one change at a time "
          f"(median ms of {steps} steps, engines stepped in turn)")
    base = statistics.median(next(iter(times.values())))
    for name, t in times.items():
        m = statistics.median(t)
        print(f"   {name:<48} {m * 1e3:8.1f} ms  {m / base:5.2f}x")
    print(f"   same tokens in all {len(variants)}: {len(outputs) == 1}")


SHORT, LONG = 2, 34  # tokens per call: the step is their difference over LONG - SHORT
DECODE_BATCHES = (1, 4, 16)  # requests per batch, as serve_bench's concurrencies


def serve_bench_batches(vocab: int, repeats: int) -> dict:
    """Prompts for ``--vllm``, drawn once for both engines: serve_bench's prefixes (read
    from ``closed_loop``), a warm-up batch, and per batch size and repeat two batches of
    fresh prompts, request ``i`` behind prefix ``i % 4`` (as the client sends them)."""
    from closed_loop import prompts_for

    pool = iter(prompts_for(vocab, 4 + 2 * repeats * sum(DECODE_BATCHES), seed=7))

    def batch(n: int) -> list[list[int]]:
        return [next(pool) for _ in range(n)]

    return {"short": SHORT, "long": LONG, "warmup": batch(4),
            "batches": {str(b): [(batch(b), batch(b)) for _ in range(repeats)]
                        for b in DECODE_BATCHES}}



def engine_decode_steps(model, spec: dict) -> dict[str, float]:
    """``serve_bench_batches``' prompts through minirt's ``Engine.generate``: per batch
    size, the median over repeats of (the LONG call - the SHORT call) / (LONG - SHORT)."""
    from serve_bench import vllm_kv_tokens

    engine = Engine(model, capacity=vllm_kv_tokens(model.name_or_path))

    def run(prompts: list[list[int]], tokens: int) -> float:
        start = time.perf_counter()
        engine.generate([Request(prompt=p, max_new_tokens=tokens, stop_on_eos=False)
                         for p in prompts], progress=False)
        return time.perf_counter() - start

    run(spec["warmup"], SHORT)
    return {b: statistics.median((run(long, LONG) - run(short, SHORT)) / (LONG - SHORT)
                                 for short, long in reps)
            for b, reps in spec["batches"].items()}


def vllm_side_by_side(model, repeats: int) -> None:
    """The decode step at serve_bench's batches, minirt's then vLLM's (``vllm_decode.py``
    in ``.venv-vllm``), with minirt/vLLM."""
    spec = serve_bench_batches(model.config.vocab_size, repeats)
    mine = engine_decode_steps(model, spec)
    result = run_in_vllm("vllm_decode.py", {**spec, "gemms": gemm_shapes(model)})
    theirs = result["steps"]
    print(f"\n4. The decode step behind serve_bench's 4 prefixes (512 + 64 tokens each), "
          f"ms, median of {repeats}: ({LONG}-token call - {SHORT}-token call) / {LONG - SHORT}")
    print(f"   {'requests':>8} {'vLLM':>8} {'minirt':>8} {'minirt/vLLM':>12}")
    for b in spec["batches"]:
        print(f"   {b:>8} {theirs[b] * 1e3:8.1f} {mine[b] * 1e3:8.1f} "
              f"{mine[b] / theirs[b]:12.2f}")
    print(f"\n5. The same steps' GEMMs alone ({len(result['gemms'])} batch sizes; "
          "random weights at the model's shapes, the two kernels alternated in one "
          "process), ms per step:")
    print(f"   {'requests':>8} {'vLLM onednn_mm':>15} {'minirt':>14} {'minirt/vLLM':>12}"
          "   (minirt: gemv on 1 row, oneDNN prepacked on more)")
    for b, t in result["gemms"].items():
        print(f"   {b:>8} {t['vllm'] * 1e3:15.1f} {t['minirt'] * 1e3:14.1f} "
              f"{t['minirt'] / t['vllm']:12.2f}")


def gemm_shapes(model) -> dict:
    """The decode step's GEMMs as ``vllm_decode.gemm_steps`` takes them, read off the
    model's own weights: [out, in] of the fused q/k/v, o, fused gate/up and down
    projections of a layer, the layer count, and the head."""
    layers = model.model.layers
    attn, mlp = layers[0].self_attn, layers[0].mlp

    def stacked(*linears) -> list[int]:  # the rows of one fused GEMM
        return [sum(lin.out_features for lin in linears), linears[0].in_features]

    return {"shapes": [stacked(attn.q_proj, attn.k_proj, attn.v_proj), stacked(attn.o_proj),
                       stacked(mlp.gate_proj, mlp.up_proj), stacked(mlp.down_proj)],
            "layers": len(layers), "head": stacked(model.lm_head),
            "rows": list(DECODE_BATCHES)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-at", type=int, nargs=2, default=[16, 600],
                   metavar=("BATCH", "CONTEXT"))
    p.add_argument("--no-grid", action="store_true", help="skip the grid")
    p.add_argument("--no-choices", action="store_true", help="skip the step-by-step table")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vllm", action="store_true",
                   help="also the decode step at serve_bench's shapes, minirt's and vLLM's "
                        "(needs .venv-vllm)")
    p.add_argument("--repeats", type=int, default=3, help="repeats for --vllm")
    args = p.parse_args()
    model = timing_model(args.threads)
    if not args.no_grid:
        grid(model, args.batches, args.contexts, args.steps)
    profile_split(model, *args.profile_at, args.steps)
    if not args.no_choices:
        choices(*args.profile_at, args.steps)
    if args.vllm:
        vllm_side_by_side(model, args.repeats)
    decode_attention(model, 7)
    print(f"\nload average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
