"""Eviction cost as the tree grows: the leaf heap against a full scan of the tree.

    .venv/bin/python benchmarks/eviction.py [--sizes 1000 10000 100000]

For each tree size it builds a bushy LRU cache, shuffles the access order with random
matches, then evicts leaves one at a time with ``RadixCache.evict`` (the heap: O(log n)
per leaf; best of 3 rounds of up to 1,000 evictions) and with
``minirt.simulate.evict_by_scan`` (a walk over every node per leaf: O(n)), and prints
evictions per second for both and their ratio, in CPU time. It also checks that from the
smallest to the largest tree the heap's cost per evicted leaf grows by at most 2x (exit
status 1 if not).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

import torch

from minirt.cache import RadixCache
from minirt.simulate import evict_by_scan


def build_tree(num_nodes: int, seed: int = 0) -> RadixCache:
    """An LRU cache of about ``num_nodes`` nodes: 8-token sequences whose first token is
    one of 64, so 64 inner nodes fan out to the leaves; then random matches (one per two
    sequences) reorder the leaves' last-access ticks, as traffic would."""
    rng = random.Random(seed)
    cache = RadixCache(policy="lru")
    slot, seqs = 0, []
    while cache.num_nodes < num_nodes:
        seq = [rng.randrange(64)] + [rng.randrange(4096) for _ in range(7)]
        seqs.append(seq)
        cache.insert_prefix(seq, list(range(slot, slot + 8)))
        slot += 8
    for _ in range(len(seqs) // 2):
        cache.match_prefix(seqs[rng.randrange(len(seqs))])
    return cache


def per_leaf_seconds(cache: RadixCache, evict, leaves: int) -> float:
    """Mean CPU seconds per evicted leaf over ``leaves`` one-token evictions.

    CPU time of this process (``time.process_time``), not wall time: the machine is
    shared, and time spent descheduled is not a cost of the data structure.
    """
    start = time.process_time()
    for _ in range(leaves):
        evict(cache, 1)
    return (time.process_time() - start) / leaves


def heap_evict(cache: RadixCache, n: int) -> torch.Tensor:
    return cache.evict(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for n in args.sizes:
        # same victims both ways: check the first few on twin trees
        heap_cache, scan_cache = build_tree(min(n, 20_000), args.seed), build_tree(
            min(n, 20_000), args.seed
        )
        assert all(
            torch.equal(heap_cache.evict(1), evict_by_scan(scan_cache, 1)) for _ in range(5)
        )
        del heap_cache, scan_cache
        # heap: 3 rounds of 1,000 evictions (n // 4 on small trees), keep the fastest round
        cache = build_tree(n, args.seed)
        nodes = cache.num_nodes
        per_round = min(1_000, n // 4)
        heap_s = min(per_leaf_seconds(cache, heap_evict, per_round) for _ in range(3))
        cache.check_integrity()
        del cache
        gc.collect()
        # scan: O(n) per victim, so fewer of them on big trees
        cache = build_tree(n, args.seed)
        scan_leaves = max(5, min(200, 2_000_000 // n))
        scan_s = per_leaf_seconds(cache, evict_by_scan, scan_leaves)
        cache.check_integrity()
        del cache
        gc.collect()
        rows.append((nodes, heap_s, scan_s))

    print(f"{'nodes':>8} {'heap us/leaf':>13} {'heap evict/s':>13} {'scan us/leaf':>13} "
          f"{'scan evict/s':>13} {'scan/heap':>10}")
    for nodes, heap_s, scan_s in rows:
        print(f"{nodes:>8} {heap_s * 1e6:>13.2f} {1 / heap_s:>13,.0f} {scan_s * 1e6:>13.1f} "
              f"{1 / scan_s:>13,.0f} {scan_s / heap_s:>10.0f}x")
    growth = rows[-1][1] / rows[0][1]
    verdict = "OK" if growth <= 2.0 else "FAIL"
    print(f"\nheap cost per leaf, {rows[-1][0]} vs {rows[0][0]} nodes: {growth:.2f}x "
          f"(claim: at most 2x) {verdict}")
    print(f"scan cost per leaf grows {rows[-1][2] / rows[0][2]:.0f}x over the same range "
          f"(O(n): about {rows[-1][0] / rows[0][0]:.0f}x expected)")
    return 0 if growth <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
