"""The request lifecycle over a real KV pool: walk-through, misuse, use-after-free, fuzzing."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minirt.cache import RadixCache
from minirt.errors import HandleError, OutOfMemoryError, PoolError, RequestError, StaleHandleError
from minirt.forward import forward_paged
from minirt.lifecycle import (
    Lifecycle,
    check_integrity,
    greedy_reference,
    matched_paths,
    pool_map,
    state_snapshot,
)
from minirt.model import tiny_model
from minirt.pool import KVPool
from minirt.viz import LifecycleState, pool_map_text
from minirt.widgets import lifecycle_stepper, step_index

S = [90, 10, 11, 12]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


def make(model, capacity=8, page_size=1, policy="lru"):
    pool = KVPool.for_model(model, capacity, page_size=page_size)
    return Lifecycle(model, pool, RadixCache(page_size=page_size, policy=policy))


def test_seed_walkthrough(model):
    """The R1/R2 story: R2 must wait while R1 runs, then evicts R1's finished suffix."""
    lc = make(model, capacity=8)
    lc.run(lc.new_request(S, 1, rid="S"))
    assert lc.cache.evictable_size == 4 and lc.pool.free_slots().tolist() == [4, 5, 6, 7]
    r1, r2 = lc.new_request(S + [31, 32], 3, rid="R1"), lc.new_request(S + [41, 42, 43], 2,
                                                                         rid="R2")
    assert lc.match(r1).cached_len == lc.match(r2).cached_len == 4
    assert (r1.uncached_len, r2.uncached_len) == (2, 3)
    lc.lock(r1)
    assert lc.counters()["protected"] == 4 and lc.counters()["evictable"] == 0
    assert lc.allocate(r1).tolist() == [4, 5]
    assert r1.page_table.tolist() == [0, 1, 2, 3, 4, 5]
    before = state_snapshot(lc)
    with pytest.raises(OutOfMemoryError, match="2 free \\+ 0 evictable"):
        lc.admit(r2)
    assert state_snapshot(lc) == before and r2.state == "waiting"
    lc.prefill(r1)
    lc.insert_running(r1)
    assert lc.counters()["protected"] == 6 and r1.cached_len == 6
    while not r1.done:
        lc.decode([r1])
        lc.check_integrity()
    assert r1.page_table.tolist() == list(range(8))
    lc.finish(r1)
    assert lc.counters() == {"free": 0, "evictable": 8, "protected": 0, "private": 0,
                             "capacity": 8}
    lc.admit(r2)  # evicts R1's output leaf, then [31, 32]: the cascade frees 4 >= 3 slots
    assert r2.page_table.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert pool_map_text(pool_map(lc)) == "PPPP222."
    lc.prefill(r2)
    lc.insert_running(r2)
    while not r2.done:
        lc.decode([r2])
    lc.finish(r2)
    lc.check_integrity()
    assert r1.output == greedy_reference(model, S + [31, 32], 3)
    assert r2.output == greedy_reference(model, S + [41, 42, 43], 2)


def test_prefill_logits_equal_plain_prefill(model):
    lc = make(model, capacity=16)
    lc.run(lc.new_request(S, 1))
    r = lc.new_request(S + [31, 32, 33], 1)
    lc.admit(r)
    assert r.reused_len == 4
    logits = lc.prefill(r, all_logits=True)
    ref = model(torch.tensor([S + [31, 32, 33]])).logits[0, 4:]
    torch.testing.assert_close(logits, ref)


def test_page_size_two_frees_unaligned_tail(model):
    lc = make(model, capacity=12, page_size=2)
    r = lc.new_request([5, 6, 7, 8, 9], 2)  # 5 prompt tokens -> 3 pages
    lc.admit(r)
    assert r.private.numel() == 6 and len(r.page_table) == 5
    lc.prefill(r)
    lc.decode([r])  # position 5 fits the unused slot of the third page
    assert r.private.numel() == 6
    lc.finish(r)  # 6 tokens with K/V: all three pages cached, nothing left over
    assert lc.cache.total_size == 6 and lc.pool.num_free == 6
    r2 = lc.new_request(r.tokens[:6].tolist() + [11], 1)
    lc.admit(r2)
    assert r2.reused_len == 6  # matched on prompt[:-1] = 6 tokens, whole pages
    lc.prefill(r2)
    lc.finish(r2)  # 7 tokens: 6 already cached, 1 in a page of its own -> freed
    lc.check_integrity()
    assert lc.pool.num_free == 6 and lc.cache.total_size == 6


def test_batched_decode_matches_reference(model):
    lc = make(model, capacity=40)
    prompts = [S + [1], S + [2, 3, 4], [7, 8]]
    reqs = [lc.new_request(p, 4) for p in prompts]
    for r in reqs:
        lc.admit(r)
        lc.prefill(r)
    while not all(r.done for r in reqs):
        lc.decode([r for r in reqs if not r.done])
        lc.check_integrity()
    for r, p in zip(reqs, prompts, strict=True):
        lc.finish(r)
        assert r.output == greedy_reference(model, p, 4)
    lc.check_integrity()


def test_duplicates_are_freed_after_repointing_no_use_after_free(model):
    """Two requests compute the same prompt; the second's copy is freed when it inserts.

    It keeps decoding afterwards, and a third request is given exactly the freed slots
    and overwrites them. Because the page table was re-pointed at the tree's copy
    first, the second request's output is still the reference.
    """
    prompt = [3, 1, 4, 1, 5, 9]
    lc = make(model, capacity=24)
    a, b = lc.new_request(prompt, 3, rid="A"), lc.new_request(prompt, 3, rid="B")
    lc.admit(a)
    lc.admit(b)  # nothing cached yet: both allocate a private copy
    lc.prefill(a)
    lc.prefill(b)
    lc.insert_running(a)
    b_own = b.page_table.slots.clone()
    lc.insert_running(b)  # the tree already has the prompt: b's copy is a duplicate
    assert torch.equal(b.page_table.slots, a.page_table.slots)
    assert lc.pool.is_free(b_own).all()
    lc.check_integrity()
    c = lc.new_request([60, 61, 62, 63, 64, 65, 66], 1, rid="C")
    lc.admit(c)
    assert set(b_own.tolist()) <= set(c.page_table.tolist())  # the freed slots, reused
    lc.prefill(c)  # overwrites them with other K/V
    while not b.done:
        lc.decode([b])
    assert b.output == greedy_reference(model, prompt, 3)
    lc.check_integrity()


def test_freeing_duplicates_without_repointing_is_caught(model):
    """The bug the ordering prevents, done on purpose: integrity fails, the logits go wrong."""
    prompt = [3, 1, 4, 1, 5, 9]
    lc = make(model, capacity=24)
    a, b = lc.new_request(prompt, 3, rid="A"), lc.new_request(prompt, 3, rid="B")
    for r in (a, b):
        lc.admit(r)
        lc.prefill(r)
    lc.insert_running(a)
    # Buggy insert for b: free the duplicates but leave b's page table pointing at them.
    res = lc.cache.insert_prefix(b.tokens[:b.kv_len], b.page_table.slots[:b.kv_len])
    dup = b.page_table.slots[b.cached_len:res.cached_len]
    lc.pool.free(dup)
    b.private = b.private[res.cached_len - b.cached_len:]
    with pytest.raises(AssertionError, match="page table"):
        lc.check_integrity()
    c = lc.new_request([60, 61, 62, 63, 64, 65, 66], 1, rid="C")
    lc.admit(c)
    lc.prefill(c)  # C's K/V now sits where b's page table still points
    b.page_table.append(lc.pool.alloc(1))
    got = forward_paged(model, lc.pool, [b.page_table], [torch.tensor([b.output[-1]])])[0]
    ref = model(torch.tensor([prompt + b.output])).logits[0, -1]
    assert not torch.allclose(got, ref, atol=1e-3)


def _locked_full(model):
    lc = make(model, capacity=8)
    r = lc.new_request([1, 2, 3, 4, 5, 6], 3, rid="big")
    lc.admit(r)
    lc.prefill(r)
    lc.insert_running(r)
    return lc, r


def test_everything_locked_and_no_room(model):
    lc, r = _locked_full(model)
    other = lc.new_request([9, 9, 9], 1)
    before = state_snapshot(lc)
    with pytest.raises(OutOfMemoryError, match="not enough"):
        lc.admit(other)
    assert state_snapshot(lc) == before
    lc.decode([r])
    lc.decode([r])  # uses the last free slots
    with pytest.raises(OutOfMemoryError):
        lc.make_room(1)
    assert lc.pool.num_free == 0
    lc.check_integrity()


def test_unlock_twice_and_stale_handle(model):
    lc, r = _locked_full(model)
    lc.decode([r])
    lc.decode([r])
    lc.finish(r)
    handle = lc.cache.match_prefix([1, 2, 3, 4, 5, 6]).handle
    lc.cache.lock(handle)
    lc.cache.unlock(handle)
    before = state_snapshot(lc)
    with pytest.raises(HandleError, match="without a matching lock"):
        lc.cache.unlock(handle)
    assert state_snapshot(lc) == before
    lc.make_room(8)  # evicts everything: the handle's node is gone
    before = state_snapshot(lc)
    with pytest.raises(StaleHandleError):
        lc.cache.unlock(handle)
    with pytest.raises(StaleHandleError):
        lc.cache.lock(handle)
    assert state_snapshot(lc) == before
    lc.check_integrity()


@pytest.mark.parametrize(
    "action, error",
    [
        (lambda lc, r: lc.new_request(list(range(9)), 1), RequestError),   # larger than pool
        (lambda lc, r: lc.new_request([1, 2], 8), RequestError),           # with its output
        (lambda lc, r: lc.new_request([], 1), RequestError),
        (lambda lc, r: lc.new_request([1, 128], 1), RequestError),         # not in vocab
        (lambda lc, r: lc.new_request([1, -2], 1), ValueError),
        (lambda lc, r: lc.new_request([1, 2], 0), RequestError),
        (lambda lc, r: lc.new_request([1, 2], 1, rid="big"), RequestError),  # id in use
        (lambda lc, r: lc.admit(r), RequestError),                         # already running
        (lambda lc, r: lc.prefill(r), RequestError),                       # already prefilled
        (lambda lc, r: lc.decode([r, r]), RequestError),
        (lambda lc, r: lc.step([r], []), RequestError),                    # already prefilled
        (lambda lc, r: lc.step([], [r, r]), RequestError),
        (lambda lc, r: lc.pool.free([6]), PoolError),                      # never allocated
        (lambda lc, r: lc.pool.alloc(3), OutOfMemoryError),
        (lambda lc, r: lc.make_room(3), OutOfMemoryError),                 # all locked
    ],
)
def test_bad_input_leaves_everything_unchanged(model, action, error):
    lc, r = _locked_full(model)
    before = state_snapshot(lc)
    with pytest.raises(error):
        action(lc, r)
    assert state_snapshot(lc) == before
    lc.check_integrity()


def test_a_mixed_step_is_checked_whole_before_it_runs(model):
    """``Lifecycle.step`` prefills one request and decodes another in one pass; a request in
    the wrong state, or no slot for a decoding request's next token, raises before anything
    changes. Then the same step runs, and both get the plain model's greedy tokens."""
    lc = make(model, capacity=15)
    r = lc.new_request([1, 2, 3, 4, 5, 6], 3, rid="r")
    lc.admit(r)
    lc.prefill(r)
    lc.insert_running(r)
    s = lc.new_request([7, 8, 9, 10, 11, 12, 13, 14], 2, rid="s")
    lc.admit(s)
    t = lc.new_request([20], 1, rid="t")
    lc.admit(t)  # the last free slot: none left for r's next token
    before = state_snapshot(lc)
    for prefill, decode, error, words in [
            ([s], [s], RequestError, "must be prefilled"), ([r], [], RequestError, "already"),
            ([s], [r], OutOfMemoryError, "decode needs 1 new slots")]:
        with pytest.raises(error, match=words):
            lc.step(prefill, decode)
        assert state_snapshot(lc) == before
    lc.abort(t)
    p_logits, d_logits = lc.step([s], [r])
    assert len(p_logits) == len(d_logits) == 1
    assert s.output == greedy_reference(model, s.prompt.tolist(), 1)
    assert r.output == greedy_reference(model, r.prompt.tolist(), 2)
    lc.check_integrity()


def test_finish_twice_and_decode_before_prefill(model):
    lc = make(model, capacity=16)
    r = lc.new_request([1, 2, 3], 1)
    lc.admit(r)
    before = state_snapshot(lc)
    with pytest.raises(RequestError, match="prefilled"):
        lc.decode([r])
    with pytest.raises(RequestError, match="never prefilled"):
        lc.finish(r)
    assert state_snapshot(lc) == before
    lc.prefill(r)
    lc.finish(r)
    before = state_snapshot(lc)
    with pytest.raises(RequestError, match="finished"):
        lc.finish(r)
    assert state_snapshot(lc) == before


def test_abort_returns_everything(model):
    lc = make(model, capacity=16)
    lc.run(lc.new_request(S, 1))
    r = lc.new_request(S + [5, 6], 2)
    lc.admit(r)
    lc.prefill(r)
    lc.abort(r)
    lc.check_integrity()
    assert lc.pool.num_free == 12 and lc.cache.protected_size == 0


def test_integrity_catches_a_leak_and_a_wrong_ref_count(model):
    lc, r = _locked_full(model)
    lc.pool.alloc(1)  # taken from the free list, owned by nobody
    with pytest.raises(AssertionError, match="capacity"):
        lc.check_integrity()
    lc, r = _locked_full(model)
    r.handle.node.ref_count += 1
    with pytest.raises(AssertionError):
        check_integrity(lc.pool, lc.cache, lc.running)


def test_states_and_stepper_logic(model):
    lc = make(model, capacity=8)
    frames = [LifecycleState.capture(lc, "empty")]
    lc.run(lc.new_request(S, 1, rid="S"))
    frames.append(LifecycleState.capture(lc, "S cached"))
    assert frames[0].counters["free"] == 8 and frames[1].counters["evictable"] == 4
    assert frames[1].pool == ["cached"] * 4 + ["free"] * 4
    assert "digraph" in frames[1].tree_source and "90, 10, 11, 12" in frames[1].tree_source
    assert "[S cached]" in frames[1].text() and "free list [4, 5, 6, 7]" in frames[1].text()
    assert [step_index(0, -1, 2), step_index(0, 1, 2), step_index(1, 1, 2)] == [0, 1, 1]
    widget = lifecycle_stepper(frames)
    back, nxt, title = widget.children[0].children
    assert back.disabled and "1/2: empty" in title.value
    nxt.click()
    assert nxt.disabled and not back.disabled and "2/2: S cached" in title.value
    assert "<svg" in widget.children[3].value and "p0" in widget.children[1].value
    back.click()
    assert "1/2" in title.value


def _bold_nodes(source: str) -> list[str]:
    """Names of the tree nodes (not legend entries) a DOT source draws with the highlight."""
    return re.findall(r"^\s*(n\d+) \[.*color=\"#d62728\"", source, re.M)


def test_match_frame_highlights_the_matched_path(model):
    """The stepper's legend lists "matched path": the frame after match must show one."""
    lc = make(model, capacity=8)
    lc.run(lc.new_request(S, 1, rid="S"))
    r1 = lc.new_request(S + [31, 32], 3, rid="R1")
    before = LifecycleState.capture(lc, "start")
    assert matched_paths(lc) == [] and _bold_nodes(before.tree_source) == []
    lc.match(r1)
    matched = LifecycleState.capture(lc, "match")
    # root and S's node, joined by a highlighted edge; nothing else
    assert [n.key.tolist() for n in matched_paths(lc)] == [[], S]
    assert _bold_nodes(matched.tree_source) == ["n0", "n1"]
    assert re.search(r'n0 -> n1 \[color="#d62728"', matched.tree_source)
    lc.lock(r1)
    locked = LifecycleState.capture(lc, "lock")
    assert _bold_nodes(locked.tree_source) == [], "a locked request's path is drawn protected"


def test_stale_match_is_not_highlighted(model):
    lc = make(model, capacity=8)
    lc.run(lc.new_request(S, 1, rid="S"))
    r1 = lc.new_request(S + [31], 1, rid="R1")
    lc.match(r1)
    lc.cache.evict(4)
    assert matched_paths(lc) == []
    assert _bold_nodes(LifecycleState.capture(lc, "evicted").tree_source) == []


# ---------------------------------------------------------------- stateful fuzzing

PREFIXES = [[], [7, 7], [20, 21, 22, 23], [20, 21, 5]]
_reference_cache: dict[tuple[tuple[int, ...], int], list[int]] = {}
_model64 = tiny_model(0).to(torch.float64)


def _reference(prompt: list[int], n: int) -> list[int]:
    key = (tuple(prompt), n)
    if key not in _reference_cache:
        _reference_cache[key] = greedy_reference(_model64, prompt, n)
    return _reference_cache[key]


class LifecycleMachine(RuleBasedStateMachine):
    """Random new / advance / abort / evict on a small pool; integrity checked after each step.

    ``advance`` moves one request a stage on (admit, prefill with or without an insert,
    a decode step batched with other ready requests, finish), so most runs get requests
    all the way through while others compete for the same small pool.
    """

    @initialize(capacity=st.sampled_from([10, 12, 16]), page_size=st.sampled_from([1, 2]),
                policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, capacity, page_size, policy):
        pool = KVPool.for_model(_model64, capacity, page_size=page_size)
        self.lc = Lifecycle(_model64, pool, RadixCache(page_size=page_size, policy=policy))

    def _unchanged_after_error(self, fn, *errors):
        before = state_snapshot(self.lc)
        try:
            fn()
        except errors:
            assert state_snapshot(self.lc) == before
            event(f"{fn.__name__}: out of memory, state unchanged")
            return False
        return True

    def _active(self):
        return [r for r in self.lc.requests.values() if r.state in ("waiting", "running")]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=3),
          n=st.integers(1, 3), twins=st.booleans())
    def new(self, prefix, suffix, n, twins):
        prompt = prefix + suffix or [1]
        for _ in range(1 + twins):  # twins: the same prompt twice, computed side by side
            def new_request():
                self.lc.new_request(prompt, n)
            self._unchanged_after_error(new_request, RequestError)

    @precondition(lambda self: self._active())
    @rule(data=st.data(), stages=st.integers(1, 4))
    def advance(self, data, stages):
        r = data.draw(st.sampled_from(self._active()))
        for _ in range(stages):
            if r.state not in ("waiting", "running") or not self._stage(r, data):
                break
            self.lc.check_integrity()

    def _stage(self, r, data) -> bool:
        """Move ``r`` one stage on; False if it ran out of memory (and nothing changed)."""
        lc = self.lc
        if r.state == "waiting":
            cached = lc.cache.total_size

            def admit():
                lc.admit(r)
            if not self._unchanged_after_error(admit, OutOfMemoryError):
                return False
            assert all(n.ref_count > 0 for n in _path(r.handle.node))
            event("admit evicted" if lc.cache.total_size < cached else "admit")
        elif not r.output:
            lc.prefill(r)
            if data.draw(st.booleans()):
                free = lc.pool.num_free
                lc.insert_running(r)
                event("insert freed duplicates" if lc.pool.num_free > free else "insert")
        elif not r.done:
            ready = [x for x in lc.running if x.output and not x.done and x is not r]
            others = data.draw(st.lists(st.sampled_from(ready), unique_by=lambda x: x.rid)
                               if ready else st.just([]))

            def decode():
                lc.decode([r] + others)
            if not self._unchanged_after_error(decode, OutOfMemoryError):
                return False
            event(f"decode batch of {1 + len(others)}")
        else:
            free = lc.pool.num_free
            lc.finish(r)
            event("finish freed slots" if lc.pool.num_free > free else "finish")
            assert r.output == _reference(r.prompt.tolist(), r.max_new_tokens)
        return True

    @precondition(lambda self: self.lc.running)
    @rule(data=st.data())
    def abort(self, data):
        self.lc.abort(data.draw(st.sampled_from(self.lc.running)))

    @rule(k=st.integers(0, 12))
    def evict(self, k):
        locked = {id(n) for r in self.lc.running for n in _path(r.handle.node)}

        def make_room():
            self.lc.make_room(k)
        if self._unchanged_after_error(make_room, OutOfMemoryError):
            still = {id(n) for r in self.lc.running for n in _path(r.handle.node)}
            assert locked == still  # no locked node left the tree
            assert self.lc.pool.num_free >= k

    @invariant()
    def integrity(self):
        if hasattr(self, "lc"):
            self.lc.check_integrity()


def _path(node):
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    assert node.is_root()
    return out


LifecycleMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_lifecycle_state_machine = LifecycleMachine.TestCase


def test_a_prompt_prefilled_in_chunks_is_the_prompt_prefilled_at_once(model):
    """Chunks of 3, 2 and the rest, behind a cached prefix and beside a decode: the same
    last-position logits and first token as one prefill, no token before the last chunk,
    and each chunk's K/V written where the whole prefill writes them."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    whole, parts = make(model, capacity=64), make(model, capacity=64)
    for lc in (whole, parts):
        lc.run(lc.new_request(prompt[:4] + [99], 1, rid="warm"))  # caches prompt[:4]
        other = lc.new_request([3, 1, 4], 3, rid="o")
        lc.admit(other)
        lc.prefill(other)
    r = whole.new_request(prompt, 2, rid="r")
    whole.admit(r)
    ref = whole.prefill(r)
    c = parts.new_request(prompt, 2, rid="r")
    parts.admit(c)
    assert c.cached_len == 4
    parts.prefill(c, chunk=3)
    assert (c.kv_len, c.output) == (7, [])
    parts.step([c], [parts.requests["o"]], chunks=[2])  # a mixed step cuts too
    assert (c.kv_len, c.output) == (9, [])
    got = parts.prefill(c)  # the rest (one token)
    assert c.kv_len == len(prompt) and c.output == r.output
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for layer in range(whole.pool.num_layers):
        torch.testing.assert_close(parts.pool.k[layer][c.page_table.slots[4:]],
                                   whole.pool.k[layer][r.page_table.slots[4:]],
                                   rtol=1e-5, atol=1e-5)
    parts.insert_running(c)
    parts.decode([c])
    parts.check_integrity()


def test_a_bad_chunk_changes_nothing_and_a_part_way_request_aborts_cleanly(model):
    lc = make(model, capacity=32)
    r = lc.new_request(list(range(1, 9)), 2, rid="r")
    lc.admit(r)
    before = state_snapshot(lc)
    for bad in (0, 9, -1, True, 2.0):
        with pytest.raises(RequestError, match="chunk"):
            lc.prefill(r, chunk=bad)
    with pytest.raises(RequestError, match="2 chunk sizes for 1"):
        lc.prefill_batch([r], chunks=[1, 2])
    assert state_snapshot(lc) == before
    lc.prefill(r, chunk=5)
    with pytest.raises(RequestError, match="must be prefilled"):
        lc.decode([r])
    with pytest.raises(RequestError, match="never prefilled"):
        lc.finish(r)
    with pytest.raises(RequestError, match="from 1 to the 3"):
        lc.prefill(r, chunk=4)
    lc.check_integrity()
    lc.abort(r)
    assert lc.pool.num_free == 32 and lc.cache.total_size == 0


def test_a_request_keeps_its_own_checked_copy_of_the_prompt(model):
    """The cache is handed ``prompt_ids`` (checked once) and the model reads ``prompt``:
    both come from one copy, so a caller changing its tensor afterwards changes neither,
    and the ids the insert hands the cache are the prompt's, then prompt + output."""
    lc = make(model, capacity=16)
    ids = torch.tensor([5, 6, 7, 8, 9])
    req = lc.new_request(ids, 3, rid="A")
    ids[0] = 1
    assert req.prompt.tolist() == req.prompt_ids.tolist() == [5, 6, 7, 8, 9]
    assert lc.match(req).cached_len == 0
    lc.run(req)
    assert req.cache_ids(4).tolist() == [5, 6, 7, 8]
    assert req.cache_ids(7).tolist() == req.tokens[:7].tolist() and len(req.output) == 3
    assert lc.match(lc.new_request([5, 6, 7, 8, 9, 2], 1, rid="B")).cached_len == 5
