"""Which cached tokens to drop when the pool runs short, and how well a policy does.

A policy gives every node a priority tuple; smaller tuples are evicted first. Only
unlocked leaves may go (a parent's K/V is the prefix its children depend on), and a
parent whose last child goes becomes a leaf and a candidate in turn. ``LeafHeap``
keeps the evictable leaves in a binary heap, so each eviction costs O(log n) rather
than a walk over the whole tree (``minirt.simulate.evict_by_scan`` is that walk, kept as the
baseline chapter 05 measures against).

The offline side (replaying traces through a cache, Belady's bound, and the full-scan
baseline) lives in ``minirt.simulate``, one layer above the cache, so imports run one
way: radix <- eviction <- cache <- simulate.
"""

from __future__ import annotations

import heapq
import sys

from .radix import RadixNode

__all__ = [
    "FIFO",
    "LFU",
    "LRU",
    "POLICIES",
    "EvictionPolicy",
    "LeafHeap",
    "Priority",
    "is_evictable_leaf",
    "make_policy",
    "pack_key",
    "unpack_key",
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


def unpack_key(packed: int, fields: int) -> tuple[int, ...]:
    """The key tuple of ``fields`` fields that ``pack_key`` turned into ``packed``.

    For reading heap entries (``LeafHeap.entries``); ValueError if ``packed`` does not
    fit in ``fields`` fields.
    """
    if not isinstance(fields, int) or isinstance(fields, bool) or fields < 1:
        raise ValueError(f"fields must be a positive int, got {fields!r}")
    if not isinstance(packed, int) or packed < 0 or packed >> (_FIELD_BITS * fields):
        raise ValueError(f"{packed!r} is not a key of {fields} packed 64-bit fields")
    return tuple(
        ((packed >> (_FIELD_BITS * (fields - 1 - i))) & _FIELD_MASK) - _OFFSET
        for i in range(fields)
    )


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

    def __init__(self, policy: EvictionPolicy, *, rebuild: bool = True) -> None:
        self.policy = policy
        self._heap: list[int] = []
        # node id -> (node, its latest entry), for nodes with an entry in the heap
        self._filed: dict[int, tuple[RadixNode, int]] = {}
        self._rebuilds = rebuild  # False only to show what rebuilds prevent (chapter 05a)
        self._rebuild_at = 64 if rebuild else sys.maxsize

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
            current = pack_key(self.policy.key(node))  # its id checked when it was filed
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
        """One entry per evictable leaf, its latest (which keeps the promise); drop the rest.

        No key is computed: a leaf whose key grew since is re-filed when its entry
        surfaces, as it would have been without the rebuild.
        """
        self._filed = {i: filed for i, filed in self._filed.items() if is_evictable_leaf(filed[0])}
        self._heap = [entry for _, entry in self._filed.values()]
        heapq.heapify(self._heap)
        self._rebuild_at = max(64, 2 * len(self._heap))

    # ------------------------------------------------------------------ read-only views

    def entries(self) -> list[int]:
        """A copy of every entry in the heap, smallest first, as packed keys (``unpack_key``).

        Includes entries that no longer count (an older entry of a node filed again since,
        a node locked or given a child since); ``live_nodes`` says which nodes still count.
        """
        return sorted(self._heap)

    @property
    def rebuild_threshold(self) -> int | None:
        """The size above which the next push rebuilds the heap, or None if it never does.

        64 at first, then ``max(64, 2k)`` after a rebuild that kept ``k`` entries; None for
        a heap made with ``rebuild=False``.
        """
        return self._rebuild_at if self._rebuilds else None
