"""The online engine on tiny_model: ``submit`` / ``step`` / ``cancel`` with requests arriving
while others run give the tokens ``generate`` gives, with the pool and cache intact after
every step; TTFT counts from each request's own arrival; stop strings end a request."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minirt.llama as llama
from minirt.engine import Engine, RequestHandle
from minirt.errors import RequestError
from minirt.lifecycle import greedy_reference
from minirt.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


def idle(engine: Engine) -> bool:
    """Nothing locked, nothing private: every slot is free or evictable."""
    return (engine.cache.protected_size == 0 and not engine.lifecycle.requests
            and engine.pool.num_free + engine.cache.evictable_size == engine.pool.capacity)


@st.composite
def traffic(draw):
    """Prompts sharing stems, each arriving at some step, some cancelled a few steps later."""
    stems = draw(st.lists(st.lists(st.integers(0, 127), min_size=1, max_size=8),
                          min_size=1, max_size=3))
    n = draw(st.integers(1, 7))
    prompts, max_new, arrive, cancel = [], [], [], []
    for _ in range(n):
        prompt = draw(st.sampled_from(stems)) + draw(st.lists(st.integers(0, 127), max_size=5))
        prompts.append(prompt)
        max_new.append(draw(st.integers(1, 5)))
        arrive.append(draw(st.integers(0, 6)))
        cancel.append(draw(st.none() | st.integers(0, 4)))  # steps after arrival, or never
    page_size = draw(st.sampled_from([1, 2, 4]))
    need = max(-(-(len(p) + m - 1) // page_size) * page_size
               for p, m in zip(prompts, max_new, strict=True))
    capacity = max(need, draw(st.integers(need, need + 40)) // page_size * page_size)
    budget = draw(st.integers(1, 30))
    return prompts, max_new, arrive, cancel, page_size, capacity, budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_arrivals_and_cancellations_match_generate(model, workload):
    """Each request arrives at its step, some are cancelled (waiting or running); every
    request that runs to its end gets exactly generate's tokens, a cancelled one a prefix
    of them, and pool and cache pass the integrity check after every step."""
    prompts, max_new, arrive, cancel, page_size, capacity, budget = workload
    batch = [Request(prompt=p, max_new_tokens=m, stop_on_eos=False)
             for p, m in zip(prompts, max_new, strict=True)]
    want = Engine(model, capacity=512, page_size=page_size).generate(batch, progress=False)
    engine = Engine(model, capacity=capacity, page_size=page_size, token_budget=budget,
                    check=True)
    handles: dict[int, RequestHandle] = {}
    step = 0
    while len(handles) < len(batch) or engine.has_work:
        for i, t in enumerate(arrive):
            if t == step:
                handles[i] = engine.submit(batch[i])
        for i, h in handles.items():
            if cancel[i] is not None and arrive[i] + cancel[i] == step and not h.done:
                assert engine.cancel(h) and h.status == "cancelled"
                engine.lifecycle.check_integrity()
        before = {h.rid: len(h.output_ids) for h in handles.values()}
        out = engine.step()
        engine.lifecycle.check_integrity()
        assert all(h.status == "finished" for h in out.finished)
        for h in handles.values():  # the step reports exactly the tokens it appended
            new = [tok for rid, tok in out.tokens if rid == h.rid]
            assert h.output_ids == h.output_ids[:before[h.rid]] + new
        step += 1
        assert step < 200, "the engine stopped making progress"
    assert idle(engine)
    for i, h in handles.items():
        assert h.done and h.result.output_ids == h.output_ids
        if h.status == "finished":
            assert h.output_ids == want[i].output_ids
            assert h.result.finish_reason == "length" and h.result.metrics.ttft >= 0
        else:
            assert h.output_ids == want[i].output_ids[:len(h.output_ids)]
            assert h.result.finish_reason == "cancelled"
            assert (h.result.metrics is None) == (h.output_ids == [])


def test_arrival_while_others_run_shares_their_prefix(model):
    """B arrives while A decodes and finds A's prompt in the tree (inserted at prefill); the
    step that admits B prefills it and decodes A in one forward pass (a mixed step)."""
    a = list(range(10, 30))
    engine = Engine(model, capacity=128, check=True)
    ha = engine.submit(Request(prompt=a, max_new_tokens=6, stop_on_eos=False))
    first = engine.step()
    assert [h.rid for h in first.admitted] == [ha.rid] and first.num_tokens == 1
    assert ha.status == "running" and len(ha.output_ids) == 1
    hb = engine.submit(Request(prompt=a[:15] + [99, 98], max_new_tokens=3, stop_on_eos=False))
    assert hb.status == "waiting" and engine.waiting == [hb] and engine.running == [ha]
    with mock.patch.object(llama, "llama_forward", wraps=llama.llama_forward) as passes:
        out = engine.step()
    assert out.admitted == [hb] and hb.cached_tokens == 15
    # One pass: B's prefill gives its first token, A's decode its second, beside it.
    assert passes.call_count == 1 and out.admit_s > 0 and out.forward_s > 0
    assert out.tokens == [(hb.rid, hb.output_ids[0]), (ha.rid, ha.output_ids[1])]
    while engine.has_work:
        engine.step()
    assert ha.output_ids == greedy_reference(model, a, 6)
    assert hb.output_ids == greedy_reference(model, a[:15] + [99, 98], 3)
    assert hb.result.metrics.cached_tokens == 15 and idle(engine)
    assert engine.step().tokens == []  # nothing pending: a step does nothing


def test_ttft_counts_from_the_requests_own_arrival(model):
    engine = Engine(model, capacity=256)
    long = engine.submit(Request(prompt=[1, 2, 3], max_new_tokens=30, stop_on_eos=False))
    for _ in range(10):
        engine.step()
    time.sleep(0.05)
    t1 = time.perf_counter()
    late = engine.submit(Request(prompt=[4, 5], max_new_tokens=2, stop_on_eos=False))
    old = engine.submit(Request(prompt=[6, 7], max_new_tokens=2, stop_on_eos=False),
                        arrival=time.perf_counter() - 5.0)
    while engine.has_work:
        engine.step()
    end = time.perf_counter()
    # late's clock started at its own submit, not when the engine (or `long`) started.
    assert late.result.metrics.ttft <= late.result.metrics.latency <= end - t1
    assert long.result.metrics.latency > end - t1 + 0.05
    assert old.result.metrics.ttft >= 5.0  # an explicit, earlier arrival


def test_cancel_frees_everything_and_says_what_it_did(model):
    engine = Engine(model, capacity=64, check=True)
    run = engine.submit(Request(prompt=list(range(1, 12)), max_new_tokens=8, stop_on_eos=False))
    wait = engine.submit(Request(prompt=list(range(40, 60)), max_new_tokens=8), arrival=0.0)
    engine.step()
    assert run.status == "running" and wait.status == "running"
    late = engine.submit(Request(prompt=[3, 3, 3], max_new_tokens=60))  # cannot fit yet
    engine.step()
    assert late.status == "waiting" and engine.lifecycle.counters()["private"] > 0
    assert engine.cancel(late) and late.result.metrics is None and late.output_ids == []
    assert engine.cancel(run.rid) and run.status == "cancelled"
    assert run.result.metrics.output_tokens == len(run.output_ids) == 2  # first, one decode
    assert engine.cancel(wait)
    assert idle(engine) and not engine.has_work
    assert engine.cache.match_prefix(list(range(1, 12))).cached_len == 11  # prompt stays cached
    assert not engine.cancel(run)  # already cancelled
    with pytest.raises(RequestError, match="no request 'nope'"):
        engine.cancel("nope")
    with pytest.raises(RequestError, match="empty prompt"):
        engine.submit(Request(prompt=[]))
    assert not engine.has_work and engine.lifecycle.requests == {}


class CharTokenizer:
    """id = ord(char): enough to decode tiny_model's outputs (ids < 128) as text."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_strings_end_a_request_and_cut_its_text(model):
    prompt = [20, 21, 22, 23]
    greedy = greedy_reference(model, prompt, 12)
    engine = Engine(model, CharTokenizer(), capacity=128, check=True)
    stop = chr(greedy[4]) + chr(greedy[5])
    cut = "".join(map(chr, greedy)).find(stop)
    res = engine.generate([Request(prompt=prompt, max_new_tokens=12, stop=[stop, "\x7f\x7f"]),
                           Request(prompt=prompt, max_new_tokens=12)], progress=False)
    assert res[0].output_ids == greedy[:cut + 2] and res[0].finish_reason == "stop"
    assert res[0].text == "".join(map(chr, greedy[:cut]))
    assert res[1].output_ids == greedy and res[1].finish_reason == "length"
    for bad in ("x", [""], [3]):
        with pytest.raises(RequestError, match="stop must be"):
            engine.validate(Request(prompt=prompt, stop=bad))
    with pytest.raises(RequestError, match="tokenizer"):
        Engine(model, capacity=64).validate(Request(prompt=prompt, stop=["a"]))


def test_a_failing_sampler_fails_its_own_request_only(model, monkeypatch):
    """The engine isolates a sampling failure: that request finishes with reason "error",
    the greedy one in the same steps gets the tokens it gets alone."""
    from minirt import request as request_module

    alone = Engine(model, capacity=256).generate(
        [Request(prompt=[1, 2, 3, 4], max_new_tokens=6)], progress=False)[0].output_ids

    def broken(*args, **kwargs):
        raise RuntimeError("probability tensor contains inf, nan or element < 0")

    monkeypatch.setattr(request_module, "sample_token", broken)
    eng = Engine(model, capacity=256)
    good = eng.submit(Request(prompt=[1, 2, 3, 4], max_new_tokens=6))
    bad_one = eng.submit(Request(prompt=[5, 6, 7], max_new_tokens=6, temperature=0.7))
    while eng.has_work:
        eng.step()
    assert good.result.output_ids == alone and good.result.finish_reason == "length"
    assert bad_one.result.finish_reason == "error" and not bad_one.result.ok
    assert "probability tensor" in str(bad_one.result.error)
    assert eng.lifecycle.counters()["private"] == 0 and eng.lifecycle.counters()["protected"] == 0
    assert idle(eng)


def test_tiny_temperatures_run_at_the_floor_and_seeds_are_64_bit(model):
    """A positive temperature below MIN_TEMPERATURE samples as MIN_TEMPERATURE (no inf, no
    NaN: the step goes on); a seed outside int64 is rejected at submit, nothing queued."""
    from minirt.request import MIN_TEMPERATURE

    def run(t: float) -> list[int]:
        r = Request(prompt=[1, 2, 3], max_new_tokens=5, temperature=t, seed=7)
        return Engine(model, capacity=128).generate([r], progress=False)[0].output_ids

    assert run(1e-38) == run(5e-324) == run(MIN_TEMPERATURE)
    engine = Engine(model, capacity=128)
    for seed in (2**63, -2**63 - 1, 10**30):
        with pytest.raises(RequestError, match=r"seed must be None or an int in \["):
            engine.submit(Request(prompt=[1, 2], seed=seed, temperature=1.0))
    assert not engine.has_work
    engine.submit(Request(prompt=[1, 2], seed=-2**63, temperature=1.0, max_new_tokens=2))
    assert engine.has_work
