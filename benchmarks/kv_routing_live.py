"""Routing by KV events on live servers: round robin, SGLang's real router
(``--policy cache_aware``) and minirt's precise router, in front of 3 real
``minirt.serve`` processes that evict.

``benchmarks/kv_routing.py`` measures the same policies on in-process engines, where
the precise router waits for every event sent before it decides. Here nothing waits:
each replica is a ``python -m minirt.serve --capacity C --page-size P
--kv-events-config '{"enable_kv_cache_events": true, ...}'`` process publishing vLLM's
events over ZMQ on its own two ports (PUB and replay), and the precise router reads
what has arrived when it routes. The requests are ``kv_routing.workload``'s eviction
workload (6 tenants' long system prompts; 800-token pools hold about three prompts), sent as
``/v1/chat/completions`` (greedy, ``temperature`` 0, streaming with
``stream_options.include_usage``), ``--concurrency`` at a time, in order; in the
``restart`` workload, once half of them are answered, replica 0's process is stopped (by
its pid) and started again on the same ports, with an empty cache and its event numbers
from 0. The policies:

* ``round_robin``: the client deals requests to the replicas in turn;
* ``sglang``: SGLang's router (sglang-router 0.3.2, started as ``tools/router_demo.py``
  starts it: ``router_demo.start_router``) with ``--policy cache_aware`` and the same
  thresholds; the client posts to the router, which routes by the messages' text;
* ``precise``: ``minirt.precise_router.PreciseRouter`` (its default, speculation on) fed
  by ``KVEventSubscriber`` from the replicas' live events; the client picks a replica
  with ``route_ids`` on the prompt's token ids and posts to it, and calls ``done`` when
  the response ends.

Every policy gets fresh replicas (empty caches). Per policy, from the responses: hit
tokens (``usage.prompt_tokens_details.cached_tokens`` summed), prompt tokens
(``usage.prompt_tokens`` summed; each must equal the ids the precise router hashed),
TTFT measured by the client as the time from sending the request to its first streamed
chunk (the server sends the first chunk with the first token), requests per replica
(each replica names itself in ``system_fingerprint``), and the in-flight spread: max -
min of the requests in flight per replica at each request's start, from the client's
own send and end times. Outputs (the generated text) must be equal across policies.

    make kv-routing-live     (or: .venv/bin/python benchmarks/kv_routing_live.py \\
                              --router-python .venv-router/bin/python --json PATH)

``--json PATH`` writes::

    {"schema": 1, "command": str,
     "settings": {"model": str, "replicas": int, "capacity": int, "page": int,
                  "requests": int, "tenants": int, "system_tokens": int,
                  "concurrency": int, "max_new_tokens": int, "balance_abs": int,
                  "balance_rel": float, "cache_threshold": float, "seed": int},
     "policies": [str, ...],
     "workloads": {"eviction" | "restart": {"<policy>": {
         "prompt_tokens": int, "hit_tokens": int, "hit_rate": float,
         "ttft_ms_median": float, "ttft_ms_p90": float,
         "per_replica": [int, ...], "spread_mean": float, "spread_max": int,
         "outputs_equal": int, "requests": int, "seconds": float,
         "feed": {str: int} | null,       # precise: the subscriber's FeedStats totals
         "reasons": {str: int} | null,    # precise: its decisions by reason
         "credited_but_gone": int | null,  # precise: cache-hit routes whose response
                                           # found fewer tokens cached than credited
         "restart_seconds": float | null,  # restart: replica 0 down until serving
         "per_request": [{"tenant": int, "replica": str, "cached": int,
                          "reason": str | null}, ...]}}}}  # in send order

TTFT in milliseconds depends on the machine and its load (3 replicas on shared CPU
cores); hit tokens and outputs do not depend on timing except through the routing.
Every process is stopped by its pid, also on failure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

from kv_routing import workload  # noqa: E402
from router_demo import MODEL_NAME, free_port, start_router  # noqa: E402

from minirt.model import DEFAULT_MODEL, load_model  # noqa: E402
from minirt.precise_router import (  # noqa: E402
    BlockIndex,
    EventSource,
    KVEventSubscriber,
    PreciseRouter,
)
from minirt.replicas import tenant_chats  # noqa: E402
from minirt.request import chat_prompt_ids  # noqa: E402
from minirt.serve import ServerProcess, launch  # noqa: E402

POLICIES = ("round_robin", "sglang", "precise")
SCENARIOS = ("eviction", "restart")


@dataclass
class Sent:
    """One request as the client saw it."""

    rid: str
    replica: str = ""
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    credited: int | None = None  # precise, cache_hit: prompt tokens its index credited
    reason: str | None = None  # precise: why it chose the replica
    tenant: int = -1


@dataclass
class Result:
    policy: str
    sent: list[Sent] = field(default_factory=list)
    seconds: float = 0.0
    feed: dict[str, int] | None = None
    reasons: dict[str, int] | None = None  # precise: its routing decisions by reason
    restart_seconds: float | None = None  # restart: replica 0 stopped -> serving again


def chat_jobs(tokenizer, args) -> list[tuple[object, list[dict[str, str]]]]:
    """``kv_routing.workload``'s jobs with the messages they were built from (the same
    ``tenant_chats`` call), checked to be the same prompts."""
    jobs = workload(tokenizer, args.tenants, args.requests, args.system_tokens, args.seed)
    chats = tenant_chats(tokenizer, tenants=args.tenants, conversations=args.requests,
                         turns=1, system_tokens=args.system_tokens, seed=args.seed)
    out = []
    for c, job in enumerate(jobs):
        messages = [{"role": "system", "content": chats.systems[chats.tenant_of[c]]},
                    {"role": "user", "content": chats.users[c][0]}]
        if chat_prompt_ids(tokenizer, messages) != job.ids:
            raise RuntimeError(f"{job.rid}: messages do not rebuild the workload's prompt")
        out.append((job, messages))
    return out


def start_replica(i: int, args, ports: tuple[int, int, int]) -> ServerProcess:
    """``minirt.serve`` on fixed ports (HTTP, event PUB, event replay) as replica ``r{i}``."""
    http, pub, replay = ports
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    return launch("--port", str(http), "--server-id", f"r{i}", "--capacity",
                  str(args.capacity), "--page-size", str(args.page), "--served-model-name",
                  MODEL_NAME, "--kv-events-config", json.dumps(config),
                  env={"TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})


def start_replicas(args) -> tuple[list[ServerProcess], list[tuple[int, int, int]]]:
    ports = [(free_port(), free_port(), free_port()) for _ in range(args.replicas)]
    servers: list[ServerProcess] = []
    try:
        with ThreadPoolExecutor(args.replicas) as pool:
            futures = [pool.submit(start_replica, i, args, p) for i, p in enumerate(ports)]
            errors = []
            for f in futures:
                try:
                    servers.append(f.result())
                except Exception as exc:  # noqa: BLE001 - start what we can, then stop all
                    errors.append(exc)
        if errors:
            raise errors[0]
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers, ports


def post(client: httpx.Client, url: str, messages, args, sent: Sent) -> None:
    """One streamed chat completion; fills ``sent`` from its chunks."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": args.max_new_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent.start = time.perf_counter()
    pieces = []
    with client.stream("POST", url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{sent.rid}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if sent.first is None:
                sent.first = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{sent.rid}: {chunk['error']}")
            sent.replica = chunk.get("system_fingerprint", sent.replica)
            for choice in chunk.get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
            if chunk.get("usage"):
                sent.prompt_tokens = chunk["usage"]["prompt_tokens"]
                sent.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    sent.end = time.perf_counter()
    sent.text = "".join(pieces)


def run(policy: str, scenario: str, jobs, args) -> Result:
    """Fresh replicas, the policy's router, every job sent; every process stopped.
    ``restart``: once half the jobs are sent and answered, replica 0's process is stopped
    and a new one started on the same three ports (an empty cache; its events number
    from 0 again); for SGLang's router, the run goes on once its health check reports
    every worker healthy again."""
    servers, ports = start_replicas(args)
    router = sub = None
    result = Result(policy)
    try:
        urls = [s.url for s in servers]
        rule = {"cache_threshold": args.cache_threshold,
                "balance_abs_threshold": args.balance_abs,
                "balance_rel_threshold": args.balance_rel}
        if policy == "sglang":
            router = start_router(args.router_python, [s.base for s in servers],
                                  "cache_aware", settings=rule)
        precise = None
        if policy == "precise":
            sources = [EventSource(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
                       for _, pub, replay in ports]
            sub = KVEventSubscriber(BlockIndex(len(servers)), sources, block_size=args.page)
            precise = PreciseRouter(len(servers), args.page, subscriber=sub, **rule)
            time.sleep(0.3)  # the SUB sockets connect
        lock = threading.Lock()
        slots = threading.Semaphore(args.concurrency)
        errors: list[BaseException] = []

        def one(k: int, job, messages, client: httpx.Client) -> None:
            sent = result.sent[k]
            try:
                if policy == "sglang":
                    post(client, router.url, messages, args, sent)
                else:
                    with lock:
                        if precise is None:
                            replica = k % len(servers)
                        else:
                            replica = precise.route_ids(job.ids)
                            d = precise.decisions[-1]
                            sent.reason = d.reason
                            if d.reason == "cache_hit":
                                sent.credited = round(d.match_rate * len(job.ids))
                    try:
                        post(client, urls[replica], messages, args, sent)
                    finally:
                        if precise is not None:
                            with lock:
                                precise.done(replica)
                if sent.prompt_tokens != len(job.ids):
                    raise RuntimeError(f"{job.rid}: the server counted {sent.prompt_tokens} "
                                       f"prompt tokens, the client hashed {len(job.ids)}")
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                errors.append(exc)
            finally:
                slots.release()

        start = time.perf_counter()
        with httpx.Client(timeout=300) as client, \
                ThreadPoolExecutor(args.concurrency) as pool:
            for k, (job, messages) in enumerate(jobs):
                result.sent.append(Sent(job.rid, tenant=job.tenant))
                if scenario == "restart" and k == len(jobs) // 2:
                    for _ in range(args.concurrency):  # every request so far answered
                        slots.acquire()
                    result.restart_seconds = restart(servers, ports, router, args)
                    for _ in range(args.concurrency):
                        slots.release()
                slots.acquire()
                if errors:
                    break
                pool.submit(one, k, job, messages, client)
        result.seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        if sub is not None:
            totals = sub.totals()
            result.feed = {name: int(getattr(totals, name)) for name in vars(totals)}
            result.reasons = dict(Counter(d.reason for d in precise.decisions))
    finally:
        if sub is not None:
            sub.close()
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
    return result


def restart(servers: list[ServerProcess], ports, router, args) -> float:
    """Stop replica 0 by its pid and start it again, empty, on the same ports."""
    start = time.perf_counter()
    servers[0].stop()
    servers[0] = start_replica(0, args, ports[0])
    if router is not None:
        time.sleep(2)  # its health check (every 1 s) has seen the new process
        deadline = time.monotonic() + 60
        while not all(w["is_healthy"] for w in router.workers()):
            if time.monotonic() > deadline:
                raise TimeoutError("the router did not see replica 0 healthy again in 60 s")
            time.sleep(0.2)
    return time.perf_counter() - start


def spreads(sent: list[Sent], names: list[str]) -> list[int]:
    """At each request's start, max - min of the requests then in flight per replica
    (the request itself counted), from the client's send and end times."""
    out = []
    for s in sent:
        loads = {n: 0 for n in names}
        for o in sent:
            if o.start <= s.start < o.end or o is s:
                loads[o.replica] += 1
        out.append(max(loads.values()) - min(loads.values()))
    return out


def summary(r: Result, base: Result, replicas: int) -> dict:
    names = [f"r{i}" for i in range(replicas)]
    ttft = sorted(1000 * (s.first - s.start) for s in r.sent)
    spread = spreads(r.sent, names)
    prompt = sum(s.prompt_tokens for s in r.sent)
    hit = sum(s.cached_tokens for s in r.sent)
    return {"prompt_tokens": prompt, "hit_tokens": hit, "hit_rate": round(hit / prompt, 4),
            "ttft_ms_median": round(statistics.median(ttft), 1),
            "ttft_ms_p90": round(ttft[int(0.9 * (len(ttft) - 1))], 1),
            "per_replica": [sum(s.replica == n for s in r.sent) for n in names],
            "spread_mean": round(statistics.mean(spread), 2), "spread_max": max(spread),
            "outputs_equal": sum(a.text == b.text for a, b in zip(r.sent, base.sent,
                                                                   strict=True)),
            "requests": len(r.sent), "seconds": round(r.seconds, 1), "feed": r.feed,
            "reasons": r.reasons,
            "credited_but_gone": (None if r.reasons is None else sum(
                s.credited is not None and s.cached_tokens < s.credited for s in r.sent)),
            "restart_seconds": (None if r.restart_seconds is None
                                else round(r.restart_seconds, 1)),
            "per_request": [{"tenant": s.tenant, "replica": s.replica, "cached": s.cached_tokens,
                             "reason": s.reason} for s in r.sent]}


def report(scenario: str, rows: dict[str, dict]) -> None:
    print(f"\n{scenario}")
    print(f"{'policy':<12} {'hit tokens':>10} {'of prompt':>9} {'hit rate':>8} "
          f"{'TTFT med ms':>11} {'TTFT p90 ms':>11} {'per replica':>12} {'spread':>6} "
          f"{'outputs':>8}")
    for policy, s in rows.items():
        per = "/".join(str(n) for n in s["per_replica"])
        print(f"{policy:<12} {s['hit_tokens']:>10} {s['prompt_tokens']:>9} "
              f"{s['hit_rate']:>8.3f} {s['ttft_ms_median']:>11.0f} {s['ttft_ms_p90']:>11.0f} "
              f"{per:>12} {s['spread_mean']:>6.2f} "
              f"{s['outputs_equal']:>3}/{s['requests']:<4}")
    for policy, s in rows.items():
        if s["feed"]:
            print(f"  {policy}: decisions {s['reasons']}, of the cache hits "
                  f"{s['credited_but_gone']} found less cached than credited; feed: "
                  + ", ".join(f"{k} {v}" for k, v in s["feed"].items() if v))


def differences(rows: dict[str, dict], a: str = "sglang", b: str = "precise") -> None:
    """Print the requests whose cached tokens differ between policies ``a`` and ``b``: the
    per-request account of a difference in hit tokens."""
    if a not in rows or b not in rows:
        return
    pairs = list(zip(rows[a]["per_request"], rows[b]["per_request"], strict=True))
    diff = [(k, x, y) for k, (x, y) in enumerate(pairs) if x["cached"] != y["cached"]]
    print(f"  {len(diff)} requests cached differently, {a} vs {b} "
          f"(request: tenant, replica and cached tokens of each; {b}'s reason):")
    for k, x, y in diff:
        print(f"    {k:>3}: tenant {x['tenant']}  {x['replica']} {x['cached']:>4}  "
              f"{y['replica']} {y['cached']:>4}  {y['reason']}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-python", default=str(ROOT / ".venv-router/bin/python"),
                    help="a Python with sglang-router==0.3.2 (make .venv-router)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=800, help="KV pool tokens per replica")
    ap.add_argument("--page", type=int, default=16, help="page = vLLM block size")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-threshold", type=float, default=0.3,
                    help="cache_threshold (sglang-router's default 0.3)")
    ap.add_argument("--balance-abs", type=int, default=64,
                    help="balance_abs_threshold (sglang-router's default 64)")
    ap.add_argument("--balance-rel", type=float, default=1.5,
                    help="balance_rel_threshold (sglang-router's default 1.5)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                    help="round_robin first (outputs are compared with its)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    args = ap.parse_args(argv)
    _, tokenizer = load_model()  # the tokenizer the replicas use (the model is dropped)
    jobs = chat_jobs(tokenizer, args)
    print(f"{DEFAULT_MODEL}; {args.replicas} minirt.serve replicas of {args.capacity} "
          f"tokens, page {args.page}, KV events over ZMQ; {len(jobs)} requests from "
          f"{args.tenants} tenants, prompts {min(len(j.ids) for j, _ in jobs)}-"
          f"{max(len(j.ids) for j, _ in jobs)} tokens; concurrency {args.concurrency}; "
          f"{args.max_new_tokens} new tokens, greedy; balance thresholds {args.balance_abs}, "
          f"{args.balance_rel}; TTFT: client-side, request sent -> first streamed chunk",
          flush=True)
    workloads = {}
    for scenario in args.scenarios:
        results = {}
        for policy in args.policies:
            results[policy] = run(policy, scenario, jobs, args)
            print(f"  {scenario}, {policy}: {results[policy].seconds:.0f} s", flush=True)
        base = results[args.policies[0]]
        workloads[scenario] = {p: summary(r, base, args.replicas) for p, r in results.items()}
        report(scenario, workloads[scenario])
        differences(workloads[scenario])
    table = {"schema": 1, "command": " ".join(["benchmarks/kv_routing_live.py", *(
                 argv if argv is not None else sys.argv[1:])]),
             "settings": {"model": DEFAULT_MODEL, "replicas": args.replicas,
                          "capacity": args.capacity, "page": args.page,
                          "requests": len(jobs), "tenants": args.tenants,
                          "system_tokens": args.system_tokens,
                          "concurrency": args.concurrency,
                          "max_new_tokens": args.max_new_tokens,
                          "balance_abs": args.balance_abs, "balance_rel": args.balance_rel,
                          "cache_threshold": args.cache_threshold, "seed": args.seed},
             "policies": list(args.policies), "workloads": workloads}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return table


if __name__ == "__main__":
    main()
