"""Routing by KV events, side by side: round robin, the approximate tree, the precise
router and an oracle, on in-process replicas that publish vLLM-format KV events over ZMQ.

Each replica is a minirt ``Engine`` whose cache is an event cache
(``kv_event_caches.use_event_cache``), with a ``ZmqEventPublisher`` on TCP (PUB and
replay sockets) sending the events of every engine step as one batch. The precise
router subscribes to every replica (``precise_router.KVEventSubscriber``) and, before
each decision, waits until it has received every batch sent so far: the table measures
the knowledge, not the staleness window (a deployed router routes with what has arrived).

Workloads, where the approximate tree goes wrong:

* ``eviction``: tenants' long system prompts on replicas whose pools hold about two of
  them, so replicas evict while the tree still credits them;
* ``restart``: the same, with replica 0 restarted with an empty cache halfway through
  (a new engine and a new publisher on the same ports, numbering from 0 again);
* ``two_routers``: requests dealt alternately to two routers of the same policy in front
  of the same replicas; each tree sees half the traffic, each router counts only its own
  load; the two precise routers read the same events.

Policies: ``round_robin``; ``approx``, chapter 09a's ``CacheAwareRouter``; ``precise_09a``,
the precise router with chapter 09a's rule as it is (``affinity=False``: a request no
replica holds goes to the least-loaded replica); ``precise``, the same with the affinity
step (such a request goes to the replica that last stored its deepest block, learned from
the events; see ``minirt.precise_router``); ``oracle``, ``precise``'s rule reading the
caches directly. All share the thresholds.

Per policy: prompt tokens found in the cache ("hit tokens"), prefill tokens computed,
TTFT as the prefill tokens the request's replica computed from its routing until its own
prefill (a count standing for time on a CPU this loaded), the spread of in-flight
requests across replicas, and whether every output equals round robin's (greedy).

    .venv/bin/python benchmarks/kv_routing.py --quick --tiny   # seconds, any machine
    .venv/bin/python benchmarks/kv_routing.py                  # the default model
    .venv/bin/python benchmarks/kv_routing.py --quick --tiny --json benchmarks/kv_routing.json

``--json PATH`` writes the table as JSON (``benchmarks/kv_routing.json`` is the recorded
run the chapter reads; ``table_json`` builds the same dict in-process). Schema::

    {"schema": 1,
     "command": str,                  # the command line that printed it
     "settings": {"model": "tiny" | "default", "replicas": int, "capacity": int,
                  "page": int, "requests": int, "tenants": int, "prompt_tokens": [min, max],
                  "concurrency": int, "max_new_tokens": int, "balance_abs": int,
                  "balance_rel": float, "cache_threshold": float, "seed": int},
     "policies": ["round_robin", "approx", "precise_09a", "precise", "oracle"],
     "workloads": {"eviction" | "restart" | "two_routers": {
         "<policy>": {"prompt_tokens": int,      # prompt tokens of every request
                      "hit_tokens": int,         # of them found cached
                      "computed": int,           # prompt_tokens - hit_tokens
                      "hit_rate": float,
                      "ttft_mean": float,        # TTFT in prefill tokens (see above)
                      "ttft_p90": int,
                      "spread": float,           # mean max - min in-flight requests
                      "outputs_equal": int,      # outputs equal to round robin's
                      "requests": int,
                      "reasons": {str: int},     # routing decisions by reason
                      "feed": {str: int} | null}}},  # precise: FeedStats totals
     "staleness": {...} | null}        # see ``staleness`` (absent: not measured)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from minirt.engine import Engine
from minirt.kv_event_caches import use_event_cache
from minirt.kv_events import ZmqEventPublisher
from minirt.model import load_model, tiny_model
from minirt.precise_router import (
    BlockIndex,
    EventSource,
    KVEventSubscriber,
    OracleRouter,
    PreciseRouter,
)
from minirt.replicas import chat_routing_text, tenant_chats
from minirt.request import Request, chat_prompt_ids
from minirt.router import CacheAwareRouter, RoundRobinRouter

POLICIES = ("round_robin", "approx", "precise_09a", "precise", "oracle")
SCENARIOS = ("eviction", "restart", "two_routers")


@dataclass(frozen=True)
class Job:
    rid: str
    ids: list[int]
    text: str
    tenant: int


@dataclass
class Outcome:
    """One policy on one workload."""

    policy: str
    prompt: int = 0
    hit: int = 0
    computed: int = 0
    waits: list[int] = field(default_factory=list)
    spreads: list[int] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    feed: str = ""
    feed_totals: dict[str, int] | None = None
    routed: dict[str, tuple[int, str]] = field(default_factory=dict)  # rid -> replica, reason
    hits: dict[str, int] = field(default_factory=dict)  # rid -> cached prompt tokens
    reasons: Counter = field(default_factory=Counter)


def workload(tokenizer, tenants: int, requests: int, system_tokens: int, seed: int) -> list[Job]:
    chats = tenant_chats(tokenizer, tenants=tenants, conversations=requests, turns=1,
                         system_tokens=system_tokens, seed=seed)
    jobs = []
    for c in range(chats.num_conversations):
        messages = [{"role": "system", "content": chats.systems[chats.tenant_of[c]]},
                    {"role": "user", "content": chats.users[c][0]}]
        jobs.append(Job(f"r{c}", chat_prompt_ids(tokenizer, messages),
                        chat_routing_text(messages), chats.tenant_of[c]))
    return jobs


class Replica:
    """An engine with an event cache and its publisher on two TCP ports."""

    def __init__(self, model, tokenizer, capacity: int, page: int,
                 ports: tuple[str, str] = ("0", "0")) -> None:
        self.args = (model, tokenizer, capacity, page)
        self.engine = Engine(model, tokenizer, capacity=capacity, page_size=page)
        self.cache = use_event_cache(self.engine)
        self.pub = _publisher(*ports)
        self.ports = (self.pub.endpoint.rsplit(":", 1)[1],
                      self.pub.replay_endpoint.rsplit(":", 1)[1])
        self.source = EventSource(f"tcp://127.0.0.1:{self.ports[0]}",
                                  f"tcp://127.0.0.1:{self.ports[1]}")

    def step(self):
        out = self.engine.step()
        self.events = self.cache.take_events()
        self.pub.publish_events(self.events)
        return out

    def restart(self) -> None:
        """A new engine, empty, and a new publisher on the same ports (numbers from 0)."""
        self.pub.close()
        model, tokenizer, capacity, page = self.args
        self.engine = Engine(model, tokenizer, capacity=capacity, page_size=page)
        self.cache = use_event_cache(self.engine)
        self.pub = _publisher(*self.ports)

    def close(self) -> None:
        self.pub.close()


def _publisher(port: str, replay_port: str) -> ZmqEventPublisher:
    for _ in range(100):  # ZMQ releases a closed socket's port in the background
        try:
            return ZmqEventPublisher(f"tcp://*:{port}", f"tcp://*:{replay_port}")
        except Exception:  # noqa: BLE001 - zmq.ZMQError: address in use, retried
            time.sleep(0.05)
    raise RuntimeError(f"ports {port}, {replay_port} stayed busy")


def make_router(policy: str, replicas: list[Replica], args):
    """One router; the three cache-aware ones share chapter 09a's balance thresholds."""
    n = len(replicas)
    rule = {"balance_abs_threshold": args.balance_abs, "balance_rel_threshold": args.balance_rel,
            "cache_threshold": args.cache_threshold}
    if policy == "round_robin":
        return RoundRobinRouter(n)
    if policy == "approx":
        return CacheAwareRouter(n, **rule)
    if policy in ("precise", "precise_09a"):
        sub = KVEventSubscriber(BlockIndex(n), [r.source for r in replicas],
                                block_size=args.page)
        return PreciseRouter(n, args.page, subscriber=sub, affinity=policy == "precise", **rule)
    return OracleRouter([r.cache for r in replicas], **rule)


def run(policy: str, scenario: str, model, tokenizer, jobs: list[Job], args) -> Outcome:
    replicas = [Replica(model, tokenizer, args.capacity, args.page)
                for _ in range(args.replicas)]
    routers = [make_router(policy, replicas, args)
               for _ in range(2 if scenario == "two_routers" else 1)]
    time.sleep(0.3)  # the SUB sockets connect
    out = Outcome(policy)
    waiting = deque(jobs)
    live: dict[str, tuple[int, int, int]] = {}  # rid -> (replica, router, mark)
    inflight = [0] * len(replicas)
    computed = [0] * len(replicas)
    sent = 0
    restarted = scenario != "restart"

    def send(job: Job) -> None:
        nonlocal sent
        k = sent % len(routers)
        router = routers[k]
        if isinstance(router, PreciseRouter):
            for r in replicas:
                r.pub.flush()
            if not router.subscriber.sync([r.pub.seq for r in replicas]):
                raise RuntimeError("the precise router's feed did not catch up in 5 s")
        if isinstance(router, (PreciseRouter, OracleRouter)):
            replica = router.route_ids(job.ids)
        else:
            replica = router.route(job.text)
        out.spreads.append(max(inflight) - min(inflight))
        out.routed[job.rid] = (replica, router.decisions[-1].reason)
        inflight[replica] += 1
        replicas[replica].engine.submit(Request(prompt=job.ids,
                                                max_new_tokens=args.max_new_tokens,
                                                rid=job.rid))
        live[job.rid] = (replica, k, computed[replica])
        sent += 1

    def step(i: int) -> None:
        result = replicas[i].step()
        for router in routers:
            if isinstance(router, OracleRouter):
                router.observe(i, replicas[i].events)
        computed[i] += sum(len(h.lc.prompt) - h.lc.reused_len for h in result.admitted)
        for h in result.admitted:
            out.waits.append(computed[i] - live[h.rid][2])
        for h in result.finished:
            replica, k, _ = live.pop(h.rid)
            metrics = h.result.metrics
            out.prompt += metrics.prompt_tokens
            out.hit += metrics.cached_tokens
            out.hits[h.rid] = metrics.cached_tokens
            out.outputs[h.rid] = list(h.result.output_ids)
            inflight[replica] -= 1
            routers[k].done(replica)

    while waiting or live:
        if not restarted and sent >= len(jobs) // 2:
            while replicas[0].engine.has_work:  # drain replica 0, then restart it
                step(0)
            replicas[0].restart()
            for router in routers:
                if isinstance(router, OracleRouter):
                    router.caches[0] = replicas[0].cache
            time.sleep(0.3)  # the SUB sockets reconnect
            restarted = True
        while waiting and len(live) < args.concurrency:
            send(waiting.popleft())
        for i, r in enumerate(replicas):
            if r.engine.has_work:
                step(i)
    out.computed = out.prompt - out.hit
    subs = [r.subscriber for r in routers if isinstance(r, PreciseRouter)]
    if subs:
        totals = [s.totals() for s in subs]
        out.feed_totals = {name: sum(getattr(t, name) for t in totals) for name in vars(totals[0])}
        out.feed = (f"batches {sum(t.batches for t in totals)}, restarts "
                    f"{sum(t.restarts for t in totals)}, late starts "
                    f"{sum(t.late_starts for t in totals)}, gaps {sum(t.gaps for t in totals)}, "
                    f"bad {sum(t.bad_batches + t.bad_events for t in totals)}")
        for s in subs:
            s.close()
    for router in routers:
        out.reasons.update(d.reason for d in router.decisions)
    for r in replicas:
        r.close()
    return out


def report(scenario: str, outcomes: list[Outcome]) -> None:
    base = outcomes[0].outputs
    print(f"\n{scenario}")
    print(f"{'policy':<12} {'hit tokens':>10} {'hit rate':>8} {'computed':>9} "
          f"{'TTFT mean':>9} {'TTFT p90':>8} {'spread':>6} {'outputs':>8}")
    for o in outcomes:
        waits = sorted(o.waits)
        p90 = waits[int(0.9 * (len(waits) - 1))]
        same = sum(o.outputs[rid] == base[rid] for rid in base)
        print(f"{o.policy:<12} {o.hit:>10} {o.hit / o.prompt:>8.3f} {o.computed:>9} "
              f"{statistics.mean(o.waits):>9.1f} {p90:>8} "
              f"{statistics.mean(o.spreads):>6.2f} {same:>4}/{len(base):<3}")
    for o in outcomes:
        if o.feed:
            print(f"  {o.policy} feed: {o.feed}")


def outcome_json(o: Outcome, base: dict[str, list[int]]) -> dict:
    """One policy's row of the JSON table (see the module docstring)."""
    waits = sorted(o.waits)
    return {"prompt_tokens": o.prompt, "hit_tokens": o.hit, "computed": o.computed,
            "hit_rate": round(o.hit / o.prompt, 4),
            "ttft_mean": round(statistics.mean(o.waits), 2),
            "ttft_p90": waits[int(0.9 * (len(waits) - 1))],
            "spread": round(statistics.mean(o.spreads), 3),
            "outputs_equal": sum(o.outputs[rid] == base[rid] for rid in base),
            "requests": len(base), "reasons": dict(sorted(o.reasons.items())),
            "feed": o.feed_totals}


def table_json(results: dict[str, list[Outcome]], jobs: list[Job], args,
               staleness: dict | None = None) -> dict:
    """The whole table as the JSON the module docstring describes."""
    return {
        "schema": 1,
        "command": "python " + " ".join(["benchmarks/kv_routing.py", *sys.argv[1:]]),
        "settings": {"model": "tiny" if args.tiny else "default", "replicas": args.replicas,
                     "capacity": args.capacity, "page": args.page, "requests": len(jobs),
                     "tenants": args.tenants,
                     "prompt_tokens": [min(len(j.ids) for j in jobs),
                                       max(len(j.ids) for j in jobs)],
                     "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
                     "balance_abs": args.balance_abs, "balance_rel": args.balance_rel,
                     "cache_threshold": args.cache_threshold, "seed": args.seed},
        "policies": list(POLICIES),
        "workloads": {scenario: {o.policy: outcome_json(o, outcomes[0].outputs)
                                 for o in outcomes}
                      for scenario, outcomes in results.items()},
        "staleness": staleness,
    }


def vllm_check(tokenizer, jobs: list[Job]) -> None:
    """vLLM's own events (``_kv_events_vllm.py`` in .venv-vllm) into a precise router's
    index: every full block vLLM cached must be found under minirt's hashes."""
    from _setup import run_in_vllm

    from minirt.precise_router import request_block_hashes

    prompts = [j.ids for j in jobs[:4]]
    block = 32  # vLLM's CPU attention refuses 16: "No common block size for 16"
    got = run_in_vllm("_kv_events_vllm.py", {"port": 25557, "prompts": prompts,
                                               "max_tokens": 2, "block_size": block})
    sub = KVEventSubscriber(BlockIndex(1), block_size=block)
    held: Counter = Counter()
    for topic, seq, payload in got["frames"]:
        assert bytes.fromhex(topic) == b"kv"
        sub.receive(0, int(seq, 16), bytes.fromhex(payload))
        if sub.index.held(0):
            held = sub.index.held(0)
    stats = sub.feeds[0].stats
    print(f"vLLM published {len(got['frames'])} batches: {stats.events} events, "
          f"{stats.bad_batches} bad batches, {stats.bad_events} bad events, "
          f"{stats.ignored_events} ignored; vLLM's cached tokens per prompt "
          f"{[o['cached'] for o in got['outputs']]}")
    for ids in prompts:
        hashes = request_block_hashes(ids, block)
        found = sum(h in held for h in hashes)
        print(f"  prompt of {len(ids)} tokens: {found}/{len(hashes)} of its full blocks' "
              "minirt hashes were in vLLM's events")
        assert found == len(hashes), "minirt's hashes differ from vLLM's"
    assert len(sub.index) == 0, "AllBlocksCleared after reset_prefix_cache empties the index"
    print("  after reset_prefix_cache: AllBlocksCleared emptied the index")


def check(scenario: str, by: dict[str, Outcome]) -> None:
    """What must hold whatever the numbers: the outputs agree; a precise router that has
    every batch before it decides decides as the oracle does; its feed saw no gap or bad
    batch, and the restart (only in that workload)."""
    base = by["round_robin"].outputs
    for name, o in by.items():
        assert o.outputs == base, f"{scenario}: {name}'s outputs differ from round robin's"
    assert by["precise"].hit == by["oracle"].hit, f"{scenario}: precise and oracle differ"
    feed = by["precise"].feed
    assert ", gaps 0, bad 0" in feed, f"{scenario}: {feed}"
    assert (", restarts 1," in feed) == (scenario == "restart"), f"{scenario}: {feed}"
    print(f"  checked: equal outputs, precise = oracle, feed clean ({scenario})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=800, help="pool tokens per replica")
    ap.add_argument("--page", type=int, default=16, help="page = vLLM block size")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-threshold", type=float, default=0.3,
                    help="cache_threshold (sglang-router's default 0.3)")
    ap.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    ap.add_argument("--balance-abs", type=int, default=64,
                    help="balance_abs_threshold (sglang-router's default 64)")
    ap.add_argument("--balance-rel", type=float, default=1.5,
                    help="balance_rel_threshold (sglang-router's default 1.5)")
    ap.add_argument("--tiny", action="store_true",
                    help="serve on a random tiny Llama with the real vocabulary: routing, hit "
                         "tokens and TTFT in tokens do not depend on the weights; outputs do")
    ap.add_argument("--check", action="store_true",
                    help="assert equal outputs, precise = oracle and a clean feed (make target)")
    ap.add_argument("--vllm", action="store_true",
                    help="only feed a real vLLM CPU engine's KV events into the index")
    args = ap.parse_args()
    if args.quick:
        args.requests = 30
    torch.set_num_threads(2)
    model, tokenizer = load_model()
    if args.tiny:
        model = tiny_model(0, vocab_size=len(tokenizer))
    jobs = workload(tokenizer, args.tenants, args.requests, args.system_tokens, args.seed)
    if args.vllm:
        vllm_check(tokenizer, jobs)
        return
    print(f"{'tiny random model' if args.tiny else 'the default model'}; "
          f"{args.replicas} replicas of {args.capacity} tokens, page {args.page}; "
          f"{len(jobs)} requests from {args.tenants} tenants, prompts "
          f"{min(len(j.ids) for j in jobs)}-{max(len(j.ids) for j in jobs)} tokens; "
          f"concurrency {args.concurrency}; balance thresholds {args.balance_abs}, "
          f"{args.balance_rel}; TTFT in prefill tokens")
    results: dict[str, list[Outcome]] = {}
    for scenario in args.scenarios:
        start = time.perf_counter()
        outcomes = [run(p, scenario, model, tokenizer, jobs, args) for p in POLICIES]
        results[scenario] = outcomes
        report(scenario, outcomes)
        if args.check:
            check(scenario, {o.policy: o for o in outcomes})
        print(f"  ({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table_json(results, jobs, args), f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
