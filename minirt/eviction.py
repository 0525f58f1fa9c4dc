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


# ------------------------------------------------ SGLang's segmented and tail-optimized LRU
#
# SGLang 0.5.23's ``--radix-eviction-policy`` offers lru, lfu, slru, priority and tlru
# (sglang 0.5.23 `srt/arg_groups/choices.py: RADIX_EVICTION_POLICY_CHOICES`); the two
# below complete minirt's set. Both keep LRU's order inside a class of nodes and only
# decide which class goes first.


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int (tokens), got {value!r}")
    return value


class SLRU(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than ``protected_threshold`` times go first, LRU inside.

    Key ``(segment, last_access, id)``: segment 0 (probationary) while its hits
    (below) are fewer than ``protected_threshold``, 1 (protected) from then on, so a node reused
    often enough outlives every probationary one however old it is. The same tuple as
    sglang 0.5.23 `srt/mem_cache/evict_policy.py: SLRUStrategy.get_priority`, with the
    same default of 2, set there through ``--radix-eviction-policy-config``
    (sglang 0.5.23 `srt/arg_groups/fields/memory.py: Memory.radix_eviction_policy_config`).

    Where minirt differs: its ``hit_count`` counts the ``match_prefix`` calls that
    reached a node (as LFU's does); SGLang counts at insert, once per request for each
    node that request did not insert itself, and once for the request that made the node
    (sglang 0.5.23 `srt/mem_cache/unified_cache/unified_tree_core.py:
    UnifiedTreeCore._finish_insert_walk_node, UnifiedTreeCore._should_backup_after_insert`;
    sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixCache._insert_helper`), so its new
    node starts at 1. The segment test here is therefore ``hit_count + 1 >=
    protected_threshold``: with the default 2 a node is protected from its first reuse, as
    in SGLang. SGLang takes any threshold; minirt refuses one below 2, which would protect
    every node (a new one included) and make SLRU plain LRU.
    """

    name = "slru"

    def __init__(self, protected_threshold: int = 2) -> None:
        if isinstance(protected_threshold, bool) or not isinstance(protected_threshold, int) \
                or protected_threshold < 2:
            raise ValueError(
                f"slru: protected_threshold must be an int >= 2 (hits, the insert that made a "
                f"node counting as one, that move it to the protected segment; 1 would protect "
                f"every node: plain LRU), got {protected_threshold!r}")
        self.protected_threshold = protected_threshold

    def key(self, node: RadixNode) -> tuple[int, ...]:
        protected = 1 if node.hit_count + 1 >= self.protected_threshold else 0
        return (protected, node.last_access, node.id)

    def __repr__(self) -> str:
        return f"SLRU(protected_threshold={self.protected_threshold})"


class NodeTracking(EvictionPolicy):
    """A policy that keeps state of its own per node, so the cache announces its tree changes.

    ``RadixCache`` calls ``node_added`` when it hangs a new leaf (already attached to its
    parent), ``node_split`` after a match splits a node (``upper`` is the new parent,
    ``lower`` the old node, now shorter), then files ``lower`` again if it is an
    evictable leaf (its key may have dropped), and ``node_removed`` when a node leaves
    the tree (eviction or reset). A policy without per-node state needs none of this.
    """

    def node_added(self, node: RadixNode) -> None:
        raise NotImplementedError

    def node_split(self, upper: RadixNode, lower: RadixNode) -> None:
        raise NotImplementedError

    def node_removed(self, node: RadixNode) -> None:
        raise NotImplementedError


class TLRU(NodeTracking):
    """Tail-optimized LRU (Zhang et al., arXiv 2510.15152): drop the tail no next turn needs.

    A conversation whose history is ``L`` tokens, and whose next prompt is expected to
    add ``next_prompt_estimate`` more, keeps its next prefill within ``threshold``
    uncached tokens (the paper's TTFT budget) as long as its first
    ``L + next_prompt_estimate - threshold`` tokens stay cached. A node that starts at
    or past that depth is "TEL-safe": evicting it cannot push the conversation's next
    turn over the budget (so a whole conversation of at most ``threshold -
    next_prompt_estimate`` tokens is TEL-safe: recomputing all of it fits the budget).
    Key ``(-1 if TEL-safe else 0, last_access, id)``: every
    TEL-safe node goes before any other, LRU among each class, the implementation the
    paper suggests and SGLang's (sglang 0.5.23 `srt/mem_cache/evict_policy.py:
    TLRUStrategy.get_priority`). ``threshold`` and ``next_prompt_estimate`` are in tokens,
    as in SGLang (the paper counts blocks).

    ``L`` is the branch's high-water depth: for each node, the deepest end of any node
    ever added below it (or itself) while it was cached, raised on every insert and kept
    when the tail below is evicted, so a trimmed conversation stops at its budget
    instead of being walked down to nothing. SGLang keeps the same two numbers on its
    nodes, a node's end depth and that high-water mark, and copies the mark to the new
    parent of a split (sglang 0.5.23 `srt/mem_cache/unified_cache/unified_tree_core.py:
    _set_tlru_lens_and_raise_history, UnifiedTreeCore._split_node`); minirt keeps them in
    the policy, filled by the cache's ``NodeTracking`` calls, so one TLRU follows the
    trees of the caches it serves (node ids are unique across caches).

    Settings as SGLang checks them at startup (sglang 0.5.23
    `srt/arg_groups/kv_cache_hook.py: handle_cache_compatibility`): both non-negative,
    and ``threshold > next_prompt_estimate``, else no node is ever TEL-safe and TLRU is
    LRU; so ``make_policy("tlru")`` without settings is refused, as SGLang refuses
    ``--radix-eviction-policy tlru`` without ``--radix-eviction-policy-config``. Where
    minirt differs: ints only (SGLang also hands floats to its Rust core, sglang 0.5.23
    `srt/mem_cache/rust_tree_core/adapter.py: _tlru_float_config`), and SGLang computes
    the keys of every evictable leaf when an eviction starts, where minirt's heap keeps
    them filed between evictions (hence ``NodeTracking``).

    A split is the one event that lowers a node's key: the lower half now starts deeper
    and may have become TEL-safe, which is why the cache files it again.
    """

    name = "tlru"

    def __init__(self, threshold: int = 0, next_prompt_estimate: int = 0) -> None:
        threshold = _check_count(threshold, "tlru: threshold")
        next_prompt_estimate = _check_count(next_prompt_estimate, "tlru: next_prompt_estimate")
        if threshold <= next_prompt_estimate:
            unset = " (the defaults: tlru needs settings)" if threshold == 0 else ""
            raise ValueError(
                f"tlru: threshold must be greater than next_prompt_estimate, got {threshold} <= "
                f"{next_prompt_estimate}{unset}; otherwise no tokens are ever TEL-safe and TLRU "
                f"is exactly LRU. Give both, in tokens: TLRU(threshold=4096, "
                f"next_prompt_estimate=512), or make_policy_from_config('tlru', {{...}})")
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate
        self._slack = next_prompt_estimate - threshold  # budget = max(L + slack, 0)
        # node id -> [end depth in tokens (root to the node's last token), high-water L]
        self._lens: dict[int, list[int]] = {}

    def key(self, node: RadixNode) -> tuple[int, ...]:
        lens = self._lens.get(node.id)
        if lens is None:
            raise KeyError(f"tlru: {node!r} was never announced to this policy; a TLRU tracks "
                           "the nodes of the RadixCache it was given to")
        end, history = lens
        safe = end - node.length >= history + self._slack  # budget <= 0: always safe
        return (-1 if safe else 0, node.last_access, node.id)

    def tel_safe(self, node: RadixNode) -> bool:
        """Whether ``node`` is TEL-safe now (its key's first field is -1)."""
        return self.key(node)[0] < 0

    def lens(self, node: RadixNode) -> tuple[int, int]:
        """``(end depth, high-water depth L)`` of a tracked node, in tokens."""
        end, history = self._lens[node.id]
        return end, history

    def node_added(self, node: RadixNode) -> None:
        parent = node.parent
        lens = self._lens
        assert parent is not None, "a new node is attached before it is announced"
        end = node.length + (lens[parent.id][0] if parent.parent is not None else 0)
        lens[node.id] = [end, end]
        while parent.parent is not None:  # raise the mark up the branch; stop where it holds
            above = lens[parent.id]
            if above[1] >= end:
                break
            above[1] = end
            parent = parent.parent

    def node_split(self, upper: RadixNode, lower: RadixNode) -> None:
        end, history = self._lens[lower.id]  # lower keeps its end; upper ends where it starts
        self._lens[upper.id] = [end - lower.length, history]

    def node_removed(self, node: RadixNode) -> None:
        self._lens.pop(node.id, None)

    def __repr__(self) -> str:
        return (f"TLRU(threshold={self.threshold}, "
                f"next_prompt_estimate={self.next_prompt_estimate})")


POLICIES.update({p.name: p for p in (SLRU, TLRU)})
__all__ += ["SLRU", "TLRU", "NodeTracking", "make_policy_from_config"]


def make_policy_from_config(policy: str, config: dict | None = None) -> EvictionPolicy:
    """A policy from SGLang's two flags: its name and its settings as keyword arguments.

    ``make_policy_from_config("slru", {"protected_threshold": 4})``,
    ``make_policy_from_config("tlru", {"threshold": 4096, "next_prompt_estimate": 512})``:
    ``--radix-eviction-policy`` and ``--radix-eviction-policy-config``
    (sglang 0.5.23 `srt/mem_cache/utils.py: get_eviction_strategy`). ValueError naming the
    key and the policy for a setting the policy does not take, as SGLang fails at startup.
    """
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")
    cls = POLICIES[policy.lower()]
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"{policy}: config must be a dict of settings, got {config!r:.80}")
    takes = {"slru": {"protected_threshold"}, "tlru": {"threshold", "next_prompt_estimate"}}
    allowed = takes.get(cls.name, set())
    for name in config:
        if name not in allowed:
            raise ValueError(f"{cls.name}: unknown setting {name!r}; it takes "
                             f"{sorted(allowed) or 'no settings'}")
    return cls(**config)
