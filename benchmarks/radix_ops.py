"""Throughput of RadixCache.match_prefix and insert_prefix on a large shared-prefix trace.

    .venv/bin/python benchmarks/radix_ops.py [--requests 10000] [--seed 0]

Prints three tables:
1. insert, match and match+insert (as a server does) over the whole trace: ops/s, tokens/s;
2. the cost of one match against the query length (one cached sequence, full hit);
3. the cost of one match against the number of cached sequences (fixed query length).
A match walks one path: its cost grows with the query's length (tokens compared) and
its depth in nodes, not with how many sequences the tree holds.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from minirt.cache import RadixCache

VOCAB = 32000


def shared_prefix_trace(num_requests: int, seed: int = 0) -> list[torch.Tensor]:
    """Requests like a chat service gets: a system prompt (32 of them, 256 tokens), one of 8
    few-shot blocks per prompt (64 tokens), a user turn (16-128 tokens); a third of the
    requests continue an earlier request with another turn (multi-turn chat)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    systems = [tokens(256) for _ in range(32)]
    shots = [[tokens(64) for _ in range(8)] for _ in range(32)]
    requests: list[list[int]] = []
    for _ in range(num_requests):
        if requests and rng.random() < 1 / 3:
            base = requests[rng.randrange(max(0, len(requests) - 200), len(requests))]
            requests.append(base + tokens(rng.randint(16, 64)))
        else:
            s = rng.randrange(32)
            requests.append(systems[s] + shots[s][rng.randrange(8)] + tokens(rng.randint(16, 128)))
    return [torch.tensor(r, dtype=torch.int64) for r in requests]


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    """Best CPU time of ``repeat`` runs of ``fn``, in seconds.

    CPU time of this process (``time.process_time``): on a shared machine, time spent
    waiting for a core is not a cost of the cache.
    """
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def trace_throughput(trace: list[torch.Tensor]) -> list[tuple[str, float, float]]:
    tokens = sum(r.numel() for r in trace)
    offsets = torch.tensor([0] + [r.numel() for r in trace]).cumsum(0).tolist()
    slots = [torch.arange(a, b) for a, b in zip(offsets, offsets[1:], strict=False)]  # made up
    cache = RadixCache()

    def insert_all():
        for ids, idx in zip(trace, slots, strict=True):
            cache.insert_prefix(ids, idx)

    def match_all():
        for ids in trace:
            cache.match_prefix(ids)

    served = RadixCache()

    def serve_all():  # what a server does per request: match, then insert the rest
        for ids, idx in zip(trace, slots, strict=True):
            served.match_prefix(ids)
            served.insert_prefix(ids, idx)

    t_insert = timed(insert_all)
    t_match = timed(match_all)
    t_serve = timed(serve_all)
    cache.check_integrity()
    rows = [("insert_prefix (cold tree)", t_insert), ("match_prefix (warm tree)", t_match),
            ("match + insert per request", t_serve)]
    print(f"trace: {len(trace)} requests, {tokens} tokens, tree of {cache.num_nodes} nodes "
          f"holding {cache.total_size} tokens; hit rate while serving {served.stats.hit_rate:.3f}")
    return [(name, len(trace) / t, tokens / t) for name, t in rows]


def match_vs_length(lengths: list[int]) -> list[tuple[int, float]]:
    rng = torch.Generator().manual_seed(1)
    longest = max(lengths)
    seq = torch.randint(VOCAB, (longest,), generator=rng)
    cache = RadixCache()
    cache.insert_prefix(seq, torch.arange(longest))
    out, reps = [], 500
    for n in lengths:
        query = seq[:n].clone()
        t = timed(lambda q=query: [cache.match_prefix(q) for _ in range(reps)], repeat=5)
        out.append((n, t / reps * 1e6))
    return out


def match_vs_tree_size(sizes: list[int], query_len: int = 256) -> list[tuple[int, int, float]]:
    rng = random.Random(2)
    out = []
    for n in sizes:
        cache = RadixCache()
        # n sequences under 16 shared 64-token heads: a bushy tree two levels deep
        heads = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(16)]
        seqs = []
        for i in range(n):
            s = heads[i % 16] + [rng.randrange(VOCAB) for _ in range(query_len - 64)]
            seqs.append(torch.tensor(s))
            cache.insert_prefix(seqs[-1], torch.arange(i * query_len, (i + 1) * query_len))
        queries = [seqs[rng.randrange(n)] for _ in range(500)]
        t = timed(lambda c=cache, qs=queries: [c.match_prefix(q) for q in qs], repeat=5)
        out.append((n, cache.num_nodes, t / len(queries) * 1e6))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensor ops: threads only add overhead

    trace = shared_prefix_trace(args.requests, args.seed)
    rows = trace_throughput(trace)
    print(f"\n{'operation':<28} {'ops/s':>10} {'tokens/s':>12}")
    for name, ops, toks in rows:
        print(f"{name:<28} {ops:>10,.0f} {toks:>12,.0f}")

    print(f"\n{'query length':>12} {'us/match':>10} {'ns/token':>10}   (full hit, one sequence)")
    for n, us in match_vs_length([16, 64, 256, 1024, 4096, 16384]):
        print(f"{n:>12} {us:>10.1f} {us * 1000 / n:>10.1f}")

    print(f"\n{'sequences':>10} {'nodes':>8} {'us/match':>10}   (query 256 tokens, full hit)")
    for n, nodes, us in match_vs_tree_size([10, 100, 1000, 10000]):
        print(f"{n:>10} {nodes:>8} {us:>10.1f}")


if __name__ == "__main__":
    main()
