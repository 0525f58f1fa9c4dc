"""The window-aware cache: greedy outputs through it equal the uncached model's (transformers'
own sliding-window mask) on tiny models with window layers, with shared prefixes and
evictions, the integrity check after every step; tombstones, the tail-window rule,
hits lost against keeping every layer; bad input leaves the state unchanged."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirt.errors import (
    HandleError,
    InvalidIdsError,
    OutOfMemoryError,
    RequestError,
    StaleHandleError,
)
from minirt.hybrid import (
    NO_SLOT,
    HybridSpec,
    WindowRadixCache,
    greedy_uncached,
    with_sliding_window,
)
from minirt.model import tiny_model
from minirt.window_lifecycle import WindowRunner


@functools.cache
def windowed(window: int, full_every: int = 3, layers: int = 3):
    spec = HybridSpec.interleaved(layers, window=window, full_every=full_every)
    return with_sliding_window(tiny_model(0, num_layers=layers), spec)


def fill(cache: WindowRadixCache, ids, window_kept, first=0):
    """Insert ``ids`` with made-up slots; window slots only where ``window_kept(pos)``."""
    n = len(ids)
    full = list(range(first, first + n))
    window = [1000 + first + i if window_kept(i) else NO_SLOT for i in range(n)]
    return cache.insert_prefix(ids, full, window)


# ---------------------------------------------------------------- the tree alone

def test_tombstone_splits_the_usable_prefix():
    cache = WindowRadixCache(window=3)  # need the last 2 tokens
    fill(cache, list(range(10)), lambda i: i >= 8)  # only the tail window kept
    cache.check_integrity()
    assert cache.num_tombstones == 1 and cache.window_tokens == 2
    assert cache.usable_length(list(range(10))) == (10, 10)
    assert cache.usable_length(list(range(6)) + [99]) == (0, 6)  # inside the tombstone
    assert cache.usable_length(list(range(9)) + [99]) == (0, 9)  # run of 1 < 2
    # a shorter prompt ends inside the tombstone: full K/V there, no window
    m = cache.match_prefix(list(range(5)))
    assert (m.cached_len, m.full_len) == (0, 5)
    assert cache.full_hit_tokens - cache.stats.hit_tokens == 5


def test_short_prefixes_need_no_more_than_their_length():
    cache = WindowRadixCache(window=8)
    fill(cache, [1, 2, 3], lambda i: True)
    assert cache.usable_length([1, 2, 3, 4]) == (3, 3)  # run 3 covers min(3, 7)


def test_insert_recovers_a_tombstone():
    cache = WindowRadixCache(window=3)
    fill(cache, list(range(10)), lambda i: i >= 8)
    res = cache.insert_prefix(list(range(6)), list(range(6)), [NO_SLOT] * 4 + [500, 501])
    assert res.free_full == [] and res.free_window == []
    cache.check_integrity()
    assert cache.usable_length(list(range(6)) + [99]) == (6, 6)
    assert cache.window_tokens == 4


def test_window_eviction_tombstones_inner_nodes_and_removes_leaves():
    cache = WindowRadixCache(window=3)
    fill(cache, [1, 2, 3], lambda i: True)
    fill(cache, [1, 2, 3, 4, 5, 6], lambda i: True, first=10)  # touches [1, 2, 3] with it
    cache.check_integrity()
    full, window = cache.evict(window=3)  # the parent counts as older than its child
    assert sorted(window) == [1000, 1001, 1002] and full == []
    assert cache.num_tombstones == 1 and cache.full_tokens == 6
    assert cache.usable_length([1, 2, 3, 4, 5, 6]) == (6, 6)
    assert cache.usable_length([1, 2, 3, 9]) == (0, 3)
    full, window = cache.evict(window=3)  # a leaf: both kinds go, and its tombstone parent
    assert sorted(full) == [0, 1, 2, 13, 14, 15] and sorted(window) == [1013, 1014, 1015]
    assert cache.full_tokens == 0
    cache.check_integrity()


def test_locked_path_keeps_its_window_and_errors_change_nothing():
    cache = WindowRadixCache(window=3)
    fill(cache, [1, 2, 3, 4], lambda i: True)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.handle)
    before = cache.snapshot()
    with pytest.raises(OutOfMemoryError):
        cache.evict(window=1)
    with pytest.raises(OutOfMemoryError):
        cache.evict(full=1)
    with pytest.raises(InvalidIdsError):
        cache.insert_prefix([1, 2], [0], [NO_SLOT])
    with pytest.raises(InvalidIdsError):
        cache.match_prefix([-1, 2])
    assert cache.snapshot() == before
    cache.unlock(m.handle)
    with pytest.raises(HandleError):
        cache.unlock(m.handle)
    cache.evict(full=4)
    with pytest.raises(StaleHandleError):
        cache.lock(m.handle)
    cache.check_integrity()


# ---------------------------------------------------------------- through a model

def test_windowed_model_is_the_llama_inside_the_window():
    import torch

    model = windowed(window=64)  # longer than the prompt: no window bites
    base = tiny_model(0, num_layers=3)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, base(ids).logits, atol=1e-5)


def test_runner_matches_uncached_and_saves_window_memory():
    model = windowed(window=4)
    sys_prompt = [5, 17, 33, 2, 8, 90, 41, 7, 12, 60]
    prompts = [sys_prompt + [i, i + 1, i + 2] for i in range(4)] + [sys_prompt[:6] + [3]]
    aware = WindowRunner(model, 200, 200, check=True)
    keep = WindowRunner(model, 200, 200, window_aware=False, check=True)
    for p in prompts:
        ref = greedy_uncached(model, p, 3)
        assert aware.generate(p, 3) == ref == keep.generate(p, 3)
    assert aware.cache.window_tokens < keep.cache.window_tokens == keep.cache.full_tokens
    assert aware.cache.full_tokens == keep.cache.full_tokens
    assert aware.cached_bytes < keep.cached_bytes
    # the branch rule kept the window before the system prompt's end: those hits stay
    assert aware.cache.stats.hit_tokens <= keep.cache.stats.hit_tokens


def test_runner_error_leaves_state_unchanged():
    model = windowed(window=4)
    r = WindowRunner(model, 8, 8, check=True)
    r.generate([1, 2, 3], 2)
    before = r.cache.snapshot(), r.pools["full"].snapshot(), r.pools["window"].snapshot()
    with pytest.raises(RequestError, match="pool holds only 8"):
        r.generate(list(range(20)), 2)  # more than the pools hold
    r.check_integrity()
    with pytest.raises(RequestError):
        r.generate([], 2)
    after = r.cache.snapshot(), r.pools["full"].snapshot(), r.pools["window"].snapshot()
    assert after == before


prompt_sets = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 127), min_size=1, max_size=8)),
    min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_sets, st.sampled_from([2, 3, 5]), st.integers(24, 60), st.booleans())
def test_greedy_equals_uncached_with_evictions(specs, window, capacity, aware):
    model = windowed(window=window)
    stems = [[7, 3, 9, 1, 4, 4, 2, 8][: 2 * k] for k in range(4)]
    runner = WindowRunner(model, capacity, capacity if not aware else capacity // 2 + 6,
                          window_aware=aware, check=True)
    for stem, tail in specs:
        prompt = stems[stem] + tail
        assert runner.generate(prompt, 3) == greedy_uncached(model, prompt, 3)
    runner.check_integrity()


# ---------------------------------------------------------------- through the engine

def _requests(prompts, new=4):
    from minirt.request import Request

    return [Request(prompt=p, max_new_tokens=new, stop_on_eos=False) for p in prompts]


STEM = [7, 3, 9, 1, 4, 4, 2, 8]
ENGINE_PROMPTS = ([STEM + [i, i + 1] for i in range(5)] + [STEM[:4] + [50]]
                  + [STEM + [0, 1, 2, 3], [99, 98]])


@pytest.mark.parametrize("capacity", [200, 24])
def test_engine_serves_window_layers_equal_to_uncached(capacity):
    """Batches of requests with shared prefixes, twice (the second round hits), through
    the engine's window cache; a 24-slot pool must evict. Integrity after every step."""
    from minirt.engine import Engine
    from minirt.window_lifecycle import WindowLifecycle

    model = windowed(window=3)
    ref = [greedy_uncached(model, p, 4) for p in ENGINE_PROMPTS]
    engine = Engine(model, capacity=capacity, check=True, token_budget=30)
    assert isinstance(engine.lifecycle, WindowLifecycle)  # chosen from the config
    first = engine.generate(_requests(ENGINE_PROMPTS), progress=False)
    second = engine.generate(_requests(ENGINE_PROMPTS), progress=False)
    assert first.outputs == ref and second.outputs == ref
    assert second.totals.cached_tokens > first.totals.cached_tokens > 0
    assert not engine.running and not engine.lifecycle.window_tables
    if capacity == 24:
        assert engine.evicted_tokens > 0
    assert engine.cache.window_tokens < engine.cache.full_tokens  # early frees: tombstones
    engine.flush()
    assert engine.cache.full_tokens == 0 and engine.pool.num_used == 0
    assert engine.lifecycle.pools["window"].num_used == 0


def test_engine_window_batches_decode_and_cancel():
    """Several requests decode in one batch; cancelling one mid-run frees both kinds."""
    from minirt.engine import Engine

    model = windowed(window=2)
    engine = Engine(model, capacity=80, window_capacity=48, check=True)
    handles = [engine.submit(r) for r in _requests(ENGINE_PROMPTS[:4], new=6)]
    engine.step()
    assert len(engine.running) == 4  # one prefill batch, then one decode batch
    engine.cancel(handles[1])
    while engine.has_work:
        engine.step()
    for h, p in zip(handles, ENGINE_PROMPTS[:4], strict=True):
        if h is not handles[1]:
            assert h.result.output_ids == greedy_uncached(model, p, 6)
    assert handles[1].status == "cancelled"
    engine.lifecycle.check_integrity()


def test_engine_window_bad_settings_build_nothing_and_bad_requests_change_nothing():
    from minirt.engine import Engine
    from minirt.errors import ModelError, PoolError, RequestError, TierError
    from minirt.request import Request

    model = windowed(window=3)
    with pytest.raises(PoolError, match="no sliding|has none"):
        Engine(tiny_model(0, num_layers=3), cache="window")
    with pytest.raises(PoolError, match="cache='window'"):
        Engine(model, cache="radix")
    with pytest.raises(PoolError, match="page_size"):
        Engine(model, page_size=2)
    with pytest.raises(PoolError, match="policy"):
        Engine(model, policy="lfu")
    with pytest.raises(ModelError, match="deterministic"):
        Engine(model, deterministic=True)
    with pytest.raises(TierError):
        Engine(model, host_capacity=64)
    engine = Engine(model, capacity=40, window_capacity=12, check=True)
    engine.generate(_requests([STEM]), progress=False)
    before = engine.cache.snapshot(), engine.pool.snapshot(), \
        engine.lifecycle.pools["window"].snapshot()
    out = engine.generate([Request(prompt=STEM, cache_salt="a"),
                           Request(prompt=list(range(20)), max_new_tokens=2)], progress=False)
    assert not out[0].ok and "salt" in str(out[0].error)
    assert not out[1].ok and "window pool holds only 12" in str(out[1].error)
    with pytest.raises(RequestError):
        engine.submit(Request(prompt=STEM, cache_salt="a"))
    after = engine.cache.snapshot(), engine.pool.snapshot(), \
        engine.lifecycle.pools["window"].snapshot()
    assert after == before and not engine.lifecycle.requests


engine_waves = st.lists(
    st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 127), min_size=1,
                                                   max_size=6)), min_size=1, max_size=4),
    min_size=1, max_size=3)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine_waves, st.sampled_from([2, 3, 5]), st.integers(30, 80), st.integers(4, 32),
       st.booleans())
def test_engine_greedy_equals_uncached_hypothesis(waves, window, capacity, budget, chunked):
    """Random prompts on shared stems, submitted in waves while others run, small pools
    (evictions), any token budget, whole prompts or chunked prefill: every output equals
    transformers' uncached greedy, and the integrity check (both kinds of K/V) holds after
    every step."""
    from minirt.engine import Engine

    model = windowed(window=window)
    stems = [STEM[: 2 * k] for k in range(4)]
    engine = Engine(model, capacity=capacity, window_capacity=capacity // 2 + 8,
                    token_budget=budget, check=True, chunked_prefill=chunked)
    handles = []
    for wave in waves:
        prompts = [stems[s] + tail for s, tail in wave]
        handles += [(engine.submit(r), r.prompt) for r in _requests(prompts, new=3)]
        engine.step()
    while engine.has_work:
        engine.step()
    for h, p in handles:
        assert h.result.output_ids == greedy_uncached(model, p, 3)


def test_engine_window_prefills_in_chunks_equal_to_uncached():
    """Prompts longer than the window, cut into chunks of 4 tokens: each chunk reads the
    window the one before left, and the outputs equal transformers' uncached greedy."""
    from minirt.engine import Engine

    model = windowed(window=3)
    prompts = [STEM + STEM[::-1], STEM + [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    engine = Engine(model, capacity=200, token_budget=4, check=True, chunked_prefill=True)
    first = engine.generate(_requests(prompts), progress=False)
    second = engine.generate(_requests(prompts), progress=False)
    ref = [greedy_uncached(model, p, 4) for p in prompts]
    assert first.outputs == ref and second.outputs == ref
    assert second.totals.cached_tokens > 0
