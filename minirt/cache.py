"""RadixCache: the prefix cache, a radix tree from token ids to KV-pool slots.

The life of a request against it: ``match_prefix`` finds the longest cached prefix
(whole pages only) and returns a handle; ``lock`` protects that prefix while the
request runs; the caller computes K/V for the rest into slots of its own;
``insert_prefix`` adds the new tokens and says how many were already there (the
caller frees its duplicate slots); ``unlock`` makes the prefix evictable again; and
when the pool runs short, ``evict`` removes unlocked leaves in policy order and
returns their slots.

Every token the tree holds is either *evictable* (no request uses it) or *protected*
(its node's ref_count > 0); the two sizes are kept up to date as locks come and go.

Where it sits (BOOK.md s.4's layers): above the radix tree's nodes (``radix``), the
eviction policies (``eviction``) and the checked ids (``token_ids``); the lifecycle, the
engine and the server above it reach it through ``PrefixCache``, the protocol it shares
with the block-hash cache. ``Salt`` and ``SaltedKey`` are here because a salt is a
namespace of the tree, not a property of the ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .errors import (
    HandleError,
    InvalidIdsError,
    OutOfMemoryError,
    PoolError,
    RequestError,
    StaleHandleError,
)
from .eviction import EvictionPolicy, LeafHeap, NodeTracking, is_evictable_leaf, make_policy
from .radix import RadixNode, Tokens, page_key
from .token_ids import IdsLike, TokenIds, as_ids, as_token_view, slots_tensor

__all__ = [
    "CacheHandle",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "PrefixCache",
    "RadixCache",
    "Salt",
    "SaltedKey",
    "SizeInfo",
    "check_salt",
    "insert_fresh",
]


@dataclass(slots=True, unsafe_hash=True)  # a value, never reassigned (frozen: 4x dearer to make)
class CacheHandle:
    """Where a match (or insert) ended: ``node`` and the prefix length ``cached_len`` it spells.

    Pass it to ``lock`` / ``unlock``. It goes stale when its node is evicted or the cache
    reset; a split leaves it valid (the handle's node keeps the deeper half).
    """

    node: RadixNode
    cached_len: int


@dataclass(eq=False, slots=True)
class MatchResult:
    """``match_prefix``'s answer: a handle, the cached prefix's length and its slot runs.

    ``indices``, the prefix's slots as one int64 tensor, is built from ``runs`` (the
    matched nodes' values, root side first) when read: the tree itself works on
    ``Tokens`` views, and a tensor is made only where a caller asks for one. A plain
    record, made once per call (a frozen one costs three times as much to make).
    """

    handle: CacheHandle
    cached_len: int
    runs: tuple[Tokens, ...] = field(repr=False)

    @property
    def indices(self) -> torch.Tensor:
        return slots_tensor(self.runs)


@dataclass(eq=False, slots=True)
class InsertResult:
    """``insert_prefix``'s answer, a plain record like ``MatchResult``.

    ``cached_len``: leading tokens that were already cached (the caller's own slots for
    them are duplicates to free); ``handle``: the node ending at the inserted length;
    ``indices``: the tree's slots for the whole inserted prefix (re-point the request's
    page table at them before freeing anything), built from ``runs`` when read.
    """

    cached_len: int
    handle: CacheHandle
    runs: tuple[Tokens, ...] = field(repr=False)

    @property
    def indices(self) -> torch.Tensor:
        return slots_tensor(self.runs)


@dataclass(frozen=True)
class SizeInfo:
    """Cached tokens no request uses (``evictable``) and tokens in use (``protected``)."""

    evictable: int
    protected: int

    @property
    def total(self) -> int:
        return self.evictable + self.protected


@dataclass(frozen=True)
class CacheStats:
    """Prefix-hit statistics of ``match_prefix`` calls."""

    queries: int
    query_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens found in the cache (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


Salt = str | bytes | None


def check_salt(salt: Any) -> Salt:
    """``salt`` if it is None or a non-empty str/bytes; RequestError (a ValueError) otherwise."""
    if salt is None or (isinstance(salt, (str, bytes)) and len(salt) > 0):
        return salt
    raise RequestError(f"cache salt must be None or a non-empty str or bytes, got {salt!r:.80}")


class SaltedKey:
    """Child key of a salted request's nodes: ``(salt, key_fn(tokens, pos))``.

    SGLang does the same: every child key of a request with an ``extra_key`` or a
    ``cache_salt`` starts with them (sglang 0.5.23
    `srt/mem_cache/radix_cache.py: RadixKey.child_key_at`). Every node of a salted subtree
    carries it as its ``key_fn``, so a split re-keys the halves correctly and requests with
    different salts never share a node.
    """

    def __init__(self, key_fn, salt: str | bytes) -> None:
        self.key_fn, self.salt = key_fn, salt
        self.page_size = getattr(key_fn, "page_size", 1)

    def __call__(self, tokens: Tokens | Sequence[int], pos: int = 0) -> tuple:
        return (self.salt, self.key_fn(tokens, pos))


class PrefixCache(Protocol):
    """What the lifecycle and the engine need from a prefix cache.

    SGLang's counterpart is sglang 0.5.23 `srt/mem_cache/base_prefix_cache.py: BasePrefixCache`.

    ``RadixCache`` (a tree of token runs) and ``hashcache.HashCache`` (vLLM's hashed
    blocks) implement it. A *unit* is a node or a block: it has ``value`` (its slots)
    and ``ref_count`` (the running requests that hold it).
    """

    page_size: int

    def match_prefix(self, ids: IdsLike, *, priority: int = 0,
                     salt: Salt = None) -> MatchResult: ...
    def insert_prefix(self, ids: IdsLike, indices: IdsLike, *, priority: int = 0,
                      salt: Salt = None) -> InsertResult: ...
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def evict(self, num_tokens: int) -> torch.Tensor: ...
    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    @property
    def total_size(self) -> int: ...
    @property
    def stats(self) -> CacheStats: ...
    def peek_prefix_len(self, ids: IdsLike, *, salt: Salt = None) -> int: ...
    def held_by(self, handle: Any) -> list: ...
    def units(self) -> Iterator: ...
    def all_values(self) -> torch.Tensor: ...
    def snapshot(self) -> tuple: ...
    def check_integrity(self) -> None: ...
    def reset(self) -> None: ...


class RadixCache:
    """A radix tree of cached token prefixes, each token mapped to the pool slot of its K/V.

    ``page_size`` > 1 caches whole pages only: children are keyed by their first page,
    matches and inserts are rounded down to whole pages, and splits happen only at page
    boundaries. ``policy`` picks eviction victims ("lru", "lfu", "fifo", "priority", or an
    ``EvictionPolicy``). A ``salt`` on match/insert keys the request's nodes with it
    (``SaltedKey``): requests with different salts never share a node. Ids are checked on
    every call, unless they come as ``TokenIds`` (checked once, when made).
    """

    def __init__(self, page_size: int = 1, policy: str | EvictionPolicy = "lru") -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.key_fn = page_key(page_size)
        self.policy = make_policy(policy)
        self._tracking = self.policy if isinstance(self.policy, NodeTracking) else None
        self.reset()

    def reset(self) -> None:
        """Empty the cache (tree, sizes, statistics); every existing handle becomes stale."""
        if self._tracking is not None and hasattr(self, "root"):
            self._forget_all()
        self.root = RadixNode(self.key_fn)
        self._heap = LeafHeap(self.policy)
        self._locks: dict[RadixNode, int] = {}  # handle's node -> locks taken through it
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._tick = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the hit statistics, keeping the tree."""
        self._queries = self._query_tokens = self._hit_tokens = 0

    # ------------------------------------------------------------------ match and insert

    def match_prefix(self, ids: IdsLike | TokenIds, *, priority: int = 0,
                     salt: Salt = None) -> MatchResult:
        """The longest cached prefix of ``ids``, in whole pages: handle, length, slot indices.

        If the match ends inside a node, that node is split there so that the handle's
        node ends exactly at the match (metadata only: no K/V moves). Marks the matched
        nodes as used now (last access, hit count, priority) and updates the statistics.
        Does not lock: call ``lock(result.handle)`` to keep the prefix from eviction.
        """
        ids = _checked_view(ids, "ids")[0]
        if type(priority) is not int or salt is not None:  # the defaults need no check
            priority, salt = _check_priority(priority), check_salt(salt)
        node, cached_len, runs = self._descend(ids, salt)
        self._tick += 1
        if cached_len:  # nothing matched, nothing to stamp
            self._touch(node, priority, hit=True)
        self._queries += 1
        self._query_tokens += len(ids)
        self._hit_tokens += cached_len
        return MatchResult(CacheHandle(node, cached_len), cached_len, tuple(runs))

    def insert_prefix(
        self, ids: IdsLike | TokenIds, indices: IdsLike, *, priority: int = 0, salt: Salt = None
    ) -> InsertResult:
        """Cache ``ids[:n]`` with K/V in slots ``indices[:n]``, n = len(ids) rounded down to pages.

        Tokens already cached keep the tree's slots; the result says how many there were
        (``cached_len``) and gives the tree's slots for the whole prefix. The tail past
        the last whole page is not cached: its slots stay the caller's to free.
        """
        ids, own_ids = _checked_view(ids, "ids")
        slots, own_slots = _checked_view(indices, "indices")
        if len(ids) != len(slots):
            raise InvalidIdsError(
                f"ids and indices must have the same length, got {len(ids)} and {len(slots)}"
            )
        if type(priority) is not int or salt is not None:
            priority, salt = _check_priority(priority), check_salt(salt)
        n = len(ids) - len(ids) % self.page_size
        # the whole ids, not a slice: their tail past n is under a page, where no match goes
        node, cached_len, runs = self._descend(ids, salt)
        self._tick += 1
        if cached_len:
            self._touch(node, priority, hit=False)
        if cached_len < n:
            key, value = ids[cached_len:n], slots[cached_len:n]  # views of the checked ids
            # buffers of its own: the leaf keeps no prefix alive, and never the caller's memory
            key = _copy(key) if cached_len or not own_ids else key
            value = _copy(value) if cached_len or not own_slots else value
            node = self._add_leaf(node, key, value, priority, salt)
            runs.append(node.value)
        return InsertResult(cached_len, CacheHandle(node, n), tuple(runs))

    def _add_leaf(self, parent: RadixNode, key: Tokens, value: Tokens, priority: int,
                  salt: Salt) -> RadixNode:
        """Hang a new leaf under ``parent``, stamped with the current tick; it is evictable
        (nothing locks it yet), so it is filed in the eviction heap."""
        key_fn = self.key_fn if salt is None else SaltedKey(self.key_fn, salt)
        leaf = RadixNode(key_fn, key, value, self._tick)
        leaf.priority = priority
        leaf.parent = parent
        parent.children[key_fn(key)] = leaf
        self._evictable += leaf.length
        self._num_nodes += 1
        if self._tracking is not None:
            self._tracking.node_added(leaf)
        self._heap.push(leaf)
        return leaf

    def peek_prefix_len(self, ids: IdsLike | TokenIds, *, salt: Salt = None) -> int:
        """The length ``match_prefix`` would return, read only: no split, no access time, no
        statistics (what a scheduler peeks at for every waiting prompt)."""
        return self.peek_position(ids, salt=salt)[2]

    def peek_position(self, ids: IdsLike | TokenIds, *,
                      salt: Salt = None) -> tuple[RadixNode, int, int]:
        """Where ``match_prefix`` would stop, read only: ``(node, depth, length)``, the node the
        match ends at or inside, how many tokens of its edge it covers (all of them when it
        ends at the node), and the matched length. Where this ends inside an edge,
        ``match_prefix`` would split the node."""
        ids, salt = as_token_view(ids), check_salt(salt)
        key_fn = self.key_fn if salt is None else SaltedKey(self.key_fn, salt)
        node, pos, n = self.root, 0, len(ids)
        while n - pos >= self.page_size:
            child = node.children.get(key_fn(ids, pos))
            if child is None:
                break
            m = child.get_match_len(ids, pos)  # >= one page: the first page is the key
            pos += m
            if m < child.length:
                return child, m, pos
            node = child
        return node, node.length, pos

    def _descend(self, ids: Tokens, salt: Salt = None) -> tuple[RadixNode, int, list[Tokens]]:
        """Follow ``ids`` down from the root page by page; split where the match stops mid-node.

        Returns the node the match ends at, the matched length and the matched slot runs.
        """
        node, pos, runs = self.root, 0, []
        n, page = len(ids), self.page_size
        key_fn = self.key_fn if salt is None else SaltedKey(self.key_fn, salt)
        while n - pos >= page:
            child = node.children.get(key_fn(ids, pos))
            if child is None:
                break
            m = child.get_match_len(ids, pos)  # >= one page: the first page is the key
            stopped_inside = m < child.length
            if stopped_inside:
                child = self._split(child, m)
            runs.append(child.value)
            node, pos = child, pos + m
            if stopped_inside:
                break
        return node, pos, runs

    def _touch(self, node: RadixNode, priority: int, hit: bool) -> None:
        """Stamp ``node`` and its ancestors as used at the current tick.

        Only ``node`` can be a leaf. If its policy key grew (LRU, LFU, priority) the heap
        re-files it lazily; if it dropped (a custom policy), it is pushed again now.
        """
        leaf = node if is_evictable_leaf(node) else None
        before = self.policy.key(leaf) if leaf is not None else None
        tick = self._tick
        while node.parent is not None:
            node.last_access = tick
            if priority > node.priority:
                node.priority = priority
            if hit:
                node.hit_count += 1
            node = node.parent
        if leaf is not None and self.policy.key(leaf) < before:
            self._heap.push(leaf)

    # ------------------------------------------------------------------ lock and unlock

    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's prefix from eviction: +1 ref_count from its node to the root."""
        self._add_ref(handle, +1)
        self._locks[handle.node] = self._locks.get(handle.node, 0) + 1

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one ``lock(handle)``: -1 ref_count from its node to the root.

        HandleError if the handle holds no lock; StaleHandleError if its node was evicted
        or the cache reset. Either way nothing changes.
        """
        held = self._locks.get(handle.node, 0) if isinstance(handle, CacheHandle) else 0
        if held == 0:
            self._add_ref(handle, 0)  # raises if the handle is stale or malformed
            raise HandleError(f"unlock without a matching lock: {handle}")
        self._add_ref(handle, -1)
        if held == 1:
            del self._locks[handle.node]
        else:
            self._locks[handle.node] = held - 1
        if is_evictable_leaf(handle.node):
            self._heap.push(handle.node)

    def _add_ref(self, handle: CacheHandle, delta: int) -> None:
        """Add ``delta`` to every ref_count from ``handle.node`` up to the root.

        One walk does the work and checks the handle on the way: it must reach this
        cache's root at depth ``cached_len``. A bad handle's walk is undone before the
        error is raised, so it changes nothing.
        """
        if not isinstance(handle, CacheHandle):
            raise HandleError(f"expected a CacheHandle, got {type(handle).__name__}")
        top, depth = self._shift_refs(handle.node, delta)
        if top is self.root and depth == handle.cached_len:
            return
        self._shift_refs(handle.node, -delta)
        if top is not self.root:
            raise StaleHandleError(
                f"stale handle: its node was evicted or the cache was reset since it was made "
                f"({handle})"
            )
        raise HandleError(
            f"handle claims a prefix of {handle.cached_len} tokens but its node ends at "
            f"{depth}"
        )

    def _shift_refs(self, node: RadixNode, delta: int) -> tuple[RadixNode, int]:
        """``ref_count += delta`` from ``node`` to the top of its tree; a node whose count
        leaves or reaches 0 moves its tokens between protected and evictable.
        Returns the top node and the depth of ``node`` in tokens."""
        depth = 0
        while True:
            before = node.ref_count
            node.ref_count = before + delta
            if before == 0 and delta > 0:
                self._evictable -= node.length
                self._protected += node.length
            elif before + delta == 0 and delta < 0:
                self._evictable += node.length
                self._protected -= node.length
            if node.parent is None:
                return node, depth
            depth += node.length
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove unlocked leaves in policy order until >= ``num_tokens`` tokens are freed.

        Returns the freed slot indices (int64). A parent whose last child goes becomes a
        leaf and may go next. Each victim comes off a heap: O(log n), no tree walk. If
        fewer than ``num_tokens`` tokens are evictable, raises OutOfMemoryError and
        evicts nothing.
        """
        self._check_evict_request(num_tokens)
        freed: list[Tokens] = []
        count = 0
        while count < num_tokens:
            victim = self._heap.pop()
            assert victim is not None, "evictable tokens but no evictable leaf in the heap"
            freed.append(victim.value)
            count += victim.length
            self._remove_leaf(victim)
        return slots_tensor(freed)

    def _check_evict_request(self, num_tokens: int) -> None:
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise PoolError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if num_tokens > self._evictable:
            raise OutOfMemoryError(
                f"cannot evict {num_tokens} tokens: only {self._evictable} are evictable "
                f"({self._protected} more are locked by running requests)"
            )

    def _remove_leaf(self, node: RadixNode) -> None:
        """Detach an evictable leaf; its parent may become an evictable leaf itself."""
        parent = node.parent
        assert parent is not None  # pop hands out evictable leaves only
        del parent.children[node.key_fn(node.key)]
        node.parent = None  # marks the node evicted: handles to it are now stale
        self._evictable -= node.length
        self._num_nodes -= 1
        if self._tracking is not None:
            self._tracking.node_removed(node)
        if is_evictable_leaf(parent):
            self._heap.push(parent)

    # ------------------------------------------------------------------ inspection

    @property
    def leaf_heap(self) -> LeafHeap:
        """The heap of eviction candidates, to inspect (``entries()``, ``live_nodes()``,
        ``rebuild_threshold``, ``len``); only the cache itself pushes and pops it."""
        return self._heap

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable, self._protected)

    @property
    def evictable_size(self) -> int:
        """Cached tokens no running request uses: what ``evict`` can free."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Cached tokens some locked handle uses."""
        return self._protected

    @property
    def total_size(self) -> int:
        """All tokens the tree holds (= the pool slots it owns)."""
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        """Number of nodes, not counting the (empty) root."""
        return self._num_nodes

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queries, self._query_tokens, self._hit_tokens)

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the (empty) root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    units = nodes  # the cache protocol's name for "every node or block"

    def held_by(self, handle: CacheHandle) -> list[RadixNode]:
        """The nodes a lock on ``handle`` holds, root-most first (root excluded).

        HandleError or StaleHandleError, as ``unlock`` raises them, if the handle is bad.
        """
        self._add_ref(handle, 0)  # checks the handle, changes nothing
        path, node = [], handle.node
        while node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def snapshot(self) -> tuple:
        """Every cached token as (salt, prefix, slot, ref_count) and the sizes, for ``==``.

        Token by token, so a ``split_at`` (metadata only) does not count as a change.
        """
        tokens = []
        stack: list[tuple[RadixNode, tuple]] = [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            keys = node.key.tolist()
            salt = getattr(node.key_fn, "salt", None)
            for i, slot in enumerate(node.value.tolist()):
                tokens.append((salt, prefix + tuple(keys[: i + 1]), slot, node.ref_count))
            stack.extend((c, prefix + tuple(keys)) for c in node.children.values())
        return tuple(sorted(tokens, key=repr)), self._evictable, self._protected

    def all_values(self) -> torch.Tensor:
        """Every slot index the tree owns (each exactly once)."""
        return slots_tensor(node.value for node in self.nodes())

    def check_integrity(self) -> None:
        """Walk the whole tree; raise AssertionError naming the first broken invariant."""
        root, page = self.root, self.page_size

        def require(cond: bool, what: str, node: RadixNode) -> None:
            if not cond:
                raise AssertionError(f"cache invariant broken: {what} (at {node})")

        require(root.parent is None and root.length == 0, "root is empty and parentless", root)
        evictable = protected = count = 0
        slots: list[int] = []
        stack = [root]
        while stack:
            node = stack.pop()
            child_refs = 0
            for k, child in node.children.items():
                require(child.parent is node, "child.parent points back at its parent", child)
                require(child.length > 0, "no empty node besides the root", child)
                require(k == child.key_fn(child.key), "children keyed by key_fn(child.key)", child)
                child_refs += child.ref_count
                stack.append(child)
            require(node.ref_count >= child_refs, "a locked node's ancestors are locked", node)
            if node is root:
                continue
            count += 1
            for run in (node.key, node.value):
                require(isinstance(run, memoryview) and run.format == "q" and run.ndim == 1,
                        "key and value are 1-D int64 Tokens views", node)
            require(len(node.key) == len(node.value) == node.length,
                    "len(key) == len(value) == length", node)
            require(node.length % page == 0, "node lengths are whole pages", node)
            require(node.ref_count >= 0, "ref_count >= 0", node)
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
            slots.extend(node.value.tolist())
        require(count == self._num_nodes, f"num_nodes {self._num_nodes} == {count} nodes", root)
        require(
            (evictable, protected) == (self._evictable, self._protected),
            f"sizes (evictable, protected) = {(self._evictable, self._protected)} match the "
            f"tree's {(evictable, protected)}",
            root,
        )
        require(
            root.ref_count == sum(self._locks.values()), "root.ref_count counts held locks", root
        )
        require(len(set(slots)) == len(slots), "every slot owned once", root)
        live = self._heap.live_nodes()
        missing = [n for n in self.nodes() if is_evictable_leaf(n) and n.id not in live]
        require(
            not missing,
            f"every evictable leaf has a heap entry no larger than its key (not {missing[:3]})",
            root,
        )

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.policy.name}, "
            f"nodes={self._num_nodes}, evictable={self._evictable}, "
            f"protected={self._protected})"
        )

    # ------------------------------------------------------------------ policies with state

    def _split(self, node: RadixNode, pos: int) -> RadixNode:
        """``node.split_at(pos)``, counted; a ``NodeTracking`` policy hears of it, and the
        lower half, whose key may have dropped (it now starts deeper), is filed again."""
        upper = node.split_at(pos)
        self._num_nodes += 1
        if self._tracking is not None:
            self._tracking.node_split(upper, node)
            if is_evictable_leaf(node):
                self._heap.push(node)
        return upper

    def _forget_all(self) -> None:
        """Tell a ``NodeTracking`` policy that every node of the tree is gone (reset)."""
        for node in self.nodes():
            self._tracking.node_removed(node)


_IN_PLACE = 4096  # an int64 tensor this long is checked where it lies, not copied first


def _checked_view(x: IdsLike | TokenIds, what: str) -> tuple[Tokens, bool]:
    """``x`` checked as ``as_token_view`` checks it, and whether the view is the cache's own.

    A long 1-D int64 CPU tensor (an engine's ids or slots) is checked where it lies, in
    one numpy pass, and viewed without a copy (``False``: the caller's memory, to copy
    before keeping any of it); a request then costs one copy of what the tree keeps
    rather than a copy of everything first. Anything else goes through ``as_token_view``
    (a copy, or a ``TokenIds``' own view: ``True``), which also raises the errors.
    """
    if type(x) is torch.Tensor and x.dtype is torch.int64 and x.dim() == 1 and x.is_cpu \
            and x.numel() >= _IN_PLACE and x.is_contiguous():
        arr = x.numpy()
        if arr.min() >= 0:
            return memoryview(arr).cast("B").cast("q"), False
    return as_token_view(x, what), True


def _copy(run: Tokens) -> Tokens:
    """``run`` in a buffer of its own."""
    return memoryview(run.tobytes()).cast("q")


def _check_priority(priority: int) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"priority must be an int, got {priority!r}")
    return priority


def insert_fresh(cache: RadixCache, ids: IdsLike, first_slot: int) -> tuple[InsertResult, int]:
    """Cache ``ids`` as a request would, with made-up slots instead of a pool.

    Match, number the uncached whole-page part with consecutive slots from
    ``first_slot``, insert. Returns the insert result and the next unused slot number.
    For examples, checkers and tests that need a tree, not K/V.
    """
    ids = as_ids(ids)
    match = cache.match_prefix(ids)
    aligned = ids.numel() - ids.numel() % cache.page_size
    fresh = torch.arange(first_slot, first_slot + aligned - match.cached_len, dtype=torch.int64)
    result = cache.insert_prefix(ids[:aligned], torch.cat([match.indices, fresh]))
    return result, first_slot + fresh.numel()
