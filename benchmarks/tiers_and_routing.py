"""The host tier and cache-aware routing on the real model, in one run.

    python benchmarks/tiers_and_routing.py           # all three tables
    python benchmarks/tiers_and_routing.py --quick   # shorter prompts, a smaller workload

1. Load-back against recompute, per token, at several prompt lengths
   (``minirt.tiers.measure_load_back``: medians of interleaved repeats of copying K/V
   host -> device and of prefilling the same prompt), with the write (device -> host).
2. Write policies on a cycling multi-turn chat workload with a device pool too small for
   it (one request at a time): tokens found on the device, loaded back from the host and
   computed, the hit rate, tokens copied to the host, and the median TTFT of the turns
   after the first, with no host tier and with each write policy. Greedy outputs are
   checked identical.
3. Routing policies on 4 in-process replicas and a multi-tenant chat workload, balanced
   and skewed (one tenant with 8x the traffic): prefill tokens computed, hit rate, the
   spread (max - min) of the router's queue lengths, requests per replica, and the
   busiest replica's prefill tokens. Greedy outputs are checked identical.

Timings on a shared machine are noisy: the load average is printed beside them; the
token counts are deterministic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from minirt.engine import Engine
from minirt.model import load_model
from minirt.replicas import make_replicas, replay_replicas, tenant_chats
from minirt.request import Request
from minirt.router import ROUTING_POLICIES, make_router
from minirt.tiers import measure_load_back
from minirt.workloads import unique_prefix_count


def load_back_table(model, lengths: list[int], repeats: int) -> None:
    print("1. load-back vs recompute per token (medians of interleaved repeats)")
    print(f"{'tokens':>7s} {'load back us/tok':>17s} {'write us/tok':>13s} "
          f"{'recompute us/tok':>17s} {'recompute/load':>15s}")
    for n in lengths:
        c = measure_load_back(model, n, repeats=repeats)
        print(f"{n:7d} {c.load_per_token * 1e6:17.3f} {c.write_s / n * 1e6:13.3f} "
              f"{c.recompute_per_token * 1e6:17.1f} {c.ratio:14.0f}x")


def write_policy_table(model, tokenizer, desks: int, turns: int, system_tokens: int,
                       device: int, host: int) -> None:
    chats = tenant_chats(tokenizer, tenants=desks, conversations=desks, turns=turns,
                         system_tokens=system_tokens)
    trace = [(c, t) for t in range(turns) for c in range(desks)]
    msgs = {k: chats.canned_messages(*k) for k in trace}
    probe = Engine(model, tokenizer)
    ids = [probe.prompt_ids(Request(messages=msgs[k])).tolist() for k in trace]
    print(f"\n2. write policies: {desks} desks x {turns} turns, one request at a time; "
          f"prompts {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{unique_prefix_count(ids)} distinct; device pool {device}, host {host}")
    configs = {
        "no host tier": {},
        "write_back": dict(host_capacity=host, write_policy="write_back"),
        "write_through": dict(host_capacity=host, write_policy="write_through"),
        "selective (2 hits)": dict(host_capacity=host, write_policy="write_through_selective",
                                   write_through_threshold=2),
    }
    print(f"{'':20s} {'device hits':>11s} {'loaded':>7s} {'computed':>9s} {'hit rate':>8s} "
          f"{'written':>8s} {'TTFT ms (turns 2+)':>19s}")
    outputs = {}
    for name, tier in configs.items():
        engine = Engine(model, tokenizer, capacity=device, **tier)
        results = [engine.generate([Request(messages=msgs[k], max_new_tokens=4)],
                                   progress=False)[0] for k in trace]
        m = [r.metrics for r in results]
        written = engine.host_tier.tier_stats.written_tokens if engine.host_tier else 0
        prompt = sum(x.prompt_tokens for x in m)
        cached = sum(x.cached_tokens for x in m)
        ttft = statistics.median(x.ttft for x in m[desks:])
        print(f"{name:20s} {sum(x.device_hit_tokens for x in m):11d} "
              f"{sum(x.loaded_tokens for x in m):7d} {prompt - cached:9d} "
              f"{cached / prompt:8.3f} {written:8d} {ttft * 1e3:19.1f}")
        outputs[name] = [r.output_ids for r in results]
    same = all(o == outputs["no host tier"] for o in outputs.values())
    print(f"greedy outputs identical across configurations: {same}")
    assert same


def routing_table(model, tokenizer, conversations: int, turns: int, system_tokens: int,
                  capacity: int) -> None:
    def busiest(rep) -> int:
        work = [0] * rep.num_replicas
        for r in rep.requests:
            work[r.replica] += r.computed_tokens
        return max(work)

    runs = [("balanced", None, policy, {}) for policy in ROUTING_POLICIES]
    runs += [("skewed 8:1:1:1", [8, 1, 1, 1], "cache_aware", {}),
             ("skewed 8:1:1:1", [8, 1, 1, 1], "cache_aware", {"balance_abs_threshold": 2}),
             ("skewed 8:1:1:1", [8, 1, 1, 1], "round_robin", {})]
    print(f"\n3. routing: 4 replicas (pool {capacity} each), 4 tenants, {conversations} "
          f"conversations x {turns} turns, {system_tokens}-token system prompts, 8 open at once")
    print(f"{'workload':15s} {'policy':32s} {'computed':>8s} {'hit rate':>8s} "
          f"{'spread max':>10s} {'mean':>5s} {'busiest':>8s}  requests per replica")
    outputs: dict[str, dict] = {}
    for workload, weights, policy, kw in runs:
        chats = tenant_chats(tokenizer, tenants=4, conversations=conversations, turns=turns,
                             system_tokens=system_tokens, weights=weights)
        rep = replay_replicas(make_replicas(model, tokenizer, 4, capacity=capacity),
                              make_router(policy, 4, **kw), chats, concurrency=8,
                              max_new_tokens=2)
        label = policy + "".join(f" {k}={v}" for k, v in kw.items())
        print(f"{workload:15s} {label:32s} {rep.computed_tokens:8d} {rep.hit_rate:8.3f} "
              f"{rep.max_spread:10d} {rep.mean_spread:5.2f} {busiest(rep):8d}  "
              f"{rep.per_replica}")
        outputs.setdefault(workload, {})[label] = rep.outputs()
    same = all(len({str(sorted(o.items())) for o in w.values()}) == 1 for w in outputs.values())
    print(f"greedy outputs identical across policies: {same}")
    assert same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter prompts and a smaller workload")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, tokenizer = load_model(dtype=torch.float32)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    lengths = [64, 256] if args.quick else [64, 256, 1024]
    load_back_table(model, lengths, args.repeats)
    if args.quick:
        write_policy_table(model, tokenizer, 4, 3, 80, 256, 2048)
        routing_table(model, tokenizer, 8, 2, 80, 1024)
    else:
        write_policy_table(model, tokenizer, 6, 3, 160, 512, 4096)
        routing_table(model, tokenizer, 16, 2, 120, 2048)
    print(f"\n{time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
