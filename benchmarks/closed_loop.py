"""serve_bench's ``prefix_repetition`` load through ``Engine`` offline: where the time goes.

    python benchmarks/closed_loop.py                      # concurrency 4 and 16
    python benchmarks/closed_loop.py --concurrency 16 --num-prompts 64

No server and no client: ``--concurrency`` requests are kept in flight, a new one submitted
as soon as one finishes, as vLLM's benchmark client does at that concurrency. The prompts
have serve_bench's shape in token ids (4 prefixes of 512 random tokens, each request one
of them and 64 tokens of its own, 32 output tokens, EOS ignored: read from serve_bench's
``DATASETS``); the pool holds as many tokens as serve_bench's (vLLM's KV space). One
engine serves every run, as a server does; its cache is flushed before each, so every run
computes its prefixes. A first run warms up, the second is timed. Printed: the duration,
the median TTFT and TPOT (each request's first token, and its last over its 31 gaps),
every step that admitted requests (how many, their uncached tokens, how many were running,
ms), and the decode-only steps' median by batch size. The load average is printed beside
the numbers: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch
from serve_bench import DATASETS, OUTPUT_LEN, vllm_kv_tokens

from minirt.engine import Engine
from minirt.model import load_model
from minirt.request import Request

_SHAPE = dict(zip(DATASETS["prefix_repetition"][::2], DATASETS["prefix_repetition"][1::2],
                  strict=True))  # serve_bench's client options, read rather than restated
PREFIXES = int(_SHAPE["--prefix-repetition-num-prefixes"])
PREFIX = int(_SHAPE["--prefix-repetition-prefix-len"])
OWN = int(_SHAPE["--prefix-repetition-suffix-len"])
OUTPUT = OUTPUT_LEN


def prompts_for(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: prefix ``i % PREFIXES`` and ``OWN`` tokens of their own."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(1000, vocab, (PREFIX,), generator=gen).tolist()
                for _ in range(PREFIXES)]
    return [prefixes[i % PREFIXES] + torch.randint(1000, vocab, (OWN,), generator=gen).tolist()
            for i in range(n)]


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int) -> dict:
    """Serve ``prompts`` with ``concurrency`` in flight, from an empty cache; per request
    TTFT and TPOT (s), and per step (admitted, uncached tokens, running before, seconds)."""
    engine.flush()
    queue, sent, first, last, steps = list(prompts), {}, {}, {}, []

    def submit() -> None:
        h = engine.submit(Request(prompt=queue.pop(0), max_new_tokens=OUTPUT,
                                  stop_on_eos=False))
        sent[h.rid] = time.perf_counter()

    for _ in range(min(concurrency, len(queue))):
        submit()
    start = time.perf_counter()
    while engine.has_work:
        running, t = len(engine.running), time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        for rid, _ in out.tokens:
            first.setdefault(rid, now)
            last[rid] = now
        uncached = sum(h.lc.prompt.numel() - h.cached_tokens for h in out.admitted)
        steps.append((len(out.admitted), uncached, running, now - t))
        for _ in out.finished:
            if queue:
                submit()
    return {"duration": time.perf_counter() - start,
            "ttft": [first[r] - sent[r] for r in sent],
            "tpot": [(last[r] - first[r]) / (OUTPUT - 1) for r in sent], "steps": steps}


def report(concurrency: int, run: dict) -> None:
    steps = run["steps"]
    prefill = [s for s in steps if s[0]]
    decode = defaultdict(list)
    for _, _, running, seconds in (s for s in steps if not s[0]):
        decode[running].append(seconds)
    print(f"\nconcurrency {concurrency}: duration {run['duration']:.2f} s, median TTFT "
          f"{1e3 * statistics.median(run['ttft']):.0f} ms, median TPOT "
          f"{1e3 * statistics.median(run['tpot']):.1f} ms, {len(steps)} steps "
          f"(load average {os.getloadavg()[0]:.2f})")
    print(f"  {len(prefill)} steps admitted requests, {sum(s[3] for s in prefill):.2f} s in all:")
    for admitted, uncached, running, seconds in prefill:
        print(f"    admitted {admitted:2d}, uncached tokens {uncached:5d}, running before "
              f"{running:2d}: {1e3 * seconds:6.0f} ms")
    print("  decode-only steps, median ms by rows: " + ", ".join(
        f"{rows}: {1e3 * statistics.median(v):.1f} (x{len(v)})"
        for rows, v in sorted(decode.items())))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    p.add_argument("--num-prompts", type=int, default=32)
    args = p.parse_args()
    if args.num_prompts < 1 or min(args.concurrency) < 1:
        p.error("--num-prompts and --concurrency must be at least 1")
    model, _ = load_model(dtype=torch.float32)
    prompts = prompts_for(model.config.vocab_size, args.num_prompts)
    print(f"device {next(model.parameters()).device}, torch threads {torch.get_num_threads()}, "
          f"{args.num_prompts} prompts ({PREFIXES} prefixes of {PREFIX} + {OWN} own, "
          f"{OUTPUT} output tokens)")
    engine = Engine(model, capacity=vllm_kv_tokens(model.name_or_path))  # serve_bench's pool
    for c in args.concurrency:
        closed_loop(engine, prompts, c)  # warm-up
        report(c, closed_loop(engine, prompts, c))


if __name__ == "__main__":
    main()
