"""minirt.simulate.replay: simulate's replay, request by request."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt.errors import PoolError, RequestError
from minirt.eviction import SLRU, TLRU
from minirt.simulate import replay, simulate

traces = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=25)
policies = st.sampled_from(["lru", "lfu", "fifo", "priority", "slru"]) | st.builds(
    TLRU, st.integers(1, 6), st.just(0))


@settings(max_examples=200, deadline=None)
@given(trace=traces, extra=st.integers(0, 20), page=st.sampled_from([1, 2, 4]), policy=policies)
def test_replay_is_simulate_request_by_request(trace, extra, page, policy):
    capacity = max(len(r) for r in trace) + extra
    cached = replay(trace, capacity, policy, page_size=page)
    stats = simulate(trace, capacity, policy, page_size=page)
    assert len(cached) == len(trace) and sum(cached) == stats.hit_tokens
    for request, hit in zip(trace, cached, strict=True):
        assert 0 <= hit <= len(request) and hit % page == 0


def test_replay_names_who_missed():
    trace = [[1, 2, 3], [4, 5, 6], [1, 2, 3], [1, 2, 3, 7]]
    assert replay(trace, 7) == [0, 0, 3, 3]
    assert replay(trace, 4) == [0, 0, 0, 3]  # [1, 2, 3] was evicted for [4, 5, 6]
    assert replay([torch.tensor(r) for r in trace], 7, SLRU(2)) == [0, 0, 3, 3]
    with pytest.raises(RequestError):
        replay(trace, 2)
    with pytest.raises(PoolError):
        replay(trace, -1)
    assert replay([], 4) == []
