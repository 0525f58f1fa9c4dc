"""Prefix caches that report what they store and evict, as vLLM's block pool does.

``EventRadixCache`` (chapter 3's tree, page-aligned) and ``EventHashCache`` (chapter
08's block hashes) are the two caches with one addition each: every path that changes
which full blocks the cache holds appends a KV cache event (``minirt.kv_events``) to
``kv_event_queue``, and ``take_events`` hands the queue over, as vllm 0.32.0
`v1/core/block_pool.py: BlockPool.take_events` does for the scheduler:

* a new leaf / new blocks: one ``BlockStored`` for the blocks the call added, with the
  hash of the block before them as ``parent_block_hash`` (None at the prompt's start),
  their token ids, ``block_size`` = the page size, ``extra_keys`` one entry per block
  (the salt on the first block, else None) and ``group_idx`` 0, as
  vllm 0.32.0 `v1/core/block_pool.py: BlockPool.cache_full_blocks` builds it;
* an evicted leaf / block: one ``BlockRemoved`` per block
  (vllm 0.32.0 `v1/core/block_pool.py: BlockPool._emit_block_removed_events`);
* ``reset``: ``AllBlocksCleared``
  (vllm 0.32.0 `v1/core/block_pool.py: BlockPool.reset_prefix_cache`).

The hashes are vLLM's (``kv_events.vllm_block_hashes``: SHA-256 of the pickled block,
``NONE_HASH`` first), sent as their low 64 bits, so one router reads vLLM's servers and
minirt's alike. A radix node holds tokens, not hashes: the tree hashes the path from the
root when a leaf comes or goes, with a memo of recent block hashes so that a long shared
prefix is hashed once. Splits and matches change no block and say nothing.

The host tier (chapter 09's ``HiRadixCache``) does not publish yet: it is another
subclass of ``RadixCache`` with a second tree for host memory, and ``use_event_cache``
refuses an engine that has one. Publishing it would mean device events as here plus the
host tree's stores and evictions with ``medium`` "CPU", as vLLM's CPU offloading does
(vllm 0.32.0 `v1/simple_kv_offload/manager.py: SimpleCPUOffloadScheduler`, its
``kv_event_medium``); the precise router indexes device blocks only, so a host hit
would count for nothing in its decisions either way.

``use_event_cache(engine)`` puts an event cache into a fresh ``Engine`` in place of the
one it built; ``publish_engine_events(engine, config)`` also starts a publisher from a
``--kv-events-config`` (``kv_events.parse_kv_events_config``) and sends each engine
step's events as one batch, as vLLM's scheduler does once per step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .cache import InsertResult, RadixCache, Salt
from .errors import RequestError
from .hashcache import HashCache, HashHandle
from .hashcache import block_hashes as chained_block_hashes
from .kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    ZmqEventPublisher,
    external_block_hash,
    none_hash,
    vllm_sha256,
)
from .radix import RadixNode

__all__ = ["EventHashCache", "EventRadixCache", "cached_vllm_sha256", "publish_engine_events",
           "use_event_cache"]

cached_vllm_sha256 = functools.lru_cache(maxsize=1 << 16)(vllm_sha256)
"""``vllm_sha256`` with a memo of the last 65,536 blocks (a block is a hashable tuple)."""


def _stored(hashes: Sequence[bytes], parent: bytes | None, tokens: list[int], block_size: int,
            salt: Salt, first_index: int, medium: str | None) -> BlockStored:
    keys: list[tuple[Any, ...] | None] = [None] * len(hashes)
    if salt is not None and first_index == 0:
        keys[0] = (salt,)  # vLLM publishes extra keys untagged: the bare salt
    return BlockStored(block_hashes=[external_block_hash(h) for h in hashes],
                       parent_block_hash=None if parent is None else external_block_hash(parent),
                       token_ids=tokens, block_size=block_size, lora_id=None, medium=medium,
                       lora_name=None, extra_keys=keys, group_idx=0)


def _removed(block_hash: bytes, medium: str | None) -> BlockRemoved:
    return BlockRemoved(block_hashes=[external_block_hash(block_hash)], medium=medium,
                        group_idx=0)


class EventRadixCache(RadixCache):
    """A ``RadixCache`` that queues KV cache events (see the module). ``seed``: the
    ``NONE_HASH`` seed (None: vLLM's, ``PYTHONHASHSEED`` or "vllm-none-hash")."""

    def __init__(self, page_size: int = 16, policy: Any = "lru", *, medium: str = MEDIUM_GPU,
                 seed: str | None = None) -> None:
        self.kv_event_queue: list[KVCacheEvent] = []
        self.medium = medium
        self.none_hash = none_hash(seed)
        super().__init__(page_size=page_size, policy=policy)

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first; the queue is emptied."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def path_hashes(self, node: RadixNode) -> tuple[list[bytes], list[int], Salt]:
        """The vLLM block hashes of the prefix ending at ``node``, its tokens, its salt."""
        parts = []
        walk: RadixNode | None = node
        while walk is not None and walk.parent is not None:
            parts.append(walk.key)
            walk = walk.parent
        tokens = [int(t) for part in reversed(parts) for t in part]
        salt = getattr(node.key_fn, "salt", None)
        hashes = chained_block_hashes(tokens, self.page_size, self.none_hash,
                                      cached_vllm_sha256, salt)
        return [bytes(h) for h in hashes], tokens, salt

    def _add_leaf(self, parent: RadixNode, key, value, priority: int, salt: Salt) -> RadixNode:
        leaf = super()._add_leaf(parent, key, value, priority, salt)
        hashes, tokens, salt = self.path_hashes(leaf)
        n = leaf.length // self.page_size
        first = len(hashes) - n
        self.kv_event_queue.append(_stored(
            hashes[first:], hashes[first - 1] if first else None, tokens[first * self.page_size:],
            self.page_size, salt, first, self.medium))
        return leaf

    def _remove_leaf(self, node: RadixNode) -> None:
        hashes, _, _ = self.path_hashes(node)
        super()._remove_leaf(node)
        n = node.length // self.page_size
        for h in hashes[len(hashes) - n:]:
            self.kv_event_queue.append(_removed(h, self.medium))

    def reset(self) -> None:
        if getattr(self, "root", None) is not None:  # not the first reset, in __init__
            self.kv_event_queue.append(AllBlocksCleared())
        super().reset()


class EventHashCache(HashCache):
    """A ``HashCache`` with vLLM's hash function and ``NONE_HASH`` that queues KV cache
    events (see the module)."""

    def __init__(self, block_size: int = 16, *, medium: str = MEDIUM_GPU,
                 seed: str | None = None) -> None:
        self.kv_event_queue: list[KVCacheEvent] = []
        self.medium = medium
        super().__init__(block_size=block_size, hash_fn=cached_vllm_sha256, seed=none_hash(seed))

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first; the queue is emptied."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def insert_prefix(self, ids, indices, *, priority: int = 0,
                      salt: Salt = None) -> InsertResult:
        before = set(self._blocks)
        result = super().insert_prefix(ids, indices, priority=priority, salt=salt)
        handle: HashHandle = result.handle
        blocks = handle.blocks
        first = next((i for i, b in enumerate(blocks) if b.block_id not in before), None)
        if first is not None:  # the new blocks follow the leading run already cached
            new = blocks[first:]
            self.kv_event_queue.append(_stored(
                [b.block_hash for b in new], blocks[first - 1].block_hash if first else None,
                [t for b in new for t in b.tokens], self.block_size, salt, first, self.medium))
        return result

    def evict(self, num_tokens: int) -> torch.Tensor:
        queued = list(self.free_queue.values())
        slots = super().evict(num_tokens)
        for block in queued:
            if not block.cached:
                self.kv_event_queue.append(_removed(block.block_hash, self.medium))
        return slots

    def reset(self) -> None:
        if hasattr(self, "_blocks"):  # not the first reset, in __init__
            self.kv_event_queue.append(AllBlocksCleared())
        super().reset()


def use_event_cache(engine) -> EventRadixCache | EventHashCache:
    """Give a fresh ``Engine`` (radix or hash cache, no host tier, nothing cached yet) an
    event cache of the same kind and page size in place of its own; returns it."""
    old = engine.cache
    if getattr(engine, "host_tier", None) is not None or getattr(engine, "windowed", False):
        raise RequestError("KV events need the engine's plain radix or hash cache "
                           "(no host tier, no window cache)")
    if old.total_size:
        raise RequestError(f"the engine's cache already holds {old.total_size} tokens; "
                           "swap it before serving")
    if type(old) is RadixCache:
        new: EventRadixCache | EventHashCache = EventRadixCache(old.page_size, old.policy)
    elif type(old) is HashCache:
        new = EventHashCache(old.block_size)
    else:
        raise RequestError(f"no event version of {type(old).__name__}")
    engine.cache = engine.lifecycle.cache = new
    return new


def publish_engine_events(engine, config: dict[str, Any]) -> ZmqEventPublisher | None:
    """Give a fresh ``engine`` an event cache and a publisher for ``config`` (a parsed
    ``--kv-events-config``); after every ``engine.step()`` the step's events go out as
    one batch. None, and nothing changed, when the config's publisher is "null"."""
    if config["publisher"] == "null":
        return None
    use_event_cache(engine)
    publisher = ZmqEventPublisher(config["endpoint"], config["replay_endpoint"],
                                  buffer_steps=config["buffer_steps"], hwm=config["hwm"],
                                  topic=config["topic"])
    step = engine.step

    def step_and_publish(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        finally:  # a step that raised may still have changed the cache
            publisher.publish_events(engine.cache.take_events())

    engine.step = step_and_publish
    return publisher
