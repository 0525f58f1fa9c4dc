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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
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
from .eviction import EvictionPolicy, LeafHeap, is_evictable_leaf, make_policy
from .radix import RadixNode, page_key

__all__ = [
    "CacheHandle",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "PrefixCache",
    "RadixCache",
    "SaltedKey",
    "SizeInfo",
    "as_ids",
    "check_salt",
    "insert_fresh",
]

_HOST = torch.device("cpu")  # the tree's own bookkeeping lives in host memory
_EMPTY = torch.empty(0, dtype=torch.int64)

IdsLike = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class CacheHandle:
    """Where a match (or insert) ended: ``node`` and the prefix length ``cached_len`` it spells.

    Pass it to ``lock`` / ``unlock``. It goes stale when its node is evicted or the cache
    reset; a split leaves it valid (the handle's node keeps the deeper half).
    """

    node: RadixNode
    cached_len: int


@dataclass(frozen=True, eq=False)
class MatchResult:
    """``match_prefix``'s answer: a handle, the cached prefix's slot indices, its length."""

    handle: CacheHandle
    indices: torch.Tensor
    cached_len: int


@dataclass(frozen=True, eq=False)
class InsertResult:
    """``insert_prefix``'s answer.

    ``cached_len``: leading tokens that were already cached (the caller's own slots for
    them are duplicates to free); ``handle``: the node ending at the inserted length;
    ``indices``: the tree's slots for the whole inserted prefix (re-point the request's
    page table at them before freeing anything).
    """

    cached_len: int
    handle: CacheHandle
    indices: torch.Tensor


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


def as_ids(x: IdsLike, what: str = "ids") -> torch.Tensor:
    """``x`` (a list, tuple, array or tensor of non-negative ints) as a 1-D int64 CPU tensor.

    Raises InvalidIdsError naming ``what`` for anything else: wrong rank, a float or bool
    dtype, negative entries, or values that are not integers at all.
    """
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, (list, tuple)) and len(x) == 0:
        return _EMPTY
    else:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidIdsError(f"{what} must be a 1-D sequence of ints, got {x!r:.80}") from exc
    if t.dim() != 1:
        raise InvalidIdsError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise InvalidIdsError(f"{what} must have an integer dtype, got {t.dtype}")
    t = t.to(device=_HOST, dtype=torch.int64)
    if t.numel() and int(t.min()) < 0:
        bad = int((t < 0).nonzero()[0, 0])
        raise InvalidIdsError(f"{what} must be non-negative, got {int(t[bad])} at position {bad}")
    return t


def _concat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values) if values else _EMPTY


Salt = str | bytes | None


def check_salt(salt: Any) -> Salt:
    """``salt`` if it is None or a non-empty str/bytes; RequestError (a ValueError) otherwise."""
    if salt is None or (isinstance(salt, (str, bytes)) and len(salt) > 0):
        return salt
    raise RequestError(f"cache salt must be None or a non-empty str or bytes, got {salt!r:.80}")


class SaltedKey:
    """Child key of a salted request's nodes: ``(salt, key_fn(key))``, as SGLang's extra key.

    Every node of a salted subtree carries it as its ``key_fn``, so a split re-keys the
    halves correctly and requests with different salts never share a node.
    """

    def __init__(self, key_fn, salt: str | bytes) -> None:
        self.key_fn, self.salt = key_fn, salt
        self.page_size = getattr(key_fn, "page_size", 1)

    def __call__(self, key: torch.Tensor) -> tuple:
        return (self.salt, self.key_fn(key))


class PrefixCache(Protocol):
    """What the lifecycle and the engine need from a prefix cache (SGLang's BasePrefixCache).

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
    (``SaltedKey``): requests with different salts never share a node.
    """

    def __init__(self, page_size: int = 1, policy: str | EvictionPolicy = "lru") -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.key_fn = page_key(page_size)
        self.policy = make_policy(policy)
        self.reset()

    def reset(self) -> None:
        """Empty the cache (tree, sizes, statistics); every existing handle becomes stale."""
        self.root = RadixNode(self.key_fn)
        self._heap = LeafHeap(self.policy)
        self._locks: Counter[CacheHandle] = Counter()
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._tick = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the hit statistics, keeping the tree."""
        self._queries = self._query_tokens = self._hit_tokens = 0

    # ------------------------------------------------------------------ match and insert

    def match_prefix(self, ids: IdsLike, *, priority: int = 0, salt: Salt = None) -> MatchResult:
        """The longest cached prefix of ``ids``, in whole pages: handle, slot indices, length.

        If the match ends inside a node, that node is split there so that the handle's
        node ends exactly at the match (metadata only: no K/V moves). Marks the matched
        nodes as used now (last access, hit count, priority) and updates the statistics.
        Does not lock: call ``lock(result.handle)`` to keep the prefix from eviction.
        """
        ids = as_ids(ids)
        priority = _check_priority(priority)
        node, cached_len, values = self._descend(ids, ids.tolist(), check_salt(salt))
        self._tick += 1
        self._touch(node, priority, hit=True)
        self._queries += 1
        self._query_tokens += ids.numel()
        self._hit_tokens += cached_len
        return MatchResult(CacheHandle(node, cached_len), _concat(values), cached_len)

    def insert_prefix(
        self, ids: IdsLike, indices: IdsLike, *, priority: int = 0, salt: Salt = None
    ) -> InsertResult:
        """Cache ``ids[:n]`` with K/V in slots ``indices[:n]``, n = len(ids) rounded down to pages.

        Tokens already cached keep the tree's slots; the result says how many there were
        (``cached_len``) and returns the tree's slots for the whole prefix. The tail past
        the last whole page is not cached: its slots stay the caller's to free.
        """
        ids = as_ids(ids)
        indices = as_ids(indices, "indices")
        if ids.numel() != indices.numel():
            raise InvalidIdsError(
                f"ids and indices must have the same length, got {ids.numel()} and "
                f"{indices.numel()}"
            )
        priority = _check_priority(priority)
        salt = check_salt(salt)
        n = ids.numel() - ids.numel() % self.page_size
        ids, indices = ids[:n], indices[:n]
        tokens = ids.tolist()
        node, cached_len, values = self._descend(ids, tokens, salt)
        self._tick += 1
        if cached_len < n:
            key_fn = self.key_fn if salt is None else SaltedKey(self.key_fn, salt)
            leaf = RadixNode(
                key_fn, ids[cached_len:].clone(), indices[cached_len:].clone(), self._tick
            )
            leaf.priority = priority
            leaf.parent = node
            node.children[self._child_key(tokens, cached_len, salt)] = leaf
            self._evictable += leaf.length
            self._num_nodes += 1
            values.append(leaf.value)
            node = leaf
        self._touch(node, priority, hit=False)
        if cached_len < n:
            self._heap.push(node)  # a new evictable leaf
        return InsertResult(cached_len, CacheHandle(node, n), _concat(values))

    def _child_key(self, tokens: list[int], pos: int, salt: Salt = None) -> Hashable:
        """``key_fn(ids[pos:])`` computed on a Python list (no tensor op per tree level).

        With a salt the key is ``(salt, key)`` (``SaltedKey``), at every level.
        """
        key = tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])
        return key if salt is None else (salt, key)

    def _descend(
        self, ids: torch.Tensor, tokens: list[int], salt: Salt = None
    ) -> tuple[RadixNode, int, list[torch.Tensor]]:
        """Follow ``ids`` down from the root page by page; split where the match stops mid-node.

        ``tokens`` is ``ids.tolist()``. Returns the node the match ends at, the matched
        length and the matched slot runs.
        """
        node, pos, values = self.root, 0, []
        n, page = ids.numel(), self.page_size
        while n - pos >= page:
            child = node.children.get(self._child_key(tokens, pos, salt))
            if child is None:
                break
            m = child.get_match_len(ids[pos:])  # >= one page: the first page is the key
            stopped_inside = m < child.length
            if stopped_inside:
                child = child.split_at(m)
                self._num_nodes += 1
            values.append(child.value)
            node, pos = child, pos + m
            if stopped_inside:
                break
        return node, pos, values

    def _touch(self, node: RadixNode, priority: int, hit: bool) -> None:
        """Stamp ``node`` and its ancestors as used at the current tick.

        Only ``node`` can be a leaf. If its policy key grew (LRU, LFU, priority) the heap
        re-files it lazily; if it dropped (a custom policy), it is pushed again now.
        """
        last, before, tick = node, self.policy.key(node), self._tick
        while node.parent is not None:
            node.last_access = tick
            node.priority = max(node.priority, priority)
            if hit:
                node.hit_count += 1
            node = node.parent
        if is_evictable_leaf(last) and self.policy.key(last) < before:
            self._heap.push(last)

    # ------------------------------------------------------------------ lock and unlock

    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's prefix from eviction: +1 ref_count from its node to the root."""
        path = self._path(handle)
        for node in path:
            if node.ref_count == 0:
                self._evictable -= node.length
                self._protected += node.length
            node.ref_count += 1
        self._locks[handle] += 1

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one ``lock(handle)``: -1 ref_count from its node to the root.

        HandleError if the handle holds no lock; StaleHandleError if its node was evicted
        or the cache reset. Either way nothing changes.
        """
        path = self._path(handle)
        if self._locks.get(handle, 0) == 0:
            raise HandleError(f"unlock without a matching lock: {handle}")
        for node in path:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._evictable += node.length
                self._protected -= node.length
        self._locks[handle] -= 1
        if self._locks[handle] == 0:
            del self._locks[handle]
        if is_evictable_leaf(handle.node):
            self._heap.push(handle.node)

    def _path(self, handle: CacheHandle) -> list[RadixNode]:
        """The nodes from ``handle.node`` up to and including the root; checks the handle."""
        if not isinstance(handle, CacheHandle):
            raise HandleError(f"expected a CacheHandle, got {type(handle).__name__}")
        path, depth, node = [], 0, handle.node
        while node.parent is not None:
            path.append(node)
            depth += node.length
            node = node.parent
        if node is not self.root:
            raise StaleHandleError(
                f"stale handle: its node was evicted or the cache was reset since it was made "
                f"({handle})"
            )
        path.append(node)
        if depth != handle.cached_len:
            raise HandleError(
                f"handle claims a prefix of {handle.cached_len} tokens but its node ends at "
                f"{depth}"
            )
        return path

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove unlocked leaves in policy order until >= ``num_tokens`` tokens are freed.

        Returns the freed slot indices (int64). A parent whose last child goes becomes a
        leaf and may go next. Each victim comes off a heap: O(log n), no tree walk. If
        fewer than ``num_tokens`` tokens are evictable, raises OutOfMemoryError and
        evicts nothing.
        """
        self._check_evict_request(num_tokens)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens:
            victim = self._heap.pop()
            assert victim is not None, "evictable tokens but no evictable leaf in the heap"
            freed.append(victim.value)
            count += victim.length
            self._remove_leaf(victim)
        return _concat(freed)

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
        assert parent is not None and is_evictable_leaf(node)
        del parent.children[node.key_fn(node.key)]
        node.parent = None  # marks the node evicted: handles to it are now stale
        self._evictable -= node.length
        self._num_nodes -= 1
        if is_evictable_leaf(parent):
            self._heap.push(parent)

    # ------------------------------------------------------------------ inspection

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
        """The nodes a lock on ``handle`` holds, root-most first (root excluded); checks it."""
        return self._path(handle)[-2::-1]

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
        return _concat([node.value for node in self.nodes()])

    def check_integrity(self) -> None:
        """Walk the whole tree; raise AssertionError naming the first broken invariant."""
        root, page = self.root, self.page_size

        def require(cond: bool, what: str, node: RadixNode) -> None:
            if not cond:
                raise AssertionError(f"cache invariant broken: {what} (at {node})")

        require(root.parent is None and root.length == 0, "root is empty and parentless", root)
        evictable = protected = count = 0
        slots: list[torch.Tensor] = []
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
            require(node.key.dim() == 1 and node.key.dtype == torch.int64, "key is 1-D int64", node)
            require(node.value.dtype == torch.int64, "value is int64", node)
            require(node.key.shape == node.value.shape, "len(key) == len(value)", node)
            require(node.length % page == 0, "node lengths are whole pages", node)
            require(node.ref_count >= 0, "ref_count >= 0", node)
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
            slots.append(node.value)
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
        values = _concat(slots)
        require(values.unique().numel() == values.numel(), "every slot owned once", root)
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
