"""SGLang's own router (PyPI sglang-router==0.3.2) in front of real minirt.serve replicas.

    make router-demo        (or: python tools/router_demo.py [--router-python PATH])

Starts 3 ``minirt.serve`` replicas and the real router on free 127.0.0.1 ports, and
replays a multi-tenant chat trace (``minirt.replicas.tenant_chats``: several system
prompts, many conversations, canned replies as history) through the router with
``minirt.replay``:

1. ``--policy cache_aware`` and ``--policy round_robin`` (fresh replicas each time): hit
   rate, prefill tokens computed, and the spread of the router's queue lengths where its
   rule uses them: at each routing decision, max - min of its own in-flight counts per
   replica (``GET /workers``, read just before the request is sent) once the request
   is routed. The cache-aware rule leaves at most ``balance_abs_threshold + 1`` after a
   decision on balanced loads and sends the request to a least-loaded replica on
   imbalanced ones; completions between two arrivals can widen the gap further, and
   then only the shortest-queue choices close it. Every decision is checked against
   the rule for the loads the router may have seen (between the read before it and the
   read before the next arrival);
2. a skewed trace (one tenant with most conversations) at ``balance_abs_threshold`` 2:
   the popular tenant's requests pile up on one replica until the router rebalances;
3. how often ``minirt.router.CacheAwareRouter``, fed the same trace (arrivals and
   completions in the order the client saw them), picks the replica the real router
   picked (each replica names itself in ``system_fingerprint``);
4. a replica killed mid-run: the router's retries and health check take it out; every
   request the router answered is complete, and any that failed is reported and sent
   again.

Every process is stopped by its pid, also on failure. Timings are not measured here.

What the router asks a worker (sglang-router 0.3.2, read from its source): at
registration ``GET /health``, then best effort ``/server_info`` and ``/model_info``
(``/get_server_info`` and ``/get_model_info`` after a 404); afterwards its health checker
polls ``GET /health`` every ``--health-check-interval-secs`` (1 s here, 60 by default).
``minirt.serve`` answers ``/health`` and ``/get_model_info``.

Methodology, and what one run showed (chapter 09a keeps only the table):

* The balance rule bounds the spread at a routing decision, because the router tests
  its loads only when a request arrives. On balanced loads the request may go anywhere,
  so afterwards the spread is at most ``balance_abs_threshold + 1``; on imbalanced loads
  it goes to a least-loaded replica, which cannot widen the spread. Between arrivals
  requests finish, and a replica that finishes a batch drops its count at once, so the
  gap can open past the threshold until later arrivals close it. The demo therefore
  reads the router's loads just before each request is sent and compares each read with
  the next (a request finishing in the milliseconds before the routing shows up there):
  a decision counts as "exactly read" when the two agree.
* Sampling the loads on a timer instead (every 50 ms, as an earlier version did) read
  spreads of 9 to 11 on a loaded machine: moments between arrivals when one replica had
  finished its batch and another had not, not states the router decided on.
* ``balance_abs_threshold`` is 8, not the default 64, which 36 requests never approach;
  the balanced trace's spread after each decision was at most 3 in the recorded run
  (between 2 and 6 over seven runs).
* ``CacheAwareRouter`` fed the same arrivals and completions can part ways with the real
  router: the two see loads at slightly different moments, and one different choice
  between equally idle replicas makes their trees disagree from then on (one run agreed
  on 36 of 36, an earlier one on 12 of 36).
* At ``--rate 1`` requests rarely overlap, every replica looks idle, and each tenant's
  first request goes to the first replica: the cache-aware run then sends all 36
  requests to one replica, whose queue never exceeds 3, below the threshold.
* The kill test sends SIGKILL to one replica 3.2 s into the run (5 requests in flight
  there in the recorded run): 1 request failed with a connection error and was sent
  again; the health check took the replica out; no answered request was incomplete.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minirt.replay import ReplayReport, replay  # noqa: E402
from minirt.replicas import TenantChats, chat_routing_text, tenant_chats  # noqa: E402
from minirt.router import CacheAwareRouter  # noqa: E402
from minirt.serve import ServerProcess, launch  # noqa: E402

MODEL_NAME = "minirt"
# The router's settings for the demo: its defaults, except balance_abs_threshold (64 by
# default, far beyond anything a 36-request trace builds) and a fast health check.
SETTINGS = {"cache_threshold": 0.3, "balance_abs_threshold": 8, "balance_rel_threshold": 1.5}
# The skewed run: chapter 09a's threshold of 2, low enough that the popular tenant's
# pile-up makes the router rebalance.
SKEW_SETTINGS = {**SETTINGS, "balance_abs_threshold": 2}
SKEW_WEIGHTS = [8, 1, 1]
SKEW_RATE = 16.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess(ServerProcess):
    """The real router, a child process serving the same ``/v1`` routes as a replica;
    ``stop()`` (inherited) ends it by its pid."""

    def workers(self) -> list[dict]:
        return httpx.get(self.base + "/workers", timeout=5).json()["workers"]


def start_router(python: str, urls: list[str], policy: str, timeout: float = 60.0,
                 settings: dict = SETTINGS) -> RouterProcess:
    """``python -m sglang_router.launch_router`` on free ports, waiting until every
    worker is registered and healthy."""
    port, metrics = free_port(), free_port()
    log = Path(tempfile.mkstemp(prefix="sglang-router-", suffix=".log")[1])
    cmd = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics), "--policy", policy,
           "--cache-threshold", str(settings["cache_threshold"]),
           "--balance-abs-threshold", str(settings["balance_abs_threshold"]),
           "--balance-rel-threshold", str(settings["balance_rel_threshold"]),
           "--health-check-interval-secs", "1", "--log-level", "warn",
           "--worker-urls", *urls]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    router = RouterProcess(process, f"http://127.0.0.1:{port}/v1", log)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the router exited with {process.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
            try:
                workers = router.workers()
                if len(workers) == len(urls) and all(w["is_healthy"] for w in workers):
                    return router
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not ready after {timeout} s:\n{log.read_text()[-3000:]}")
    except BaseException:
        router.stop()
        raise


def start_replicas(n: int, capacity: int) -> list[ServerProcess]:
    """``n`` minirt.serve replicas started side by side, named r0..r{n-1}."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(launch, "--server-id", f"r{i}", "--capacity", str(capacity),
                               "--served-model-name", MODEL_NAME,
                               env={"TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
                   for i in range(n)]
        servers, errors = [], []
        for f in futures:
            try:
                servers.append(f.result())
            except Exception as exc:  # start what we can, then stop them all
                errors.append(exc)
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


class RouterLoads:
    """A replay hook (``minirt.replay``'s ``hook``): the router's own in-flight count per
    replica (``GET /workers``, the ``load`` its policy reads) just before each request is
    sent, in send order.

    The read blocks the replay's event loop on purpose: no other request of the trace
    goes out between the read and the request it belongs to.
    """

    def __init__(self, router: RouterProcess, names: dict[str, str]) -> None:
        self.router, self.names = router, names  # names: worker url -> "r0", "r1", ...
        self.client = httpx.Client(timeout=5)
        self.before: dict[int, dict[str, int]] = {}
        self.sent: list[int] = []  # record indices in send order

    def read(self) -> dict[str, int] | None:
        try:
            workers = self.client.get(self.router.base + "/workers").json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        loads = {self.names[w["url"]]: w["load"] for w in workers
                 if w["is_healthy"] and w["url"] in self.names}
        return loads if len(loads) == len(self.names) else None

    async def __call__(self, rec) -> None:
        loads = self.read()
        self.sent.append(rec.index)
        if loads is not None:
            self.before[rec.index] = loads

    def close(self) -> None:
        self.client.close()


@dataclass
class Decision:
    """One routing decision as the router counted it. ``loads``: its in-flight count per
    replica read just before the request was sent; ``pick``: the replica that answered;
    ``low``/``high``: bounds on the counts it decided on, between ``loads`` and the read
    before the next arrival less this request's own +1 (requests that finished, or an
    earlier one routed only after the read, move a count only one way in between; after
    the last arrival, anything may have finished). ``exact``: the next read is this one
    plus this request's +1 and nothing else, so ``loads`` are what the router saw."""

    index: int
    loads: tuple[int, ...]
    pick: int
    low: tuple[int, ...]
    high: tuple[int, ...]
    exact: bool = False

    @property
    def spread_before(self) -> int:
        return max(self.loads) - min(self.loads)

    @property
    def spread_after(self) -> int:
        after = list(self.loads)
        after[self.pick] += 1
        return max(after) - min(after)

    def possible_loads(self):
        """Every count vector between ``low`` and ``high``."""
        return itertools.product(*(range(lo, hi + 1)
                                   for lo, hi in zip(self.low, self.high, strict=True)))


def decisions(report: ReplayReport, loads: RouterLoads, order: list[str]) -> list[Decision]:
    """The trace's routing decisions in send order, with the router's loads in ``order``
    (server ids); requests without an answer or a reading are left out."""
    out = []
    by_index = {r.index: r for r in report.records}
    for k, i in enumerate(loads.sent):
        rec, before = by_index[i], loads.before.get(i)
        if rec.server not in order or before is None:
            continue
        now = tuple(before[sid] for sid in order)
        pick = order.index(rec.server)
        nxt = loads.before.get(loads.sent[k + 1]) if k + 1 < len(loads.sent) else None
        then = ((0,) * len(order) if nxt is None else
                tuple(nxt[sid] - (sid == rec.server) for sid in order))
        low = tuple(max(0, min(a, b)) for a, b in zip(now, then, strict=True))
        out.append(Decision(i, now, pick, low, tuple(map(max, now, then)),
                            exact=nxt is not None and then == now))
    return out


def imbalanced(loads: Sequence[int], abs_threshold: int, rel_threshold: float) -> bool:
    """The cache-aware rule's test: ``max - min > abs`` and ``max > rel * min``."""
    return max(loads) - min(loads) > abs_threshold and max(loads) > rel_threshold * min(loads)


def rule_bound(loads: Sequence[int], abs_threshold: int, rel_threshold: float) -> int:
    """The widest spread (max - min) the cache-aware rule can leave after routing one
    request on ``loads``: if they are imbalanced it goes to a least-loaded replica, which
    cannot widen the spread; otherwise it may go anywhere: ``abs + 1`` when the spread
    was within ``abs``, one more than before when only ``max <= rel * min`` held."""
    spread = max(loads) - min(loads)
    if imbalanced(loads, abs_threshold, rel_threshold):
        return spread
    return abs_threshold + 1 if spread <= abs_threshold else spread + 1


def follows_rule(d: Decision, abs_threshold: int, rel_threshold: float) -> bool:
    """Whether some loads the router may have decided on make ``d.pick`` a choice the
    rule allows: a least-loaded replica when they are imbalanced, and a spread after
    routing within ``rule_bound``."""
    for loads in d.possible_loads():
        after = list(loads)
        after[d.pick] += 1
        if max(after) - min(after) <= rule_bound(loads, abs_threshold, rel_threshold) and (
                not imbalanced(loads, abs_threshold, rel_threshold)
                or loads[d.pick] == min(loads)):
            return True
    return False


def spread_check(ds: list[Decision], settings: dict) -> dict:
    """Spreads at the decisions, and every decision against the rule."""
    abs_t, rel_t = settings["balance_abs_threshold"], settings["balance_rel_threshold"]
    exact = [d for d in ds if d.exact]
    rebalanced = [d for d in exact if imbalanced(d.loads, abs_t, rel_t)]
    return {
        "decisions": len(ds), "exact": len(exact),
        # sglang-router 0.3.2's round_robin does not count: its loads read 0 throughout
        "counted": any(sum(d.loads) > 0 for d in ds),
        "after": [d.spread_after for d in ds], "before": [d.spread_before for d in ds],
        "exact_after": [d.spread_after for d in exact],
        "imbalanced": len(rebalanced),
        "imbalanced_to_least": sum(d.loads[d.pick] == min(d.loads) for d in rebalanced),
        "against_rule": [(d.index, d.loads, d.low, d.high, d.pick) for d in ds
                         if not follows_rule(d, abs_t, rel_t)],
    }


def client_loads(report: ReplayReport, order: list[str]) -> dict[int, tuple[int, ...]]:
    """The loads the client can reconstruct at each arrival from its own timestamps:
    requests sent earlier and not yet answered, per replica that answered them."""
    out = {}
    done = [r for r in report.records if r.server in order and r.latency is not None]
    for rec in report.records:
        counts = [0] * len(order)
        for r in done:
            if r.arrival < rec.arrival < r.arrival + r.latency:
                counts[order.index(r.server)] += 1
        out[rec.index] = tuple(counts)
    return out


@dataclass
class Trace:
    """The requests of a trace in send order: (conversation, tenant, turn, messages)."""

    chats: TenantChats
    items: list[tuple[int, int, int, list[dict]]] = field(default_factory=list)

    def write(self, path: Path, which: list[int] | None = None) -> Path:
        with open(path, "w") as f:
            for i in range(len(self.items)) if which is None else which:
                f.write(json.dumps({"messages": self.items[i][3]}) + "\n")
        return path


def build_trace(tokenizer, tenants: int, conversations: int, turns: int,
                system_tokens: int, seed: int, weights: list[float] | None = None) -> Trace:
    """Turn t of every conversation, then turn t+1 (as concurrent users would send them);
    ``weights``: each tenant's share of the conversations (default equal)."""
    chats = tenant_chats(tokenizer, tenants, conversations, turns, system_tokens,
                         weights=weights, seed=seed)
    trace = Trace(chats)
    for t in range(turns):
        for c in range(conversations):
            trace.items.append((c, chats.tenant_of[c], t, chats.canned_messages(c, t)))
    return trace


def run_trace(router: RouterProcess, replicas: list[str], path: Path, rate: float,
              max_tokens: int, seed: int, tokenizer) -> tuple[ReplayReport, RouterLoads]:
    """Replay the JSONL trace through the router; the report and the router's loads at
    each arrival (``replicas``: the worker urls, named r0, r1, ... in this order)."""
    loads = RouterLoads(router, {url: f"r{i}" for i, url in enumerate(replicas)})
    try:
        report = replay(router.base + "/v1", str(path), rate=rate, seed=seed,
                        max_tokens=max_tokens, model=MODEL_NAME, ignore_eos=True,
                        tokenizer=tokenizer, hook=loads)
    finally:
        loads.close()
    return report, loads


def agreement(report: ReplayReport, trace: Trace, order: list[str]) -> tuple[int, int, dict]:
    """Feed ``CacheAwareRouter`` the trace as the client saw it (each arrival routed,
    each completion a ``done``) and count its picks equal to the real router's.

    ``order``: the server ids in the real router's worker order (its tie-breaks).
    """
    ours = CacheAwareRouter(len(order), **SETTINGS)
    events = []
    for rec in report.records:
        events.append((rec.arrival, 1, rec.index))
        if rec.latency is not None:
            events.append((rec.arrival + rec.latency, 0, rec.index))
    events.sort()
    picked: dict[int, int] = {}
    agree = total = 0
    reasons: dict[str, list[int]] = {}
    for _, kind, i in sorted(events):
        if kind == 0:
            if i in picked:
                ours.done(picked[i])
            continue
        rec = report.records[i]
        picked[i] = ours.route(chat_routing_text(trace.items[i][3]))
        reason = ours.decisions[-1].reason
        if rec.server is None:
            continue
        same = order[picked[i]] == rec.server
        agree += same
        total += 1
        reasons.setdefault(reason, [0, 0])
        reasons[reason][0] += same
        reasons[reason][1] += 1
    return agree, total, reasons


def agreement_same_state(report: ReplayReport, trace: Trace, order: list[str],
                         loads: RouterLoads) -> tuple[int, int]:
    """The decision rule alone: for each request, the router's own loads read just before
    it was sent and a tree of the real router's own earlier picks; how often
    ``CacheAwareRouter``'s rule picks what the real router picked.

    ``order``: server ids in the tie-break order.
    """
    ours = CacheAwareRouter(len(order), **SETTINGS)
    index = {sid: i for i, sid in enumerate(order)}
    agree = total = 0
    for rec in sorted(report.records, key=lambda r: r.arrival):
        text = chat_routing_text(trace.items[rec.index][3])
        before = loads.before.get(rec.index)
        if rec.server is None or before is None:
            continue
        now = [before[sid] for sid in order]
        if ours.imbalanced(now):
            pick = min(range(len(now)), key=lambda i: now[i])
        else:
            match = ours.tree.prefix_match(text)
            pick = match.tenant if match.rate > ours.cache_threshold \
                else min(range(len(now)), key=lambda i: now[i])
        agree += pick == index[rec.server]
        total += 1
        ours.tree.insert(text, index[rec.server])
    return agree, total


def stats(report: ReplayReport) -> dict:
    ok = report.ok
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    per: dict[str, int] = {}
    for r in ok:
        per[r.server or "?"] = per.get(r.server or "?", 0) + 1
    return {"requests": len(report.records), "failed": len(report.records) - len(ok),
            "prompt": prompt, "cached": cached, "computed": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "per_replica": dict(sorted(per.items()))}


def _spread(xs: list[int]) -> str:
    return f"max {max(xs, default=0)}, mean {sum(xs) / len(xs) if xs else 0:.2f}"


def _row(policy: str, s: dict, check: dict) -> str:
    spread = (f"{_spread(check['after']):<18} {check['exact']:>2}/{check['decisions']:<3}"
              if check["counted"] else f"{'(no count kept)':<18} {'':<6}")
    return (f"{policy:<12} {s['requests']:>4} {s['failed']:>6} {s['prompt']:>7} "
            f"{s['computed']:>8} {s['hit_rate']:>8.3f}   {spread}  {s['per_replica']}")


def per_tenant(report: ReplayReport, trace: Trace) -> dict[int, dict[str, int]]:
    """Requests each tenant sent to each replica."""
    out: dict[int, dict[str, int]] = {}
    for r in report.ok:
        tenant = out.setdefault(trace.items[r.index][1], {})
        tenant[r.server or "?"] = tenant.get(r.server or "?", 0) + 1
    return {t: dict(sorted(v.items())) for t, v in sorted(out.items())}


def kill_run(python: str, trace: Trace, path: Path, args, tokenizer, procs: list) -> dict:
    """Cache-aware replay on fresh replicas; once a third of the trace has been sent, SIGKILL
    the first replica the router has a request in flight on (cache affinity may leave any
    one replica idle for the rest of the trace, so the victim is not fixed in advance)."""
    replicas = start_replicas(args.replicas, args.capacity)
    procs.extend(replicas)
    router = start_router(python, [s.base for s in replicas], "cache_aware")
    procs.append(router)
    by_url = {s.base: (i, s) for i, s in enumerate(replicas)}
    kill: dict = {}
    t0 = time.perf_counter()

    def killer() -> None:
        time.sleep(len(trace.items) / 3 / args.rate if args.rate else 0.5)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                busy = [(w["load"], w["url"]) for w in router.workers()
                        if w["load"] > 0 and w["url"] in by_url]
            except (httpx.HTTPError, ValueError, KeyError):
                busy = []
            if busy:
                load, url = busy[0]
                kill["in_flight"] = load
                kill["at"] = time.perf_counter() - t0
                kill["index"], victim = by_url[url]
                kill["victim"] = victim
                victim.process.kill()  # SIGKILL by pid: no goodbye to the router
                return
            time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    report, _ = run_trace(router, [s.base for s in replicas], path, args.rate,
                          args.max_tokens, args.seed, tokenizer)
    thread.join(130)
    time.sleep(2.5)  # a health check or two
    healthy = {w["url"]: w["is_healthy"] for w in router.workers()}
    victim = kill.get("victim")
    name = f"r{kill['index']}" if victim is not None else None
    failed = [r.index for r in report.records if r.error is not None]
    truncated = [r.index for r in report.records
                 if r.error is None and (r.finish_reason is None or
                                         r.completion_tokens != args.max_tokens)]
    after = [r for r in report.records if "at" in kill and r.arrival > kill["at"] + 0.5]
    retry = None
    if failed:
        retry, _ = run_trace(router, [s.base for s in replicas],
                             trace.write(path.with_suffix(".retry.jsonl"), failed),
                             0, args.max_tokens, args.seed, tokenizer)
    return {"killed_at": kill.get("at"), "in_flight": kill.get("in_flight"),
            "report": report, "failed": failed, "truncated": truncated, "retry": retry,
            "sent_after": len(after),
            "victim": name, "victim_after": sum(r.server == name for r in after),
            "victim_healthy": healthy.get(victim.base) if victim is not None else None,
            "victim_pid": victim.pid if victim is not None else None}


def serve_trace(args, policy: str, settings: dict, trace: Trace, path: Path, rate: float,
                tokenizer, procs: list) -> dict:
    """The trace through the real router (``policy``, ``settings``) on fresh replicas:
    its stats, the router's loads at each decision and the spread check."""
    replicas = start_replicas(args.replicas, args.capacity)
    procs.extend(replicas)
    router = start_router(args.router_python, [s.base for s in replicas], policy,
                          settings=settings)
    procs.append(router)
    ids = {s.base: f"r{i}" for i, s in enumerate(replicas)}
    order = [ids[w["url"]] for w in router.workers()]
    report, loads = run_trace(router, [s.base for s in replicas], path, rate,
                              args.max_tokens, args.seed, tokenizer)
    for proc in [router, *replicas]:
        proc.stop()
    s = stats(report)
    ds = decisions(report, loads, order)
    check = spread_check(ds, settings)
    seen = client_loads(report, order)
    check["client_agrees"] = sum(seen[d.index] == d.loads for d in ds)
    return {**s, "loads": loads, "report": report, "order": order, "decisions": ds,
            "spread": check, "per_tenant": per_tenant(report, trace)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--router-python", default=str(ROOT / ".venv-router" / "bin" / "python"),
                   help="a Python with sglang-router==0.3.2 installed")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=150)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-skew", action="store_true", help="skip the skewed-tenants run")
    p.add_argument("--no-kill", action="store_true", help="skip the killed-replica run")
    args = p.parse_args(argv)

    from minirt.workloads import default_tokenizer

    tokenizer = default_tokenizer()
    trace = build_trace(tokenizer, args.tenants, args.conversations, args.turns,
                        args.system_tokens, args.seed)
    work = Path(tempfile.mkdtemp(prefix="router-demo-"))
    path = trace.write(work / "trace.jsonl")
    print(f"trace: {len(trace.items)} chat requests, {args.tenants} tenants, "
          f"{args.conversations} conversations x {args.turns} turns, Poisson {args.rate}/s, "
          f"{args.max_tokens} new tokens each; {args.replicas} minirt.serve replicas; "
          f"router settings {SETTINGS}")
    procs: list = []
    out: dict = {"runs": {}, "settings": dict(SETTINGS)}
    try:
        header = (f"{'policy':<12} {'reqs':>4} {'failed':>6} {'prompt':>7} {'computed':>8} "
                  f"{'hit rate':>8}   {'spread':<18} {'exact':<7} requests per replica")
        rows = []
        for policy in ("cache_aware", "round_robin"):
            run = serve_trace(args, policy, SETTINGS, trace, path, args.rate, tokenizer, procs)
            out["runs"][policy] = run
            rows.append(_row(policy, run, run["spread"]))
        abs_t = SETTINGS["balance_abs_threshold"]
        print("\nthe real router in front of minirt.serve (same trace, fresh replicas each). "
              "spread: max - min of the router's own\nin-flight counts per replica (its GET "
              "/workers, read just before each request was sent) once that request is "
              "routed;\nexact: decisions whose read the next arrival's read confirms (nothing "
              "finished or was routed in between)")
        print(header)
        print("\n".join(rows))
        ca, rr = out["runs"]["cache_aware"], out["runs"]["round_robin"]
        c = ca["spread"]
        print(f"cache_aware computes {ca['computed']} prefill tokens, round_robin "
              f"{rr['computed']}: {rr['computed'] / max(ca['computed'], 1):.2f}x")
        print(f"cache_aware, at its {c['decisions']} decisions: spread after routing "
              f"{dict(sorted(Counter(c['after']).items()))} (max {max(c['after'], default=0)}"
              f"; before routing, max {max(c['before'], default=0)}) against "
              f"balance_abs_threshold {abs_t}")
        print(f"  read exactly (the next read is this one plus this request) at {c['exact']}: "
              f"spread after routing max {max(c['exact_after'], default=0)}; loads imbalanced "
              f"(spread > {abs_t} and max > {SETTINGS['balance_rel_threshold']} x min) "
              f"{c['imbalanced']} times, {c['imbalanced_to_least']} of them sent to a "
              f"least-loaded replica")
        print(f"  every decision as the rule allows (a least-loaded replica on imbalanced loads; "
              f"after routing, a spread within {abs_t + 1} after balanced ones, no wider than "
              f"before after imbalanced ones) for some loads between the read before it and "
              f"the read before the next: "
              f"{'yes' if not c['against_rule'] else 'no, ' + str(c['against_rule'])}")
        print(f"  the client's own count (requests sent and not yet answered, from its "
              f"timestamps) equals the router's at {c['client_agrees']} of {c['decisions']} "
              f"arrivals")
        print(f"requests per tenant per replica: cache_aware {ca['per_tenant']}; "
              f"round_robin {rr['per_tenant']}")

        # Ties go to the router's first worker in its internal order, which its API does
        # not show (GET /workers lists them in another order): try all orders, keep the best.
        listed = agreement(ca["report"], trace, ca["order"])
        order, (agree, total, reasons) = max(
            ((list(o), agreement(ca["report"], trace, list(o)))
             for o in itertools.permutations(ca["order"])), key=lambda x: x[1][0])
        out["agreement"] = (agree, total, reasons)
        print(f"\nminirt.router.CacheAwareRouter on the same trace (arrivals and completions in "
              f"the order the client saw them) picks the real router's replica for "
              f"{agree}/{total} requests ({agree / max(total, 1):.0%}); by its own reason: "
              + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in reasons.items()))
        print(f"  (its replicas in the order {order}, the best of the {len(order)}! orders for "
              f"the router's hidden tie-break; in GET /workers' order {ca['order']}: "
              f"{listed[0]}/{listed[1]})")
        same, n = agreement_same_state(ca["report"], trace, order, ca["loads"])
        out["agreement_same_state"] = (same, n)
        print(f"  its decision rule alone, given the real router's loads at each arrival and a "
              f"tree of the real router's own picks: {same}/{n} ({same / max(n, 1):.0%})")

        if not args.no_skew:
            # Sent fast enough that the popular tenant's requests pile up on its replica
            # however fast the replicas are, so the balance rule must step in; not all at
            # once, so that each read of the loads sees the requests sent before it routed.
            skewed = build_trace(tokenizer, args.tenants, args.conversations, args.turns,
                                 args.system_tokens, args.seed, weights=SKEW_WEIGHTS)
            skew_path = skewed.write(work / "skewed.jsonl")
            sk = serve_trace(args, "cache_aware", SKEW_SETTINGS, skewed, skew_path,
                             SKEW_RATE, tokenizer, procs)
            out["skew"] = sk
            c, abs_s = sk["spread"], SKEW_SETTINGS["balance_abs_threshold"]
            print(f"\nskewed tenants (weights {SKEW_WEIGHTS}: conversations per tenant "
                  f"{[skewed.chats.tenant_of.count(t) for t in range(args.tenants)]}), "
                  f"{len(skewed.items)} requests at Poisson {SKEW_RATE}/s, cache_aware with "
                  f"balance_abs_threshold {abs_s}:")
            print(f"  computed {sk['computed']} of {sk['prompt']} prompt tokens (hit rate "
                  f"{sk['hit_rate']:.3f}); requests per replica {sk['per_replica']}; per tenant "
                  f"{sk['per_tenant']}")
            print(f"  read exactly at {c['exact']} of {c['decisions']} decisions: spread after "
                  f"routing {dict(sorted(Counter(c['exact_after']).items()))} (max "
                  f"{max(c['exact_after'], default=0)}); loads imbalanced {c['imbalanced']} "
                  f"times, {c['imbalanced_to_least']} of them sent to a least-loaded replica")
            print(f"  every decision as the rule allows, for some loads between the read before "
                  f"it and the read before the next: "
                  f"{'yes' if not c['against_rule'] else 'no, ' + str(c['against_rule'])}")

        if not args.no_kill:
            k = kill_run(args.router_python, trace, path, args, tokenizer, procs)
            out["kill"] = k
            ks = stats(k["report"])
            print(f"\nreplica {k['victim']} (pid {k['victim_pid']}) killed with SIGKILL at "
                  f"{k['killed_at'] or float('nan'):.1f} s, with {k['in_flight']} requests in "
                  f"flight there; the router then marks it healthy={k['victim_healthy']}")
            print(f"  answered {len(trace.items) - len(k['failed'])} of {len(trace.items)}: "
                  f"{len(k['truncated'])} of those incomplete; {len(k['failed'])} failed "
                  f"with an error: {[k['report'].records[i].error[:80] for i in k['failed']]}")
            print(f"  of the {k['sent_after']} requests sent from 0.5 s after the kill, "
                  f"{k['victim']} answered {k['victim_after']}")
            if k["retry"] is not None:
                print(f"  sent again: {len(k['retry'].ok)} of {len(k['failed'])} answered")
            print(f"  requests per replica: {ks['per_replica']}")
    finally:
        for proc in procs:
            proc.stop()
        alive = [proc.pid for proc in procs if proc.process.poll() is None]
        out["alive_after_stop"] = alive
        print(f"\nstopped {len(procs)} processes by pid; still alive: {alive or 'none'}")
    return out


if __name__ == "__main__":
    main()
