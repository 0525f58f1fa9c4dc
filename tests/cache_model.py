"""Test helpers for minirt.cache: a structural snapshot, an independent invariant check,
and a hypothesis state machine that runs RadixCache against a plain reference model.

The reference model is a dict from every cached prefix of whole pages (a tuple of
token ids) to the slots of its last page: the set of inserted sequences with their
indices. A match must return the longest cached page-aligned prefix, with the indices
first inserted for it. Locks are tracked per handle; eviction is checked for what it may do
(only unlocked prefixes, only whole leaves, at least what was asked) rather than which
victim it picks, which tests/test_eviction.py checks separately.
"""

from __future__ import annotations

from array import array
from collections import Counter

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minirt.cache import CacheHandle, RadixCache
from minirt.errors import (
    HandleError,
    InvalidIdsError,
    OutOfMemoryError,
    StaleHandleError,
)
from minirt.token_ids import TokenIds


def snapshot(cache: RadixCache):
    """Everything observable about the tree and its counters, as comparable Python data."""

    def node_state(node):
        return (
            node.id,
            node.key.tolist(),
            node.value.tolist(),
            node.ref_count,
            node.last_access,
            node.hit_count,
            node.created,
            node.priority,
            tuple((k, node_state(c)) for k, c in node.children.items()),
        )

    return (
        node_state(cache.root),
        cache.size_info,
        cache.num_nodes,
        cache.stats,
        cache._tick,
        dict(cache._locks),
    )


def assert_invariants(cache: RadixCache) -> None:
    """Structural invariants, checked here independently of RadixCache.check_integrity."""
    page = cache.page_size
    evictable = protected = 0
    stack = [cache.root]
    assert cache.root.length == 0 and cache.root.parent is None
    while stack:
        node = stack.pop()
        keys = list(node.children)
        assert len(keys) == len(set(keys)), "duplicate child keys"
        firsts = [tuple(c.key[:page].tolist()) for c in node.children.values()]
        assert len(firsts) == len(set(firsts)), "two children share a first page"
        for k, child in node.children.items():
            assert child.parent is node
            assert k == cache.key_fn(child.key), "child not keyed by key_fn"
            if child.ref_count > 0:
                assert node.ref_count > 0, "locked node under an unlocked ancestor"
            stack.append(child)
        assert node.ref_count >= 0, "negative ref_count"
        if node is cache.root:
            continue
        for run in (node.key, node.value):  # int64 views in host memory
            assert isinstance(run, memoryview) and run.format == "q" and run.ndim == 1
        assert len(node.key) == len(node.value) == node.length, "key/value lengths differ"
        assert node.length > 0, "empty non-root node"
        assert node.length % page == 0, "node not page aligned"
        if node.ref_count:
            protected += node.length
        else:
            evictable += node.length
    assert (evictable, protected) == (cache.evictable_size, cache.protected_size)
    assert cache.total_size == evictable + protected
    cache.check_integrity()


def cached_prefixes(cache: RadixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """The tree read back as the reference model: cached page prefix -> its last page's slots."""
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    page = cache.page_size
    stack = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        key, value = node.key.tolist(), node.value.tolist()
        for i in range(0, len(key), page):
            prefix = prefix + tuple(key[i : i + page])
            out[prefix] = tuple(value[i : i + page])
        stack.extend((prefix, c) for c in node.children.values())
    return out


# Requests built from a few chunks that share prefixes of various lengths, plus a short
# random tail, so that matches end at, inside and across page boundaries.
CHUNKS = ([0, 1, 2, 3], [0, 1, 2, 9], [0, 1], [4, 5, 6, 7], [0], [8, 8, 8, 8, 8, 8], [1, 2, 3])
tokens = st.builds(
    lambda chunks, tail: [t for c in chunks for t in c] + tail,
    st.lists(st.sampled_from(CHUNKS), max_size=4),
    st.lists(st.integers(0, 3), max_size=3),
)
bad_ids = st.sampled_from(
    [
        [1, -2, 3],
        [[1, 2], [3, 4]],
        [1.5, 2.0],
        [True, False],
        "abc",
        torch.tensor([1.0, 2.0]),
        torch.tensor([[1, 2]]),
        torch.tensor(3),
        torch.tensor([4, -1]),
        array("q", [4, -1]),
        [2**70],
    ]
)
# The forms a request's ids may take: a list, ids checked once (TokenIds), an int64 array.
id_forms = st.sampled_from([list, TokenIds, lambda ids: array("q", ids)])


class CacheMachine(RuleBasedStateMachine):
    """RadixCache against the reference model; subclasses pick page_size, policy, evict."""

    page_size = 1
    policy = "lru"
    with_evict = False

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(page_size=self.page_size, policy=self.policy)
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.next_slot = 0
        self.handles: list[CacheHandle] = []  # every handle seen, possibly stale
        self.dead: set[CacheHandle] = set()  # handles whose node was evicted or reset
        self.locks: Counter[CacheHandle] = Counter()
        self.ends: dict[CacheHandle, tuple[int, ...]] = {}

    # ---- reference model

    def expected_match(self, ids: list[int]) -> tuple[int, list[int]]:
        n, page, slots = 0, self.page_size, []
        while n + page <= len(ids) and tuple(ids[: n + page]) in self.model:
            n += page
            slots.extend(self.model[tuple(ids[:n])])
        return n, slots

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        out = set()
        for handle in self.locks:
            end = self.ends[handle]
            out.update(end[:i] for i in range(self.page_size, len(end) + 1, self.page_size))
        return out

    def remember(self, handle: CacheHandle, ids: list[int]) -> None:
        self.handles.append(handle)
        self.ends[handle] = tuple(ids[: handle.cached_len])

    # ---- rules

    @rule(ids=tokens, priority=st.integers(0, 2), form=id_forms)
    def match(self, ids, priority, form):
        expected_len, expected_idx = self.expected_match(ids)
        result = self.cache.match_prefix(form(ids), priority=priority)
        assert result.cached_len == expected_len == result.handle.cached_len
        assert result.indices.tolist() == expected_idx
        self.remember(result.handle, ids)

    @rule(ids=tokens, form=id_forms)
    def peek(self, ids, form):
        """The read-only walk: the model's match length, the tree and counters untouched,
        and its node's path plus the depth on its edge is the matched prefix."""
        before = snapshot(self.cache)
        node, depth, length = self.cache.peek_position(form(ids))
        assert self.cache.peek_prefix_len(form(ids)) == length == self.expected_match(ids)[0]
        assert snapshot(self.cache) == before
        assert 0 < depth <= node.length or node is self.cache.root  # the root's length is 0
        above, up = 0, node.parent
        while up is not None:
            above, up = above + up.length, up.parent
        assert above + depth == length

    @rule(ids=tokens, data=st.data(), priority=st.integers(0, 2), form=id_forms)
    def insert(self, ids, data, priority, form):
        own_len, _ = self.expected_match(ids)
        slots = list(range(self.next_slot, self.next_slot + len(ids)))
        self.next_slot += len(ids)
        # sometimes the caller already holds the cached prefix's slots (after a match)
        if data.draw(st.booleans()):
            slots[:own_len] = self.expected_match(ids)[1]
        result = self.cache.insert_prefix(
            form(ids), torch.tensor(slots, dtype=torch.int64), priority=priority
        )
        n = len(ids) - len(ids) % self.page_size
        assert result.cached_len == own_len
        assert result.handle.cached_len == n
        for k in range(own_len + self.page_size, n + 1, self.page_size):
            self.model[tuple(ids[:k])] = tuple(slots[k - self.page_size : k])
        assert result.indices.tolist() == self.expected_match(ids[:n])[1]
        self.remember(result.handle, ids)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def lock(self, data):
        handle = data.draw(st.sampled_from(self.handles))
        if handle in self.dead:
            before = snapshot(self.cache)
            with pytest.raises(StaleHandleError):
                self.cache.lock(handle)
            assert snapshot(self.cache) == before
            return
        self.cache.lock(handle)
        self.locks[handle] += 1

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        handle = data.draw(st.sampled_from(sorted(self.locks, key=lambda h: h.node.id)))
        self.cache.unlock(handle)
        self.locks[handle] -= 1
        if not self.locks[handle]:
            del self.locks[handle]

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unlock_without_lock(self, data):
        handle = data.draw(st.sampled_from(self.handles))
        if self.locks.get(handle):
            return
        before = snapshot(self.cache)
        expected = StaleHandleError if handle in self.dead else HandleError
        with pytest.raises(expected):
            self.cache.unlock(handle)
        assert snapshot(self.cache) == before

    @rule(bad=bad_ids, good=tokens, which=st.sampled_from(["match", "ids", "indices", "lengths"]))
    def bad_input(self, bad, good, which):
        before = snapshot(self.cache)
        with pytest.raises(InvalidIdsError):
            if which == "match":
                self.cache.match_prefix(bad)
            elif which == "ids":
                self.cache.insert_prefix(bad, [0, 1, 2])
            elif which == "indices":
                self.cache.insert_prefix(TokenIds(good[:2] + [0]), bad)  # checked ids, bad slots
            else:
                self.cache.insert_prefix(TokenIds(good + [1]), list(range(len(good) + 2)))
        assert snapshot(self.cache) == before

    @precondition(lambda self: self.with_evict)
    @rule(data=st.data())
    def evict(self, data):
        locked = self.locked_prefixes()
        evictable = (len(self.model) - len(locked)) * self.page_size
        assert self.cache.evictable_size == evictable
        num = data.draw(st.integers(0, evictable + 2))
        if num > evictable:
            before = snapshot(self.cache)
            with pytest.raises(OutOfMemoryError):
                self.cache.evict(num)
            assert snapshot(self.cache) == before
            return
        nodes_before = list(self.cache.nodes())
        freed = self.cache.evict(num).tolist()
        assert len(freed) >= num and len(set(freed)) == len(freed)
        removed = {p for p, slots in self.model.items() if slots[0] in set(freed)}
        assert len(removed) * self.page_size == len(freed), "evict freed slots it did not own"
        assert not removed & locked, "evicted a locked prefix"
        for p in removed:
            del self.model[p]
        for p in self.model:  # what is left is still prefix closed
            assert len(p) == self.page_size or p[: -self.page_size] in self.model
        for handle, end in self.ends.items():
            if end and end not in self.model:
                self.dead.add(handle)
        gone = [n for n in nodes_before if n.parent is None]
        assert sum(n.length for n in gone) == len(freed), "evict removes whole nodes"
        if num:  # no more than needed: before the last victim, fewer than num were freed
            (last,) = [n for n in gone if int(n.value[-1]) == freed[-1]]
            assert len(freed) - last.length < num

    @rule(go=st.integers(0, 3))
    def reset(self, go):
        if go:  # only one draw in four resets, so trees get to grow
            return
        self.cache.reset()
        self.model.clear()
        self.dead.update(self.handles)
        self.locks.clear()

    # ---- invariants after every step

    @invariant()
    def structure(self):
        assert_invariants(self.cache)

    @invariant()
    def agrees_with_model(self):
        assert cached_prefixes(self.cache) == self.model
        locked = self.locked_prefixes()
        assert self.cache.protected_size == len(locked) * self.page_size
        assert self.cache.evictable_size == (len(self.model) - len(locked)) * self.page_size
