"""Scheduling policies: same greedy tokens under every order (with evictions), the DFS
theorem against brute force, aging bounds every wait, bad settings rejected."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirt.cache import RadixCache, insert_fresh
from minirt.engine import Engine
from minirt.errors import MinirtError, ScheduleError
from minirt.lifecycle import Lifecycle
from minirt.pool import KVPool
from minirt.request import Request
from minirt.scheduler import (
    POLICIES,
    Scheduler,
    SimRequest,
    best_order,
    cache_dfs_weight_order,
    cached_prefix_len,
    dfs_weight_order,
    edge_sum,
    schedule_order,
    sequential_cost,
    simulate_schedule,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


@st.composite
def workloads(draw):
    stems = draw(st.lists(st.lists(st.integers(0, 127), min_size=2, max_size=12),
                          min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(2, 7))):
        stem = draw(st.sampled_from(stems))
        prompts.append(stem + draw(st.lists(st.integers(0, 127), min_size=1, max_size=5)))
    max_new = draw(st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts)))
    need = max(len(p) + m - 1 for p, m in zip(prompts, max_new, strict=True))
    capacity = need + draw(st.integers(0, 24))
    budget = draw(st.integers(1, 30))
    return prompts, max_new, capacity, budget


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([p for p in POLICIES if p != "fcfs"]), st.booleans())
def test_every_policy_gives_fcfs_tokens(model, workload, policy, in_batch):
    """Order changes what is cached and when, never what greedy decoding produces."""
    prompts, max_new, capacity, budget = workload

    def run(schedule):
        eng = Engine(model, capacity=capacity, token_budget=budget, check=True,
                     schedule=schedule)
        out = eng.generate([Request(prompt=p, max_new_tokens=m, stop_on_eos=False)
                            for p, m in zip(prompts, max_new, strict=True)], progress=False)
        eng.lifecycle.check_integrity()
        return out

    base = run("fcfs")
    for rule, walk in (("minirt", "prompts"), ("sglang", "cache")):
        other = run(Scheduler(policy, in_batch=in_batch, in_batch_rule=rule,
                              in_batch_max_cached=4, in_batch_min_shared=2, max_wait_steps=3,
                              dfs_walk=walk))
        assert other.outputs == base.outputs
        assert all(r.ok for r in other)


def test_fcfs_default_keeps_arrival_order(model):
    eng = Engine(model, capacity=64, token_budget=1)
    assert eng.scheduler.policy == "fcfs"
    prompts = [[5, 6, 7], [1, 2, 3], [5, 6, 8]]
    out = eng.generate([Request(prompt=p, max_new_tokens=1) for p in prompts], progress=False)
    latencies = [r.metrics.latency for r in out]
    assert latencies == sorted(latencies)


def test_lpm_lets_a_cached_prefix_jump_the_queue(model):
    eng = Engine(model, capacity=64, token_budget=1, schedule="lpm")
    eng.generate(Request(prompt=[9, 9, 9, 9, 1], max_new_tokens=1), progress=False)
    out = eng.generate([Request(prompt=[3, 4, 5, 6, 7], max_new_tokens=1),
                        Request(prompt=[9, 9, 9, 9, 2], max_new_tokens=1)], progress=False)
    assert out[1].metrics.latency < out[0].metrics.latency
    assert out[1].metrics.cached_tokens == 4


def _lc_requests(model, prompts, max_new=None):
    lc = Lifecycle(model, KVPool.for_model(model, 256), RadixCache())
    return lc, [lc.new_request(p, (max_new or [1] * len(prompts))[i])
                for i, p in enumerate(prompts)]


def test_policy_orders(model):
    lc, reqs = _lc_requests(model, [[1, 2, 3], [7, 8, 9, 10], [1, 2, 4], [7, 8, 9, 11],
                                    [7, 8, 5]], [1, 5, 2, 1, 1])
    insert_fresh(lc.cache, [7, 8, 9, 10, 12], 0)
    rid = lambda rs: [reqs.index(r) for r in rs]  # noqa: E731
    assert rid(schedule_order(reqs, "fcfs")) == [0, 1, 2, 3, 4]
    assert rid(schedule_order(reqs, "lpm", lc.cache)) == [1, 3, 4, 0, 2]
    assert rid(schedule_order(reqs, "dfs-weight", lc.cache)) == [1, 3, 4, 0, 2]
    assert rid(schedule_order(reqs, "lof")) == [1, 2, 0, 3, 4]
    assert sorted(rid(schedule_order(reqs, "random"))) == [0, 1, 2, 3, 4]
    assert rid(schedule_order(reqs, "dfs-weight", RadixCache())) == [1, 3, 4, 0, 2]
    assert dfs_weight_order([[1, 2, 3], [5], [1, 2], [5, 6], [5, 7]]) == [1, 3, 4, 2, 0]


def test_sglang_dfs_weight_walks_the_cache_tree():
    """Each request at its deepest cached node, post-order, heavier subtrees first."""
    cache = RadixCache()
    insert_fresh(cache, [7, 8, 9, 10, 12], 0)
    insert_fresh(cache, [1, 2, 6], 5)
    prompts = [[1, 2, 3], [7, 8, 9, 10], [1, 2, 4], [7, 8, 9, 11], [7, 8, 5], [4, 4]]
    # [7,8..]: three requests (two at depth 3 of its edge, one at depth 2); [1,2..]: two;
    # [4,4] has nothing cached and sits at the root, after every child.
    assert cache_dfs_weight_order(cache, prompts) == [1, 3, 4, 0, 2, 5]
    assert cache_dfs_weight_order(RadixCache(), prompts) == list(range(6))  # queue order
    assert dfs_weight_order(prompts) != list(range(6))  # minirt's walk groups them anyway
    # a node's own requests come after its children's, whatever the queue order
    assert cache_dfs_weight_order(cache, [[7, 8, 5], [7, 8, 9, 10]]) == [1, 0]
    assert cache_dfs_weight_order(cache, [[1, 2, 3]], ["tenant"]) == [0]  # salted: root
    with pytest.raises(ScheduleError, match="radix tree"):
        cache_dfs_weight_order(object(), prompts)


def test_hrrn_ages_by_prefill_tokens(model):
    lc, reqs = _lc_requests(model, [[1, 2, 3, 4, 5, 6], [7, 8, 9]])
    s = Scheduler("hrrn")
    assert s.order(reqs, lc.cache) == reqs  # nothing waited yet: arrival order
    late = lc.new_request([7, 8, 9, 9], 1)
    late.arrival = 5
    # reqs[1] left the queue (admitted): its 3 uncached tokens are processed, which
    # reqs[0] (6 uncached) waited through; the newcomer waited none
    assert s.order([late, reqs[0]], lc.cache) == [reqs[0], late]
    assert s.processed_tokens == 3 and s.waited_tokens(reqs[0]) == 3
    assert s.waited_tokens(late) == 0
    # the ratio divides by the uncached tokens: a cached prefix raises it
    insert_fresh(lc.cache, [1, 2, 3, 4, 5], 0)
    rival = lc.new_request([9, 9, 9, 9, 9, 9], 1)
    rival.arrival = -1
    s.order([rival, reqs[0], late], lc.cache)  # rival joins: it waited nothing yet
    assert s.order([rival, reqs[0], late], lc.cache)[0] is reqs[0]  # 3 waited / 1 uncached
    assert Scheduler("fcfs").order([rival, reqs[0]])[0] is rival  # arrival alone: rival
    assert Scheduler("hrrn", lpm_max_queue=1).active_policy(2) == "fcfs"  # the cutoff


def test_hrrn_bounds_the_loners_wait_without_a_parameter():
    warm = [SimRequest(torch.tensor(list(range(200, 232)) + [0]), rid="warm")]
    res = simulate_schedule(warm + _stream(40), 256, Scheduler("hrrn"), token_budget=8)
    assert next(r for r in res.requests if r.rid == "loner").wait <= 3
    starved = simulate_schedule(warm + _stream(40), 256, Scheduler("lpm"), token_budget=8)
    assert res.computed == starved.computed


def test_sglang_in_batch_rule_only_reorders():
    common = list(range(100, 164))
    four = lambda: [SimRequest(torch.tensor(common + [i]), rid=f"r{i}") for i in range(4)]  # noqa: E731
    sglang = Scheduler("lpm", in_batch=True, in_batch_rule="sglang")
    res = simulate_schedule(four(), 1024, sglang, token_budget=512)
    assert res.computed == 4 * 65 and res.steps == 1  # all four in one batch
    assert not sglang.defers(common + [9], 0, [torch.tensor(common + [8])])
    minirt = simulate_schedule(four(), 1024, Scheduler("lpm", in_batch=True), token_budget=512)
    assert minirt.computed == 65 + 3 and minirt.steps == 2
    # where it helps: a budget of two requests, two families interleaved behind each other
    fam = lambda s: [SimRequest(torch.tensor(list(range(s, s + 64)) + [i]), rid=f"{s}-{i}")  # noqa: E731
                     for i in range(3)]
    plain = simulate_schedule(fam(300) + fam(400), 1024, Scheduler("lpm"), token_budget=130)
    rule = Scheduler("lpm", in_batch=True, in_batch_rule="sglang")
    helped = simulate_schedule(fam(300) + fam(400), 1024, rule, token_budget=130)
    assert helped.admitted[:2] == ["300-0", "400-0"] and plain.admitted[:2] == ["300-0", "300-1"]
    assert helped.computed == 2 * 65 + 4 < plain.computed
    # the rule counts cached tokens too, and skips requests with more than 32 cached
    cache = RadixCache()
    insert_fresh(cache, common[:40], 0)
    reqs = four()
    ordered = rule.order(reqs, cache)
    assert ordered == reqs and rule.last_deprioritized == []  # 40 cached > 32: no check
    assert Scheduler("fcfs", in_batch=True, in_batch_rule="sglang").order(reqs) == reqs


def test_lpm_falls_back_to_fcfs_past_the_cutoff(model):
    lc, reqs = _lc_requests(model, [[1, 2, 3], [7, 8, 9]])
    insert_fresh(lc.cache, [7, 8, 9], 0)
    assert Scheduler("lpm", lpm_max_queue=2).order(reqs, lc.cache) == [reqs[1], reqs[0]]
    sched = Scheduler("lpm", lpm_max_queue=1)
    assert sched.order(reqs, lc.cache) == reqs and sched.last_policy == "fcfs"


def test_cached_prefix_len_changes_nothing():
    cache = RadixCache(page_size=2)
    insert_fresh(cache, [1, 2, 3, 4, 5, 6], 0)
    nodes, stats = len(list(cache.nodes())), cache.stats
    assert cached_prefix_len(cache, [1, 2, 3, 4, 9, 9]) == 4
    assert cached_prefix_len(cache, [1, 2, 3, 9]) == 2
    assert cached_prefix_len(cache, [8]) == 0
    assert cache.stats == stats
    assert len(list(cache.nodes())) == nodes  # no split


def test_in_batch_rule():
    s = Scheduler("lpm", in_batch=True)
    shared = list(range(40))
    assert s.defers(shared + [1], 0, [torch.tensor(shared + [2])])
    assert not s.defers(shared + [1], 33, [torch.tensor(shared + [2])])   # cached enough
    assert not s.defers(shared[:20] + [1], 0, [torch.tensor(shared + [2])])  # shares 20
    assert not s.defers(shared + [1], 0, [])
    assert not Scheduler("lpm").defers(shared + [1], 0, [torch.tensor(shared + [2])])


def test_in_batch_sharing_computes_a_new_prefix_once_in_a_batched_prefill():
    common = list(range(100, 164))
    reqs = lambda: [SimRequest(torch.tensor(common + [i]), rid=f"r{i}") for i in range(4)]  # noqa: E731
    without = simulate_schedule(reqs(), 1024, Scheduler("lpm"))
    with_ = simulate_schedule(reqs(), 1024, Scheduler("lpm", in_batch=True))
    assert without.computed == 4 * 65 and with_.computed == 65 + 3
    serial = simulate_schedule(reqs(), 1024, Scheduler("lpm"), batched=False)
    assert serial.computed == 65 + 3


def _random_batch(rng, n, maxlen, vocab):
    ps = set()
    while len(ps) < n:
        ps.add(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, maxlen))))
    return [list(p) for p in sorted(ps)]


@pytest.mark.parametrize("seed", range(6))
def test_theorem_dfs_order_is_optimal_with_a_big_enough_cache(seed):
    rng = random.Random(seed)
    for _ in range(15):
        ps = _random_batch(rng, rng.randint(2, 5), 6, rng.choice([2, 3]))
        capacity = max(map(len, ps)) + rng.randint(0, 3)
        best, _ = best_order(ps, capacity)
        assert sequential_cost(ps, capacity, dfs_weight_order(ps)) == best == edge_sum(ps)


def test_a_small_cache_breaks_the_bound():
    ps = [[0, 0, 0], [0, 0, 1]]
    assert edge_sum(ps) == 4 and best_order(ps, 1)[0] == 5 > edge_sum(ps)
    assert best_order(ps, 3)[0] == 4


def _stream(steps):
    """A loner arriving first, then a steady stream of requests sharing one cached prefix."""
    hot = list(range(200, 232))
    reqs = [SimRequest(torch.tensor([7] * 20), rid="loner")]
    reqs += [SimRequest(torch.tensor(hot + [i % 100, i // 100]), arrival=i, rid=f"s{i}")
             for i in range(steps)]
    return reqs


def test_lpm_starves_a_loner_and_aging_bounds_its_wait():
    warm = [SimRequest(torch.tensor(list(range(200, 232)) + [0]), rid="warm")]
    starved = simulate_schedule(warm + _stream(40), 256, Scheduler("lpm"), token_budget=8)
    loner = next(r for r in starved.requests if r.rid == "loner")
    assert loner.wait == 40  # served only after the stream dries up
    for k in (0, 3, 10):
        aged = simulate_schedule(warm + _stream(40), 256, Scheduler("lpm", max_wait_steps=k),
                                 token_budget=8)
        assert next(r for r in aged.requests if r.rid == "loner").wait <= k + 1
        assert max(r.wait for r in aged.requests) <= k + 2


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.sampled_from(POLICIES), st.integers(0, 10_000))
def test_no_request_waits_past_the_aging_limit(limit, policy, seed):
    rng = random.Random(seed)
    reqs = [SimRequest(torch.tensor([rng.randrange(4) for _ in range(rng.randint(2, 8))]),
                       max_new_tokens=rng.randint(1, 3), arrival=rng.randrange(6), rid=str(i))
            for i in range(8)]
    res = simulate_schedule(reqs, 32, Scheduler(policy, max_wait_steps=limit, seed=seed),
                            token_budget=6)
    assert all(r.finished_step is not None for r in res.requests)
    # one step per older request that may be ahead of it in the aged queue
    assert max(r.wait for r in res.requests) <= limit + len(reqs)


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "sjf"}, "unknown schedule policy 'sjf'"),
    ({"lpm_max_queue": -1}, "lpm_max_queue must be an int >= 0"),
    ({"in_batch_max_cached": -3}, "in_batch_max_cached"),
    ({"in_batch_min_shared": 0}, "in_batch_min_shared must be an int >= 1"),
    ({"max_wait_steps": -1}, "max_wait_steps"),
    ({"max_wait_steps": 2.5}, "max_wait_steps"),
    ({"in_batch": "yes"}, "in_batch must be True or False"),
    ({"in_batch_rule": "vllm"}, "in_batch_rule must be one of minirt, sglang"),
    ({"dfs_walk": "tree"}, "dfs_walk must be one of prompts, cache"),
])
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Scheduler(**kwargs)
    assert issubclass(ScheduleError, MinirtError) and issubclass(ScheduleError, ValueError)


def test_engine_rejects_a_bad_schedule(model):
    with pytest.raises(ScheduleError, match="unknown schedule policy"):
        Engine(model, capacity=32, schedule="shortest")
    with pytest.raises(ScheduleError, match="policy name"):
        Engine(model, capacity=32, schedule=3)
    with pytest.raises(ScheduleError, match="reads the cache"):
        Scheduler("lpm").order([])
    with pytest.raises(ScheduleError, match="permutation"):
        sequential_cost([[1], [2]], 4, [0, 0])


def test_cache_agnostic_policies_do_not_read_the_cache():
    """FCFS, LOF and random cost a sort, not a lookup per waiting request (section 4.1)."""

    class NoPeek:
        def peek_prefix_len(self, *args, **kwargs):
            raise AssertionError("peeked")

    reqs = [SimRequest(torch.tensor([1, 2, 3]), arrival=i, rid=str(i)) for i in range(3)]
    for policy in ("fcfs", "lof", "random"):
        assert sorted(Scheduler(policy, in_batch=True, in_batch_rule="sglang")
                      .order(reqs, NoPeek()), key=lambda r: r.arrival) == reqs
    with pytest.raises(AssertionError, match="peeked"):
        Scheduler("lpm").order(reqs, NoPeek())
