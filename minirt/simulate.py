"""Replaying traces through a cache, and the bounds no eviction policy can beat.

``simulate`` runs a token trace through a ``RadixCache`` of a given capacity to measure
a real policy's hit rate. ``belady_hit_rate`` is Belady's offline bound at token
granularity: the hit rate of an oracle that, after each request, keeps the tokens needed
soonest; it bounds every policy that inserts what it computes. ``evict_by_scan`` is the
O(n)-per-leaf eviction that chapter 05's heap is measured against.

This module sits above ``cache`` and ``eviction`` (it drives a whole cache), so neither
of them imports it.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence

import torch

from .cache import CacheStats, RadixCache
from .errors import OutOfMemoryError, PoolError, RequestError
from .eviction import EvictionPolicy, is_evictable_leaf
from .token_ids import TokenIds, slots_tensor

__all__ = ["belady_hit_rate", "evict_by_scan", "replay", "simulate"]


def evict_by_scan(cache: RadixCache, num_tokens: int) -> torch.Tensor:
    """The baseline ``RadixCache.evict`` improves on: find each victim by walking the tree.

    Same result and same errors as ``cache.evict`` (same policy order), but every victim
    costs a full walk, O(n) per evicted leaf. Only for measurement and teaching.
    """
    cache._check_evict_request(num_tokens)
    freed = []
    count = 0
    key = cache.policy.key
    while count < num_tokens:
        victim = min(
            (node for node in cache.nodes() if is_evictable_leaf(node)), key=key, default=None
        )
        if victim is None:  # pragma: no cover - excluded by _check_evict_request
            raise OutOfMemoryError("no evictable leaf left")
        freed.append(victim.value)
        count += victim.length
        cache._remove_leaf(victim)
    return slots_tensor(freed)



def _as_trace(trace: Iterable[Sequence[int] | torch.Tensor]) -> list[tuple[int, ...]]:
    out = []
    for request in trace:
        ids = request.tolist() if isinstance(request, torch.Tensor) else list(request)
        out.append(tuple(int(x) for x in ids))
    return out


def _check_capacity(trace: list[tuple[int, ...]], capacity: int) -> None:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
        raise PoolError(f"capacity must be a non-negative int, got {capacity!r}")
    longest = max((len(r) for r in trace), default=0)
    if longest > capacity:
        raise RequestError(
            f"a request of {longest} tokens does not fit a cache of capacity {capacity}: "
            f"its K/V must all be resident while it runs"
        )


def belady_hit_rate(trace: Iterable[Sequence[int] | torch.Tensor], capacity: int) -> float:
    """Belady's bound: the token hit rate of an oracle keeping ``capacity`` tokens between requests.

    Token-level Belady: after serving a request (all its tokens are now computed),
    evict the token whose next use lies furthest in the future, ties broken toward the
    deeper token, until at most ``capacity`` tokens remain. A request that uses a token
    also uses every token before it, so a parent's next use is never later than its
    child's and the victim is always a leaf's last token: the cached set stays a tree.
    With unit sizes this is optimal among policies that decide after each request what
    to keep, so it bounds every node-level policy (LRU, LFU, ...) from above. A real
    cache must also hold the whole running request, so it may fall short of the bound
    even with perfect foresight (chapter 05 shows a trace). Hit rate = cached tokens
    reused / all tokens requested.
    """
    requests = _as_trace(trace)
    _check_capacity(requests, capacity)
    # One trie node per distinct token prefix; paths[t] lists request t's nodes in order.
    node_of: dict[tuple[int, int], int] = {}
    depth: list[int] = []
    parent: list[int] = []
    paths: list[list[int]] = []
    for request in requests:
        path, prev = [], -1
        for token in request:
            nid = node_of.setdefault((prev, token), len(depth))
            if nid == len(depth):
                depth.append(len(path) + 1)
                parent.append(prev)
            path.append(nid)
            prev = nid
        paths.append(path)
    never = len(requests)
    uses: list[list[int]] = [[] for _ in depth]
    for t in range(len(requests) - 1, -1, -1):  # each node's use times, latest first
        for nid in paths[t]:
            uses[nid].append(t)
    cached = [False] * len(depth)
    children_cached = [0] * len(depth)
    next_use = [never] * len(depth)
    heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, node): max next use, deepest
    size = hits = total = 0
    for path in paths:
        total += len(path)
        reused = 0
        while reused < len(path) and cached[path[reused]]:
            reused += 1
        hits += reused
        for nid in path:
            uses[nid].pop()  # t itself
            next_use[nid] = uses[nid][-1] if uses[nid] else never
            if not cached[nid]:
                cached[nid] = True
                size += 1
                if parent[nid] >= 0:
                    children_cached[parent[nid]] += 1
            heapq.heappush(heap, (-next_use[nid], -depth[nid], nid))
        while size > capacity:
            neg_next, _, nid = heapq.heappop(heap)
            if not cached[nid] or -neg_next != next_use[nid]:
                continue  # stale entry
            assert children_cached[nid] == 0, "Belady picked a token with a cached child"
            cached[nid] = False
            size -= 1
            if parent[nid] >= 0:
                children_cached[parent[nid]] -= 1
    return hits / total if total else 0.0


def simulate(
    trace: Iterable[Sequence[int] | torch.Tensor],
    capacity: int,
    policy: str | EvictionPolicy = "lru",
    page_size: int = 1,
    *,
    cached: list[int] | None = None,
) -> CacheStats:
    """Replay ``trace`` through a ``RadixCache`` holding at most ``capacity`` tokens.

    Per request: match, lock the match (its K/V is in use), evict just enough for the
    uncached part, insert, unlock. Slot indices are made up (each new token gets a
    fresh one); only the hit statistics matter. Returns the cache's ``CacheStats``;
    ``cached``, if given, gets each request's cached length appended (``replay``).
    """
    requests = _as_trace(trace)
    _check_capacity(requests, capacity)
    cache = RadixCache(page_size=page_size, policy=policy)
    next_slot = 0
    for request in requests:
        ids = TokenIds(request)  # checked once, for the match and the insert
        match = cache.match_prefix(ids)
        aligned = len(request) // page_size * page_size
        need = aligned - match.cached_len
        cache.lock(match.handle)
        overflow = cache.total_size + need - capacity
        if overflow > 0:
            cache.evict(overflow)
        slots = array("q", bytearray().join(match.runs))  # the cached prefix's, then fresh
        slots.extend(range(next_slot, next_slot + need))
        next_slot += need
        cache.insert_prefix(ids[:aligned], slots)
        cache.unlock(match.handle)
        if cached is not None:
            cached.append(match.cached_len)
    return cache.stats


def replay(
    trace: Iterable[Sequence[int] | torch.Tensor],
    capacity: int,
    policy: str | EvictionPolicy = "lru",
    page_size: int = 1,
) -> list[int]:
    """``simulate``, request by request: how many tokens of each request were cached.

    ``sum(result) / total tokens`` is ``simulate``'s hit rate, and the per-request
    numbers show who pays for a miss: ``len(request) - result[i]`` tokens of prefill
    before request ``i``'s first token (the tail that tail-optimized LRU targets).
    """
    cached: list[int] = []
    simulate(trace, capacity, policy, page_size, cached=cached)
    return cached
