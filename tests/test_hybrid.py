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
    WindowRunner,
    greedy_uncached,
    with_sliding_window,
)
from minirt.model import tiny_model


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
