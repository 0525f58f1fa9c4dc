"""minirt's RadixCache against SGLang's, side by side in one process, on the same traces.

    .venv/bin/python benchmarks/radix_vs_sglang.py [--repeats 5] [--quick]
    .venv/bin/python benchmarks/radix_vs_sglang.py --only-production   # Mooncake's traces only
    .venv/bin/python benchmarks/radix_vs_sglang.py --memory-costs --full-block-requests 600

The peer is SGLang's own sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixCache` with
the three files it needs, sglang 0.5.23 `srt/mem_cache/base_prefix_cache.py`,
sglang 0.5.23 `srt/mem_cache/evict_policy.py` and
sglang 0.5.23 `srt/mem_cache/cache_init_params.py`, read unchanged from the published
wheel (its ``python/sglang/`` folder). The wheel is
fetched once with ``pip download --no-deps`` into ``~/.cache/minirt/peers`` (or
``$MINIRT_PEERS``); only those four files are loaded, beside minimal stand-ins for
their other imports (KV events and metrics off, as in SGLang's defaults).

Per request, both caches do what a server does (timed as one "request path"): match
the prompt, read the cached prefix's slot indices, lock the match, insert the whole
sequence with fresh slots, unlock. Each is handed its request as its own server holds
it: the ids as an ``array('q')`` (SGLang's ``RadixKey`` type); the fresh slots as an
int64 tensor for minirt (its ``PageTable.slots``) and as an int32 row for SGLang (its
request's row of ``ReqToTokenPool.req_to_token``). minirt checks the ids once per
request (``TokenIds``, inside the timing) and hands the checked ids to both its match
and its insert, as its ``Lifecycle`` does (``Request.prompt_ids``: the prompt's ``TokenIds``,
made when the request is added; an insert past the prompt, with output tokens, copies
and checks those ids once more, which these prompt-only traces never need); it checks
the slots in its insert. Each keeps its own copy of what it
caches: minirt copies the ids once (the checked copy, read-only, which the tree then
shares) and the slots it keeps. SGLang's insert gets what its server path,
sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixCache.checkpoint, RadixCache._insert_cache`,
hands it: the key a fresh slice of the request's ids
(``req.full_untruncated_fill_ids[:up_to]``), the values the row as a fresh int64
tensor (``kv_indices[:key_len].to(dtype=torch.int64, copy=True)``), whose new part the
insert then clones. Both trees live in host memory here, as on SGLang's CPU backend; on
a GPU server the row and the tree's values live on the device, where the conversion and
the clone cost the host a kernel launch each rather than a pass over the row (not
measured here). Then the tree is evicted to empty, a request's worth of tokens per
call (as a server making room), timed as "eviction".

The workloads: the book's chat, few-shot and RAG workloads, shared system prompts,
random unrelated requests (also handed to minirt as int64 tensors, as a caller without
``TokenIds`` would, given as they are to both its match and its insert, which each check
them; and 3,000 of 16 tokens, where a request costs its calls and little else), and
Mooncake's production
traces (``minirt.traces``: the conversation and synthetic traces), whole at
``--block-size`` tokens per hash id (16 by default) and their first
``--full-block-requests`` requests at 512, the traces' own block, where a request is
13,800 (conversation) and 12,400 (synthetic) tokens on average in the first 600: there
the cost per token (copies, comparisons) dominates, where at 16 the cost per node and
per call does.

Every request's matched length, its slot indices and the already-cached length of
its insert must agree between the two caches; the script exits with status 1 if
they ever differ. Timing: one thread, CPU time of this process
(``time.process_time``), garbage collector off while timing (as ``timeit`` does), the
contenders interleaved (the order flips each repeat), median of ``--repeats`` runs.
Ratios are minirt / SGLang: below 1, minirt is faster.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import statistics
import subprocess
import sys
import time
import types
import zipfile
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from minirt.cache import RadixCache
from minirt.token_ids import TokenIds

SGLANG = "sglang==0.5.23"
SGLANG_FILES = ("cache_init_params.py", "evict_policy.py", "base_prefix_cache.py", "radix_cache.py")
_PKG = "sglang/srt/mem_cache/"


def peers_dir() -> Path:
    return Path(os.environ.get("MINIRT_PEERS", Path.home() / ".cache" / "minirt" / "peers"))


def sglang_wheel(fetch: bool = True) -> Path | None:
    """The cached SGLang wheel; downloaded with pip (no dependencies) if missing and ``fetch``."""
    folder = peers_dir()
    version = SGLANG.split("==")[1]
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if found or not fetch:
        return found[0] if found else None
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SGLANG,
           "-d", str(folder)]
    try:
        subprocess.run(cmd, check=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"could not fetch {SGLANG}: {exc}", file=sys.stderr)
        return None
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


# ------------------------------------------------------------------ SGLang, loaded from the wheel


class _Disabled:
    """Stand-in for SGLang's KVCacheEventRecorder with events off: every record is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        self.enabled = False

    def record_store(self, *args, **kwargs) -> None:
        return None

    def record_remove(self, *args, **kwargs) -> None:
        return None

    def record_all_cleared(self) -> None:
        return None


class _FreeList:
    """Stand-in for the KV allocator: eviction hands it the freed slot runs."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[torch.Tensor] = []

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.freed.append(indices)


def _stand_ins(evict_policy: types.ModuleType) -> dict[str, dict[str, object]]:
    """The names the four files import from elsewhere in SGLang, with minimal meanings."""
    strategies = {
        "lru": evict_policy.LRUStrategy, "lfu": evict_policy.LFUStrategy,
        "fifo": evict_policy.FIFOStrategy, "mru": evict_policy.MRUStrategy,
        "filo": evict_policy.FILOStrategy, "priority": evict_policy.PriorityStrategy,
    }

    def get_eviction_strategy(policy: str, config: dict | None = None):
        factory = strategies[policy.lower()]
        return factory(**config) if config else factory()

    def split_node_hash_value(hashes, split_len: int, page_size: int):
        if hashes is None:
            return None, None
        pages = split_len // page_size
        return hashes[:pages], hashes[pages:]

    class LoRANameTable(dict):
        pass

    class ComponentType(Enum):
        FULL = "full"

    nothing = types.SimpleNamespace
    return {
        "sglang.srt.mem_cache.events": {
            "KVCacheEventRecorder": _Disabled, "LoRANameTable": LoRANameTable,
            "KvEventLoraNames": LoRANameTable,
        },
        "sglang.srt.mem_cache.utils": {
            "get_eviction_strategy": get_eviction_strategy,
            "split_node_hash_value": split_node_hash_value,
        },
        "sglang.srt.utils.common": {"ceil_align": lambda x, a: (x + a - 1) // a * a},
        "sglang.srt.mem_cache.allocator": {"BaseTokenToKVPoolAllocator": object},
        "sglang.srt.mem_cache.memory_pool": {"ReqToTokenPool": object},
        "sglang.srt.mem_cache.unified_cache.component_type": {"ComponentType": ComponentType},
        "sglang.srt.observability.metrics_collector": {
            "STAT_LOGGER_ROLE_RADIX_CACHE": "radix_cache", "RadixCacheMetricsCollector": object,
            "radix_cache_metric_labels": lambda *a, **k: {},
            "resolve_collector_class": lambda role, default: default,
        },
        "sglang.srt.runtime_context": {
            "get_observability": lambda: nothing(extra_metric_labels=None),
            "get_parallel": lambda: nothing(),
        },
    }


def load_sglang(wheel: Path) -> types.SimpleNamespace:
    """SGLang's radix cache from ``wheel``: its four files, unchanged, over stand-ins.

    The modules live in ``sys.modules`` only while they load (their dataclasses need
    that); afterwards ``sys.modules`` is as before.
    """
    with zipfile.ZipFile(wheel) as zf:
        sources = {name: zf.read(_PKG + name).decode() for name in SGLANG_FILES}
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    added: list[str] = []

    def module(name: str, attrs: dict[str, object] | None = None) -> types.ModuleType:
        mod = sys.modules.get(name) if name in added else None
        if mod is None:
            mod = types.ModuleType(name)
            mod.__path__ = []  # a package, so that submodules can be imported under it
            sys.modules[name] = mod
            added.append(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(module(parent), child, mod)
        mod.__dict__.update(attrs or {})
        return mod

    def load(file: str) -> types.ModuleType:
        mod = module("sglang.srt.mem_cache." + file[:-3])
        mod.__file__ = f"{wheel.name}/{_PKG}{file}"
        exec(compile(sources[file], mod.__file__, "exec"), mod.__dict__)
        return mod

    try:
        for k in saved:
            del sys.modules[k]
        policy = load("evict_policy.py")
        for name, attrs in _stand_ins(policy).items():
            module(name, attrs)
        load("cache_init_params.py")
        base = load("base_prefix_cache.py")
        radix = load("radix_cache.py")
    finally:
        for k in added:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
    return types.SimpleNamespace(
        RadixCache=radix.RadixCache, RadixKey=radix.RadixKey,
        MatchPrefixParams=base.MatchPrefixParams, InsertParams=base.InsertParams,
        EvictParams=base.EvictParams, source=wheel.name,
    )


# ------------------------------------------------------------------ the two contenders


@dataclass
class Trace:
    """A workload as both contenders take it: each request's ids as an int64 array, its
    fresh slots as an int64 tensor (minirt's) and as an int32 row (SGLang's)."""

    name: str
    requests: Sequence[Sequence[int]]  # lists, or int64 arrays (a production trace's)
    tensor_ids: bool = False  # minirt gets each request's ids as an int64 tensor

    def __post_init__(self) -> None:
        self.arrays = [array("q", r) for r in self.requests]
        self.tensors = ([torch.tensor(a, dtype=torch.int64) for a in self.arrays]
                        if self.tensor_ids else None)
        self.slots, start = [], 0
        for r in self.requests:  # fresh slots for the whole sequence, as after a prefill
            self.slots.append(torch.arange(start, start + len(r), dtype=torch.int64))
            start += len(r)
        self.rows = [s.to(torch.int32) for s in self.slots]  # the same, as SGLang holds them
        self.tokens = sum(len(r) for r in self.requests)
        self.evict_chunk = max(1, int(statistics.median(len(r) for r in self.requests)))


class Contender:
    """One cache under test: ``fresh`` tree, ``serve`` the trace, ``drain`` by eviction."""

    name = "?"

    def fresh(self, page_size: int) -> object:
        raise NotImplementedError

    def serve(self, cache, trace: Trace, record: list | None = None) -> None:
        raise NotImplementedError

    def drain(self, cache, chunk: int) -> int:
        raise NotImplementedError


class Minirt(Contender):
    name = "minirt"

    def fresh(self, page_size: int) -> RadixCache:
        return RadixCache(page_size=page_size)

    def serve(self, cache: RadixCache, trace: Trace, record: list | None = None) -> None:
        tensors = trace.tensor_ids
        for request, slots in zip(trace.tensors if tensors else trace.arrays, trace.slots,
                                  strict=True):
            # checked once per request, for both match and insert; a tensor, as an engine
            # holds ids, is handed to both as it is (each checks it)
            ids = request if tensors else TokenIds(request)
            m = cache.match_prefix(ids)
            prefix = m.indices
            cache.lock(m.handle)
            r = cache.insert_prefix(ids, slots)
            cache.unlock(m.handle)
            if record is not None:
                record.append((m.cached_len, _slots_digest(prefix), r.cached_len))

    def drain(self, cache: RadixCache, chunk: int) -> int:
        freed = 0
        while cache.evictable_size:
            freed += cache.evict(min(chunk, cache.evictable_size)).numel()
        return freed


class SGLang(Contender):
    name = "SGLang"

    def __init__(self, sgl: types.SimpleNamespace) -> None:
        self.sgl = sgl

    def fresh(self, page_size: int):
        return self.sgl.RadixCache.create_simulated(mock_allocator=_FreeList(), page_size=page_size)

    def serve(self, cache, trace: Trace, record: list | None = None) -> None:
        key_of, match_params, insert_params = (
            self.sgl.RadixKey, self.sgl.MatchPrefixParams, self.sgl.InsertParams)
        for ids, row in zip(trace.arrays, trace.rows, strict=True):
            m = cache.match_prefix(match_params(key=key_of(ids)))
            node = m.last_device_node
            prefix = cache.path_device_indices(node)
            cache.inc_lock_ref(node)
            # what SGLang's own insert path hands ``insert``: the key a fresh array
            # (``RadixCache.checkpoint``: ``req.full_untruncated_fill_ids[:up_to]``), the
            # values the request's int32 row of ``req_to_token`` as a fresh int64 tensor
            # (``RadixCache._insert_cache``: ``.to(dtype=torch.int64, copy=True)``)
            aligned = len(ids) - len(ids) % cache.page_size  # the key's whole pages
            values = row[:aligned].to(dtype=torch.int64, copy=True)
            r = cache.insert(insert_params(key=key_of(ids[: len(ids)]), value=values))
            cache.dec_lock_ref(node)
            if record is not None:
                record.append((m.device_prefix_len, _slots_digest(prefix), r.prefix_len))

    def drain(self, cache, chunk: int) -> int:
        params = self.sgl.EvictParams
        while cache.evictable_size():
            cache.evict(params(num_tokens=chunk))
        freed = cache.token_to_kv_pool_allocator.freed
        return sum(len(v) for v in freed)


# ------------------------------------------------------------------ agreement and timing


def _slots_digest(slots: torch.Tensor) -> str:
    """The prefix's slots, as what a comparison needs: the first few and a digest of all
    (a production trace's prefixes run to millions of slots)."""
    head = slots[:6].tolist()
    return f"{head}{'...' if slots.numel() > 6 else ''} n={slots.numel()} " + \
        hashlib.blake2b(slots.numpy().tobytes(), digest_size=12).hexdigest()


class Disagreement(AssertionError):
    """The two caches answered a request differently."""


def check_agreement(a: Contender, b: Contender, trace: Trace, page_size: int) -> int:
    """Serve ``trace`` through both; raise Disagreement at the first request they answer
    differently (matched length, the prefix's slots, or already-cached length).
    Returns the number of requests checked."""
    got: dict[str, list] = {}
    for c in (a, b):
        got[c.name] = []
        c.serve(c.fresh(page_size), trace, got[c.name])
    for i, (x, y) in enumerate(zip(got[a.name], got[b.name], strict=True)):
        if x != y:
            what = ["matched length", "matched slots", "already-cached length"]
            field = next(k for k in range(3) if x[k] != y[k])
            raise Disagreement(
                f"{trace.name}, page_size {page_size}, request {i} "
                f"({len(trace.requests[i])} tokens): {what[field]} differs: "
                f"{a.name} {str(x[field])[:80]}, {b.name} {str(y[field])[:80]}")
    return len(trace.requests)


def _cpu(fn: Callable[[], object]) -> tuple[float, object]:
    """CPU seconds of ``fn()``, with the garbage collector off as ``timeit`` has it: a full
    collection walks every object torch created (tens of ms) and would land on whichever
    contender happened to trigger it."""
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        out = fn()
        return time.process_time() - start, out
    finally:
        gc.enable()


def time_pair(contenders: Sequence[Contender], trace: Trace, page_size: int,
              repeats: int) -> dict[str, tuple[float, float]]:
    """Median CPU seconds per contender: (request path over the trace, draining the tree)."""
    serve: dict[str, list[float]] = {c.name: [] for c in contenders}
    drain: dict[str, list[float]] = {c.name: [] for c in contenders}
    freed_by: dict[str, int] = {}
    for rep in range(repeats):
        order = contenders if rep % 2 == 0 else list(reversed(contenders))
        for c in order:
            cache = c.fresh(page_size)
            t_serve, _ = _cpu(lambda c=c, cache=cache: c.serve(cache, trace))
            t_drain, freed = _cpu(lambda c=c, cache=cache: c.drain(cache, trace.evict_chunk))
            serve[c.name].append(t_serve)
            drain[c.name].append(t_drain)
            freed_by[c.name] = freed
    if len(set(freed_by.values())) != 1:
        raise Disagreement(f"{trace.name}, page_size {page_size}: the trees held different "
                           f"numbers of tokens: {freed_by}")
    return {c.name: (statistics.median(serve[c.name]), statistics.median(drain[c.name]),
                     freed_by[c.name]) for c in contenders}


def memory_costs(trace: Trace, repeats: int) -> dict[str, float]:
    """CPU microseconds a request of ``trace`` spends on the memory work alone, outside
    any tree: what each side copies (SGLang also converts) and keeps, and minirt's
    checks. Each loop keeps
    what it makes (as a tree would: fresh memory each request), median of ``repeats``.
    The floor of the request path where requests share nothing."""
    import numpy as np

    def slots_check_then_copy(s: torch.Tensor) -> tuple:
        a = s.numpy()
        return bool(a.min(initial=0) >= 0), a.tobytes()  # what minirt's insert does to new slots

    steps: dict[str, Callable[[array, torch.Tensor, torch.Tensor], object]] = {
        "SGLang: ids[:len] + row.to(int64) + clone()": lambda a, s, row: (
            a[: len(a)], row.to(dtype=torch.int64, copy=True).clone()),
        "SGLang: row.to(int64) alone": lambda a, s, row: row.to(dtype=torch.int64, copy=True),
        "minirt: TokenIds (copy + sign check)": lambda a, s, row: TokenIds(a),
        "minirt: slots sign check + copy": lambda a, s, row: slots_check_then_copy(s),
        "minirt: slots sign check alone": lambda a, s, row: bool(np.asarray(s).min(initial=0) >= 0),
        "ids and slots copied, unchecked (for scale)": lambda a, s, row: (
            a.tobytes(), s.numpy().tobytes()),
    }
    out = {}
    for name, step in steps.items():
        runs = []
        for _ in range(repeats):
            kept: list[object] = []
            seconds, _ = _cpu(lambda step=step, kept=kept: [
                kept.append(step(a, s, row))
                for a, s, row in zip(trace.arrays, trace.slots, trace.rows, strict=True)])
            runs.append(seconds)
            del kept
        out[name] = statistics.median(runs) / len(trace.arrays) * 1e6
    return out


# ------------------------------------------------------------------ workloads


def book_traces(scale: int) -> list[Trace]:
    """The book's chat, few-shot and RAG workloads (minirt.workloads), larger than the chapters'."""
    from minirt import workloads

    tok = workloads.default_tokenizer()
    chat = workloads.multi_turn_chat(tok, num_conversations=8 * scale, turns=6)
    return [
        Trace("chat", chat.requests),
        Trace("few-shot", workloads.few_shot(tok, num_requests=64 * scale).requests),
        Trace("RAG", workloads.rag(tok, num_documents=6, num_requests=64 * scale).requests),
    ]


def system_prompt_trace(systems: int = 20, conversations: int = 100, turns: int = 20,
                        vocab: int = 49152, seed: int = 0) -> Trace:
    """``conversations`` chats over ``systems`` shared system prompts (~300 tokens); each
    request resends its chat so far plus a new user turn, and the reply joins the history.
    Turn 1 of every chat arrives first, then turn 2, ...: ``conversations * turns`` requests."""
    rng = random.Random(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    prompts = [tokens(200, 400) for _ in range(systems)]
    history = [list(prompts[c % systems]) for c in range(conversations)]
    requests = []
    for _ in range(turns):
        for chat in history:
            chat += tokens(10, 60)  # the user's message
            requests.append(list(chat))
            chat += tokens(20, 80)  # the reply, sent back with the next turn
    return Trace(f"{systems} system prompts", requests)


def random_trace(num: int = 2000, lo: int = 200, hi: int = 2000, vocab: int = 49152,
                 seed: int = 1, tensor_ids: bool = False, name: str = "random") -> Trace:
    """``num`` unrelated requests of ``lo``..``hi`` random tokens: almost nothing to share.
    ``tensor_ids``: minirt is handed each request's ids as an int64 tensor."""
    rng = random.Random(seed)
    return Trace(f"{name}, tensor ids" if tensor_ids else name,
                 [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
                  for _ in range(num)], tensor_ids)


def production_traces(block_size: int, requests: int | None = None) -> list[Trace]:
    """Mooncake's conversation and synthetic traces (``minirt.traces``), each hash id a block
    of ``block_size`` synthesized token ids; the first ``requests`` of each if given."""
    from minirt.traces import TRACES, load_trace

    out = []
    for name in sorted(TRACES):
        reqs = load_trace(name).requests[:requests]
        label = f"{name}/{block_size}" + (f" x{len(reqs)}" if requests is not None else "")
        out.append(Trace(label, [array("q", r.token_ids(block_size)) for r in reqs]))
    return out


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per contender (>= 5)")
    parser.add_argument("--quick", action="store_true", help="smaller traces (a smoke test)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per hash id of the production traces, whole (default 16)")
    parser.add_argument("--full-block-requests", type=int, default=1000,
                        help="first requests of each production trace at 512 tokens per "
                             "hash id, the traces' own (default 1000; 0: none)")
    parser.add_argument("--only-production", action="store_true",
                        help="Mooncake's traces and the random ones only")
    parser.add_argument("--memory-costs", action="store_true",
                        help="only the memory work per request (copies, checks) on the "
                             "production traces at 512, outside any tree")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_costs:
        for trace in production_traces(512, args.full_block_requests or None):
            print(trace.name)
            for name, us in memory_costs(trace, args.repeats).items():
                print(f"  {us:7.1f} us/request  {name}")
        return 0

    wheel = sglang_wheel()
    if wheel is None:
        print(f"{SGLANG} is neither cached in {peers_dir()} nor downloadable", file=sys.stderr)
        return 2
    sgl = load_sglang(wheel)
    contenders = [Minirt(), SGLang(sgl)]
    if args.quick:
        traces = [*book_traces(1), system_prompt_trace(conversations=20, turns=5),
                  random_trace(200), random_trace(200, tensor_ids=True),
                  *production_traces(args.block_size, 300)]
    else:
        traces = [] if args.only_production else [*book_traces(4), system_prompt_trace()]
        traces += [random_trace(), random_trace(tensor_ids=True),
                   random_trace(3000, 16, 16, name="random, 16 tokens"),
                   *production_traces(args.block_size)]
        if args.full_block_requests:
            traces += production_traces(512, args.full_block_requests)
    print(f"minirt RadixCache vs {sgl.source} RadixCache; CPU time, 1 thread, median of "
          f"{args.repeats} interleaved repeats; ratio = minirt / SGLang (< 1: minirt faster)")
    print("(a shared, loaded machine: read the ratios, taken side by side, over the absolutes)\n")
    head = (f"{'workload':<24} {'page':>4} {'reqs':>5} {'tokens':>9} | {'us/request':>17} "
            f"{'ratio':>5} | {'Mtokens/s':>11} | {'evict ns/token':>14} {'ratio':>5}")
    print(head)
    print(f"{'':<46} | {'minirt':>8} {'SGLang':>8} {'':>5} | {'minirt':>5} {'SGLang':>5} | "
          f"{'minirt':>6} {'SGLang':>7} {'':>5}")
    print("-" * len(head))
    worst_serve = worst_evict = 0.0
    checked = 0
    prod: list[float] = []  # request-path ratios on the production traces
    rand: list[float] = []
    for trace in traces:
        for page in (1, 16):
            try:
                checked += check_agreement(contenders[0], contenders[1], trace, page)
                times = time_pair(contenders, trace, page, args.repeats)
            except Disagreement as exc:
                print(f"\nDISAGREEMENT: {exc}", file=sys.stderr)
                return 1
            (ms, me, freed), (ss, se, _) = times["minirt"], times["SGLang"]
            n = len(trace.requests)
            r_serve, r_evict = ms / ss, me / se
            worst_serve, worst_evict = max(worst_serve, r_serve), max(worst_evict, r_evict)
            if "/" in trace.name:
                prod.append(r_serve)
            elif trace.name.startswith("random"):
                rand.append(r_serve)
            print(f"{trace.name:<24} {page:>4} {n:>5} {trace.tokens:>9} | {ms / n * 1e6:>8.1f} "
                  f"{ss / n * 1e6:>8.1f} {r_serve:>5.2f} | {trace.tokens / ms / 1e6:>5.1f} "
                  f"{trace.tokens / ss / 1e6:>5.1f} | {me / freed * 1e9:>6.0f} "
                  f"{se / freed * 1e9:>7.0f} {r_evict:>5.2f}")
    print(f"\nagreement: matched length, matched slots and already-cached length equal on all "
          f"{checked} requests (each trace at page sizes 1 and 16)")
    print(f"worst ratios: request path {worst_serve:.2f} (goal <= 0.80), eviction "
          f"{worst_evict:.2f} (goal <= 1.00)")
    for label, ratios in (("production traces", prod), ("random", rand)):
        if ratios:
            print(f"{label}: request path {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
