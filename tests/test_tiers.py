"""The host-memory tier (minirt.tiers): what each write policy stores against a reference
model, K/V moved intact between tiers, integrity of both tiers after every step, greedy
outputs identical with and without the tier, and bad settings rejected with nothing changed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minirt.engine import Engine
from minirt.errors import (
    InvalidIdsError,
    MinirtError,
    OutOfMemoryError,
    PoolError,
    StaleHandleError,
    TierError,
)
from minirt.lifecycle import greedy_reference
from minirt.model import tiny_model
from minirt.pool import KVPool
from minirt.request import Request
from minirt.tiers import (
    WRITE_POLICIES,
    HiRadixCache,
    HostPool,
    TierMatchResult,
    check_tier_settings,
    copy_kv,
    measure_load_back,
    slot_runs,
)
from minirt.viz import draw_tier_tree, tier_tree_text

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- a cache over a toy pool


def sig(prefix: tuple) -> float:
    """The K value a token's slot must hold: a function of its whole prefix (exact in fp64)."""
    return float(hash(prefix) % (1 << 50))


def toy_cache(capacity: int, host_capacity: int, policy: str, threshold: int = 1,
              page_size: int = 1) -> HiRadixCache:
    pool = KVPool(1, 1, 1, capacity, page_size, dtype=torch.float64)
    return HiRadixCache(pool, host_capacity, write_policy=policy,
                        write_through_threshold=threshold)


def serve(cache: HiRadixCache, ids: list[int]) -> tuple[TierMatchResult, bool]:
    """One request without a model: match (loading back), compute the gap's K/V as ``sig``
    of each prefix, insert, unlock. Returns the match and whether the request fit."""
    m = cache.match_prefix(ids)
    n = len(ids) - len(ids) % cache.page_size
    gap = n - m.cached_len
    cache.lock(m.handle)
    try:
        if gap > cache.pool.num_free + cache.evictable_size:
            return m, False
        cache.make_room(gap)
        slots = cache.pool.alloc(gap)
        for i, s in enumerate(slots.tolist()):
            value = sig(tuple(ids[: m.cached_len + i + 1]))
            cache.pool.k[0, s] = value
            cache.pool.v[0, s] = -value
        res = cache.insert_prefix(ids[:n], torch.cat([m.indices, slots]))
        assert res.cached_len == m.cached_len
    finally:
        cache.unlock(m.handle)
    return m, True


def tokens_of(tree_snapshot: tuple) -> dict[tuple, int]:
    """{prefix: slot} of every token in a RadixCache snapshot (unsalted)."""
    return {prefix: slot for _salt, prefix, slot, _ref in tree_snapshot[0]}


def device_tokens(cache: HiRadixCache) -> dict[tuple, int]:
    return tokens_of(cache.snapshot()[0])


def host_tokens(cache: HiRadixCache) -> dict[tuple, int]:
    return tokens_of(cache.host.snapshot())


def closure(prefixes) -> set[tuple]:
    """Every prefix of every given prefix (a tier always holds whole prefixes)."""
    return {p[:i] for p in prefixes for i in range(1, len(p) + 1)}


def check_all(cache: HiRadixCache) -> None:
    """Both trees' invariants, every device slot owned once, and every K/V where it should be."""
    cache.check_integrity()
    pool = cache.pool
    owned = cache.all_values()
    assert owned.numel() + pool.num_free == pool.capacity
    assert torch.cat([owned, pool.free_slots()]).unique().numel() == pool.capacity
    for store, toks in ((pool, device_tokens(cache)), (cache.host_pool, host_tokens(cache))):
        for prefix, slot in toks.items():
            assert store.k[0, slot, 0, 0].item() == sig(prefix), (prefix, store)
            assert store.v[0, slot, 0, 0].item() == -sig(prefix)


# ---------------------------------------------------------------- reference model

ops = st.lists(
    st.one_of(
        st.tuples(st.just("req"), st.sampled_from([[1, 2, 3], [1, 2, 4], [5, 6], [1, 2]]),
                  st.lists(st.integers(0, 4), max_size=4)),
        st.tuples(st.just("evict"), st.integers(1, 12), st.just([])),
    ),
    min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(WRITE_POLICIES), st.integers(1, 3), st.integers(4, 16))
def test_each_policy_stores_what_the_reference_says(script, policy, threshold, capacity):
    """A host too large to evict: write_back holds exactly every prefix the device ever
    evicted; write_through every prefix ever inserted; selective every matched prefix
    whose tokens were hit ``threshold`` times while on the device. K/V intact in both
    tiers; a match returns the longer of the device and host prefixes."""
    cache = toy_cache(capacity, 1024, policy, threshold)
    expected: set[tuple] = set()
    hits: dict[tuple, int] = {}  # device tokens -> prefix hits since they entered the device
    for op, a, b in script:
        before = set(device_tokens(cache))
        if op == "evict":
            k = min(a, cache.evictable_size)
            cache.pool.free(cache.evict(k))
        else:
            ids = a + b
            d, h = cache.peek_tiers(ids)
            m, fit = serve(cache, ids)
            for i in range(1, d + 1):  # the device part of the match was hit
                hits[tuple(ids[:i])] += 1
            assert m.device_len == d and m.cached_len <= max(d, h)
            assert m.loaded_len == m.cached_len - d
            if capacity >= h:  # room for all of it: every host token came back
                assert m.cached_len == max(d, h)
            if policy == "write_through" and fit:
                expected |= closure([tuple(ids)])
            if policy == "write_through_selective":
                hot = [i for i in range(1, d + 1) if hits[tuple(ids[:i])] >= threshold]
                expected |= closure([tuple(ids[:max(hot)])] if hot else [])
        after = set(device_tokens(cache))
        for gone in before - after:
            hits.pop(gone, None)
        for new in after - before:
            hits[new] = 0
        if policy == "write_back":
            expected |= closure(before - after)
        assert set(host_tokens(cache)) == expected
        check_all(cache)
        if policy == "write_through":
            assert set(device_tokens(cache)) <= set(host_tokens(cache))
    stats = cache.tier_stats
    assert stats.written_tokens == len(expected) and stats.host_evicted_tokens == 0


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from(WRITE_POLICIES), st.integers(4, 10), st.integers(0, 6),
       st.sampled_from([1, 2]))
def test_small_host_evicts_its_own_leaves(script, policy, capacity, extra, page_size):
    """A host barely larger than the device: it evicts leaves LRU, never holds more than its
    capacity, keeps whole prefixes, and every K/V in either tier stays right."""
    capacity = capacity // page_size * page_size
    host_capacity = capacity + extra // page_size * page_size
    cache = toy_cache(capacity, host_capacity, policy, 1, page_size)
    for op, a, b in script:
        if op == "evict":
            k = min(a, cache.evictable_size)
            cache.pool.free(cache.evict(k))
        else:
            serve(cache, a + b)
        check_all(cache)
        assert cache.host_size <= host_capacity
        held = set(host_tokens(cache))
        assert closure(held) == held


def test_write_back_then_load_back_by_hand():
    """Evicting writes the path back; matching it again loads it back, intact, in one load."""
    cache = toy_cache(8, 16, "write_back")
    serve(cache, [1, 2, 3, 4, 5])
    assert cache.host_size == 0 and cache.tier_stats.writes == 0
    cache.pool.free(cache.evict(5))
    assert cache.total_size == 0 and cache.host_size == 5
    assert cache.peek_tiers([1, 2, 3, 4, 9]) == (0, 4)
    m = cache.match_prefix([1, 2, 3, 4, 9])
    assert (m.cached_len, m.loaded_len, m.device_len, m.host_hit_len) == (4, 4, 0, 0)
    check_all(cache)
    s = cache.tier_stats
    assert (s.writes, s.written_tokens, s.loads, s.loaded_tokens) == (1, 5, 1, 4)
    lazy = cache.match_prefix([1, 2, 3, 4, 5], load_back=False)
    assert (lazy.cached_len, lazy.host_hit_len) == (4, 1)
    full = cache.load_back([1, 2, 3, 4, 5], lazy)
    assert (full.cached_len, full.loaded_len, full.host_hit_len) == (5, 1, 0)
    check_all(cache)


def test_residency_and_its_pictures():
    """The merged tree says where each run lives; text and graphviz renders agree."""
    cache = toy_cache(8, 16, "write_back")
    serve(cache, [1, 2, 3, 4])
    serve(cache, [1, 2, 7])
    cache.pool.free(cache.evict(2))  # LRU: the older leaf [3, 4] goes to the host
    root = cache.residency()
    assert root.tokens_in("device") == 1 and root.tokens_in("both") == 2
    assert root.tokens_in("host") == 2
    assert tier_tree_text(cache) == "\n".join([
        "root",
        "    [1, 2] [both]",
        "        [3, 4] [host]",
        "        [7] [device]",
    ])
    source = draw_tier_tree(cache).source
    assert source.count("#c2a5cf") == 2 and source.count("#fdd0a2") == 2  # node + legend
    with pytest.raises(TypeError):
        tier_tree_text(object())


# ---------------------------------------------------------------- the engine on tiny_model


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


@st.composite
def workloads(draw):
    """Prompts sharing stems, a device pool barely big enough, a host a little bigger."""
    stems = draw(st.lists(st.lists(st.integers(0, 127), min_size=2, max_size=10),
                          min_size=2, max_size=4))
    prompts = []
    for _ in range(draw(st.integers(2, 8))):
        stem = draw(st.sampled_from(stems))
        prompts.append(stem + draw(st.lists(st.integers(0, 127), max_size=5)))
    max_new = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2]))
    need = max(-(-(len(p) + max_new - 1) // page_size) * page_size for p in prompts)
    capacity = max(need, draw(st.integers(need, need + 12)) // page_size * page_size)
    host = capacity + draw(st.integers(0, 24)) // page_size * page_size
    return prompts, max_new, page_size, capacity, host


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(WRITE_POLICIES), st.integers(1, 2), st.integers(1, 40))
def test_greedy_outputs_identical_with_the_host_tier(model, workload, policy, threshold, budget):
    """Every policy, small pools that evict in both tiers: the same greedy tokens as plain
    greedy decoding, integrity of both tiers after every step, and the token counts add up."""
    prompts, max_new, page_size, capacity, host = workload
    batch = [Request(prompt=p, max_new_tokens=max_new, stop_on_eos=False) for p in prompts]
    engine = Engine(model, capacity=capacity, page_size=page_size, token_budget=budget,
                    check=True, host_capacity=host, write_policy=policy,
                    write_through_threshold=threshold)
    rounds = [engine.generate(batch, progress=False) for _ in range(2)]
    expected = [greedy_reference(model, p, max_new) for p in prompts]
    loaded = 0
    for r in rounds:
        assert r.outputs == expected
        t = r.totals
        assert t.cached_tokens + t.computed_tokens == t.prompt_tokens
        assert t.device_hit_tokens + t.loaded_tokens == t.cached_tokens
        assert all(0 <= x.metrics.loaded_tokens <= x.metrics.cached_tokens for x in r)
        loaded += t.loaded_tokens
    stats = engine.host_tier.tier_stats
    assert loaded == stats.loaded_tokens
    event(f"device evicts: {engine.evicted_tokens > 0}, host evicts: "
          f"{stats.host_evicted_tokens > 0}, loads: {stats.loads > 0}")
    engine.lifecycle.check_integrity()
    assert engine.pool.num_free + engine.cache.evictable_size == capacity


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_each_policy_evicts_in_both_tiers_and_saves_prefill(model, policy):
    """Six long prompts through a device pool that holds one and a host that holds three:
    both tiers evict, the second round loads back from the host, and it computes fewer
    prompt tokens than the same engine without the tier, with identical outputs."""
    prompts = [[i] * 8 + list(range(20, 32)) for i in range(1, 7)]
    batch = [Request(prompt=p, max_new_tokens=2, stop_on_eos=False) for p in prompts]
    plain = Engine(model, capacity=24, check=True)
    tiered = Engine(model, capacity=24, check=True, host_capacity=60, write_policy=policy,
                    write_through_threshold=1)
    runs = {}
    # selective needs a hit on the device first: each prompt twice in a row
    first = [r for r in batch for _ in range(2)] if policy.endswith("selective") else batch
    for name, engine in (("plain", plain), ("tiered", tiered)):
        # the second round in reverse: the prompts the host kept (the latest) come first
        runs[name] = [engine.generate(order, progress=False) for order in (first, batch[::-1])]
    for a, b in zip(runs["plain"], runs["tiered"], strict=True):
        assert a.outputs == b.outputs
    second = runs["tiered"][1].totals
    stats = tiered.host_tier.tier_stats
    assert tiered.evicted_tokens > 0 and stats.host_evicted_tokens > 0
    assert second.loaded_tokens > 0 and stats.loaded_tokens >= second.loaded_tokens
    assert second.computed_tokens < runs["plain"][1].totals.computed_tokens
    assert "loaded from host" in str(second)


def test_default_engine_has_no_host_tier(model):
    engine = Engine(model, capacity=32)
    assert engine.host_tier is None and not isinstance(engine.cache, HiRadixCache)
    res = engine.generate([Request(prompt=[1, 2, 3], max_new_tokens=2)], progress=False)
    assert res.totals.loaded_tokens == 0 and res[0].metrics.loaded_tokens == 0


# ---------------------------------------------------------------- bad settings


@pytest.mark.parametrize("kwargs, words", [
    ({"write_policy": "write_around"}, "unknown write_policy"),
    ({"write_policy": None}, "unknown write_policy"),
    ({"host_capacity": -64}, "positive int"),
    ({"host_capacity": 0}, "positive int"),
    ({"host_capacity": 64.0}, "positive int"),
    ({"host_capacity": True}, "positive int"),
    ({"host_capacity": 16}, "smaller than the device pool's 32"),
    ({"host_capacity": 34, "page_size": 4}, "whole number of pages"),
    ({"write_through_threshold": 0}, "write_through_threshold must be an int >= 1"),
    ({"write_through_threshold": -1}, "write_through_threshold must be an int >= 1"),
    ({"write_through_threshold": 1.5}, "write_through_threshold must be an int >= 1"),
])
def test_bad_settings_rejected(model, kwargs, words):
    """The engine and the cache reject each bad setting with a TierError (a ValueError)
    that says what is wrong, before anything is built."""
    config = {"host_capacity": 64, "page_size": 1, "write_policy": "write_through",
              "write_through_threshold": 1, **kwargs}
    with pytest.raises(TierError, match=words) as err:
        Engine(model, capacity=32, **config)
    assert isinstance(err.value, ValueError) and isinstance(err.value, MinirtError)
    pool = KVPool(1, 1, 1, 32, config.pop("page_size"))
    with pytest.raises(TierError, match=words):
        HiRadixCache(pool, config.pop("host_capacity"), **config)
    assert pool.num_free == 32


def test_host_tier_needs_the_radix_cache(model):
    with pytest.raises(TierError, match="sits under the radix cache"):
        Engine(model, capacity=32, host_capacity=64, cache="hash")
    assert Engine(model, capacity=32, cache="hash").host_tier is None


def test_bad_calls_leave_both_tiers_unchanged():
    cache = toy_cache(8, 16, "write_back")
    serve(cache, [1, 2, 3, 4])
    serve(cache, [5, 6, 7])
    cache.pool.free(cache.evict(3))  # [1, 2, 3, 4] is the LRU leaf: it goes to the host
    serve(cache, [1, 2, 3, 4])       # and comes back
    stale = cache.match_prefix([1, 2], load_back=False)
    assert stale.cached_len == 2 and cache.host_size == 4
    before = (cache.snapshot(), cache.pool.snapshot(), cache.tier_stats)
    with pytest.raises(PoolError):
        cache.evict_host(-1)
    with pytest.raises(OutOfMemoryError):
        cache.evict_host(cache.host_size + 1)
    with pytest.raises(InvalidIdsError):
        cache.match_prefix([1, -2])
    with pytest.raises(InvalidIdsError):
        cache.load_back([[1]], stale)
    assert (cache.snapshot(), cache.pool.snapshot(), cache.tier_stats) == before
    cache.pool.free(cache.evict(cache.evictable_size))  # its node is gone now
    before = (cache.snapshot(), cache.pool.snapshot(), cache.tier_stats)
    with pytest.raises(StaleHandleError):
        cache.load_back([1, 2, 3, 4], stale)
    assert (cache.snapshot(), cache.pool.snapshot(), cache.tier_stats) == before
    check_all(cache)
    with pytest.raises(TierError):
        measure_load_back(tiny_model(0), 0)
    with pytest.raises(TierError):
        check_tier_settings(8, 16, 1, "write_through", 0)


def test_host_pool_layout_and_copies():
    """The host pool mirrors the device layout; copy_kv moves every layer's K and V."""
    pool = KVPool(2, 2, 3, 8, 2)
    host = HostPool.for_device(pool, 16)
    assert (host.num_layers, host.kv_heads, host.head_dim, host.page_size) == (2, 2, 3, 2)
    assert host.device.type == "cpu" and host.capacity == 16
    assert host.pinned == (pool.device.type == "cuda")
    pool.k.normal_()
    pool.v.normal_()
    copy_kv(pool, torch.tensor([2, 3]), host, torch.tensor([10, 11]))
    assert torch.equal(host.k[:, 10:12], pool.k[:, 2:4])
    assert torch.equal(host.v[:, 10:12], pool.v[:, 2:4])


def test_host_pool_is_slot_major_and_its_views_share_it():
    """``kv[side, s]`` holds slot s's K (side 0) or V (side 1) of every layer, contiguous;
    ``k`` and ``v`` are views of it in the device pool's shape."""
    host = HostPool(3, 2, 4, 8, 2)
    assert host.kv.shape == (2, 8, 3, 2, 4) and host.k.shape == (3, 8, 2, 4)
    assert host.kv[0, 5].is_contiguous() and host.kv[1, 2:6].is_contiguous()
    host.k[1, 5] = 7.0
    host.v[2, 3] = -2.0
    assert host.kv[0, 5, 1].eq(7.0).all() and host.kv[1, 3, 2].eq(-2.0).all()
    assert host.kv.abs().sum() == 7.0 * 8 + 2.0 * 8  # nothing else written


def test_slot_runs_cut_at_every_gap():
    assert slot_runs(torch.tensor([], dtype=torch.int64)) == []
    assert slot_runs(torch.tensor([4])) == [(0, 4, 1)]
    assert slot_runs(torch.tensor([3, 4, 5, 9, 10, 2, 1, 2])) == [
        (0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 1, 2)]


@pytest.mark.parametrize("by_runs", [True, False])
@pytest.mark.parametrize("host_slots", [
    list(range(4, 12)),                      # one run
    [9, 10, 11, 0, 1, 5, 6, 7],              # three runs, out of order
    [15, 13, 11, 9, 7, 5, 3, 1],             # no two consecutive
])
def test_copy_kv_both_ways_through_runs_of_host_slots(host_slots, by_runs):
    """Device -> host -> device, by runs of host slots (a GPU's way) or by one gather and
    scatter (the CPU's), moves each slot's K and V of every layer to the right place, and
    nothing else."""
    pool = KVPool(3, 2, 5, 24, 1)
    host = HostPool.for_device(pool, 16)
    pool.k.normal_()
    pool.v.normal_()
    src = torch.tensor([0, 7, 3, 4, 5, 20, 21, 2])
    hs = torch.tensor(host_slots)
    copy_kv(pool, src, host, hs, by_runs=by_runs)
    assert torch.equal(host.k[:, hs], pool.k[:, src])
    assert torch.equal(host.v[:, hs], pool.v[:, src])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[hs] = False
    assert host.kv[:, untouched].eq(0).all()
    dst = torch.tensor([8, 9, 10, 11, 16, 17, 18, 12])
    before = pool.k.clone()
    copy_kv(host, hs, pool, dst, by_runs=by_runs)
    assert torch.equal(pool.k[:, dst], before[:, src])
    assert torch.equal(pool.v[:, dst], pool.v[:, src])
    others = torch.ones(24, dtype=torch.bool)
    others[dst] = False
    assert torch.equal(pool.k[:, others], before[:, others])


def test_copy_kv_refuses_slot_lists_of_different_lengths():
    pool = KVPool(1, 1, 2, 8, 1)
    host = HostPool.for_device(pool, 8)
    pool.k.normal_()
    with pytest.raises(PoolError, match="3 source slots but 2"):
        copy_kv(pool, torch.tensor([0, 1, 2]), host, torch.tensor([0, 1]))
    assert host.kv.eq(0).all()
    copy_kv(pool, torch.tensor([], dtype=torch.int64), host, torch.tensor([], dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make test-gpu)")
def test_copies_through_a_pinned_host_pool_are_exact_on_cuda():
    """Device -> pinned host -> device returns the same K/V, however large the copy (an
    asynchronous copy to the host once let the host-side scatter read rows too early), and
    the host rows are there for a CPU read the moment a write returns."""
    pool = KVPool(4, 2, 64, 8192, 1, device="cuda")
    host = HostPool.for_device(pool, 8192)
    assert host.pinned and host.kv.is_pinned()
    pool.k.normal_()
    pool.v.normal_()
    src, dst = torch.arange(4096), torch.arange(4096, 8192)
    copy_kv(pool, src, host, src)
    assert torch.equal(host.k[:, :4096], pool.k[:, :4096].cpu())  # read on the CPU at once
    copy_kv(host, src, pool, dst)
    assert torch.equal(pool.k[:, 4096:], pool.k[:, :4096])
    assert torch.equal(pool.v[:, 4096:], pool.v[:, :4096])
    # Many short runs, reversed, with the device busy before each copy.
    hs = torch.arange(8190, 0, -2)[:2048]
    big = torch.randn(4096, 4096, device="cuda")
    (big @ big).sum()
    copy_kv(pool, src[:2048], host, hs)
    assert torch.equal(host.v[:, hs], pool.v[:, :2048].cpu())
    (big @ big).sum()
    copy_kv(host, hs, pool, dst[:2048])
    assert torch.equal(pool.v[:, 4096:6144], pool.v[:, :2048])


def test_measure_load_back_on_tiny_model():
    cost = measure_load_back(tiny_model(0), 16, repeats=2)
    assert cost.prompt_len == 16 and cost.repeats == 2
    assert cost.load_s > 0 and cost.recompute_s > 0 and cost.write_s > 0
    assert cost.ratio == pytest.approx(cost.recompute_per_token / cost.load_per_token)


def test_salted_prefixes_stay_apart_in_both_tiers():
    """A salted request's K/V goes to the host under its salt and comes back only for the
    same salt (``cache_salt`` isolation holds across tiers)."""
    cache = toy_cache(8, 16, "write_back")
    m = cache.match_prefix([1, 2, 3], salt="alice")
    cache.lock(m.handle)
    cache.make_room(3)
    slots = cache.pool.alloc(3)
    cache.insert_prefix([1, 2, 3], slots, salt="alice")
    cache.unlock(m.handle)
    cache.pool.free(cache.evict(3))
    assert cache.host_size == 3 and cache.total_size == 0
    assert cache.peek_tiers([1, 2, 3], salt="bob") == (0, 0)
    assert cache.peek_tiers([1, 2, 3]) == (0, 0)
    assert cache.match_prefix([1, 2, 3], salt="bob").cached_len == 0
    back = cache.match_prefix([1, 2, 3], salt="alice")
    assert (back.cached_len, back.loaded_len) == (3, 3)
    assert [(n.salt, n.tier) for _, n in cache.residency().walk()][1:] == [("alice", "both")]
    cache.check_integrity()
