"""A host-memory tier under the device KV pool: evicted prefixes kept in host memory, loaded back.

SGLang's HiCache (sglang 0.5.23
`srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.evict_host, UnifiedRadixCache.load_back`;
older releases had a ``HiRadixCache`` class of its own) adds a second, larger pool
in host memory. ``HiRadixCache`` here is that idea at the book's scale:

* ``HostPool``: K/V storage for the device pool's slots, in CPU memory (pinned when the
  device is a GPU, as SGLang's host pool is), one slot's layers side by side.
* The host pool is indexed by a second ``RadixCache`` (``HiRadixCache.host``) over host
  slots, with its own LRU eviction of host leaves. Both trees hold whole prefixes, so a
  token path is on the device, on the host, or on both; ``residency()`` merges the two
  into one tree that says so per node. (SGLang keeps one tree whose nodes carry a
  device ``value`` and a ``host_value``; the information is the same.)
* Write policies (SGLang's ``--hicache-write-policy``): ``write_back`` copies a node to
  the host when the device evicts it; ``write_through`` copies at insert;
  ``write_through_selective`` copies once a node has been hit ``write_through_threshold``
  times. A write copies the part of the node's prefix the host lacks.
* ``match_prefix`` that finds a longer prefix on the host than on the device loads the
  difference back into device slots (evicting on the device if it must) and inserts it
  into the device tree, so the request computes only what neither tier holds. The
  engine matches without loading and calls ``load_back`` when it admits the request,
  as SGLang's scheduler calls ``init_load_back``.

``copy_kv`` moves each run of consecutive host slots as one copy of K and one of V,
straight to or from the pinned host storage; a write to the host is complete when it
returns. SGLang runs its copies on streams of their own (sglang 0.5.23
`srt/mem_cache/l2_transfer.py: L2TransferEngine`) and lets the forward pass wait for a
load layer by layer (sglang 0.5.23
`srt/managers/cache_controller.py: LayerLoadingEvent`), so copies hide behind compute;
minirt leaves that out.

``measure_load_back`` times loading K/V back from the host against recomputing it by
prefill, per token, on a real model: that ratio is the reason the tier exists.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .cache import MatchResult, RadixCache, Salt, check_salt
from .errors import PoolError, TierError
from .eviction import EvictionPolicy
from .forward import forward_paged
from .pool import KVPool, PageTable
from .radix import RadixNode
from .token_ids import IdsLike, as_ids, slots_tensor

__all__ = [
    "WRITE_POLICIES",
    "HiRadixCache",
    "HostPool",
    "LoadBackCost",
    "TierMatchResult",
    "TierNode",
    "TierStats",
    "check_tier_settings",
    "copy_kv",
    "measure_load_back",
    "slot_runs",
]

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


def check_tier_settings(device_capacity: int, host_capacity: int, page_size: int = 1,
                        write_policy: str = "write_through",
                        write_through_threshold: int = 1) -> None:
    """Raise TierError (a ValueError) naming the first host-tier setting that cannot work.

    The host pool must hold at least as many tokens as the device pool, in whole pages: a
    host tier smaller than the device could not even mirror it. (SGLang only warns when its
    host pool is not larger than the device pool, sglang 0.5.23
    `srt/mem_cache/pool_host/base.py: HostKVCache._allocate_host_buffer`, and defaults
    ``--hicache-ratio`` to 2.0 (1.2 in its buffer-only host mode), sglang 0.5.23
    `srt/arg_groups/hicache_hook.py: handle_hicache_ratio_default`; minirt refuses.)
    ``write_through_threshold``: the prefix hits after which ``write_through_selective``
    copies a node. SGLang counts the inserting request
    as a node's first hit and copies at 2, i.e. at its first reuse: minirt counts
    ``match_prefix`` hits only, so its 1 is that same first reuse.
    """
    if write_policy not in WRITE_POLICIES:
        raise TierError(f"unknown write_policy {write_policy!r}; choose one of "
                        f"{list(WRITE_POLICIES)}")
    t = write_through_threshold
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise TierError(f"write_through_threshold must be an int >= 1 (hits before a node "
                        f"is copied to the host), got {t!r}")
    h = host_capacity
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise TierError(f"host_capacity must be a positive int (tokens), got {h!r}")
    if h < device_capacity:
        raise TierError(f"host_capacity {h} is smaller than the device pool's "
                        f"{device_capacity} tokens: the host tier must be at least as large")
    if h % page_size:
        raise TierError(f"host_capacity {h} must be a whole number of pages of "
                        f"{page_size} tokens")


class HostPool(KVPool):
    """A ``KVPool`` in host memory shaped like a device pool: where evicted K/V waits.

    Same layers, heads, head_dim, dtype and page size as the device pool, ``capacity``
    tokens, its own free list. The storage ``kv`` is slot-major,
    ``[2, capacity, layers, kv_heads, head_dim]`` (K then V): one slot's layers lie side by
    side, so a run of consecutive slots is one contiguous block of K and one of V, each
    crossing to or from a GPU as one copy. That is SGLang's ``page_first`` host layout
    (sglang 0.5.23 `srt/mem_cache/pool_host/mha.py: MHATokenToKVPoolHost.init_kv_buffer`);
    the device pool is layer-major. ``k`` and ``v`` are views of ``kv`` in the device
    pool's shape, ``[layers, capacity, kv_heads, head_dim]``. On a CUDA device the storage
    is pinned (page-locked), so those copies are DMA'd straight to and from it,
    asynchronously; on CPU it is a second store.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                 page_size: int = 1, dtype: torch.dtype = torch.float32, *,
                 pin_memory: bool = False) -> None:
        super().__init__(num_layers, kv_heads, head_dim, capacity, page_size, dtype=dtype,
                         device="cpu")
        self.kv = torch.zeros((2, capacity, num_layers, kv_heads, head_dim), dtype=dtype,
                              pin_memory=pin_memory)
        self.k, self.v = self.kv[0].transpose(0, 1), self.kv[1].transpose(0, 1)

    @classmethod
    def for_device(cls, pool: KVPool, capacity: int) -> HostPool:
        """A host pool of ``capacity`` tokens laid out like ``pool`` (pinned if it is on CUDA)."""
        return cls(pool.num_layers, pool.kv_heads, pool.head_dim, capacity, pool.page_size,
                   dtype=pool.dtype, pin_memory=pool.device.type == "cuda")

    @property
    def pinned(self) -> bool:
        """True if the K/V storage is in page-locked memory."""
        return self.kv.is_pinned()


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """``slots`` cut into runs of consecutive slot numbers: ``(offset, first slot, length)``
    per run, in order (``slots[offset:offset + length]`` is ``first .. first + length - 1``).
    """
    s = slots.to("cpu", torch.int64).reshape(-1)
    if s.numel() == 0:
        return []
    starts = [0, *(torch.nonzero(s[1:] - s[:-1] != 1).reshape(-1) + 1).tolist(), s.numel()]
    firsts = s[starts[:-1]].tolist()
    return [(a, f, b - a) for a, b, f in zip(starts[:-1], starts[1:], firsts, strict=True)]


def copy_kv(src: KVPool, src_slots: torch.Tensor, dst: KVPool, dst_slots: torch.Tensor, *,
            by_runs: bool | None = None) -> None:
    """Copy every layer's K and V of ``src_slots`` in ``src`` into ``dst_slots`` of ``dst``.

    What a write to the host or a load back from it costs. Between a device pool on a GPU
    and a ``HostPool`` (``by_runs``, the default unless the device is the CPU), each run of
    consecutive host slots (``slot_runs``) is two copies (K, V) straight to or from the
    host storage, all layers at once; the device side is gathered into (or scattered from)
    a temporary in the host's layout on the device, one ``index_select`` (or
    ``index_copy_``) per tensor. On CUDA the host storage is pinned and the copies are
    asynchronous, on the current stream:

    * to the host: an event recorded after the copies is waited for before returning, so
      the host rows are there for whoever reads them next (an unsynchronized read once
      saw rows that had not arrived);
    * from the host: nothing waits; the scatter into the device pool, and any later use
      of it, run after the copies on the same stream.

    When both sides are in CPU memory (``by_runs=False``), and between two device pools,
    it is one gather and one scatter per tensor. PoolError if the slot lists differ in
    length (nothing is copied).
    """
    n = src_slots.numel()
    if dst_slots.numel() != n:
        raise PoolError(f"copy_kv: {n} source slots but {dst_slots.numel()} destination slots")
    if n == 0:
        return
    to_host = isinstance(dst, HostPool) and not isinstance(src, HostPool)
    from_host = isinstance(src, HostPool) and not isinstance(dst, HostPool)
    if not (to_host or from_host):
        si, di = src_slots.to(src.device), dst_slots.to(dst.device)
        for a, b in ((src.k, dst.k), (src.v, dst.v)):
            b.index_copy_(1, di, a.index_select(1, si).to(dst.device))
        return
    device_pool = src if to_host else dst
    if by_runs is None:
        by_runs = device_pool.device.type != "cpu"
    if to_host:
        _to_host(src, src_slots, dst, dst_slots, by_runs)
    else:
        _from_host(src, src_slots, dst, dst_slots, by_runs)


def _to_host(src: KVPool, src_slots: torch.Tensor, host: HostPool, host_slots: torch.Tensor,
             by_runs: bool) -> None:
    si = src_slots.to(src.device)
    if not by_runs:
        hi = host_slots.to("cpu")
        for side, a in enumerate((src.k, src.v)):
            host.kv[side].index_copy_(0, hi, a.index_select(1, si).transpose(0, 1).to("cpu"))
        return
    rows = torch.stack((src.k.index_select(1, si), src.v.index_select(1, si)))
    rows = rows.transpose(1, 2).contiguous()  # [2, n, layers, heads, dim]: the host's layout
    for offset, first, length in slot_runs(host_slots):
        for side in (0, 1):
            host.kv[side, first:first + length].copy_(rows[side, offset:offset + length],
                                                      non_blocking=host.pinned)
    if rows.is_cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(rows.device))
        done.synchronize()


def _from_host(host: HostPool, host_slots: torch.Tensor, dst: KVPool, dst_slots: torch.Tensor,
               by_runs: bool) -> None:
    if by_runs:
        rows = torch.empty((2, host_slots.numel(), *host.kv.shape[2:]), dtype=host.dtype,
                           device=dst.device)
        for offset, first, length in slot_runs(host_slots):
            for side in (0, 1):
                rows[side, offset:offset + length].copy_(host.kv[side, first:first + length],
                                                         non_blocking=host.pinned)
    else:
        rows = host.kv.index_select(1, host_slots.to("cpu")).to(dst.device)
    di = dst_slots.to(dst.device)
    dst.k.index_copy_(1, di, rows[0].transpose(0, 1))
    dst.v.index_copy_(1, di, rows[1].transpose(0, 1))


@dataclass(eq=False)
class TierMatchResult(MatchResult):
    """``HiRadixCache.match_prefix``'s answer: a ``MatchResult`` whose prefix (``cached_len``
    tokens) is on the device. ``loaded_len`` of its last tokens were loaded back from the
    host by this call (``device_len`` = ``cached_len - loaded_len`` were device hits);
    ``host_hit_len`` more tokens past it are on the host, not loaded (SGLang's
    ``host_hit_length``)."""

    loaded_len: int = 0
    host_hit_len: int = 0

    @property
    def device_len(self) -> int:
        return self.cached_len - self.loaded_len


@dataclass(frozen=True)
class TierStats:
    """What the host tier has done since the cache was made (or ``reset``).

    ``writes`` / ``written_tokens``: copies device -> host and the tokens they moved;
    ``write_skipped_tokens``: tokens a write left out because the host could not make
    room; ``loads`` / ``loaded_tokens``: load-backs host -> device and their tokens;
    ``host_evictions`` / ``host_evicted_tokens``: host-tree evictions to make room.
    """

    writes: int = 0
    written_tokens: int = 0
    write_skipped_tokens: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    host_evictions: int = 0
    host_evicted_tokens: int = 0


@dataclass(frozen=True)
class TierNode:
    """A node of the merged two-tier picture: a run of ``tokens`` that live in one ``tier``.

    ``tier``: "device", "host", "both", or "root" for the root. ``salt``: the cache salt of
    the run (None if unsalted). Children are sorted, so the picture is deterministic.
    """

    tokens: tuple[int, ...]
    tier: str
    salt: Salt = None
    children: tuple[TierNode, ...] = field(default=())

    def walk(self) -> Iterator[tuple[int, TierNode]]:
        """(depth, node) for this node and every descendant, parents first."""
        stack = [(0, self)]
        while stack:
            depth, node = stack.pop()
            yield depth, node
            stack.extend((depth + 1, c) for c in reversed(node.children))

    def tokens_in(self, tier: str) -> int:
        """Tokens of this subtree whose K/V live in ``tier`` ("device", "host" or "both")."""
        return sum(len(n.tokens) for _, n in self.walk() if n.tier == tier)


class HiRadixCache(RadixCache):
    """A ``RadixCache`` over the device pool backed by a larger host tier (SGLang's HiRadixCache).

    ``pool``: the device ``KVPool`` (the cache copies K/V between it and its own
    ``host_pool`` of ``host_capacity`` tokens). ``write_policy``: "write_back",
    "write_through" or "write_through_selective" (copy once a node's prefix-hit count
    reaches ``write_through_threshold``). ``policy``: the device eviction order; the host
    tree evicts LRU. ``make_room(n)``: how a load-back gets ``n`` free device slots (by
    default: evict device leaves and free their slots; the engine points it at its
    lifecycle's, which also counts the evictions).

    Everything else is ``RadixCache``: the device tree, its locks, sizes and handles.
    """

    def __init__(self, pool: KVPool, host_capacity: int, *, write_policy: str = "write_through",
                 write_through_threshold: int = 1,
                 policy: str | EvictionPolicy = "lru") -> None:
        check_tier_settings(pool.capacity, host_capacity, pool.page_size, write_policy,
                            write_through_threshold)
        self.pool = pool
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.host_pool = HostPool.for_device(pool, host_capacity)
        self.host = RadixCache(page_size=pool.page_size, policy="lru")
        self.make_room: Callable[[int], torch.Tensor] = self._evict_and_free
        super().__init__(page_size=pool.page_size, policy=policy)

    def reset(self) -> None:
        """Empty both tiers (the host's slots go back to its free list) and the statistics.

        The device tree's slots are the caller's to free, as for ``RadixCache.reset``.
        """
        super().reset()
        held = self.host.all_values()
        self.host.reset()
        self.host_pool.free(held)
        self._stats = TierStats()

    # ------------------------------------------------------------------ match: load back

    def match_prefix(self, ids: IdsLike, *, priority: int = 0, salt: Salt = None,
                     load_back: bool = True) -> TierMatchResult:
        """The longest prefix of ``ids`` in either tier, in whole pages, brought to the device.

        Matches the device tree (``RadixCache.match_prefix``: may split a node). If the
        host holds a longer prefix, ``load_back`` copies its extra tokens into device
        slots and inserts them into the device tree (see ``load_back``); with
        ``load_back=False`` the result only reports them (``host_hit_len``), as SGLang's
        scheduler matches first and loads when it admits the request. Under
        ``write_through_selective``, matched nodes hit often enough are copied to the host.
        """
        m = super().match_prefix(ids, priority=priority, salt=salt)
        ids = as_ids(ids)
        host_len = self.host.peek_prefix_len(ids, salt=salt)
        result = TierMatchResult(m.handle, m.cached_len, m.runs, 0,
                                 max(0, host_len - m.cached_len))
        if load_back:
            result = self.load_back(ids, result, priority=priority, salt=salt)
        if self.write_policy == "write_through_selective":
            self._write_hot(ids, result, salt)
        return result

    def load_back(self, ids: IdsLike, match: MatchResult, *, priority: int = 0,
                  salt: Salt = None) -> TierMatchResult:
        """Bring the host's part of a match to the device: copy the tokens of ``ids`` past
        ``match`` that the host holds into device slots and insert them into the device tree.

        ``match``: this cache's latest ``match_prefix(ids)`` answer, nothing changed since.
        Evicts unlocked device leaves through ``make_room`` if it must, never the matched
        prefix; loads as many whole pages as the device can take. Returns the longer match
        (``loaded_len`` tokens loaded, ``host_hit_len`` left on the host).
        """
        ids = as_ids(ids)
        d = match.cached_len
        want = self.host.peek_prefix_len(ids, salt=salt) - d
        if want <= 0:
            return TierMatchResult(match.handle, d, match.runs, 0, 0)
        self.lock(match.handle)  # our own evictions must not take the device prefix
        try:
            room = self.pool.num_free + self.evictable_size
            n = min(want, room) // self.page_size * self.page_size
            if n == 0:
                return TierMatchResult(match.handle, d, match.runs, 0, want)
            hm = self.host.match_prefix(ids[:d + n], salt=salt)
            self.host.lock(hm.handle)  # device evictions may write back and evict host leaves
            try:
                self.make_room(n)
                slots = self.pool.alloc(n)
                copy_kv(self.host_pool, hm.indices[d:d + n], self.pool, slots)
            finally:
                self.host.unlock(hm.handle)
            res = RadixCache.insert_prefix(self, ids[:d + n], torch.cat([match.indices, slots]),
                                           priority=priority, salt=salt)
        finally:
            self.unlock(match.handle)
        assert res.cached_len == d, "the device prefix changed during a load-back"
        self._count(loads=1, loaded_tokens=n)
        return TierMatchResult(res.handle, d + n, res.runs, n, want - n)

    # ------------------------------------------------------------------ writes to the host

    def insert_prefix(self, ids: IdsLike, indices: IdsLike, *, priority: int = 0,
                      salt: Salt = None):
        """``RadixCache.insert_prefix``; under ``write_through`` the inserted prefix is then
        copied to the host (the part it lacks)."""
        res = super().insert_prefix(ids, indices, priority=priority, salt=salt)
        if self.write_policy == "write_through" and res.handle.cached_len:
            n = res.handle.cached_len
            self._write(as_ids(ids)[:n], res.indices, check_salt(salt))
        return res

    def _remove_leaf(self, node: RadixNode) -> None:
        """Device eviction of one leaf; under ``write_back`` its prefix is copied to the host
        first (its slots still hold the K/V until the caller frees them)."""
        if self.write_policy == "write_back":
            path = []
            n = node
            while n.parent is not None:
                path.append(n)
                n = n.parent
            path.reverse()
            ids = slots_tensor(p.key for p in path)
            self._write(ids, slots_tensor(p.value for p in path),
                        getattr(node.key_fn, "salt", None))
        super()._remove_leaf(node)

    def _write_hot(self, ids: torch.Tensor, m: MatchResult, salt: Salt) -> None:
        """``write_through_selective``: copy the matched prefix up to its deepest node hit at
        least ``write_through_threshold`` times (hit counts never grow toward the leaves)."""
        end = depth = 0
        for node in self.held_by(m.handle):
            depth += node.length
            if node.hit_count >= self.write_through_threshold:
                end = depth
        if end:
            self._write(ids[:end], m.indices[:end], salt)

    def _write(self, ids: torch.Tensor, device_slots: torch.Tensor, salt: Salt) -> None:
        """Make the host hold the prefix ``ids`` (whole pages) whose device K/V is at
        ``device_slots``: copy the part past what the host already has, evicting host
        leaves (LRU) for room; as many whole pages as fit."""
        host, hp = self.host, self.host_pool
        hm = host.match_prefix(ids, salt=salt)
        have, gap = hm.cached_len, len(ids) - hm.cached_len
        if gap <= 0:
            return
        host.lock(hm.handle)  # making room must not evict the prefix we extend
        try:
            n = min(gap, hp.num_free + host.evictable_size) // self.page_size * self.page_size
            short = n - hp.num_free
            if short > 0:
                freed = host.evict(short)
                hp.free(freed)
                self._count(host_evictions=1, host_evicted_tokens=int(freed.numel()))
            if n:
                slots = hp.alloc(n)
                copy_kv(self.pool, device_slots[have:have + n], hp, slots)
                host.insert_prefix(ids[:have + n], torch.cat([hm.indices, slots]), salt=salt)
        finally:
            host.unlock(hm.handle)
        self._count(writes=int(n > 0), written_tokens=n, write_skipped_tokens=gap - n)

    def _evict_and_free(self, num_tokens: int) -> torch.Tensor:
        """Default ``make_room``: evict device leaves until ``num_tokens`` slots are free."""
        short = num_tokens - self.pool.num_free
        if short <= 0:
            return torch.empty(0, dtype=torch.int64)
        freed = self.evict(short)
        self.pool.free(freed)
        return freed

    def _count(self, **deltas: int) -> None:
        s = self._stats
        self._stats = TierStats(**{k: getattr(s, k) + deltas.get(k, 0)
                                   for k in TierStats.__dataclass_fields__})

    # ------------------------------------------------------------------ host eviction

    def evict_host(self, num_tokens: int) -> int:
        """Evict host leaves (LRU) until >= ``num_tokens`` host slots are freed; how many were.

        PoolError for a bad count, OutOfMemoryError if the host holds fewer tokens: either
        way nothing changes. (Writes call this themselves when the host is full.)
        """
        freed = self.host.evict(num_tokens)
        self.host_pool.free(freed)
        if freed.numel():
            self._count(host_evictions=1, host_evicted_tokens=int(freed.numel()))
        return int(freed.numel())

    # ------------------------------------------------------------------ inspection

    @property
    def tier_stats(self) -> TierStats:
        """Writes, load-backs and host evictions so far (``TierStats``)."""
        return self._stats

    @property
    def host_capacity(self) -> int:
        return self.host_pool.capacity

    @property
    def host_size(self) -> int:
        """Tokens whose K/V the host tier holds (each in one host slot)."""
        return self.host.total_size

    def peek_tiers(self, ids: IdsLike, *, salt: Salt = None) -> tuple[int, int]:
        """(device, host) prefix lengths of ``ids``, read only: nothing moves, nothing counts."""
        return (self.peek_prefix_len(ids, salt=salt), self.host.peek_prefix_len(ids, salt=salt))

    def residency(self) -> TierNode:
        """Both trees merged into one: each node a run of tokens on "device", "host" or "both".

        Runs break where the tree branches or the tier changes. For pictures and tests
        (``minirt.viz.tier_tree_text`` / ``draw_tier_tree`` draw it).
        """
        trie: dict = {}  # (salt, token) -> [tiers bitmask, child trie]
        for bit, tree in ((1, self), (2, self.host)):
            stack = [(tree.root, trie)]
            while stack:
                node, level = stack.pop()
                for child in node.children.values():
                    salt = getattr(child.key_fn, "salt", None)
                    pos = level
                    for t in child.key.tolist():
                        entry = pos.setdefault((salt, t), [0, {}])
                        entry[0] |= bit
                        pos = entry[1]
                    stack.append((child, pos))
        names = {1: "device", 2: "host", 3: "both"}

        def build(key: tuple, entry: list) -> TierNode:
            tokens, (mask, kids) = [key[1]], entry
            while len(kids) == 1:
                (k2, e2), = kids.items()
                if e2[0] != mask:
                    break
                tokens.append(k2[1])
                kids = e2[1]
            children = tuple(build(k, e) for k, e in sorted(kids.items(), key=_order))
            return TierNode(tuple(tokens), names[mask], key[0], children)

        return TierNode((), "root", None,
                        tuple(build(k, e) for k, e in sorted(trie.items(), key=_order)))

    def snapshot(self) -> tuple:
        """The device tree's snapshot, the host tree's and the host free list, for ``==``."""
        return super().snapshot(), self.host.snapshot(), self.host_pool.snapshot()

    def check_integrity(self) -> None:
        """Both trees' invariants, and every host slot owned exactly once (host free list or
        host tree); no host lock outlives the load or write that took it."""
        super().check_integrity()
        self.host.check_integrity()
        hp = self.host_pool
        free, owned = hp.free_slots(), self.host.all_values()

        def require(cond: bool, what: str) -> None:
            if not cond:
                raise AssertionError(f"host tier invariant broken: {what}")

        require(self.host.protected_size == 0,
                f"{self.host.protected_size} host tokens are still locked")
        require(free.numel() + owned.numel() == hp.capacity,
                f"host free {free.numel()} + host tree {owned.numel()} != host capacity "
                f"{hp.capacity}")
        both = torch.cat([free, owned])
        require(both.unique().numel() == hp.capacity,
                "a host slot is both free and in the host tree, or in it twice")

    def __repr__(self) -> str:
        return (f"HiRadixCache(page_size={self.page_size}, write_policy={self.write_policy!r}, "
                f"device={self.total_size}/{self.pool.capacity}, "
                f"host={self.host_size}/{self.host_capacity})")


def _order(item: tuple) -> tuple:
    (salt, token), _ = item
    return (salt is not None, repr(salt), token)


# ---------------------------------------------------------------- load-back vs recompute


@dataclass(frozen=True)
class LoadBackCost:
    """Seconds to load ``prompt_len`` tokens' K/V back from the host and to recompute them
    by prefill (medians of interleaved repeats), and the ratio per token."""

    prompt_len: int
    load_s: float
    recompute_s: float
    write_s: float
    repeats: int

    @property
    def load_per_token(self) -> float:
        return self.load_s / self.prompt_len

    @property
    def recompute_per_token(self) -> float:
        return self.recompute_s / self.prompt_len

    @property
    def ratio(self) -> float:
        """How many times cheaper a load-back is than recomputing, per token."""
        return self.recompute_s / self.load_s


def measure_load_back(model, prompt_len: int, *, repeats: int = 5, seed: int = 0) -> LoadBackCost:
    """Time, on ``model``'s device, loading ``prompt_len`` tokens' K/V from a ``HostPool``
    into device slots against prefilling the same prompt, in interleaved repeats (medians).

    Also times the write to the host (device -> host), and checks that the loaded K/V
    equals the computed K/V. TierError if ``prompt_len`` or ``repeats`` is not >= 1.
    """
    for name, v in (("prompt_len", prompt_len), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TierError(f"{name} must be a positive int, got {v!r}")
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    ids = torch.randint(0, int(config.vocab_size), (prompt_len,),
                        generator=torch.Generator().manual_seed(seed))
    pool = KVPool.for_model(model, 2 * prompt_len)
    host = HostPool.for_device(pool, prompt_len)
    computed, target = pool.alloc(prompt_len), pool.alloc(prompt_len)
    host_slots = host.alloc(prompt_len)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    forward_paged(model, pool, [PageTable(computed)], [ids])  # warm-up
    loads, recomputes, writes = [], [], []
    for _ in range(repeats):
        recomputes.append(timed(lambda: forward_paged(model, pool, [PageTable(computed)], [ids])))
        writes.append(timed(lambda: copy_kv(pool, computed, host, host_slots)))
        loads.append(timed(lambda: copy_kv(host, host_slots, pool, target)))
    dev_c, dev_t = computed.to(device), target.to(device)
    if not (torch.equal(pool.k[:, dev_c], pool.k[:, dev_t])
            and torch.equal(pool.v[:, dev_c], pool.v[:, dev_t])):
        raise PoolError("loaded K/V differs from the computed K/V")  # pragma: no cover
    return LoadBackCost(prompt_len, statistics.median(loads), statistics.median(recomputes),
                        statistics.median(writes), repeats)
