"""Cache-aware scheduling: what each policy computes across pool sizes, and what ordering costs.

    .venv/bin/python benchmarks/scheduling.py [--pools 40 64 96 160] [--rounds 3] [--tiny]

Part 1 serves a burst of prompt families (four ~30-token system prompts, ``--rounds``
questions each, arriving round by round) through ``Engine(schedule=...)`` for every
policy (and SGLang's DFS-weight walk) and pool size, in one run: prefill tokens
computed, computed / edge-sum bound, hit rate, mean and p99 TTFT (seconds, wall clock,
noisy on a shared machine). Greedy outputs must equal FCFS's (exit status 1 if not).
``--tiny`` runs a random tiny model with the real tokenizer: the token columns are the
same, only the times differ.

Part 2 times one scheduling step (``Scheduler.order``) against queue length, 16 to 1,024
waiting requests over a cache holding their prefixes: CPU time, median of 5, side by
side; "lpm (cutoff)" is the default LPM with SGLang's 128-request FCFS fallback.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from minirt.cache import RadixCache, insert_fresh
from minirt.engine import Engine
from minirt.request import Request
from minirt.scheduler import POLICIES, Scheduler, SimRequest, edge_sum

# every minirt policy, plus SGLang's DFS-weight walk of the cache's tree
SCHEDULES = {p: (lambda p=p: Scheduler(p)) for p in POLICIES}
SCHEDULES["dfs (SGLang)"] = lambda: Scheduler("dfs-weight", dfs_walk="cache")

SYSTEMS = [
    "You are a careful travel agent. Answer questions about trains, flights and hotels "
    "in Europe with short practical advice and exact prices where you know them.",
    "You are a patient math tutor for high school students. Explain each step of algebra "
    "and geometry problems in plain words, and check the final answer twice.",
    "You are a friendly support bot for a home internet provider. Help customers restart "
    "routers, read status lights and book a technician visit when needed.",
    "You are a concise legal assistant. Summarise rental contracts, point out unusual "
    "clauses, and never give advice that needs a licensed lawyer to sign off.",
]
QUESTIONS = [" Question one?", " What about the second case?", " And a third, please.",
             " One more thing?", " Last one."]


def burst(tokenizer, rounds: int) -> list[list[int]]:
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [enc(s) + enc(q) for q in QUESTIONS[:rounds] for s in SYSTEMS]


def policy_table(model, tokenizer, pools: list[int], rounds: int) -> bool:
    prompts = burst(tokenizer, rounds)
    bound, longest = edge_sum(prompts), max(map(len, prompts))
    print(f"burst: {len(prompts)} requests, longest {longest} tokens, edge-sum bound {bound}")
    print(f"{'pool':>5s} {'policy':>13s} {'computed':>9s} {'/bound':>7s} {'hit rate':>9s} "
          f"{'TTFT mean':>10s} {'TTFT p99':>9s}")
    ok, reference = True, None
    for pool in pools:
        if pool < longest:
            print(f"pool {pool} < longest request {longest}: skipped")
            continue
        for policy, schedule in SCHEDULES.items():
            engine = Engine(model, tokenizer, capacity=pool, schedule=schedule())
            out = engine.generate([Request(prompt=p, max_new_tokens=1, stop_on_eos=False)
                                   for p in prompts], progress=False)
            reference = reference if reference is not None else out.outputs
            ok &= out.outputs == reference
            t = out.totals
            ttft = sorted(r.metrics.ttft for r in out)
            p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
            print(f"{pool:5d} {policy:>13s} {t.computed_tokens:9d} {t.computed_over_bound:6.2f}x "
                  f"{t.hit_rate:9.3f} {sum(ttft) / len(ttft):9.3f}s {p99:8.3f}s")
    print("greedy outputs identical under every policy:", ok)
    return ok


def scheduling_cost(sizes: list[int]) -> None:
    rng = random.Random(0)
    stems = [[rng.randrange(1000) for _ in range(32)] for _ in range(8)]
    reqs = [SimRequest(torch.tensor(rng.choice(stems) + [rng.randrange(1000) for _ in range(8)]),
                       arrival=i) for i in range(max(sizes))]
    cache, slot = RadixCache(), 0
    for r in reqs[:64]:
        _, slot = insert_fresh(cache, r.prompt[:36], slot)
    contenders = {"fcfs": lambda: Scheduler("fcfs"),
                  "lpm": lambda: Scheduler("lpm", lpm_max_queue=10**9),
                  "lpm (cutoff)": lambda: Scheduler("lpm"),
                  "dfs-weight": lambda: Scheduler("dfs-weight"),
                  "dfs (SGLang)": lambda: Scheduler("dfs-weight", dfs_walk="cache"),
                  "hrrn": lambda: Scheduler("hrrn", lpm_max_queue=10**9)}
    print("\nscheduling time per step (CPU ms, median of 5) against queue length")
    print(f"{'queue':>6s}" + "".join(f"{name:>14s}" for name in contenders)
          + f"{'lpm / fcfs':>12s}")
    for n in sizes:
        times = {name: [] for name in contenders}
        for _ in range(5):
            for name, make in contenders.items():  # interleaved: load hits all alike
                sched = make()
                t = time.process_time()
                sched.order(reqs[:n], cache)
                times[name].append(time.process_time() - t)
        med = {name: sorted(v)[2] for name, v in times.items()}
        print(f"{n:6d}" + "".join(f"{med[name] * 1e3:14.3f}" for name in contenders)
              + f"{med['lpm'] / max(med['fcfs'], 1e-9):11.1f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pools", type=int, nargs="+", default=[40, 64, 96, 160])
    parser.add_argument("--rounds", type=int, default=3, choices=range(1, 6))
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 128, 256, 1024])
    parser.add_argument("--tiny", action="store_true", help="a random tiny model (fast)")
    args = parser.parse_args()
    if args.tiny:
        from minirt.model import tiny_model
        from minirt.workloads import default_tokenizer

        tokenizer = default_tokenizer()
        model = tiny_model(0, vocab_size=len(tokenizer))
    else:
        from minirt.model import load_model

        model, tokenizer = load_model()
    ok = policy_table(model, tokenizer, args.pools, args.rounds)
    scheduling_cost(args.sizes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
