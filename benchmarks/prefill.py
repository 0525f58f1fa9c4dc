"""The burst's batched prefill on the real model, three ways, timed in turn in one run.

    python benchmarks/prefill.py                # medians of 3
    python benchmarks/prefill.py --repeats 5 --threads 2
    python benchmarks/prefill.py --vllm         # and vLLM's on the two serve_bench prefills

A burst shaped like ``benchmarks/vs_vllm.py``'s, on random token ids: 16 requests, a
500-token shared prefix and 50 tokens of their own each, pages of 128. The first request
is prefilled alone; the other 15 then find 384 tokens cached (three whole pages) and
prefill 166 each together, the first 116 of which are the same tokens in all 15. That
second step is timed:

1. transformers' forward over chapter 04's ``PoolCache`` (every request's cached K/V
   gathered in every layer);
2. ``llama_forward``, the shared prefix not gathered per request (on a CPU in fp32 read in
   the pool by minirt's attention kernel, elsewhere gathered once per layer);
3. the same with the run of new tokens they all begin with computed once (``PrefillPlan``,
   what the engine does).

Each way runs on its own engine, the engines stepped in turn; the first tokens of all 16
must agree across the three.

Then the profiler's split of the prefills ``benchmarks/serve_bench.py`` sends: one at a
time at concurrency 1, a 576-token prompt with nothing cached (``random``) and 64 new
tokens behind a cached 512-token prefix (``prefix_repetition``); and four 576-token
prompts at once, what ``random`` sends at concurrency 4 (its requests finish together and
the next four arrive together), prefilled in two chunked steps of the servers' 2,048-token
budget. Per prefill: the median time to every first token, and the GEMMs', attention's and
the rest's time, with the rate the GEMMs and attention reach (FLOP counted from the
model's shapes), which says which kernel bounds a prefill. ``--vllm`` then runs the same
prompts through vLLM's offline ``LLM`` (in ``.venv-vllm``, ``benchmarks/vllm_prefill.py``,
its budget set to its server's 2,048) and prints both side by side: wall time, GEMMs and
attention, minirt/vLLM.

Timings on a shared machine are noisy: run it on a quiet one; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch
from _setup import print_split, run_in_vllm, timing_model

from minirt.engine import Engine
from minirt.request import Request

BURST, SHARED, OWN, PAGE = 16, 500, 50, 128


def burst(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(1000, vocab, (SHARED,), generator=gen).tolist()
    return [shared + torch.randint(1000, vocab, (OWN,), generator=gen).tolist()
            for _ in range(BURST)]


def second_step(engine: Engine, prompts: list[list[int]], direct: bool) -> tuple[float, list]:
    """Flush, submit the burst, step once (the first request alone), time the second step
    (the other 15 prefilled together); returns its seconds and every first token.
    ``direct``: False runs transformers' forward over the pool instead of ``llama_forward``."""
    engine.flush()
    handles = [engine.submit(Request(prompt=p, max_new_tokens=1, stop_on_eos=False))
               for p in prompts]
    with mock.patch("minirt.forward.is_llama", lambda m: direct):
        engine.step()
        start = time.perf_counter()
        out = engine.step()
        seconds = time.perf_counter() - start
        assert len(out.admitted) == BURST - 1, "the 15 were not prefilled together"
        while engine.has_work:
            engine.step()
    return seconds, [h.output_ids[0] for h in handles]


def prefill_flops(model, new: int, cached: int, batch: int) -> dict[str, float]:
    """FLOP of ``batch`` requests' prefill of ``new`` tokens each behind ``cached``: the GEMMs
    (every layer's projections for every new token, the output head for each request's last)
    and attention (q.k and p.v for every key each new token sees)."""
    c = model.config
    layer = sum(m.weight.numel() for m in model.model.layers[0].modules()
                if isinstance(m, torch.nn.Linear))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    keys_seen = new * cached + new * (new + 1) // 2
    return {"linear layers (GEMMs)": 2.0 * batch * (new * layer * c.num_hidden_layers
                                                    + model.lm_head.weight.numel()),
            "attention": 4.0 * batch * c.num_hidden_layers * c.num_attention_heads
            * head_dim * keys_seen}


def timed_prefill(engine: Engine, prompts: list[list[int]], cached: int) -> float:
    """Seconds from submitting ``prompts`` together to every one's first token (the cache
    emptied first when nothing should be cached); checks that ``cached`` of each one's
    tokens came from the tree."""
    if not cached:
        engine.flush()
    handles = [engine.submit(Request(prompt=p, max_new_tokens=1, stop_on_eos=False))
               for p in prompts]
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    assert all(h.cached_tokens == cached for h in handles), "the prefix was not cached"
    return seconds


def serve_bench_prefills(vocab: int, repeats: int) -> dict:
    """serve_bench's prefills, drawn once for both engines: a shared prefix and, per case,
    the new and cached tokens of each prompt, and ``1 + 2 * repeats`` runs of prompts sent
    together (a warm-up, the timed ones, the profiled ones)."""
    gen = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, vocab, (n,), generator=gen).tolist()

    prefix, runs = tokens(512), 1 + 2 * repeats
    return {"prefix": prefix, "cases": {
        "576 tokens, nothing cached": {
            "new": 576, "cached": 0, "prompts": [[tokens(576)] for _ in range(runs)]},
        "64 tokens behind 512 cached": {
            "new": 64, "cached": 512, "prompts": [[prefix + tokens(64)] for _ in range(runs)]},
        "4 x 576 tokens, nothing cached": {
            "new": 576, "cached": 0,
            "prompts": [[tokens(576) for _ in range(4)] for _ in range(runs)]}}}


def profile_prefills(model, spec: dict, repeats: int) -> dict[str, dict[str, float]]:
    """The spec's prefills on minirt's engine as ``minirt.serve`` runs it (chunked prefill,
    a 2,048-token budget), each timed alone, then profiled; returns each one's seconds:
    median wall, GEMMs and attention under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(model, capacity=8192, page_size=1, token_budget=2048,
                    chunked_prefill=True)
    result = {}
    for name, case in spec["cases"].items():
        cached, runs = case["cached"], iter(case["prompts"])
        if cached:  # the prefix goes into the tree once
            engine.generate([Request(prompt=spec["prefix"], max_new_tokens=1,
                                     stop_on_eos=False)], progress=False)
        timed_prefill(engine, next(runs), cached)  # warm-up
        wall = statistics.median(timed_prefill(engine, next(runs), cached)
                                 for _ in range(repeats))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled = sum(timed_prefill(engine, next(runs), cached)
                           for _ in range(repeats)) / repeats
        print(f"\nPrefill, {name}: {wall * 1e3:.1f} ms (median of {repeats}; "
              f"{profiled * 1e3:.1f} ms under the profiler)")
        batch = len(case["prompts"][0])
        split = print_split(prof.key_averages(), profiled, repeats,
                            prefill_flops(model, case["new"], cached, batch))
        result[name] = {"wall": wall, "gemm": split["linear layers (GEMMs)"],
                        "attention": split["attention"]}
    return result


def vllm_side_by_side(mine: dict[str, dict[str, float]], spec: dict, repeats: int) -> None:
    """The same prompts through vLLM's offline ``LLM`` (``vllm_prefill.py``, in
    ``.venv-vllm``), run after minirt's; a table of both and minirt/vLLM."""
    theirs = run_in_vllm("vllm_prefill.py", {**spec, "repeats": repeats})
    print(f"\nThe same prefills through vLLM's LLM.generate, run after minirt's (median of "
          f"{repeats}; GEMMs and attention under the profiler, ms):")
    print(f"   {'prefill':<30} {'part':<10} {'vLLM':>8} {'minirt':>8} {'minirt/vLLM':>12}")
    for name, m in mine.items():
        for part in ("wall", "gemm", "attention"):
            v = theirs[name][part]
            print(f"   {name:<30} {part:<10} {v * 1e3:8.1f} {m[part] * 1e3:8.1f} "
                  f"{m[part] / v:12.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vllm", action="store_true",
                   help="also serve_bench's prefills through vLLM (needs .venv-vllm)")
    args = p.parse_args()
    model = timing_model(args.threads)
    ways = {  # name: (llama_forward, the common run computed once)
        "transformers' forward over the pool (gather)": (False, True),
        "llama_forward, no per-request gather": (True, False),
        "+ the common run computed once (minirt)": (True, True),
    }
    engines = {}
    for name, (_, share_runs) in ways.items():
        engines[name] = Engine(model, capacity=16384, page_size=PAGE, token_budget=4096)
        engines[name].lifecycle.share_runs = share_runs
    warm = burst(model.config.vocab_size, seed=1)
    for name, (direct, _) in ways.items():
        second_step(engines[name], warm, direct)
    prompts = burst(model.config.vocab_size, seed=2)
    times: dict[str, list[float]] = {name: [] for name in ways}
    firsts = set()
    for _ in range(args.repeats):
        for name, (direct, _) in ways.items():
            seconds, tokens = second_step(engines[name], prompts, direct)
            times[name].append(seconds)
            firsts.add(tuple(tokens))
    print(f"\nThe burst's second step: 15 requests x 166 new tokens behind 384 cached "
          f"(median of {args.repeats}, the ways in turn)")
    base = statistics.median(next(iter(times.values())))
    for name, t in times.items():
        m = statistics.median(t)
        print(f"   {name:<48} {m:6.2f} s  {m / base:5.2f}x")
    print(f"   the same first tokens all ways: {len(firsts) == 1}")
    assert len(firsts) == 1, "the three ways disagree on a first token"
    spec = serve_bench_prefills(model.config.vocab_size, args.repeats)
    mine = profile_prefills(model, spec, args.repeats)
    if args.vllm:
        vllm_side_by_side(mine, spec, args.repeats)
    print(f"\nload average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
