"""Window-aware cache against keeping every layer's K/V, on the real model, in one run.

    .venv/bin/python benchmarks/hybrid.py [--window 32] [--full-every 6] [--new 4]
                                          [--slack 64] [--check]

The book's SmolLM2-135M with a sliding window added on five layers of six (not a model
trained that way: see ``minirt.hybrid.with_sliding_window``). The chat workload (chapter
03's ``multi_turn_chat``) runs through ``WindowRunner`` twice with ample pools: window-aware
(early frees, tombstones) and keeping all layers. Printed: the bytes of K/V each tree
holds at the end, the peak of the window pool, the prefix hits of each (the hits lost);
then, at one equal byte budget of pools that forces evictions, the hits of both; then the
engine (``Engine(cache="window")``, chosen from the config) on the window-aware pools,
every request submitted at once. ``--check`` also compares the outputs with
transformers' own uncached greedy run (slow: minutes). Exit status 1 if any output
differs between the runs or from the reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from minirt.engine import Engine
from minirt.hybrid import HybridSpec, greedy_uncached, with_sliding_window
from minirt.model import load_model
from minirt.request import Request
from minirt.window_lifecycle import WindowRunner
from minirt.workloads import multi_turn_chat


def run(model, prompts, new: int, full: int, window: int, aware: bool):
    runner = WindowRunner(model, full, window, window_aware=aware)
    outputs = runner.run(prompts, new)
    return runner, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--full-every", type=int, default=6)
    parser.add_argument("--new", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--slack", type=int, default=64,
                        help="the equal budget: the baseline's pools hold the longest "
                             "request and this many tokens more, of every layer")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    base, tok = load_model(dtype=torch.float32)
    spec = HybridSpec.interleaved(base.config.num_hidden_layers, args.window, args.full_every)
    model = with_sliding_window(base, spec)
    prompts = multi_turn_chat(tok).requests
    longest = max(len(p) for p in prompts) + args.new
    print(f"load average {os.getloadavg()[0]:.2f}; {len(prompts)} requests, "
          f"{sum(map(len, prompts))} prompt tokens; window {args.window} on "
          f"{len(spec.window_layers)} of {len(spec.layer_types)} layers")
    ample = 8 * longest * len(prompts)
    aware, out_a = run(model, prompts, args.new, ample, ample, True)
    keep, out_k = run(model, prompts, args.new, ample, ample, False)
    ok = out_a == out_k
    mib = 2 ** 20
    for name, r in (("window-aware", aware), ("keep all layers", keep)):
        s = r.cache.stats
        print(f"{name:16s} holds {r.cached_bytes / mib:7.2f} MiB "
              f"({r.cache.full_tokens} full, {r.cache.window_tokens} window tokens, "
              f"{r.cache.num_tombstones} tombstones); window pool peak "
              f"{r.peak_window_used} tokens; hits {s.hit_tokens}/{s.query_tokens} "
              f"= {s.hit_rate:.3f}")
    print(f"memory saved {1 - aware.cached_bytes / keep.cached_bytes:.1%}, hits lost "
          f"{keep.cache.stats.hit_tokens - aware.cache.stats.hit_tokens} tokens")
    # one byte budget for both: the baseline's pools hold `tokens` tokens of every layer
    tokens = longest + args.slack
    per_f, per_w = aware.bytes_per_token("full"), aware.bytes_per_token("window")
    budget = tokens * (per_f + per_w)
    window_cap = longest + args.window
    full_cap = (budget - window_cap * per_w) // per_f
    tight_a, out_ta = run(model, prompts, args.new, full_cap, window_cap, True)
    tight_k, out_tk = run(model, prompts, args.new, tokens, tokens, False)
    ok &= out_ta == out_a and out_tk == out_a
    print(f"equal budget {budget / mib:.2f} MiB of pools:")
    for name, r, slots in (("window-aware", tight_a, f"{full_cap} full + {window_cap} window"),
                           ("keep all layers", tight_k, f"{tokens} + {tokens}")):
        s = r.cache.stats
        print(f"  {name:16s} ({slots} slots) hits {s.hit_tokens}/{s.query_tokens} = "
              f"{s.hit_rate:.3f}, evicted {r.lifecycle.evicted_tokens} tokens, holds "
              f"{r.cached_bytes / mib:.2f} MiB at the end")
    print(f"  hits gained by the window-aware cache at equal memory: "
          f"{tight_a.cache.stats.hit_tokens - tight_k.cache.stats.hit_tokens} tokens")
    # the engine on the same pools: every request submitted at once (batches)
    engine = Engine(model, capacity=full_cap, window_capacity=window_cap)
    served = engine.generate([Request(prompt=p, max_new_tokens=args.new, stop_on_eos=False)
                              for p in prompts], progress=False)
    ok &= served.outputs == out_a
    print(f"engine, same pools, all submitted at once: {served.totals}")
    if args.check:
        ref = [greedy_uncached(model, p, args.new) for p in prompts]
        ok &= ref == out_a
        print(f"outputs equal transformers' uncached greedy: {ref == out_a}")
    print(f"outputs equal across the caches: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
