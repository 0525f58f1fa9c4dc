"""The serving engine on tiny_model: cache on == cache off == plain greedy, with evictions;
integrity after every step; FCFS within the token budget; bad requests rejected alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirt.chat import ChatScript, serve_chat
from minirt.engine import Engine
from minirt.errors import RequestError
from minirt.lifecycle import greedy_reference
from minirt.request import Request, sample_token, summarize
from minirt.workloads import unique_prefix_count

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


def reqs(prompts, n=3, **kw):
    return [Request(prompt=p, max_new_tokens=n, stop_on_eos=False, **kw) for p in prompts]


@st.composite
def workloads(draw):
    """Prompts that share prefixes: branches off a few stems, some repeated or extended."""
    stems = draw(st.lists(st.lists(st.integers(0, 127), min_size=1, max_size=10),
                          min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, 6))):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, 127), max_size=6))
        prompts.append(stem + tail if stem + tail else [1])
    max_new = draw(st.lists(st.integers(1, 4), min_size=len(prompts), max_size=len(prompts)))
    page_size = draw(st.sampled_from([1, 2, 4]))
    need = max(-(-(len(p) + m - 1) // page_size) * page_size
               for p, m in zip(prompts, max_new, strict=True))
    capacity = draw(st.integers(need, need + 48)) // page_size * page_size
    capacity = max(capacity, need)
    budget = draw(st.integers(1, 40))
    return prompts, max_new, page_size, capacity, budget


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_cache_on_equals_cache_off_equals_greedy(model, workload):
    """Any workload, any pool size (evictions included), any page size, whole prompts or
    chunked prefill: identical tokens."""
    prompts, max_new, page_size, capacity, budget = workload
    batch = [Request(prompt=p, max_new_tokens=m, stop_on_eos=False)
             for p, m in zip(prompts, max_new, strict=True)]
    outs = {}
    for use_cache, chunked in ((True, False), (False, False), (True, True)):
        engine = Engine(model, capacity=capacity, page_size=page_size, use_cache=use_cache,
                        token_budget=budget, check=True,  # integrity after every step
                        chunked_prefill=chunked)
        # Two rounds: the second meets a cache the first left behind (and may evict it).
        outs[use_cache, chunked] = [engine.generate(batch, progress=False) for _ in range(2)]
        engine.lifecycle.check_integrity()
        assert engine.pool.num_free + engine.cache.evictable_size == capacity  # nothing held
    on, off, chunks = outs[True, False], outs[False, False], outs[True, True]
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on.outputs == r_off.outputs
        assert r_off.totals.cached_tokens == 0
    expected = [greedy_reference(model, p, m) for p, m in zip(prompts, max_new, strict=True)]
    assert on[0].outputs == expected == on[1].outputs
    assert chunks[0].outputs == expected == chunks[1].outputs
    for t in (on[0].totals, on[1].totals, chunks[0].totals, chunks[1].totals):
        assert t.cached_tokens + t.computed_tokens == t.prompt_tokens == sum(map(len, prompts))


def test_chunked_prefill_fills_the_budget_and_goes_on_first(model):
    """Budget 8, prompts of 5, 6 and 20 tokens: whole prompts take 5, 6, 20 tokens in three
    steps; chunked prefill fills every step with 8 (5 + 3, then 3 + 5, ...), a part-way
    prompt going on before anything newer, its first token with its last chunk."""
    prompts = [list(range(1, 6)), list(range(10, 16)), list(range(20, 40))]
    expected = [greedy_reference(model, p, 3) for p in prompts]
    plans = {}
    for chunked in (False, True):
        engine = Engine(model, capacity=128, token_budget=8, check=True,
                        chunked_prefill=chunked)
        handles = [engine.submit(r) for r in reqs(prompts)]
        out = engine.step()
        plans[chunked] = [out.prefilled]
        if chunked:
            assert [h.status for h in handles] == ["running", "prefilling", "waiting"]
            assert [h.rid for h in out.admitted] == ["q1"]
            assert engine.running == [handles[1], handles[0]]
            assert handles[1].output_ids == [] and handles[1].lc.kv_len == 3
        while engine.has_work:
            plans[chunked].append(engine.step().prefilled)
        assert [h.result.output_ids for h in handles] == expected
    assert [p for p in plans[False] if p] == [[("q1", 5)], [("q2", 6)], [("q3", 20)]]
    assert [p for p in plans[True] if p] == [[("q1", 5), ("q2", 3)], [("q2", 3), ("q3", 5)],
                                             [("q3", 8)], [("q3", 7)]]
    assert handles[2].result.metrics.prefill_time > 0
    with pytest.raises(RequestError, match="chunked_prefill must be True or False"):
        Engine(model, chunked_prefill=1)


def test_cancelling_a_part_way_prompt_frees_it_and_leaves_the_others_alone(model):
    prompts = [list(range(1, 30)), list(range(40, 46))]
    engine = Engine(model, capacity=64, token_budget=10, check=True, chunked_prefill=True)
    long, short = (engine.submit(r) for r in reqs(prompts, n=4))
    engine.step()
    assert long.status == "prefilling" and engine.pool.num_used == 29
    assert engine.cancel(long) and long.status == "cancelled"
    assert long.result.metrics is None and long.result.finish_reason == "cancelled"
    assert engine.pool.num_used == 0 and engine.cache.total_size == 0
    while engine.has_work:
        engine.step()
    assert short.result.output_ids == greedy_reference(model, prompts[1], 4)
    assert engine.pool.num_free + engine.cache.evictable_size == 64


def test_large_pool_computes_the_unique_bound(model):
    """Distinct prompts, none a prefix of another: a cache that never evicts computes each
    distinct prefix once, so computed tokens == the bound; without cache, every token."""
    stem = list(range(10, 30))
    prompts = [stem + [40 + i, 50 + i] for i in range(4)] + [[7, 8, 9]]
    bound = unique_prefix_count(prompts)
    on = Engine(model, capacity=256).generate(reqs(prompts), progress=False).totals
    off = Engine(model, capacity=256, use_cache=False).generate(reqs(prompts),
                                                                  progress=False).totals
    assert on.computed_tokens == on.unique_bound == bound == 20 + 4 * 2 + 3
    assert on.cached_tokens == 3 * 20 and on.hit_rate == pytest.approx(60 / 91)
    assert off.computed_tokens == off.prompt_tokens == 91 and off.evicted_tokens == 0


def test_last_prompt_token_is_always_computed(model):
    """Sending the same prompt twice: all but its last token hit; the last one is computed."""
    p = list(range(1, 13))
    engine = Engine(model, capacity=64)
    first = engine.generate(reqs([p], n=2), progress=False)[0]
    again = engine.generate(reqs([p], n=2), progress=False)[0]
    assert first.metrics.cached_tokens == 0 and again.metrics.cached_tokens == len(p) - 1
    assert again.metrics.computed_tokens == 1 and again.output_ids == first.output_ids


def test_small_pool_evicts_and_still_matches(model):
    prompts = [[i] * 6 + list(range(20, 30)) for i in range(1, 7)]
    engine = Engine(model, capacity=24, check=True)
    res = engine.generate(reqs(prompts, n=4), progress=False)
    assert res.totals.evicted_tokens > 0 and engine.evicted_tokens == res.totals.evicted_tokens
    assert res.outputs == [greedy_reference(model, p, 4) for p in prompts]


def test_fcfs_within_token_budget(model):
    """A budget of 8 admits one 10-token prompt per step: the others wait, in order, while
    the running request decodes; first tokens come out in arrival order."""
    prompts = [list(range(i * 10, i * 10 + 10)) for i in range(3)]
    events = []
    engine = Engine(model, capacity=128, token_budget=8)
    res = engine.generate(reqs(prompts, n=3), progress=False,
                          on_token=lambda rid, tok: events.append(rid))
    rids = [r.rid for r in res]
    firsts = [events.index(rid) for rid in rids]
    assert firsts == sorted(firsts)
    # One admission a step: request 1's first token comes a step after request 0's, in
    # the pass where request 0 decodes its second.
    assert events[: firsts[1] + 2] == [rids[0], rids[1], rids[0]]
    ttfts = [r.metrics.ttft for r in res]
    assert ttfts == sorted(ttfts)
    big = Engine(model, capacity=128, token_budget=100)
    events.clear()
    big.generate(reqs(prompts, n=3), progress=False, on_token=lambda rid, tok: events.append(rid))
    assert len(set(events[:3])) == 3  # all three prefilled before the first decode step


def test_streaming_callback_sees_every_token_in_order(model):
    prompts = [[3, 4, 5], [3, 4, 6, 7]]
    seen: dict[str, list[int]] = {}
    res = Engine(model, capacity=64).generate(
        reqs(prompts, n=5), progress=False,
        on_token=lambda rid, tok: seen.setdefault(rid, []).append(tok))
    assert {r.rid: r.output_ids for r in res} == seen


def test_memory_wait_no_oom_mid_decode(model):
    """Each request needs 12 of 16 slots: only one fits at a time, the rest wait."""
    prompts = [[i, i + 1, i + 2] for i in range(1, 30, 7)]
    engine = Engine(model, capacity=16, check=True)
    res = engine.generate(reqs(prompts, n=10), progress=False)
    assert res.outputs == [greedy_reference(model, p, 10) for p in prompts]


def test_eos_stops_early(model):
    p = [5, 6, 7, 8]
    greedy = greedy_reference(model, p, 6)
    engine = Engine(model, capacity=64)
    engine.eos_token_id = greedy[2]
    r = engine.generate([Request(prompt=p, max_new_tokens=6)], progress=False)[0]
    cut = greedy.index(greedy[2]) + 1
    assert r.output_ids == greedy[:cut] and r.finish_reason == "eos"
    r2 = engine.generate([Request(prompt=p, max_new_tokens=6, stop_on_eos=False)],
                         progress=False)[0]
    assert r2.output_ids == greedy and r2.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    p = [9, 8, 7, 6]
    alone = Engine(model, capacity=64).generate(
        reqs([p], n=8, temperature=1.5, top_k=20, seed=11), progress=False)[0]
    mixed = Engine(model, capacity=64, use_cache=False).generate(
        reqs([[1, 2], p, [3]], n=8, temperature=1.5, top_k=20, seed=11), progress=False)[1]
    other = Engine(model, capacity=64).generate(
        reqs([p], n=8, temperature=1.5, top_k=20, seed=12), progress=False)[0]
    assert alone.output_ids == mixed.output_ids
    assert other.output_ids != alone.output_ids
    assert alone.output_ids != greedy_reference(model, p, 8)


def test_sample_token_top_k_and_greedy():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample_token(logits) == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample_token(logits, 1.0, 2, g) for _ in range(200)}
    assert draws == {1, 2}


BAD = [
    (Request(prompt=[], max_new_tokens=2), "empty prompt"),
    (Request(prompt=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (Request(prompt=[1, 2], max_new_tokens=-3), "max_new_tokens"),
    (Request(prompt=list(range(100)), max_new_tokens=2), "pool holds only 40"),
    (Request(prompt=[1, 2], max_new_tokens=40), "pool holds only 40"),
    (Request(prompt=[1, 999]), "outside the model's vocabulary"),
    (Request(prompt=[1, -2]), "non-negative"),
    (Request(prompt=[1.5, 2.0]), "integer"),
    (Request(prompt=[[1, 2]]), "1-D"),
    (Request(), "exactly one of"),
    (Request(prompt=[1], messages=[{"role": "user", "content": "hi"}]), "exactly one of"),
    (Request(messages=[{"role": "user", "content": "hi"}]), "chat template"),
    (Request(prompt=[1], temperature=-1.0), "temperature"),
    (Request(prompt=[1], top_k=-1), "top_k"),
    (Request(prompt=[1], seed="x"), "seed"),
    (Request(prompt=[1], priority=1.5), "priority"),
]


@pytest.mark.parametrize("bad, words", BAD, ids=[w for _, w in BAD])
def test_bad_request_rejected_alone(model, bad, words):
    """The bad request gets a clear RequestError; the good ones around it are served
    exactly as without it, and the pool and cache end as they would have."""
    good = [[1, 2, 3, 4, 5], [1, 2, 3, 9]]
    alone = Engine(model, capacity=40, check=True)
    want = alone.generate(reqs(good, n=3), progress=False)
    engine = Engine(model, capacity=40, check=True)
    res = engine.generate([*reqs(good[:1], n=3), bad, *reqs(good[1:], n=3)], progress=False)
    assert not res[1].ok and isinstance(res[1].error, RequestError)
    assert words in str(res[1].error) and res[1].output_ids == []
    assert res[1].finish_reason == "rejected" and res[1].metrics is None
    assert [res[0].output_ids, res[2].output_ids] == want.outputs
    assert res.totals.rejected == 1 and res.totals.requests == 3
    assert res.totals.computed_tokens == want.totals.computed_tokens
    assert engine.pool.snapshot() == alone.pool.snapshot()
    assert engine.cache.all_values().tolist() == alone.cache.all_values().tolist()
    with pytest.raises(RequestError, match=words):
        engine.validate(bad)


def test_not_a_request_and_duplicate_rid(model):
    engine = Engine(model, capacity=40)
    res = engine.generate([{"prompt": [1]}, *reqs([[4, 5]], n=1)], progress=False)
    assert not res[0].ok and "Request" in str(res[0].error) and res[1].ok
    res = engine.generate([Request(prompt=[1, 2], rid="a"), Request(prompt=[3], rid="a")],
                          progress=False)
    assert res[0].ok and not res[1].ok and "already in use" in str(res[1].error)
    with pytest.raises(RequestError, match="token_budget"):
        Engine(model, capacity=40, token_budget=0)


def test_flush_and_priority_policy(model):
    engine = Engine(model, capacity=64, policy="priority")
    engine.generate(reqs([[1, 2, 3, 4, 5, 6]], n=1, priority=5), progress=False)
    engine.generate(reqs([[9, 8, 7, 6, 5, 4]], n=1), progress=False)
    # Evict 5 tokens: the priority-0 prompt goes first although it is more recent.
    engine.pool.free(engine.cache.evict(5))
    kept = engine.cache.match_prefix([1, 2, 3, 4, 5, 6]).cached_len
    gone = engine.cache.match_prefix([9, 8, 7, 6, 5, 4]).cached_len
    assert (kept, gone) == (6, 0)
    assert engine.flush() == 6 and engine.cache.total_size == 0
    assert engine.pool.num_free == 64


class CharTokenizer:
    """A character-level stand-in for a chat tokenizer: id = ord(char) (ASCII only)."""

    chat_template = "plain"
    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_serve_chat_reuses_each_previous_turn(model):
    """Turn k+1 is sent after turn k's answer and finds turn k's prompt and answer cached."""
    script = ChatScript("sys!", [["hi", "more", "bye"], ["yo", "again", "ok"]])
    engine = Engine(model, CharTokenizer(), capacity=512, check=True)
    run = serve_chat(engine, script, max_new_tokens=4, progress=False)
    assert len(run.turns) == 3 and all(len(t) == 2 for t in run.turns)
    for c in range(2):
        for k in range(1, 3):
            prev, cur = run.turns[k - 1][c], run.turns[k][c]
            assert cur.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
            # Everything with K/V from the last turn (prompt + output but its last) is reused.
            assert cur.metrics.cached_tokens >= len(prev.prompt_ids) + len(prev.output_ids) - 1
    assert run.conversations[0][-1] == {"role": "assistant", "content": run.turns[2][0].text}
    bad = engine.generate([Request(messages=[{"content": "no role"}]),
                           Request(messages=[{"role": "user", "content": "ok"}],
                                   max_new_tokens=2)], progress=False)
    assert not bad[0].ok and "chat template" in str(bad[0].error) and bad[1].ok
    off = serve_chat(Engine(model, CharTokenizer(), capacity=512, use_cache=False), script,
                     max_new_tokens=4, progress=False)
    assert [r.output_ids for r in off.results] == [r.output_ids for r in run.results]
    total = run.totals()
    assert total.requests == 6 and total.computed_tokens == summarize(run.results).computed_tokens
    assert total.unique_bound == unique_prefix_count([r.prompt_ids for r in run.results])


def test_interrupted_generate_gives_everything_back(model):
    """A callback that raises mid-flight (like Ctrl-C in a notebook): the error propagates,
    nothing stays locked or leaked, and the engine serves the next call normally."""
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [9, 9]]
    engine = Engine(model, capacity=64, check=True)
    seen = []

    def boom(rid, tok):
        seen.append(rid)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate(reqs(prompts, n=4), progress=False, on_token=boom)
    engine.lifecycle.check_integrity()
    assert engine.cache.protected_size == 0 and engine.lifecycle.requests == {}
    assert engine.pool.num_free + engine.cache.evictable_size == 64
    res = engine.generate(reqs(prompts, n=4), progress=False)
    assert res.outputs == [greedy_reference(model, p, 4) for p in prompts]


@pytest.mark.parametrize("page_size", [1, 16])
def test_deterministic_engine_gives_the_same_tokens_cached_or_not_batched_or_alone(page_size):
    """``Engine(deterministic=True)`` in bf16: 16 requests behind one 40-token prefix give the
    same greedy tokens with and without the cache, 16 in a batch or one at a time, whole or
    prefilled 7 tokens a step (chunked prefill; chunks of 16 keys, so the prefix spans
    chunks)."""
    from unittest import mock

    import minirt.attention as attention
    from minirt.model import fuse_projections, tiny_model

    m = tiny_model(7).to(torch.bfloat16)
    fuse_projections(m)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 128, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 128, (1 + i % 5,), generator=gen).tolist()
               for i in range(16)]
    runs = {}
    with mock.patch.object(attention, "CHUNK", 16):
        for use_cache, budget in ((True, 2048), (False, 2048), (True, 7)):
            for batch in (16, 4, 1):
                engine = Engine(m, capacity=1024, page_size=page_size, use_cache=use_cache,
                                deterministic=True, check=True, token_budget=budget,
                                chunked_prefill=budget == 7)
                out = []
                for i in range(0, 16, batch):
                    out += [r.output_ids for r in engine.generate(reqs(prompts[i:i + batch], 6),
                                                                   progress=False)]
                runs[use_cache, budget, batch] = out
                if use_cache and batch == 16:
                    assert sum(r.metrics.cached_tokens for r in
                               engine.generate(reqs(prompts, 1), progress=False)) > 0
    first = runs[False, 2048, 1]
    assert all(out == first for out in runs.values())
