"""Tests of eviction: leaf-only, lock-respecting, policy-ordered, heap == scan, Belady bound."""

from __future__ import annotations

import functools

import pytest
import torch
from cache_model import CacheMachine, assert_invariants, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt.cache import RadixCache
from minirt.errors import OutOfMemoryError, PoolError, RequestError
from minirt.eviction import (
    FIFO,
    LFU,
    LRU,
    EvictionPolicy,
    Priority,
    make_policy,
    pack_key,
)
from minirt.simulate import belady_hit_rate, evict_by_scan, simulate


def build(policy="lru", page_size=1):
    """Six single-token leaves under [1, 2]: [1,2,k] for k in 10..15, slots 100+k."""
    cache = RadixCache(page_size=page_size, policy=policy)
    cache.insert_prefix([1, 2], [0, 1])
    for k in range(10, 16):
        cache.insert_prefix([1, 2, k], [0, 1, 100 + k])
    return cache


def evict_one_by_one(cache):
    order = []
    while cache.evictable_size:
        order.append(cache.evict(1).tolist())
    return order


def test_make_policy():
    assert isinstance(make_policy("lru"), LRU) and isinstance(make_policy("LFU"), LFU)
    assert isinstance(make_policy("fifo"), FIFO) and isinstance(make_policy("priority"), Priority)
    custom = LRU()
    assert make_policy(custom) is custom
    with pytest.raises(ValueError):
        make_policy("mru")


def test_lru_order_and_cascade_to_parent():
    cache = build("lru")
    for k in (13, 11, 15, 10):  # touch these, in this order; 12 and 14 stay oldest
        cache.match_prefix([1, 2, k])
    # the leaves in LRU order, then [1, 2] once its last child is gone
    assert evict_one_by_one(cache) == [[112], [114], [113], [111], [115], [110], [0, 1]]
    assert cache.total_size == 0 and cache.num_nodes == 0
    assert_invariants(cache)


def test_lfu_fifo_priority_orders():
    cache = build("lfu")
    for k, hits in ((10, 3), (11, 1), (12, 2), (13, 1), (14, 0), (15, 2)):
        for _ in range(hits):
            cache.match_prefix([1, 2, k])
    # fewest hits first; equal hits by least recent use (13 was used after 11)
    assert evict_one_by_one(cache)[:6] == [[114], [111], [113], [112], [115], [110]]

    cache = build("fifo")
    for k in (15, 14, 10):
        cache.match_prefix([1, 2, k])  # use does not matter to FIFO
    assert evict_one_by_one(cache)[:6] == [[110], [111], [112], [113], [114], [115]]

    cache = RadixCache(policy="priority")
    cache.insert_prefix([1, 2], [0, 1])
    for k, prio in ((10, 2), (11, 0), (12, 1), (13, 0), (14, 2), (15, 1)):
        cache.insert_prefix([1, 2, k], [0, 1, 100 + k], priority=prio)
    cache.match_prefix([1, 2, 11])  # 13 is now the least recent of the priority-0 leaves
    assert evict_one_by_one(cache)[:6] == [[113], [111], [112], [115], [110], [114]]


def test_evict_never_takes_locked_nodes_or_parents():
    cache = build("lru")
    handle = cache.match_prefix([1, 2, 12]).handle
    cache.lock(handle)
    freed = cache.evict(5).tolist()
    assert sorted(freed) == [110, 111, 113, 114, 115]
    assert cache.total_size == 3 and cache.evictable_size == 0
    before = snapshot(cache)
    with pytest.raises(OutOfMemoryError, match="only 0 are evictable"):
        cache.evict(1)
    assert snapshot(cache) == before
    cache.unlock(handle)
    assert cache.evict(1).tolist() == [112]
    assert cache.evict(1).tolist() == [0, 1]  # the parent, now a leaf


def test_evict_frees_whole_nodes_at_least_as_asked_and_no_more_than_needed():
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    cache.insert_prefix([5, 6], [4, 5])
    freed = cache.evict(1)  # the oldest leaf is the 4-token one: all of it goes
    assert freed.tolist() == [0, 1, 2, 3] and freed.dtype == torch.int64
    assert cache.evict(0).numel() == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(PoolError):
            cache.evict(bad)
    with pytest.raises(OutOfMemoryError, match="cannot evict 3 tokens: only 2"):
        cache.evict(3)
    assert cache.total_size == 2


def test_oom_when_everything_is_locked():
    cache = build("lru")
    handles = [cache.match_prefix([1, 2, k]).handle for k in range(10, 16)]
    for h in handles:
        cache.lock(h)
    before = snapshot(cache)
    with pytest.raises(OutOfMemoryError):
        cache.evict(1)
    assert snapshot(cache) == before


def test_heap_stays_small_and_rebuilds_keep_every_leaf():
    """Each unlock files its leaf again; the heap must rebuild without losing a leaf."""
    twins = []
    for _ in range(2):
        cache = RadixCache()
        handles = [cache.insert_prefix([k, 1], [2 * k, 2 * k + 1]).handle for k in range(100)]
        for round_ in range(20):
            for h in handles[round_ % 3 :: 3]:
                cache.lock(h)
                cache.unlock(h)
            cache.match_prefix([round_ * 5, 1])
            assert len(cache._heap) <= 2 * cache.num_nodes + 64
        assert_invariants(cache)
        twins.append(cache)
    heap_order = [twins[0].evict(1).tolist() for _ in range(100)]
    scan_order = [evict_by_scan(twins[1], 1).tolist() for _ in range(100)]
    assert heap_order == scan_order and twins[0].total_size == 0


def test_evict_with_pages():
    cache = RadixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], list(range(6)))
    cache.insert_prefix([1, 2, 3, 4, 7, 8], [0, 1, 2, 3, 6, 7])
    assert cache.evict(1).tolist() == [4, 5]  # a whole page
    assert cache.evict(3).tolist() == [6, 7, 0, 1, 2, 3]  # cascades: [7,8] then [1,2,3,4]
    assert_invariants(cache)


# ------------------------------------------------------------ heap eviction == full scan

ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "evict"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
        st.integers(0, 2),
    ),
    max_size=40,
)


class MostRecentFirst(EvictionPolicy):
    """A custom policy whose key drops when a node is used (the cache must re-file it)."""

    name = "mru"

    def key(self, node):
        return (-node.last_access, node.id)


@settings(max_examples=200, deadline=None)
@given(
    ops=ops,
    policy=st.sampled_from(["lru", "lfu", "fifo", "priority", MostRecentFirst()]),
    page=st.sampled_from([1, 2]),
)
def test_heap_evicts_in_the_same_order_as_a_full_scan(ops, policy, page):
    caches = [RadixCache(page_size=page, policy=policy) for _ in range(2)]
    for cache, evict in zip(caches, (lambda c, n: c.evict(n), evict_by_scan), strict=True):
        slot = 0
        freed = []
        for op, ids, prio in ops:
            if op == "insert":
                cache.insert_prefix(ids, list(range(slot, slot + len(ids))), priority=prio)
                slot += len(ids)
            elif op == "match":
                cache.match_prefix(ids, priority=prio)
            elif op == "lock":
                cache.lock(cache.match_prefix(ids).handle)
            else:
                n = min(len(ids), cache.evictable_size)
                freed.append(evict(cache, n).tolist())
        while cache.evictable_size:
            freed.append(evict(cache, 1).tolist())
        assert_invariants(cache)
        cache.freed = freed
    assert caches[0].freed == caches[1].freed


# ------------------------------------------------------------ stateful, with eviction


def machine(policy_name: str, page: int):
    return type(
        f"Evict{policy_name.title()}{page}",
        (CacheMachine,),
        {"policy": policy_name, "page_size": page, "with_evict": True},
    )


_settings = settings(max_examples=200, deadline=None, stateful_step_count=40)
TestEvictLRU = machine("lru", 1).TestCase
TestEvictLRU.settings = _settings
TestEvictLFU = machine("lfu", 2).TestCase
TestEvictLFU.settings = _settings
TestEvictFIFO = machine("fifo", 4).TestCase
TestEvictFIFO.settings = _settings
TestEvictPriority = machine("priority", 1).TestCase
TestEvictPriority.settings = _settings


# ------------------------------------------------------------ Belady and simulate


def brute_force_optimum(trace, capacity):
    """Best hit tokens over every sequence of prefix-closed cache states (tiny traces only)."""
    trace = [tuple(r) for r in trace]

    def closed_subsets(tokens):
        tokens = sorted(tokens, key=len)
        out = [frozenset()]
        for p in tokens:  # parents come first, so extend only sets that hold p's parent
            out += [s | {p} for s in out if len(p) == 1 or p[:-1] in s]
        return out

    @functools.cache
    def best(t, state):
        if t == len(trace):
            return 0
        request = trace[t]
        hits = 0
        while hits < len(request) and request[: hits + 1] in state:
            hits += 1
        full = state | {request[:i] for i in range(1, len(request) + 1)}
        return hits + max(
            best(t + 1, s) for s in closed_subsets(full) if len(s) <= capacity
        )

    return best(0, frozenset())


tiny_traces = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=3), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(trace=tiny_traces, extra=st.integers(0, 3))
def test_belady_equals_brute_force_optimum(trace, extra):
    capacity = max(len(r) for r in trace) + extra
    total = sum(len(r) for r in trace)
    assert belady_hit_rate(trace, capacity) == pytest.approx(
        brute_force_optimum(trace, capacity) / total
    )


traces = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=25
)


@settings(max_examples=200, deadline=None)
@given(trace=traces, extra=st.integers(0, 20), page=st.sampled_from([1, 2, 4]))
def test_belady_bounds_every_policy(trace, extra, page):
    capacity = max(len(r) for r in trace) + extra
    bound = belady_hit_rate(trace, capacity)
    for policy in ("lru", "lfu", "fifo", "priority"):
        assert simulate(trace, capacity, policy, page_size=page).hit_rate <= bound + 1e-12


@settings(max_examples=100, deadline=None)
@given(trace=traces)
def test_unbounded_capacity_hits_every_repeated_prefix(trace):
    """With room for everything, each request reuses its longest common prefix with any
    earlier one, for every policy and for Belady."""
    expected = 0
    for t, r in enumerate(trace):
        best = 0
        for earlier in trace[:t]:
            n = 0
            while n < min(len(r), len(earlier)) and r[n] == earlier[n]:
                n += 1
            best = max(best, n)
        expected += best
    total = sum(len(r) for r in trace)
    capacity = total
    assert belady_hit_rate(trace, capacity) == pytest.approx(expected / total)
    for policy in ("lru", "fifo"):
        stats = simulate(trace, capacity, policy)
        assert stats.hit_tokens == expected and stats.query_tokens == total


def test_simulate_small_capacity_and_errors():
    trace = [[1, 2, 3], [4, 5, 6], [1, 2, 3]]
    assert simulate(trace, 6).hit_tokens == 3  # both fit
    assert simulate(trace, 3).hit_tokens == 0  # [1,2,3] was evicted for [4,5,6]
    # the optimum drops [4,5,6] right after computing it (never used again), keeps [1,2,3]
    assert belady_hit_rate(trace, 3) == pytest.approx(3 / 9)
    assert simulate(trace, 5).hit_tokens == 0  # LRU evicts whole leaves: [1,2,3] all goes
    assert simulate([torch.tensor(r) for r in trace], 6, "lfu").hit_tokens == 3
    with pytest.raises(RequestError):
        simulate(trace, 2)
    with pytest.raises(RequestError):
        belady_hit_rate(trace, 2)
    with pytest.raises(PoolError):
        belady_hit_rate(trace, -1)
    assert belady_hit_rate([], 4) == 0.0


def test_custom_policy():
    cache = build(MostRecentFirst())
    cache.match_prefix([1, 2, 12])
    assert cache.evict(1).tolist() == [112]
    assert cache.evict(1).tolist() == [115]  # then the most recently inserted

    class NoId(EvictionPolicy):
        def key(self, node):
            return (node.last_access,)

    with pytest.raises(ValueError, match="end with node.id"):
        RadixCache(policy=NoId()).insert_prefix([1], [0])


def test_keys_raised_behind_the_caches_back_are_refiled():
    """A caller that raises a node's priority directly (no push) still gets policy order."""
    caches = [build("priority"), build("priority")]
    for cache in caches:
        for k in (10, 11, 12):
            cache.root.children[1].children[k].priority = 5
        cache.root.children[1].children[14].last_access = 99
    heap_order = [caches[0].evict(1).tolist() for _ in range(6)]
    scan_order = [evict_by_scan(caches[1], 1).tolist() for _ in range(6)]
    assert heap_order == scan_order == [[113], [115], [114], [110], [111], [112]]
    assert_invariants(caches[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**63 - 1)), min_size=2))
def test_pack_key_keeps_the_order(keys):
    packed = [pack_key(k) for k in keys]
    assert sorted(range(len(keys)), key=lambda i: keys[i]) == sorted(
        range(len(keys)), key=lambda i: packed[i]
    )
    for k, p in zip(keys, packed, strict=True):
        assert (p & (2**64 - 1)) - 2**63 == k[1]


def test_pack_key_rejects_wide_fields():
    for bad in ((2**63, 1), (-(2**63) - 1, 1), (1.5, 1)):
        with pytest.raises((ValueError, TypeError)):
            pack_key(bad)
