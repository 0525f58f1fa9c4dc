"""minirt.traffic: trace requests through the scheduler, the host tier and the routers."""

from __future__ import annotations

import pytest

from minirt.cache import RadixCache
from minirt.errors import RequestError
from minirt.router import CacheAwareRouter, RoundRobinRouter
from minirt.scheduler import simulate_schedule
from minirt.simulate import simulate
from minirt.traces import TraceRequest
from minirt.traffic import (
    replay_routed,
    replay_tiers,
    routing_text,
    schedule_requests,
    serve_prompt,
)


def _req(ms: int, ids: tuple[int, ...], out: int = 3) -> TraceRequest:
    return TraceRequest(ms, 512 * len(ids), out, ids)


# Two conversations that take turns, each turn extending its own last one.
CHATS = [_req(0, (0, 1)), _req(0, (0, 5)), _req(1000, (0, 1, 2)), _req(1500, (0, 5, 6)),
         _req(3000, (0, 1, 2, 3)), _req(3100, (0, 5, 6, 7))]


def test_schedule_requests_cuts_arrivals_into_steps_and_outputs_into_decode_steps():
    reqs = schedule_requests(CHATS[1:4], step_ms=400, output_scale=2)
    assert [r.arrival for r in reqs] == [0, 2, 3]  # from the first request's time
    assert [r.max_new_tokens for r in reqs] == [2, 2, 2]  # ceil(3 / 2)
    assert [r.rid for r in reqs] == ["0", "1", "2"]
    assert reqs[1].prompt.tolist() == [0, 1, 2]  # block_size=1: a token per block
    assert schedule_requests(CHATS[:1], block_size=2)[0].prompt.tolist() == [0, 1, 2, 3]
    assert schedule_requests([]) == []
    for bad in ({"step_ms": 0}, {"output_scale": True}, {"step_ms": 1.5}):
        with pytest.raises(RequestError):
            schedule_requests(CHATS, **bad)


def test_scheduled_trace_runs_through_simulate_schedule():
    res = simulate_schedule(schedule_requests(CHATS, step_ms=100), 16, "lpm", token_budget=8)
    assert sorted(res.admitted, key=int) == [str(i) for i in range(len(CHATS))]
    # the first two arrive in one step and are prefilled together, block 0 twice; each
    # later turn reuses all of its chat's last turn
    assert res.computed == sum(len(r.hash_ids) for r in CHATS) - (2 + 2 + 3 + 3)


def test_serve_prompt_matches_simulate():
    prompts = [r.token_ids(1) for r in CHATS] * 2
    for capacity in (4, 6, 9, 30):
        cache, slot = RadixCache(), 0
        for ids in prompts:
            slot = serve_prompt(cache, ids, capacity, slot)
            assert cache.total_size <= capacity
            cache.check_integrity()
        assert cache.stats == simulate(prompts, capacity, "lru")


def test_replay_tiers_without_a_host_is_lru_and_a_host_only_adds_loads():
    prompts = [r.token_ids(1) for r in CHATS] * 3
    none = replay_tiers(prompts, 4)
    assert none.loaded == 0 and none.device_hits == simulate(prompts, 4, "lru").hit_tokens
    rates = [none.hit_rate]
    for host in (4, 8, 32):
        r = replay_tiers(prompts, 4, host)
        assert r.prompt_tokens == none.prompt_tokens == sum(map(len, prompts))
        assert r.computed == r.prompt_tokens - r.device_hits - r.loaded
        rates.append(r.hit_rate)
    assert rates == sorted(rates) and rates[-1] > rates[0]
    assert replay_tiers(prompts, 4, 8, write_policy="write_through").loaded > 0
    # a host that holds everything: only first uses are computed
    assert replay_tiers(prompts, 4, 32).computed == len({t for p in prompts for t in p})


def test_replay_tiers_refuses_bad_input():
    with pytest.raises(RequestError, match="does not fit"):
        replay_tiers([[1, 2, 3]], 2)
    with pytest.raises(RequestError, match="empty"):
        replay_tiers([[]], 2)
    with pytest.raises(RequestError, match="device_capacity"):
        replay_tiers([[1]], 0)


def test_routing_text_is_a_character_per_block():
    a, b = routing_text(CHATS[2]), routing_text(CHATS[4])
    assert len(a) == 3 and b.startswith(a) and len(b) == 4
    assert routing_text(CHATS[1])[:1] == a[:1] != routing_text(CHATS[1])[1:2]


def test_replay_routed_round_robin_and_cache_aware():
    rr = replay_routed(CHATS, RoundRobinRouter(2), 8)
    assert rr.requests_per_replica == (3, 3) and rr.router == "round_robin"
    assert rr.prompt_tokens == sum(len(r.hash_ids) for r in CHATS)
    # round robin alternates, and the chats alternate too: each chat stays on one replica,
    # which computes block 0 once, and each later turn reuses all of the last one
    assert rr.hit_tokens == 2 + 2 + 3 + 3
    ca = CacheAwareRouter(2)
    res = replay_routed(CHATS, ca, 8)
    assert sum(res.requests_per_replica) == len(CHATS)
    assert ca.loads == [0, 0]  # every request reported done at the end
    assert 0 <= res.hit_tokens <= res.prompt_tokens and 0 <= res.hit_rate <= 1
    # one replica's requests are in flight while the next arrive: the spread is seen
    assert replay_routed(CHATS, RoundRobinRouter(3), 8, ms_per_token=10_000).max_spread == 1


def test_replay_routed_finishes_requests_before_routing_the_next():
    router = RoundRobinRouter(2)
    replay_routed([_req(0, (0,), out=1), _req(50, (0,), out=1), _req(120, (0,), out=1)],
                  router, 4, ms_per_token=100)
    # the first finishes at 100 ms, the second at 150: the third (at 120) sees one in flight
    assert [d.loads for d in router.decisions] == [(0, 0), (1, 0), (0, 1)]


def test_replay_routed_refuses_bad_input():
    with pytest.raises(RequestError, match="does not fit"):
        replay_routed(CHATS, RoundRobinRouter(2), 2)
    with pytest.raises(RequestError, match="ms_per_token"):
        replay_routed(CHATS, RoundRobinRouter(2), 8, ms_per_token=0)
