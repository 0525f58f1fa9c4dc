"""HashCache (vLLM v1's hashed blocks) against the radix cache and a simple model of itself:
equal hits at page 16, identical greedy outputs through the engine, salts isolate tenants,
ref counts and the free queue after every step, bad input leaves the state unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirt.cache import RadixCache
from minirt.engine import Engine
from minirt.errors import (
    HandleError,
    InvalidIdsError,
    OutOfMemoryError,
    RequestError,
    StaleHandleError,
)
from minirt.hashcache import (
    HashCache,
    block_hashes,
    builtin_hash,
    canonical_bytes,
    serve_trace,
    sha256_hash,
    truncated_sha256,
)
from minirt.lifecycle import greedy_reference
from minirt.request import Request

B = 4  # small blocks keep the property tests quick; the page-16 test uses 16


def ids(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def slots(*pages, b=B):
    return torch.cat([torch.arange(p * b, (p + 1) * b) for p in pages])


# ---------------------------------------------------------------- hashing


def test_chain_names_the_whole_prefix():
    seed = b"s" * 32
    a = block_hashes(list(range(12)), 4, seed)
    b = block_hashes(list(range(8)) + [99, 9, 10, 11], 4, seed)
    c = block_hashes([50, 1, 2, 3] + list(range(4, 12)), 4, seed)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))  # same blocks after another prefix
    assert block_hashes(list(range(11)), 4, seed) == a[:2]  # the partial block has no hash
    assert block_hashes(list(range(12)), 4, b"t" * 32) != a  # the seed reaches every block
    salted = block_hashes(list(range(12)), 4, seed, salt="tenant-a")
    assert all(x != y for x, y in zip(a, salted, strict=True))
    assert block_hashes(list(range(12)), 4, seed, builtin_hash, "x")[0] == builtin_hash(
        (seed, (0, 1, 2, 3), (("cache_salt", "x"),)))


def test_canonical_encoding_is_injective_on_lookalikes():
    pairs = [((1, (2, 3)), ((1, 2), 3)), ("1", 1), (b"ab", "ab"), ((), None), (True, 1),
             ((12, 3), (1, 23))]
    for x, y in pairs:
        assert canonical_bytes(x) != canonical_bytes(y)
    assert sha256_hash((b"p", (1, 2), None)) == sha256_hash((b"p", (1, 2), None))
    with pytest.raises(TypeError, match="cannot encode"):
        canonical_bytes(1.5)
    assert 0 <= truncated_sha256(16)((1,)) < 2**16


# ---------------------------------------------------------------- the block pool


def test_match_lock_unlock_free_queue_and_eviction_order():
    c = HashCache(block_size=B, seed=b"0")
    a = ids(*range(12))
    m = c.match_prefix(a)
    assert m.cached_len == 0 and m.indices.numel() == 0
    res = c.insert_prefix(a, slots(0, 1, 2))
    assert res.cached_len == 0 and c.num_blocks == 3
    assert c.queue_order() == [2, 1, 0]  # inserted tail first: deeper blocks leave first
    c.lock(res.handle)
    assert c.queue_order() == [] and c.protected_size == 12 and c.evictable_size == 0
    c.unlock(res.handle)
    assert c.queue_order() == [2, 1, 0]
    hit = c.match_prefix(ids(*range(8), 77, 78, 79, 80))
    assert hit.cached_len == 8 and hit.indices.tolist() == slots(0, 1).tolist()
    c.lock(hit.handle)  # a hit revives queued blocks
    assert c.queue_order() == [2]
    c.unlock(hit.handle)
    assert c.queue_order() == [2, 1, 0]
    assert c.evict(5).tolist() == slots(2, 1).tolist()  # whole blocks from the head
    assert c.match_prefix(a).cached_len == 4
    c.check_integrity()


def test_no_dedup_and_stale_handles():
    c = HashCache(block_size=B, seed=b"0")
    a = ids(*range(8))
    r1 = c.insert_prefix(a, slots(0, 1))
    r2 = c.insert_prefix(a, slots(5, 6))  # the same blocks computed again elsewhere
    assert r2.cached_len == 0 and c.num_blocks == 4 and c.num_hashes == 2
    assert c.match_prefix(a).indices.tolist() == slots(0, 1).tolist()  # the first one wins
    c.lock(r2.handle)
    c.evict(8)
    with pytest.raises(StaleHandleError):
        c.lock(r1.handle)
    assert c.match_prefix(a).indices.tolist() == slots(5, 6).tolist()
    c.unlock(r2.handle)
    with pytest.raises(HandleError, match="without a matching lock"):
        c.unlock(r2.handle)
    c.check_integrity()


def test_bad_input_clear_error_state_unchanged():
    c = HashCache(block_size=B, seed=b"0")
    res = c.insert_prefix(ids(*range(8)), slots(0, 1))
    c.lock(res.handle)
    before = c.snapshot()
    bad = [
        (lambda: c.match_prefix(ids(1, 2), salt=5), RequestError, "salt"),
        (lambda: c.insert_prefix(ids(1, 2, 3, 4), slots(3), salt=""), RequestError, "salt"),
        (lambda: c.insert_prefix(ids(*range(8)), slots(3)), InvalidIdsError, "same length"),
        (lambda: c.insert_prefix(ids(9, 9, 9, 9), torch.arange(1, 5)), InvalidIdsError,
         "whole pool page"),
        (lambda: c.insert_prefix(ids(9, 9, 9, 9), slots(0)), InvalidIdsError, "already holds"),
        (lambda: c.insert_prefix(ids(9, 9, 9, 9, 8, 8, 8, 8), slots(3, 3)), InvalidIdsError,
         "already holds"),
        (lambda: c.match_prefix(ids(-1, 2)), InvalidIdsError, "non-negative"),
        (lambda: c.evict(1), OutOfMemoryError, "evictable"),
        (lambda: c.unlock("handle"), HandleError, "HashHandle"),
    ]
    for call, exc, words in bad:
        with pytest.raises(exc, match=words):
            call()
        assert c.snapshot() == before
    c.check_integrity()
    for bs in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="block_size"):
            HashCache(block_size=bs)
    with pytest.raises(ValueError, match="hash_fn"):
        HashCache(hash_fn="md5")


# ---------------------------------------------------------------- against the radix cache


@st.composite
def traces(draw, vocab=6, max_len=40):
    stems = draw(st.lists(st.lists(st.integers(0, vocab), min_size=1, max_size=max_len),
                          min_size=1, max_size=4))
    out = []
    for _ in range(draw(st.integers(1, 10))):
        stem = draw(st.sampled_from(stems))
        out.append(stem[:draw(st.integers(1, len(stem)))]
                   + draw(st.lists(st.integers(0, vocab), max_size=20)))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(vocab=3, max_len=70), st.sampled_from(["sha256", "builtin"]))
def test_hash_hits_equal_radix_page16_hits_when_nothing_evicts(trace, hash_fn):
    big = 16 * 64
    radix = serve_trace(RadixCache(page_size=16), trace, big, check=True)
    hashed = serve_trace(HashCache(16, hash_fn), trace, big, check=True)
    assert hashed.evicted_tokens == radix.evicted_tokens == 0
    assert hashed.cached_tokens == radix.cached_tokens
    assert hashed.prompt_tokens == radix.prompt_tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(0, 12))
def test_invariants_after_every_request_with_evictions(trace, extra_pages):
    need = max(-(-len(t) // B) for t in trace)
    stats = serve_trace(HashCache(B), trace, (need + extra_pages) * B, check=True)
    assert 0 <= stats.cached_tokens <= stats.prompt_tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.lists(st.sampled_from(["a", b"a", "b", None]), min_size=10, max_size=10),
       st.sampled_from([1, B]))
def test_salted_tenants_never_share_a_block_or_node(trace, tenants, page):
    """Served together with salts, each tenant hits exactly what it would hit alone."""
    salts = tenants[:len(trace)]
    for make in (lambda: HashCache(page), lambda: RadixCache(page_size=page)):
        together = serve_trace(make(), trace, 10_000, salts=salts, check=True)
        alone = 0
        for tenant in set(salts):
            mine = [t for t, s in zip(trace, salts, strict=True) if s == tenant]
            alone += serve_trace(make(), mine, 10_000).cached_tokens
        assert together.evicted_tokens == 0 and together.cached_tokens == alone
    solo = serve_trace(HashCache(page), trace, 10_000, salts=[f"t{i}" for i in range(len(trace))])
    assert solo.cached_tokens == 0


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(vocab=127, max_len=12), st.integers(0, 16), st.sampled_from([1, 2, 4]))
def test_engine_outputs_identical_with_either_cache(model, trace, slack, page):
    torch.set_num_threads(1)
    batch = [Request(prompt=p, max_new_tokens=3, stop_on_eos=False) for p in trace]
    need = max(-(-(len(p) + 2) // page) * page for p in trace)
    outs = {}
    for kind in ("radix", "hash"):
        engine = Engine(model, capacity=need + slack * page, page_size=page, cache=kind,
                        check=True)
        outs[kind] = [engine.generate(batch, progress=False).outputs for _ in range(2)]
        assert engine.pool.num_free + engine.cache.evictable_size == engine.pool.capacity
    expected = [greedy_reference(model, p, 3) for p in trace]
    assert outs["radix"] == outs["hash"] == [expected, expected]


def test_engine_hash_cache_hits_and_salts(model):
    stem = list(range(1, 33))
    prompts = [stem + [40, 41], stem + [50, 51, 52]]
    e = Engine(model, capacity=256, page_size=16, cache="hash", check=True)
    t = e.generate([Request(prompt=p, max_new_tokens=2, stop_on_eos=False)
                    for p in prompts], progress=False).totals
    assert t.cached_tokens == 32  # the second prompt hits both full blocks of the stem
    salted = e.generate([Request(prompt=prompts[0], max_new_tokens=2, cache_salt="other")],
                        progress=False)
    assert salted.totals.cached_tokens == 0
    bad = e.generate([Request(prompt=prompts[0], cache_salt=3)], progress=False)
    assert not bad[0].ok and "salt" in str(bad[0].error)
    with pytest.raises(ValueError, match="radix cache only"):
        Engine(model, cache="hash", policy="lfu")
    with pytest.raises(ValueError, match="'radix', 'hash' or 'window'"):
        Engine(model, cache="tree")


# ---------------------------------------------------------------- attack statistics


def test_mann_whitney_matches_exact_permutation_test_and_chance_interval():
    import itertools
    import random

    from minirt.sidechannel import chance_interval, mann_whitney_p

    def exact(x, y):  # P(U' >= U_obs) over all splits, U' counting x-before-y pairs
        def u(xs, ys):
            return sum((a < b) + 0.5 * (a == b) for a in xs for b in ys)
        pooled, obs = x + y, u(x, y)
        splits = list(itertools.combinations(range(len(pooled)), len(x)))
        hits = sum(u([pooled[i] for i in c], [pooled[i] for i in range(len(pooled))
                                               if i not in c]) >= obs for c in splits)
        return hits / len(splits)

    rng = random.Random(3)
    for shift in (0.0, 0.8, 2.0):
        x = [rng.gauss(0, 1) for _ in range(7)]
        y = [rng.gauss(shift, 1) for _ in range(8)]
        assert abs(mann_whitney_p(x, y) - exact(x, y)) < 0.03
    assert mann_whitney_p([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]) < 0.001
    with pytest.raises(ValueError):
        mann_whitney_p([], [1.0])
    lo, hi = chance_interval(10, 4)
    assert (lo, hi) == (0.0, 0.5)  # Binomial(10, 1/4): P(X > 5) ~ 0.020, P(X >= 5) ~ 0.078
    lo, hi = chance_interval(40, 4)
    assert lo < 0.25 < hi and (lo, hi) == (0.125, 0.4)


# ---------------------------------------------------------------- no orphans under the request life


def orphans(present: set, chains) -> list[tuple[int, int]]:
    """(chain, block) pairs where a block's hash is cached and its parent's is not."""
    return [(c, i) for c, hashes in enumerate(chains) for i in range(1, len(hashes))
            if hashes[i] in present and hashes[i - 1] not in present]


def test_orphan_detector_sees_a_missing_parent():
    assert orphans({"h1", "h2"}, [["h0", "h1", "h2"]]) == [(0, 1)]
    assert orphans({"h0", "h1"}, [["h0", "h1", "h2"]]) == []


def test_free_queue_never_orphans_a_block_under_the_request_life():
    """Concurrent requests through the public API (match prompt[:-1], lock, evict when the
    free list is short, insert, lock the insert, unlock the match; unlock at finish): after
    every eviction, every cached block's parent is cached too. Chapter 08 claims this."""
    total = sum(_orphan_fuzz_run(run) for run in range(150))
    assert total > 300  # the runs really evicted, many times


def _orphan_fuzz_run(run: int) -> int:
    """One random run; returns how many evictions it made."""
    import random

    rng = random.Random(run)
    bs = 2
    cache = HashCache(bs, seed=b"fuzz")
    free = list(range(24))  # 24 slots = 12 blocks
    stems = [[rng.randrange(4) for _ in range(rng.choice([2, 4, 6]))] for _ in range(3)]
    seen: list[list[int]] = []
    held: list = []
    evictions = 0
    for _ in range(60):
        if held and (rng.random() < 0.45 or len(held) >= 3):
            cache.unlock(held.pop(rng.randrange(len(held))))
            continue
        prompt = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.choice([2, 4]))]
        m = cache.match_prefix(prompt[:-1])
        cache.lock(m.handle)
        need = len(prompt) - m.cached_len
        if len(free) < need:
            try:
                free += cache.evict(need - len(free)).tolist()
            except OutOfMemoryError:
                cache.unlock(m.handle)
                continue
            evictions += 1
            present = {b.block_hash for b in cache.units()}
            assert not orphans(present, [cache.hashes(p) for p in seen]), (run, seen)
        slots, free = free[:need], free[need:]
        r = cache.insert_prefix(prompt, torch.cat([m.indices, torch.tensor(slots)]))
        cache.lock(r.handle)
        cache.unlock(m.handle)
        held.append(r.handle)
        seen.append(prompt)
    cache.check_integrity()
    return evictions
