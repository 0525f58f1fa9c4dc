"""Tests of minirt.cache: match/insert (page sizes 1 and > 1), handles, lock/unlock, errors."""

from __future__ import annotations

from array import array

import pytest
import torch
from cache_model import CacheMachine, assert_invariants, snapshot
from hypothesis import settings

from minirt.cache import CacheHandle, CacheStats, RadixCache
from minirt.errors import HandleError, InvalidIdsError, RequestError, StaleHandleError
from minirt.radix import as_tokens
from minirt.token_ids import TokenIds, as_ids

A = [101, 11, 12, 21, 22]
B = [101, 11, 12, 31, 32]
C = [101, 11, 99]


def tree_keys(cache: RadixCache) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """Each node's key -> the keys of its children (sorted), to compare tree shapes."""
    out = {}
    stack = [cache.root]
    while stack:
        node = stack.pop()
        kids = sorted(tuple(c.key.tolist()) for c in node.children.values())
        out[tuple(node.key.tolist())] = kids
        stack.extend(node.children.values())
    return out


def test_seed_abc_example():
    cache = RadixCache()
    r = cache.insert_prefix(A, [0, 1, 2, 3, 4])
    assert r.cached_len == 0 and r.indices.tolist() == [0, 1, 2, 3, 4]
    assert tree_keys(cache) == {(): [tuple(A)], tuple(A): []}

    r = cache.insert_prefix(B, [5, 6, 7, 8, 9])
    assert r.cached_len == 3 and r.indices.tolist() == [0, 1, 2, 8, 9]  # caller frees 5, 6, 7
    assert tree_keys(cache) == {
        (): [(101, 11, 12)],
        (101, 11, 12): [(21, 22), (31, 32)],
        (21, 22): [],
        (31, 32): [],
    }

    r = cache.insert_prefix(C, [10, 11, 12])
    assert r.cached_len == 2 and r.indices.tolist() == [0, 1, 12]
    assert tree_keys(cache) == {
        (): [(101, 11)],
        (101, 11): [(12,), (99,)],
        (12,): [(21, 22), (31, 32)],
        (21, 22): [],
        (31, 32): [],
        (99,): [],
    }
    assert cache.num_nodes == 5 and cache.total_size == 8
    assert sorted(cache.all_values().tolist()) == [0, 1, 2, 3, 4, 8, 9, 12]
    # all three share [101, 11]; A and B share [101, 11, 12]
    for ids, expected in ((A, 5), (B, 5), (C, 3), ([101, 11, 5], 2), ([7], 0)):
        assert cache.match_prefix(ids).cached_len == expected
    assert_invariants(cache)


def test_match_may_split_a_node():
    cache = RadixCache()
    cache.insert_prefix(A, [0, 1, 2, 3, 4])
    assert cache.num_nodes == 1
    m = cache.match_prefix([101, 11, 12, 99])
    assert m.cached_len == 3 and m.indices.tolist() == [0, 1, 2]
    assert cache.num_nodes == 2  # split so the handle's node ends exactly at the match
    assert m.handle.node.key.tolist() == [101, 11, 12] and m.handle.cached_len == 3
    assert cache.total_size == 5
    assert_invariants(cache)


def test_match_on_empty_cache_and_empty_query():
    cache = RadixCache()
    m = cache.match_prefix([])
    assert m.cached_len == 0 and m.indices.numel() == 0 and m.handle.node is cache.root
    m = cache.match_prefix([1, 2])
    assert m.cached_len == 0 and m.handle.node is cache.root
    assert cache.stats == CacheStats(queries=2, query_tokens=2, hit_tokens=0)


def test_insert_existing_returns_tree_indices():
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3], [7, 8, 9])
    r = cache.insert_prefix([1, 2, 3], [4, 5, 6])
    assert r.cached_len == 3 and r.indices.tolist() == [7, 8, 9]
    r = cache.insert_prefix([1, 2], [4, 5])  # a strict prefix: split, nothing new
    assert r.cached_len == 2 and r.indices.tolist() == [7, 8] and cache.num_nodes == 2
    assert r.handle.node.key.tolist() == [1, 2]
    assert cache.total_size == 3


def test_page_size_16_reuses_16_of_a_20_token_common_prefix():
    cache = RadixCache(page_size=16)
    common = list(range(1000, 1020))
    first = common + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 32 tokens: 2 pages
    r = cache.insert_prefix(first, list(range(32)))
    assert r.cached_len == 0 and r.handle.cached_len == 32
    second = common + [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    m = cache.match_prefix(second)
    assert m.cached_len == 16 and m.indices.tolist() == list(range(16))
    r = cache.insert_prefix(second, list(range(100, 132)))
    assert r.cached_len == 16 and r.indices.tolist() == list(range(16)) + list(range(116, 132))
    root_child = cache.root.children[tuple(common[:16])]
    assert root_child.length == 16 and sorted(len(c.key) for c in root_child.children.values()) == [
        16,
        16,
    ]
    assert_invariants(cache)


def test_page_alignment_of_insert_and_match():
    cache = RadixCache(page_size=4)
    r = cache.insert_prefix(list(range(10)), list(range(10)))  # 2 whole pages + a tail of 2
    assert r.handle.cached_len == 8 and r.indices.tolist() == list(range(8))
    assert cache.total_size == 8
    assert cache.match_prefix(list(range(7))).cached_len == 4
    assert cache.match_prefix(list(range(3))).cached_len == 0
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).cached_len == 4
    r = cache.insert_prefix([0, 1, 2], [0, 1, 2])  # shorter than a page: nothing to insert
    assert r.cached_len == 0 and r.handle.node is cache.root and r.indices.numel() == 0
    assert_invariants(cache)


def test_inputs_are_converted_and_copied():
    cache = RadixCache()
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    idx = torch.tensor([1, 2, 3], dtype=torch.int16)
    cache.insert_prefix(ids, idx)
    node = cache.root.children[5]
    assert node.key.format == node.value.format == "q"  # int64 views
    ids = torch.tensor([5, 6, 7, 8, 9])
    own = torch.tensor([1, 2, 3, 8, 9], dtype=torch.int64)
    cache.insert_prefix(ids, own)
    own[3], ids[3] = 123, 0  # the caller's tensors change later: the tree keeps its own copy
    assert cache.match_prefix((5, 6, 7, 8, 9)).indices.tolist() == [1, 2, 3, 8, 9]
    import numpy as np

    assert cache.match_prefix(np.array([5, 6])).cached_len == 2
    assert as_ids([]).dtype == torch.int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_indices_are_stored_on_cpu():  # pragma: no cover - runs on GPU machines
    cache = RadixCache()
    ids, idx = torch.tensor([1, 2], device="cuda"), torch.tensor([3, 4], device="cuda")
    r = cache.insert_prefix(ids, idx)
    assert r.indices.device.type == "cpu" and isinstance(cache.root.children[1].value, memoryview)


@pytest.mark.parametrize(
    "ids, indices",
    [
        ([1, -2, 3], [0, 1, 2]),
        ([[1, 2]], [[0, 1]]),
        (torch.tensor([1.0, 2.0]), [0, 1]),
        (torch.tensor([True, False]), [0, 1]),
        ("abc", [0, 1, 2]),
        (torch.tensor(3), [0]),
        ([1, 2, 3], [0, 1]),
        ([1, 2], [0, -1]),
        ([1, 2], [0.5, 1]),
        ([1, 2], None),
        ([2**70], [0]),
    ],
)
def test_bad_input_leaves_tree_unchanged(ids, indices):
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3, 4], [10, 11, 12, 13])
    cache.lock(cache.match_prefix([1, 2]).handle)
    before = snapshot(cache)
    with pytest.raises(InvalidIdsError) as err:
        cache.insert_prefix(ids, indices)
    assert str(err.value)  # a message that says what is wrong
    assert isinstance(err.value, ValueError)
    assert snapshot(cache) == before
    if indices is not None and not (isinstance(ids, list) and len(ids) == 3 and len(indices) == 2):
        if ids != [1, 2]:
            with pytest.raises(InvalidIdsError):
                cache.match_prefix(ids)
    assert snapshot(cache) == before


def test_bad_priority_and_page_size():
    cache = RadixCache()
    with pytest.raises(RequestError):
        cache.match_prefix([1], priority=1.5)
    with pytest.raises(RequestError):
        cache.insert_prefix([1], [1], priority="high")
    assert cache.total_size == 0 and cache.stats.queries == 0
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            RadixCache(page_size=bad)
    with pytest.raises(ValueError):
        RadixCache(policy="random")


def test_hit_statistics():
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    cache.match_prefix([1, 2, 3, 4])  # 4 of 4
    cache.match_prefix([1, 2, 9, 9, 9, 9])  # 2 of 6
    assert cache.stats == CacheStats(queries=2, query_tokens=10, hit_tokens=6)
    assert cache.stats.hit_rate == pytest.approx(0.6)
    cache.reset_stats()
    assert cache.stats.hit_rate == 0.0 and cache.total_size == 4


def test_a_node_keeps_the_highest_priority_that_used_it():
    cache = RadixCache(policy="priority")
    cache.insert_prefix([1, 2, 3], [0, 1, 2], priority=1)
    node = cache.root.children[1]
    cache.match_prefix([1, 2, 3], priority=2)
    cache.match_prefix([1, 2, 3], priority=0)
    cache.insert_prefix([1, 2, 3], [0, 1, 2], priority=0)
    assert node.priority == 2
    cache.match_prefix([1, 2], priority=3)  # splits: only the matched half is raised
    assert node.priority == 2 and cache.root.children[1].priority == 3


def test_last_access_is_a_logical_clock():
    cache = RadixCache()
    cache.insert_prefix([1, 2], [0, 1])
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    leaf = cache.root.children[1].children[3]
    assert (leaf.created, leaf.last_access) == (2, 2)
    cache.match_prefix([1, 2, 3])
    assert leaf.last_access == 3 and leaf.hit_count == 1
    assert cache.root.children[1].last_access == 3 and cache.root.children[1].hit_count == 1


# ---------------------------------------------------------------------- lock and unlock


def test_lock_moves_tokens_from_evictable_to_protected_once_per_node():
    cache = RadixCache()
    for ids, idx in ((A, [0, 1, 2, 3, 4]), (B, [5, 6, 7, 8, 9]), (C, [10, 11, 12])):
        cache.insert_prefix(ids, idx)
    ha = cache.match_prefix(A).handle
    hc = cache.match_prefix(C).handle
    assert cache.size_info.evictable == 8 and cache.size_info.protected == 0
    cache.lock(ha)
    assert (cache.evictable_size, cache.protected_size) == (3, 5)  # [101,11] [12] [21,22]
    cache.lock(ha)  # a second lock of the same path moves nothing
    assert (cache.evictable_size, cache.protected_size) == (3, 5)
    cache.lock(hc)  # only [99] is new
    assert (cache.evictable_size, cache.protected_size) == (2, 6)
    assert cache.root.children[101].ref_count == 3
    cache.unlock(ha)
    assert (cache.evictable_size, cache.protected_size) == (2, 6)
    cache.unlock(ha)
    assert (cache.evictable_size, cache.protected_size) == (5, 3)
    cache.unlock(hc)
    assert (cache.evictable_size, cache.protected_size) == (8, 0)
    assert cache.root.ref_count == 0
    assert_invariants(cache)


def test_split_of_a_locked_node_keeps_the_accounting():
    cache = RadixCache()
    h = cache.insert_prefix(A, [0, 1, 2, 3, 4]).handle
    cache.lock(h)
    m = cache.match_prefix([101, 11, 7])  # splits the locked node at 2
    assert m.handle.node.ref_count == 1 and cache.protected_size == 5
    cache.lock(m.handle)
    cache.unlock(h)
    assert (cache.evictable_size, cache.protected_size) == (3, 2)
    assert_invariants(cache)
    cache.unlock(m.handle)
    assert cache.evictable_size == 5


def test_unlock_without_lock_and_forged_handles():
    cache = RadixCache()
    h = cache.insert_prefix([1, 2, 3], [0, 1, 2]).handle
    before = snapshot(cache)
    with pytest.raises(HandleError):
        cache.unlock(h)
    with pytest.raises(HandleError):
        cache.unlock(CacheHandle(cache.root, 0))
    cache.lock(h)
    inner = cache.match_prefix([1, 2]).handle  # its node is locked through h, but not by it
    before = snapshot(cache)
    with pytest.raises(HandleError):
        cache.unlock(inner)
    with pytest.raises(HandleError):
        cache.lock(CacheHandle(h.node, 2))  # wrong length for its node
    with pytest.raises(HandleError):
        cache.lock("not a handle")
    assert snapshot(cache) == before
    cache.unlock(h)
    with pytest.raises(HandleError):
        cache.unlock(h)


def test_stale_handles_after_evict_reset_or_from_another_cache():
    cache = RadixCache()
    h = cache.insert_prefix([1, 2, 3], [0, 1, 2]).handle
    cache.evict(3)
    with pytest.raises(StaleHandleError):
        cache.lock(h)
    cache.insert_prefix([1, 2, 3], [0, 1, 2])  # same tokens again: a new node, h stays stale
    with pytest.raises(StaleHandleError):
        cache.lock(h)
    h2 = cache.match_prefix([1, 2, 3]).handle
    cache.lock(h2)
    cache.reset()
    with pytest.raises(StaleHandleError):
        cache.unlock(h2)
    with pytest.raises(StaleHandleError):
        cache.lock(CacheHandle(cache.root, 0).__class__(RadixCache().root, 0))
    assert cache.total_size == 0 and cache.num_nodes == 0 and cache.stats.queries == 0
    assert_invariants(cache)


def _abc_child(cache, first):
    return cache.root.children[101].children[first]


CORRUPTIONS = {
    "negative ref_count": lambda c: setattr(c.root.children[101], "ref_count", -1),
    "sizes off": lambda c: setattr(c, "_evictable", 8),
    "wrong child key": lambda c: c.root.children.update({7: c.root.children.pop(101)}),
    "empty node": lambda c: (
        setattr(_abc_child(c, 21), "key", as_tokens([])),
        setattr(_abc_child(c, 21), "value", as_tokens([])),
        setattr(_abc_child(c, 21), "length", 0),
    ),
    "key/value lengths": lambda c: setattr(c.root.children[101], "value", as_tokens([0, 1])),
    "locked under unlocked": lambda c: setattr(_abc_child(c, 31), "ref_count", 1),
    "slot owned twice": lambda c: setattr(_abc_child(c, 31), "value", as_tokens([0, 1])),
    "bad parent pointer": lambda c: setattr(_abc_child(c, 31), "parent", c.root),
    "node count": lambda c: setattr(c, "_num_nodes", 2),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_check_integrity_catches_corruption(corruption):
    cache = RadixCache()
    cache.insert_prefix(A, [0, 1, 2, 3, 4])
    cache.insert_prefix(B, [5, 6, 7, 8, 9])
    cache.check_integrity()
    CORRUPTIONS[corruption](cache)
    with pytest.raises(AssertionError, match="invariant"):
        cache.check_integrity()


# ---------------------------------------------------------------------- stateful property tests


class PageOne(CacheMachine):
    page_size = 1


class PageFour(CacheMachine):
    page_size = 4


TestCachePageOne = PageOne.TestCase
TestCachePageOne.settings = settings(max_examples=200, deadline=None, stateful_step_count=40)
TestCachePageFour = PageFour.TestCase
TestCachePageFour.settings = settings(max_examples=200, deadline=None, stateful_step_count=40)


def test_insert_fresh_numbers_only_the_uncached_whole_pages():
    from minirt.cache import insert_fresh

    cache = RadixCache(page_size=2)
    first, nxt = insert_fresh(cache, [1, 2, 3, 4, 5], 10)
    assert (first.cached_len, nxt, first.indices.tolist()) == (0, 14, [10, 11, 12, 13])
    second, nxt = insert_fresh(cache, [1, 2, 7, 8], nxt)
    assert (second.cached_len, nxt, second.indices.tolist()) == (2, 16, [10, 11, 14, 15])
    cache.check_integrity()


def test_token_ids_are_checked_once_and_taken_as_they_are():
    cache, plain = RadixCache(page_size=2), RadixCache(page_size=2)
    seq = [7, 8, 9, 10, 11]
    ids = TokenIds(torch.tensor(seq))
    assert len(ids) == 5 and ids.tolist() == seq and ids == TokenIds(seq)
    assert ids.tokens.readonly and ids.tokens.format == "q"
    with pytest.raises(AttributeError):
        ids.tokens = memoryview(array("q", [-1]))  # a checked value cannot be swapped
    for c, given in ((cache, ids), (plain, seq)):
        r = c.insert_prefix(given, [0, 1, 2, 3, 4])
        assert (r.cached_len, r.indices.tolist()) == (0, [0, 1, 2, 3])
    assert cache.root.children[(7, 8)].key.obj is ids.tokens.obj  # the tree keeps a view
    assert cache.snapshot() == plain.snapshot()
    m = cache.match_prefix(ids)
    assert (m.cached_len, m.indices.tolist()) == (4, [0, 1, 2, 3])
    assert cache.peek_prefix_len(ids[:3]) == 2 and isinstance(ids[:3], TokenIds)
    assert ids[1:3].tokens.obj is ids.tokens.obj  # a slice copies nothing
    with pytest.raises(TypeError):
        ids[::2]
    assert as_ids(ids).tolist() == seq and TokenIds(ids) == ids
    cache.check_integrity()


@pytest.mark.parametrize("bad", [[1, -2, 3], [[1, 2]], [1.5], torch.tensor([True]),
                                 array("q", [4, -1]), torch.tensor([[1, 2]]), "abc"])
def test_token_ids_reject_what_the_cache_rejects(bad):
    with pytest.raises(InvalidIdsError) as err:
        TokenIds(bad)
    assert isinstance(err.value, ValueError) and str(err.value)


def test_bad_slots_beside_checked_ids_leave_the_cache_unchanged():
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3, 4], [10, 11, 12, 13])
    before = snapshot(cache)
    ids = TokenIds([1, 2, 5, 6])
    for bad in ([0, 1, -2, 3], [0, 1, 2], torch.tensor([0.0, 1.0, 2.0, 3.0]),
                array("q", [0, 1, 2, -3])):
        with pytest.raises(InvalidIdsError):
            cache.insert_prefix(ids, bad)
        assert snapshot(cache) == before
    message = r"indices must be non-negative, got -3 at position 3"
    with pytest.raises(InvalidIdsError, match=message):
        cache.insert_prefix(ids, array("q", [0, 1, 2, -3]))


def test_int64_arrays_are_taken_without_a_tensor():
    cache = RadixCache()
    r = cache.insert_prefix(array("q", [5, 6, 7]), array("q", [0, 1, 2]))
    assert r.indices.tolist() == [0, 1, 2]
    assert cache.match_prefix(array("q", [5, 6, 9])).cached_len == 2
    assert cache.match_prefix(array("i", [5, 6, 7])).cached_len == 3  # other int arrays convert
