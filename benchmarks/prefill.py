"""The burst's batched prefill on the real model, three ways, timed in turn in one run.

    python benchmarks/prefill.py                # medians of 3
    python benchmarks/prefill.py --repeats 5 --threads 2

A burst shaped like ``benchmarks/vs_vllm.py``'s, on random token ids: 16 requests, a
500-token shared prefix and 50 tokens of their own each, pages of 128. The first request
is prefilled alone; the other 15 then find 384 tokens cached (three whole pages) and
prefill 166 each together, the first 116 of which are the same tokens in all 15. That
second step is timed:

1. transformers' forward over chapter 04's ``PoolCache`` (every request's cached K/V
   gathered in every layer);
2. ``llama_forward`` with attention split at the shared prefix (read once per layer);
3. the same with the run of new tokens they all begin with computed once (``PrefillPlan``,
   what the engine does).

Each way runs on its own engine, the engines stepped in turn; the first tokens of all 16
must agree across the three.

Timings on a shared machine are noisy: run it on a quiet one; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch
from _setup import timing_model

from minirt.engine import Engine, Request

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    model = timing_model(args.threads)
    ways = {  # name: (llama_forward, the common run computed once)
        "transformers' forward over the pool (gather)": (False, True),
        "llama_forward, shared prefix read once": (True, False),
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
    print(f"\nload average now {os.getloadavg()[0]:.2f}")
    assert len(firsts) == 1, "the three ways disagree on a first token"


if __name__ == "__main__":
    main()
