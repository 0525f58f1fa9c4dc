"""Which cached tokens to drop when the pool runs short, and how well a policy does.

A policy gives every node a priority tuple; smaller tuples are evicted first. Only
unlocked leaves may go (a parent's K/V is the prefix its children depend on), and a
parent whose last child goes becomes a leaf and a candidate in turn. ``LeafHeap``
keeps the evictable leaves in a binary heap, so each eviction costs O(log n) rather
than a walk over the whole tree (``evict_by_scan`` is that walk, kept as the baseline
chapter 05 measures against).

``belady_hit_rate`` is Belady's offline bound at token granularity: the hit rate of an
oracle that, after each request, keeps the tokens needed soonest. It bounds every
policy that inserts what it computes; ``simulate`` replays a trace through a
``RadixCache`` of a given capacity to measure a real policy.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from .errors import OutOfMemoryError, PoolError, RequestError
from .radix import RadixNode

if TYPE_CHECKING:  # pragma: no cover
    from .cache import CacheStats, RadixCache

__all__ = [
    "FIFO",
    "LFU",
    "LRU",
    "POLICIES",
    "EvictionPolicy",
    "LeafHeap",
    "Priority",
    "belady_hit_rate",
    "evict_by_scan",
    "is_evictable_leaf",
    "make_policy",
    "pack_key",
    "simulate",
]


class EvictionPolicy:
    """Orders nodes for eviction: ``key(node)`` is a tuple, the smallest goes first.

    Every key ends with ``node.id`` so that ties break the same way on every run. Keys
    are built from a node's statistics (``last_access``, ``hit_count``, ``created``,
    ``priority``), which ``split_at`` copies, so a split never changes a key.
    """

    name = "policy"

    def key(self, node: RadixNode) -> tuple[int, ...]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRU(EvictionPolicy):
    """Least recently used first (oldest ``last_access`` tick)."""

    name = "lru"

    def key(self, node: RadixNode) -> tuple[int, ...]:
        return (node.last_access, node.id)


class LFU(EvictionPolicy):
    """Fewest prefix hits first; among equals, least recently used."""

    name = "lfu"

    def key(self, node: RadixNode) -> tuple[int, ...]:
        return (node.hit_count, node.last_access, node.id)


class FIFO(EvictionPolicy):
    """Oldest first, by the tick at which the tokens entered the cache."""

    name = "fifo"

    def key(self, node: RadixNode) -> tuple[int, ...]:
        return (node.created, node.id)


class Priority(EvictionPolicy):
    """Lowest request priority first; among equals, least recently used."""

    name = "priority"

    def key(self, node: RadixNode) -> tuple[int, ...]:
        return (node.priority, node.last_access, node.id)


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, FIFO, Priority)}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """An ``EvictionPolicy`` from its name ("lru", "lfu", "fifo", "priority") or as given."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise ValueError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")


def is_evictable_leaf(node: RadixNode) -> bool:
    """Attached (has a parent, so not the root and not evicted), childless and unlocked."""
    return node.parent is not None and not node.children and node.ref_count == 0


_FIELD_BITS = 64
_OFFSET = 1 << (_FIELD_BITS - 1)  # shifts a signed 64-bit field to a non-negative one
_FIELD_MASK = (1 << _FIELD_BITS) - 1


def pack_key(key: tuple[int, ...]) -> int:
    """A policy key as one non-negative int with the same order (64 bits per field).

    Packed keys compare like the tuples they come from, and the last field (the node
    id) can be read back from the low 64 bits.
    """
    packed = 0
    for field in key:
        shifted = field + _OFFSET
        if not 0 <= shifted <= _FIELD_MASK:
            raise ValueError(f"policy key fields must be 64-bit ints, got {key!r}")
        packed = (packed << _FIELD_BITS) | shifted
    return packed


class LeafHeap:
    """A min-heap of the evictable leaves in policy order, with lazy invalidation.

    Promise: every evictable leaf has an entry filed under a key no larger than its
    current key. The cache pushes a node when it becomes an evictable leaf (a new leaf,
    an unlock, a parent whose last child went) and when its key drops. A key that grows
    (a leaf used again) needs no push: ``pop`` meets the old, smaller entry first and
    files the node again under its current key. Entries are never searched for: one
    whose node stopped being an evictable leaf is dropped when it reaches the top, and
    when such entries pile up the heap is rebuilt, so a victim costs O(log n) amortized.

    An entry is the key packed into one int (``pack_key``); ``_filed`` finds the node
    from the id in its low bits. A heap of plain ints pops about three times faster
    than a heap of tuples once it outgrows the CPU caches (benchmarks/eviction.py).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[int] = []
        # node id -> (node, its latest entry), for nodes with an entry in the heap
        self._filed: dict[int, tuple[RadixNode, int]] = {}
        self._rebuild_at = 64

    def __len__(self) -> int:
        return len(self._heap)

    def _entry(self, node: RadixNode) -> int:
        packed = pack_key(self.policy.key(node))
        if (packed & _FIELD_MASK) - _OFFSET != node.id:
            raise ValueError(f"{self.policy!r}: a policy key must end with node.id")
        return packed

    def push(self, node: RadixNode) -> None:
        """File ``node`` under its current policy key, unless an entry already keeps the promise.

        A leaf unlocked again, say, usually still has its entry from before: a second
        one would only be dropped later.
        """
        entry = self._entry(node)
        filed = self._filed.get(node.id)
        if filed is not None and filed[1] <= entry:
            return
        heapq.heappush(self._heap, entry)
        self._filed[node.id] = (node, entry)
        if len(self._heap) > self._rebuild_at:
            self._rebuild()

    def pop(self) -> RadixNode | None:
        """Remove and return the evictable leaf with the smallest key, or None if none."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            filed = self._filed.get((entry & _FIELD_MASK) - _OFFSET)
            if filed is None or filed[1] != entry:
                continue  # an older entry of a node filed again since: drop it
            node = filed[0]
            del self._filed[node.id]
            if not is_evictable_leaf(node):
                continue  # evicted, locked, or has children: drop the entry
            current = self._entry(node)
            if entry == current:
                return node
            heapq.heappush(heap, current)  # used since it was filed: file it again
            self._filed[node.id] = (node, current)
        return None

    def live_nodes(self) -> set[int]:
        """Ids of the evictable leaves whose entry keeps the promise (for integrity checks)."""
        live = set()
        for entry in self._heap:
            filed = self._filed.get((entry & _FIELD_MASK) - _OFFSET)
            if filed is not None and filed[1] == entry and is_evictable_leaf(filed[0]) \
                    and entry <= self._entry(filed[0]):
                live.add(filed[0].id)
        return live

    def _rebuild(self) -> None:
        """One entry per evictable leaf, under its current key; drop everything else."""
        leaves = [n for n, _ in self._filed.values() if is_evictable_leaf(n)]
        self._filed = {n.id: (n, self._entry(n)) for n in leaves}
        self._heap = [entry for _, entry in self._filed.values()]
        heapq.heapify(self._heap)
        self._rebuild_at = max(64, 2 * len(self._heap))


def evict_by_scan(cache: RadixCache, num_tokens: int) -> torch.Tensor:
    """The baseline ``RadixCache.evict`` improves on: find each victim by walking the tree.

    Same result and same errors as ``cache.evict`` (same policy order), but every victim
    costs a full walk, O(n) per evicted leaf. Only for measurement and teaching.
    """
    cache._check_evict_request(num_tokens)
    freed: list[torch.Tensor] = []
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
    return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)


# --------------------------------------------------------------------------- offline optimum


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
) -> CacheStats:
    """Replay ``trace`` through a ``RadixCache`` holding at most ``capacity`` tokens.

    Per request: match, lock the match (its K/V is in use), evict just enough for the
    uncached part, insert, unlock. Slot indices are made up (each new token gets a
    fresh one); only the hit statistics matter. Returns the cache's ``CacheStats``.
    """
    from .cache import RadixCache

    requests = _as_trace(trace)
    _check_capacity(requests, capacity)
    cache = RadixCache(page_size=page_size, policy=policy)
    next_slot = 0
    for request in requests:
        ids = torch.tensor(request, dtype=torch.int64)
        match = cache.match_prefix(ids)
        aligned = len(request) // page_size * page_size
        need = aligned - match.cached_len
        cache.lock(match.handle)
        overflow = cache.total_size + need - capacity
        if overflow > 0:
            cache.evict(overflow)
        fresh = torch.arange(next_slot, next_slot + need, dtype=torch.int64)
        next_slot += need
        cache.insert_prefix(ids[:aligned], torch.cat([match.indices, fresh]))
        cache.unlock(match.handle)
    return cache.stats
