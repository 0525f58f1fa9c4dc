"""The deterministic mode's cost against the default mode, in one run, on the real model.

``python benchmarks/deterministic.py [--dtype bf16] [--threads 2] [--repeats 3]``

1. TTFT: one request's prefill of a ``--context``-token prompt, uncached, and the same
   prompt's last ``--suffix`` tokens after its cached prefix.
2. Decode ms per step: a batch of ``--batch`` requests behind one shared prefix, the
   median step.
3. The burst: ``--burst`` requests behind one system prompt, served to completion
   (``--new`` tokens each) by a fresh engine (the first request warms the prefix).

Each measurement alternates the two modes (``Engine(deterministic=False)`` and ``True``)
and reports medians and the ratio; the greedy tokens of the burst are compared with one
request served alone, in both modes (the mismatch count is the number of requests whose
tokens differ). ``--probe`` first prints, for fp32 and bf16, the row counts ``M`` at which
some row of ``x[:M] @ w.T`` changes bits on this machine (``llama.MIN_ROWS``' reason),
on the plain kernel and on the prepacked one where oneDNN packs the dtype.
The load average is printed beside the numbers: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from minirt.engine import Engine
from minirt.model import load_model
from minirt.request import Request


def probe(rows: list[int]) -> None:
    """For the plain and the prepacked (oneDNN) GEMM, fp32 and bf16, on a layer's shape, at
    torch's thread count: the row counts M at which some row of ``x[:M] @ w.T`` has other
    bits than the same row alone, padded to ``MIN_ROWS`` rows (every row, not only row 0)."""
    from minirt.llama import MIN_ROWS
    from minirt.model import _linear, onednn_packs

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(1536, 576, generator=gen).to(dtype)
        x = torch.randn(max(rows), 576, generator=gen).to(dtype)
        kernels = [("plain", lambda a, w=w: torch.nn.functional.linear(a, w))]
        if onednn_packs(dtype):  # bf16 needs AVX-512 or AVX-NE-CONVERT
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            kernels.append(("prepacked", lambda a, w=w, p=packed: _linear(a, w, None, p)))
        else:
            print(f"probe {dtype} prepacked: oneDNN does not pack {dtype} on this CPU")
        for kernel, product in kernels:
            pad = x.new_zeros(MIN_ROWS - 1, x.shape[1])
            moved = []
            for m in rows:
                y = product(x[:m])
                bad = [r for r in range(m)
                       if not torch.equal(y[r], product(torch.cat([x[r:r + 1], pad]))[0])]
                if bad:
                    moved.append(f"{m}: rows {bad[:4]}{'...' if len(bad) > 4 else ''}")
            print(f"probe {dtype} {kernel}, {torch.get_num_threads()} threads: counts with "
                  f"rows other than alone: {'; '.join(moved) or 'none'}")


def ttft(model, deterministic: bool, prompt: list[int], cached: int) -> float:
    engine = Engine(model, capacity=len(prompt) + 64, deterministic=deterministic,
                    token_budget=len(prompt))
    if cached:
        engine.generate([Request(prompt=prompt[:cached], max_new_tokens=1,
                                 stop_on_eos=False)], progress=False)
    start = time.perf_counter()
    engine.generate([Request(prompt=prompt, max_new_tokens=1, stop_on_eos=False)],
                    progress=False)
    return time.perf_counter() - start


def decode_step(model, deterministic: bool, shared: list[int], own: list[list[int]],
                steps: int) -> float:
    engine = Engine(model, capacity=len(shared) + len(own) * (len(own[0]) + steps + 32),
                    deterministic=deterministic, token_budget=len(shared) * 2 + 64 * len(own))
    for tail in own:
        engine.submit(Request(prompt=shared + tail, max_new_tokens=steps + 4,
                              stop_on_eos=False))
    while engine.waiting:
        engine.step()
    engine.step()  # warm-up, the batch complete
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def burst(model, deterministic: bool, prompts: list[list[int]], new: int,
          page_size: int = 1) -> tuple[float, list[list[int]]]:
    engine = Engine(model, capacity=sum(len(p) + new for p in prompts) + 256,
                    deterministic=deterministic, page_size=page_size)
    reqs = [Request(prompt=p, max_new_tokens=new, stop_on_eos=False) for p in prompts]
    engine.generate(reqs[:1], progress=False)  # the system prompt cached
    start = time.perf_counter()
    out = engine.generate(reqs, progress=False)
    return time.perf_counter() - start, [r.output_ids for r in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--burst", type=int, default=8)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--probe", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        probe(list(range(1, 17)) + [31, 32, 64, 127])
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, _ = load_model(device="cpu", dtype=dtype)
    print(f"{args.dtype}, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, vocab, (n,), generator=gen).tolist()

    prompt = tokens(args.context)
    shared = tokens(args.context - 64)
    own = [tokens(64) for _ in range(args.batch)]
    system = tokens(args.context // 2)
    prompts = [system + tokens(16 + 8 * i) for i in range(args.burst)]
    rows = {
        f"TTFT, {args.context} tokens uncached (s)":
            lambda d: ttft(model, d, prompt, 0),
        f"TTFT, last {args.suffix} after {args.context - args.suffix} cached (s)":
            lambda d: ttft(model, d, prompt, args.context - args.suffix),
        f"decode, B={args.batch} behind {len(shared)} shared (ms/step)":
            lambda d: 1e3 * decode_step(model, d, shared, own, args.steps),
        f"burst, {args.burst} requests x {args.new} tokens (s)":
            lambda d: burst(model, d, prompts, args.new)[0],
    }
    print(f"\n{'':<48} {'default':>9} {'determ.':>9} {'ratio':>6}  (medians of {args.repeats})")
    for name, fn in rows.items():
        got = {False: [], True: []}
        for _ in range(args.repeats):
            for d in (False, True):  # alternated, so drift in the load hits both
                got[d].append(fn(d))
        a, b = statistics.median(got[False]), statistics.median(got[True])
        print(f"{name:<48} {a:9.3f} {b:9.3f} {b / a:6.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")

    # Does the cache (and the batch) change the greedy tokens? The burst against each
    # request served alone by an engine without a cache, in each mode.
    for d in (False, True):
        alone = []
        for prompt_ids in prompts:
            e = Engine(model, capacity=len(prompt_ids) + args.new + 64, deterministic=d,
                       use_cache=False)
            alone.append(e.generate([Request(prompt=prompt_ids, max_new_tokens=args.new,
                                             stop_on_eos=False)],
                                    progress=False)[0].output_ids)
        for page_size in (1, 16):
            _, batched = burst(model, d, prompts, args.new, page_size)
            diff = sum(x != y for x, y in zip(batched, alone, strict=True))
            print(f"{'deterministic' if d else 'default':>13} mode, page size {page_size:>2}: "
                  f"{diff} of {len(prompts)} requests' greedy tokens differ cached+batched "
                  "against alone uncached")


if __name__ == "__main__":
    main()
