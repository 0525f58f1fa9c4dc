"""Every eviction policy and both caches on Mooncake's production traces, against Belady.

    .venv/bin/python benchmarks/traces.py                 # both traces, whole, four capacities
    .venv/bin/python benchmarks/traces.py --requests 2000 # the first 2,000 requests of each
    .venv/bin/python benchmarks/traces.py --no-scale      # skip part 2

1. For each shipped trace (``minirt.traces``: Mooncake's conversation and synthetic
   traces) at four capacities (1/16, 1/8, 1/4 and 1/2 of the trace's unique blocks):
   the hit rate of the radix cache under every policy ``minirt.eviction`` has (LRU, LFU,
   FIFO, priority, SLRU, tail-optimized LRU; replayed by ``minirt.simulate.replay``, which
   is ``simulate`` per request), of the hash cache (vLLM's
   free queue, ``minirt.hashcache.serve_trace``), and Belady's bound
   (``minirt.simulate.belady_hit_rate``), with the trace's ceiling (its unique-token bound,
   what an unbounded cache reaches). Each cell is ``hit % (s)``: the hit rate, and the
   run's wall time per million block lookups (a lookup is one hash id of one request).
   Asserted: no policy and neither cache above Belady, Belady not above the ceiling,
   priority equal to LRU (the traces carry no priorities, so minirt's priority key
   falls back to recency), and more capacity never lowers Belady. Exit status 1 if not.
2. Why part 1 counts blocks and not tokens: on the first requests of the conversation
   trace, the cost per block lookup of the radix LRU replay and of Belady at one token per
   block against 512 (the traces' block), and what the whole trace would take at 512.

The policies are minirt's (``minirt.eviction.POLICIES``), SGLang's ``--radix-eviction-policy``
choices, lru, lfu, slru, priority and tlru
(sglang 0.5.23 `srt/arg_groups/choices.py: RADIX_EVICTION_POLICY_CHOICES`), and FIFO, which is
in SGLang's table of strategies but not a choice of the flag
(sglang 0.5.23 `srt/mem_cache/utils.py: _EVICTION_POLICY_FACTORIES`). SLRU runs with SGLang's
default ``protected_threshold`` of 2; tail-optimized LRU with ``threshold`` 8 and
``next_prompt_estimate`` 1 blocks, the example of SGLang's help text (4096 and 512 tokens,
sglang 0.5.23 `srt/arg_groups/fields/memory.py: Memory.radix_eviction_policy_config`) in
blocks of 512: it has no default, SGLang refuses it without settings. Tail-optimized LRU
trades hit rate for tail latency, so part 1 also prints each policy's P90 of uncached blocks
per request (the prefill a request waits for, what its time to first token grows with). The
hash cache has one order, vLLM's free queue, and no policy to choose.

Part 1 runs at ``block_size=1``: each hash id is one token, so a capacity is in blocks
of 512 tokens and a hit rate is a share of blocks. The radix cache at page size 1 then
counts a repeated partial last block as a hit, as any token-granular cache would; the hash
cache never hits a prompt's last block: it matches ``prompt[:-1]``, as vLLM caps a hit at
``num_tokens - 1``
(vllm 0.32.0 `v1/core/kv_cache_manager.py: KVCacheManager.get_computed_blocks`),
and caches whole blocks only. It hashes with Python's
``hash`` (deterministic for ints; the hit rate does not depend on the hash function
short of a collision). Hit rates are deterministic; the wall times are not, and depend on
the load of the machine (printed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable

import torch

from minirt.eviction import POLICIES, SLRU, TLRU, EvictionPolicy, make_policy
from minirt.hashcache import HashCache, serve_trace
from minirt.simulate import belady_hit_rate, replay, simulate
from minirt.traces import TRACE_BLOCK, TRACES, Trace, load_trace

FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
TLRU_THRESHOLD, TLRU_NEXT_PROMPT = 8, 1  # blocks: SGLang's example, 4096 and 512 tokens
SETTINGS: dict[str, Callable[[], EvictionPolicy]] = {
    "slru": lambda: SLRU(protected_threshold=2),
    "tlru": lambda: TLRU(threshold=TLRU_THRESHOLD, next_prompt_estimate=TLRU_NEXT_PROMPT),
}
COLUMNS = (*POLICIES, "hash", "belady")


def policy(name: str) -> EvictionPolicy:
    """A fresh policy of this name, with the settings the docstring gives."""
    return SETTINGS[name]() if name in SETTINGS else make_policy(name)


def _timed(fn: Callable[[], float]) -> tuple[float, float]:
    start = time.perf_counter()
    rate = fn()
    return rate, time.perf_counter() - start


def capacities(trace: Trace, prompts: list[list[int]]) -> list[int]:
    """Four capacities (in tokens of ``prompts``): FRACTIONS of the unique tokens, never
    less than the longest prompt (a running request's K/V must all be resident)."""
    unique = trace.unique_tokens(1)
    longest = max(map(len, prompts))
    return [max(longest, round(unique * f)) for f in FRACTIONS]


def tail(prompts: list[list[int]], cached: list[int]) -> tuple[int, float]:
    """P90 of uncached blocks per request, and the share of requests with more than the
    tail-optimized LRU threshold uncached (its budget: a request over it misses its TTFT)."""
    uncached = sorted(len(p) - c for p, c in zip(prompts, cached, strict=True))
    p90 = uncached[min(len(uncached) - 1, (9 * len(uncached)) // 10)]
    over = sum(u > TLRU_THRESHOLD for u in uncached) / len(uncached)
    return p90, over


def policy_table(trace: Trace) -> tuple[list[str], list[str], list[str]]:
    """Part 1 for one trace: hit-rate rows, tail rows, and the assertions that failed."""
    prompts = trace.token_ids(1)
    lookups = trace.block_lookups
    unique, ceiling = trace.unique_tokens(1), trace.ceiling(1)
    total = sum(map(len, prompts))
    rows, tails, failures = [], [], []
    belady_prev = -1.0
    for cap in capacities(trace, prompts):
        cells: dict[str, tuple[float, float]] = {}
        tail_cells = []
        for name in POLICIES:
            cached, dt = _timed(lambda n=name, c=cap: replay(prompts, c, policy(n)))
            cells[name] = (sum(cached) / total, dt)
            p90, over = tail(prompts, cached)
            tail_cells.append(f"{p90:6d} {100 * over:5.1f}")
        if abs(cells["lru"][0] - simulate(prompts, cap, "lru").hit_rate) > 1e-12:
            failures.append(f"{trace.name} capacity {cap}: replay and simulate disagree")
        cells["hash"] = _timed(
            lambda c=cap: serve_trace(HashCache(1, "builtin", seed=0), prompts, c).hit_rate)
        cells["belady"] = _timed(lambda c=cap: belady_hit_rate(prompts, c))
        best = cells["belady"][0]
        for name in COLUMNS[:-1]:
            if cells[name][0] > best + 1e-12:
                failures.append(f"{trace.name} capacity {cap}: {name} {cells[name][0]:.6f} "
                                f"above Belady {best:.6f}")
        if best > ceiling + 1e-12:
            failures.append(f"{trace.name} capacity {cap}: Belady {best:.6f} above the "
                            f"ceiling {ceiling:.6f}")
        if "priority" in cells and cells["priority"][0] != cells["lru"][0]:
            failures.append(f"{trace.name} capacity {cap}: priority differs from LRU")
        if best < belady_prev:
            failures.append(f"{trace.name} capacity {cap}: Belady fell as capacity grew")
        belady_prev = best
        text = " ".join(f"{100 * rate:5.1f} ({dt / lookups * 1e6:5.1f})"
                        for rate, dt in (cells[c] for c in COLUMNS))
        rows.append(f"{trace.name:12s} {cap:7d} {cap / unique:5.3f}  {text}  {100 * ceiling:5.1f}")
        tails.append(f"{trace.name:12s} {cap:7d} {cap / unique:5.3f}  " + " ".join(tail_cells))
    return rows, tails, failures


def token_scale(requests: int) -> None:
    """Part 2: the cost per block lookup at one token per block against 512, extrapolated."""
    trace = load_trace("conversation")
    head = Trace("head", trace.requests[:requests])
    print(f"\n2. cost per million block lookups (s), first {requests} requests of conversation "
          f"({head.block_lookups} lookups), and the whole trace ({trace.block_lookups} "
          f"lookups) extrapolated")
    print(f"{'tokens/block':>12s} {'tokens':>9s} {'radix lru':>10s} {'belady':>10s}   "
          "whole trace, one run (s): radix lru, belady")
    for block_size in (1, TRACE_BLOCK):
        prompts = head.token_ids(block_size)
        cap = 4 * max(map(len, prompts))
        _, t_lru = _timed(lambda p=prompts, c=cap: simulate(p, c, "lru").hit_rate)
        _, t_bel = _timed(lambda p=prompts, c=cap: belady_hit_rate(p, c))
        per = [t / head.block_lookups * 1e6 for t in (t_lru, t_bel)]
        whole = [p * trace.block_lookups / 1e6 for p in per]
        print(f"{block_size:12d} {sum(map(len, prompts)):9d} {per[0]:10.1f} {per[1]:10.1f}   "
              f"{whole[0]:.0f}, {whole[1]:.0f}")
    print(f"(at {TRACE_BLOCK} tokens per block the trace is {trace.total_tokens()} tokens, "
          f"{trace.unique_tokens()} of them distinct: Belady keeps one trie node per distinct "
          f"token)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=sorted(TRACES), choices=sorted(TRACES))
    ap.add_argument("--requests", type=int, default=None,
                    help="replay only the first N requests of each trace")
    ap.add_argument("--scale-requests", type=int, default=40,
                    help="requests of part 2 (default 40)")
    ap.add_argument("--no-scale", action="store_true", help="skip part 2")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.machine()} {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, Python "
          f"{platform.python_version()}, torch {torch.__version__}")
    print("\n1. hit % (wall s per million block lookups), one token per 512-token block; "
          "capacity in blocks and as a share of the trace's unique blocks")
    print(f"{'trace':12s} {'blocks':>7s} {'share':>5s}  "
          + " ".join(f"{c:>12s}" for c in COLUMNS) + "  ceiling")
    failures, tails = [], []
    for name in args.traces:
        trace = load_trace(name)
        if args.requests is not None:
            trace = Trace(name, trace.requests[:args.requests])
        rows, tail_rows, failed = policy_table(trace)
        failures += failed
        tails += tail_rows
        for row in rows:
            print(row, flush=True)
    print("asserted: every policy and the hash cache <= Belady <= ceiling; priority == LRU; "
          "Belady non-decreasing in capacity:", "FAILED" if failures else "ok")
    for f in failures:
        print("  " + f)
    print(f"\n1b. the tail: P90 of uncached blocks per request, and % of requests with more "
          f"than {TLRU_THRESHOLD} uncached (tail-optimized LRU's threshold)")
    print(f"{'trace':12s} {'blocks':>7s} {'share':>5s}  " + " ".join(f"{c:>12s}" for c in POLICIES))
    print(f"{'':26s}  " + " ".join(f"{'p90':>6s} {'>' + str(TLRU_THRESHOLD) + ' %':>5s}"
                                   for _ in POLICIES))
    for row in tails:
        print(row)
    if not args.no_scale:
        token_scale(args.scale_requests)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
