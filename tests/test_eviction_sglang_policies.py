"""SLRU and tail-optimized LRU (SGLang's "slru" and "tlru"): settings, orders, the heap
against a reference model of their keys, the scan, Belady, and the request lifecycle."""

from __future__ import annotations

import pytest
from cache_model import CacheMachine, assert_invariants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirt.cache import RadixCache
from minirt.eviction import (
    POLICIES,
    SLRU,
    TLRU,
    is_evictable_leaf,
    make_policy,
    make_policy_from_config,
)
from minirt.simulate import belady_hit_rate, evict_by_scan, simulate


def run(n, start=0):
    return list(range(start, start + n))


def evict_one_by_one(cache):
    order = []
    while cache.evictable_size:
        order.append(cache.evict(1).tolist())
    return order


# ------------------------------------------------------------ names and settings


def test_names_and_settings_as_sglangs_flags():
    assert {"slru", "tlru"} <= set(POLICIES)
    assert isinstance(make_policy("SLRU"), SLRU) and make_policy("slru").protected_threshold == 2
    slru = make_policy_from_config("slru", {"protected_threshold": 4})
    assert slru.protected_threshold == 4 and repr(slru) == "SLRU(protected_threshold=4)"
    tlru = make_policy_from_config("tlru", {"threshold": 4096, "next_prompt_estimate": 512})
    assert (tlru.threshold, tlru.next_prompt_estimate) == (4096, 512)
    assert make_policy_from_config("lru").name == "lru"
    assert TLRU(8).next_prompt_estimate == 0


@pytest.mark.parametrize(("make", "message"), [
    (lambda: make_policy("tlru"), "the defaults: tlru needs settings"),
    (lambda: TLRU(8, 8), "greater than next_prompt_estimate, got 8 <= 8"),
    (lambda: TLRU(4, 9), "got 4 <= 9"),
    (lambda: TLRU(-1), "threshold must be a non-negative int"),
    (lambda: TLRU(8, -2), "next_prompt_estimate must be a non-negative int"),
    (lambda: TLRU(8.0), "threshold must be a non-negative int"),
    (lambda: TLRU(True), "threshold must be a non-negative int"),
    (lambda: SLRU(1), "protected_threshold must be an int >= 2"),
    (lambda: SLRU(2.5), "protected_threshold must be an int >= 2"),
    (lambda: make_policy_from_config("slru", {"threshold": 3}), "unknown setting 'threshold'"),
    (lambda: make_policy_from_config("lru", {"protected_threshold": 3}), "takes no settings"),
    (lambda: make_policy_from_config("tlru", [4, 1]), "config must be a dict"),
    (lambda: make_policy_from_config("mru"), "unknown eviction policy 'mru'"),
])
def test_bad_settings_are_refused_clearly(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_tlru_refuses_a_node_it_was_never_told_about():
    from minirt.radix import RadixNode, token_key

    with pytest.raises(KeyError, match="never announced"):
        TLRU(8).key(RadixNode(token_key, [1], [1]))


# ------------------------------------------------------------ orders


def test_slru_probationary_before_protected_then_lru():
    """SLRU(3): the insert that made a node counts as its first hit (as in SGLang), so a
    node is protected from its second reuse on."""
    cache = RadixCache(policy=SLRU(3))
    cache.insert_prefix([1, 2], [0, 1])
    for k in range(10, 15):
        cache.insert_prefix([1, 2, k], [0, 1, 100 + k])
    for k, hits in ((10, 2), (11, 0), (12, 3), (13, 1), (14, 0)):
        for _ in range(hits):
            cache.match_prefix([1, 2, k])
    cache.match_prefix([1, 2, 14])  # 14: one hit, the most recent use
    # probationary (fewer than 2 reuses) oldest first: 11 (never used since insert), 13,
    # 14; then the protected ones oldest first: 10, 12; then [1, 2], protected too
    assert evict_one_by_one(cache) == [[111], [113], [114], [110], [112], [0, 1]]
    assert_invariants(cache)


def test_tlru_drops_tails_first_and_stops_at_the_budget():
    """threshold 10, next prompt 2: a conversation of L tokens needs its first L - 8.

    B (12 tokens, one node) is the oldest; conversation A grows over four turns to
    19 tokens: nodes [0, 10), [10, 13), [13, 16), [16, 19). A's budget is 11, so the
    nodes starting at 13 and 16 are TEL-safe and go first although they are the newest.
    Then A is not trimmed further: [10, 13) starts at 10 < 11, since L stays 19 after its
    tail went (a resident depth of 13 would make the budget 5 and walk A down to nothing).
    LRU among the rest: B, then A.
    """
    policy = TLRU(threshold=10, next_prompt_estimate=2)
    cache = RadixCache(policy=policy)
    b = run(12, start=1000)
    cache.insert_prefix(b, run(12, start=500))
    a = run(19)
    for end in (10, 13, 16, 19):
        cache.insert_prefix(a[:end], a[:end])
    nodes = {n.key.tolist()[0]: n for n in cache.nodes()}
    assert {k: policy.lens(n) for k, n in nodes.items()} == {
        0: (10, 19), 10: (13, 19), 13: (16, 19), 16: (19, 19), 1000: (12, 12)}
    assert [k for k, n in sorted(nodes.items()) if policy.tel_safe(n)] == [13, 16]
    lru = RadixCache(policy="lru")
    lru.insert_prefix(b, run(12, start=500))
    for end in (10, 13, 16, 19):
        lru.insert_prefix(a[:end], a[:end])
    assert lru.evict(1).tolist() == run(12, start=500)  # LRU: B first
    assert cache.evict(1).tolist() == [16, 17, 18]
    assert cache.evict(1).tolist() == [13, 14, 15]
    assert not policy.tel_safe(nodes[10]) and policy.lens(nodes[10]) == (13, 19)
    assert cache.evict(1).tolist() == run(12, start=500)  # B: older than what A has left
    assert evict_one_by_one(cache) == [[10, 11, 12], run(10)]
    assert policy._lens == {}  # every evicted node forgotten
    assert_invariants(cache)


def test_tlru_a_split_files_the_lower_half_again_and_the_upper_keeps_l():
    """threshold 6: a branch of L = 12 tokens needs its first 6. A match that splits the
    leaf [4, 12) at 8 moves the lower half's start to 8: it turns TEL-safe, its key
    drops, and the heap must see the new key (heap and scan agree). The upper half
    [4, 8) inherits L = 12, so once the tail is gone it is not TEL-safe (start 4 < 6)
    and the older branch C (8 tokens: its first 2 needed) goes before it. A branch of 6
    tokens or fewer would be TEL-safe whole: its next prefill fits the budget anyway."""
    caches = []
    for _ in range(2):
        policy = TLRU(threshold=6, next_prompt_estimate=0)
        cache = RadixCache(policy=policy)
        cache.insert_prefix(run(8, start=50), run(8, start=50))  # C: the oldest
        cache.insert_prefix(run(4), run(4))
        cache.insert_prefix(run(12), run(12))  # [0, 4) and [4, 12)
        cache.match_prefix(run(8))  # split: [4, 8) and [8, 12), which starts at 8 >= 6
        nodes = {n.key.tolist()[0]: n for n in cache.nodes()}
        assert policy.tel_safe(nodes[8]) and policy.lens(nodes[8]) == (12, 12)
        assert not policy.tel_safe(nodes[4]) and policy.lens(nodes[4]) == (8, 12)
        caches.append(cache)
    heap_order = [caches[0].evict(1).tolist() for _ in range(4)]
    scan_order = [evict_by_scan(caches[1], 1).tolist() for _ in range(4)]
    assert heap_order == scan_order == [run(4, 8), run(8, start=50), run(4, 4), run(4)]
    assert_invariants(caches[0])


def test_reset_forgets_the_tracked_nodes():
    policy = TLRU(8)
    cache = RadixCache(policy=policy)
    cache.insert_prefix(run(4), run(4))
    cache.insert_prefix(run(6), run(6))
    assert len(policy._lens) == 2
    cache.reset()
    assert policy._lens == {}
    cache.insert_prefix(run(4), run(4))
    assert list(policy._lens.values()) == [[4, 4]]


# ------------------------------------------------------------ against a reference model


class KeyModel:
    """What SLRU and TLRU keys are made of, kept per cached page prefix (a tuple of ids),
    without nodes: when it was last used (a tick per match or insert), how many matches
    reached it, and the deepest prefix ever inserted through it while it stayed cached."""

    def __init__(self, page: int) -> None:
        self.page, self.tick = page, 0
        self.last: dict[tuple, int] = {}
        self.hits: dict[tuple, int] = {}
        self.deepest: dict[tuple, int] = {}

    def cached_len(self, ids) -> int:
        n = 0
        while n + self.page <= len(ids) and tuple(ids[: n + self.page]) in self.last:
            n += self.page
        return n

    def prefixes(self, ids, lo, hi):
        return [tuple(ids[:i]) for i in range(lo + self.page, hi + 1, self.page)]

    def match(self, ids) -> None:
        self.tick += 1
        for p in self.prefixes(ids, 0, self.cached_len(ids)):
            self.last[p] = self.tick
            self.hits[p] += 1

    def insert(self, ids) -> None:
        self.tick += 1
        n = len(ids) - len(ids) % self.page
        m = self.cached_len(ids[:n])
        for p in self.prefixes(ids, 0, n):
            self.last[p] = self.tick
            self.hits.setdefault(p, 0)
            if m < n:
                self.deepest[p] = max(self.deepest.get(p, 0), n)

    def evicted(self, prefix: tuple, length: int) -> None:
        for i in range(len(prefix) - length + self.page, len(prefix) + 1, self.page):
            p = prefix[:i]
            del self.last[p], self.hits[p], self.deepest[p]

    def key(self, policy, first: tuple) -> tuple:
        """The policy's key for a leaf whose first page ends the prefix ``first``."""
        if isinstance(policy, SLRU):
            return (int(self.hits[first] + 1 >= policy.protected_threshold), self.last[first])
        start = len(first) - self.page
        budget = max(self.deepest[first] + policy.next_prompt_estimate - policy.threshold, 0)
        return (-1 if start >= budget else 0, self.last[first])


def path_of(node) -> tuple:
    parts = []
    while node.parent is not None:
        parts.append(node.key.tolist())
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


# Each op's ids extend an earlier op's (a conversation's next turn) or start afresh, so
# that branches grow deep, as conversations do, and some of their tails turn TEL-safe.
ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "match", "lock", "unlock", "evict",
                         "evict"]),
        st.integers(-1, 8),  # extend the ids of this earlier op (modulo), or none if -1
        st.lists(st.integers(0, 5), min_size=1, max_size=4),
        st.integers(1, 3),
    ),
    min_size=4, max_size=50,
)
policies = st.one_of(
    st.builds(SLRU, st.integers(2, 4)),
    st.integers(0, 4).flatmap(
        lambda est: st.builds(TLRU, st.integers(est + 1, est + 8), st.just(est))),
)


@settings(max_examples=400, deadline=None)
@given(ops=ops, policy=policies, page=st.sampled_from([1, 2]))
def test_each_victim_is_the_reference_models_smallest_key(ops, policy, page):
    cache = RadixCache(page_size=page, policy=policy)
    model = KeyModel(page)
    slot, held, seen = 0, [], []
    for op, base, tail, count in ops:
        ids = (seen[base % len(seen)] if base >= 0 and seen else []) + tail
        seen.append(ids)
        if op == "insert":
            cache.insert_prefix(ids, run(len(ids), slot))
            model.insert(ids)
            slot += len(ids)
        elif op in ("match", "lock"):
            handle = cache.match_prefix(ids).handle
            model.match(ids)
            if op == "lock":
                cache.lock(handle)
                held.append(handle)
        elif op == "unlock" and held:
            cache.unlock(held.pop(count % len(held)))
        elif op == "evict":
            for _ in range(count):
                leaves = [n for n in cache.nodes() if is_evictable_leaf(n)]
                if not leaves:
                    break
                paths = {n.id: path_of(n) for n in leaves}
                victim = min(leaves, key=lambda n: (
                    model.key(policy, paths[n.id][: len(paths[n.id]) - n.length + page]),
                    n.id))
                expected = victim.value.tolist()
                assert cache.evict(1).tolist() == expected
                model.evicted(paths[victim.id], victim.length)
        assert set(model.last) == {
            path_of(n)[:i] for n in cache.nodes()
            for i in range(len(path_of(n)) - n.length + page, len(path_of(n)) + 1, page)}
    assert_invariants(cache)


# ------------------------------------------------------------ scan, Belady, lifecycle


scan_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "evict"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=scan_ops, policy=policies, page=st.sampled_from([1, 2]))
def test_heap_and_scan_evict_alike(ops, policy, page):
    caches = [RadixCache(page_size=page, policy=policy) for _ in range(2)]
    for cache, evict in zip(caches, (lambda c, n: c.evict(n), evict_by_scan), strict=True):
        slot, freed = 0, []
        for op, ids in ops:
            if op == "insert":
                cache.insert_prefix(ids, run(len(ids), slot))
                slot += len(ids)
            elif op == "match":
                cache.match_prefix(ids)
            elif op == "lock":
                cache.lock(cache.match_prefix(ids).handle)
            else:
                freed.append(evict(cache, min(len(ids), cache.evictable_size)).tolist())
        while cache.evictable_size:
            freed.append(evict(cache, 1).tolist())
        assert_invariants(cache)
        cache.freed = freed
    assert caches[0].freed == caches[1].freed


traces = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(trace=traces, extra=st.integers(0, 20), page=st.sampled_from([1, 2, 4]), policy=policies)
def test_belady_bounds_slru_and_tlru(trace, extra, page, policy):
    capacity = max(len(r) for r in trace) + extra
    assert simulate(trace, capacity, policy, page_size=page).hit_rate \
        <= belady_hit_rate(trace, capacity) + 1e-12


def _lifecycle_machine():
    """test_lifecycle's state machine (requests admitted, prefilled, decoded, finished and
    aborted over a small pool, integrity checked after every step) under SLRU and TLRU."""
    from hypothesis.stateful import initialize
    from test_lifecycle import Lifecycle, LifecycleMachine, _model64

    from minirt.pool import KVPool

    class SGLangPolicyLifecycle(LifecycleMachine):
        @initialize(capacity=st.sampled_from([10, 12, 16]), page_size=st.sampled_from([1, 2]),
                    policy=st.sampled_from(["slru", "tlru"]))
        def setup(self, capacity, page_size, policy):
            chosen = SLRU(2) if policy == "slru" else TLRU(threshold=6, next_prompt_estimate=1)
            pool = KVPool.for_model(_model64, capacity, page_size=page_size)
            self.lc = Lifecycle(_model64, pool, RadixCache(page_size=page_size, policy=chosen))

    SGLangPolicyLifecycle.TestCase.settings = settings(
        max_examples=40, deadline=None, stateful_step_count=30,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    return SGLangPolicyLifecycle.TestCase


test_lifecycle_under_slru_and_tlru = pytest.mark.usefixtures("one_thread")(_lifecycle_machine())


# The cache's own state machine (tests/cache_model.py: matches, inserts, locks and
# evictions against a plain model of what is cached), under the two policies.
_machine_settings = settings(max_examples=150, deadline=None, stateful_step_count=40)
TestEvictSLRU = type("EvictSLRU", (CacheMachine,), {
    "policy": SLRU(2), "page_size": 2, "with_evict": True}).TestCase
TestEvictSLRU.settings = _machine_settings
TestEvictTLRU = type("EvictTLRU", (CacheMachine,), {
    "policy": TLRU(threshold=6, next_prompt_estimate=1), "page_size": 1,
    "with_evict": True}).TestCase
TestEvictTLRU.settings = _machine_settings
