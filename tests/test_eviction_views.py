"""The heap's public read-only views (chapter 05a): entries, unpack_key, rebuild_threshold,
RadixCache.leaf_heap, and a heap made without rebuilds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minirt.cache import RadixCache
from minirt.eviction import LRU, LeafHeap, is_evictable_leaf, pack_key, unpack_key

INT64 = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(INT64, min_size=1, max_size=4))
def test_unpack_key_inverts_pack_key(key):
    assert unpack_key(pack_key(tuple(key)), len(key)) == tuple(key)


def test_unpack_key_rejects_what_pack_key_cannot_have_made():
    two = pack_key((5, 7))
    assert unpack_key(two, 2) == (5, 7)
    with pytest.raises(ValueError, match="fields"):
        unpack_key(two, 0)
    with pytest.raises(ValueError, match="1 packed"):
        unpack_key(two, 1)  # a two-field key does not fit in one field
    with pytest.raises(ValueError):
        unpack_key(-1, 2)


def test_entries_are_a_sorted_copy_including_entries_that_no_longer_count():
    cache = RadixCache()  # LRU: entry = (last_access, id)
    x, y = (cache.insert_prefix([t, t], [2 * t, 2 * t + 1]).handle for t in (1, 2))
    heap = cache.leaf_heap
    assert [unpack_key(e, 2) for e in heap.entries()] == [(1, x.node.id), (2, y.node.id)]
    cache.lock(y)  # y no longer counts, but its entry stays until it surfaces
    entries = heap.entries()
    assert len(entries) == len(heap) == 2 and heap.live_nodes() == {x.node.id}
    entries.clear()  # a copy: the heap is unchanged
    assert len(heap.entries()) == 2
    cache.unlock(y)
    cache.check_integrity()


def test_leaf_heap_is_the_heap_the_cache_evicts_from():
    cache = RadixCache()
    for t in range(5):
        cache.insert_prefix([t], [t])
    before = len(cache.leaf_heap)
    cache.evict(1)
    assert len(cache.leaf_heap) == before - 1 and cache.leaf_heap.policy is cache.policy
    cache.reset()
    assert len(cache.leaf_heap) == 0  # reset makes a fresh heap; the property follows it


def test_rebuild_threshold_grows_with_the_heap_and_is_none_without_rebuilds():
    cache = RadixCache()
    assert cache.leaf_heap.rebuild_threshold == 64
    for t in range(200):  # 200 leaves, all live: each rebuild keeps them all
        cache.insert_prefix([t], [t])
        assert len(cache.leaf_heap) <= max(64, cache.leaf_heap.rebuild_threshold)
    assert cache.leaf_heap.rebuild_threshold >= 200
    assert LeafHeap(LRU(), rebuild=False).rebuild_threshold is None


@pytest.mark.parametrize("rebuild", [True, False])
def test_a_heap_mirroring_the_cache_matches_it_and_without_rebuilds_keeps_every_entry(rebuild):
    """A chat: each turn extends the last, so each turn leaves one stale entry behind."""
    cache, mirror, ids = RadixCache(), LeafHeap(LRU(), rebuild=rebuild), []
    for turn in range(150):
        ids.append(turn)
        leaf = cache.insert_prefix(ids, torch.arange(len(ids))).handle.node
        mirror.push(leaf)  # what the cache does for a new leaf
        if rebuild:
            assert mirror.entries() == cache.leaf_heap.entries()
    assert len(mirror) <= 64 if rebuild else len(mirror) == 150  # 149 stale without rebuilds
    assert mirror.live_nodes() == {leaf.id}
    # pops agree with the cache: the one live leaf first, then nothing
    assert mirror.pop() is leaf and is_evictable_leaf(leaf)
    assert mirror.pop() is None and len(mirror) == 0
