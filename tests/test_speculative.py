"""Speculative decoding (minirt.speculative): greedy outputs with speculation equal those
without on tiny_model (any prompts, batch, cached prefix, k, page size, cache, chunked
prefill) and on the real model (fp32; bf16 in the deterministic mode, bitwise); rejection
sampling keeps the target's distribution; rejected K/V is rolled back, never cached, and a
request cancelled between its drafts and their verify, or a verify that fails, leaks nothing.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minirt.speculative as spec_mod
from minirt import engine as engine_mod
from minirt.engine import Engine
from minirt.errors import ModelError, OutOfMemoryError, RequestError
from minirt.lifecycle import Lifecycle, greedy_reference, node_path, state_snapshot
from minirt.pool import KVPool, PageTable
from minirt.radix import RadixNode
from minirt.request import Request, chat_prompt_ids
from minirt.speculative import (
    NgramProposer,
    SpeculativeConfig,
    Speculator,
    accept_greedy,
    check_speculative,
    rejection_sample,
    target_probs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


def reqs(prompts, n=8, **kw):
    return [Request(prompt=p, max_new_tokens=n, stop_on_eos=False, **kw) for p in prompts]


def tree_sequences(cache) -> list[list[int]]:
    """Every root-to-node token sequence the radix tree holds."""
    return [[t for u in node_path(n) for t in u.key.tolist()] for n in cache.nodes()
            if isinstance(n, RadixNode) and n.parent is not None]


def assert_tree_holds_only(cache, served: list[list[int]]) -> None:
    """Each sequence in the tree is a prefix of some request's prompt + accepted output."""
    for seq in tree_sequences(cache):
        assert any(s[:len(seq)] == seq for s in served), f"the tree holds {seq}, served nothing"


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("bad, words", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must be <="),
    ({"k": 4}, "unknown settings"),
    ({"method": "eagle"}, "not built"),
    ("ngram", "must be None, a SpeculativeConfig or a dict"),
])
def test_bad_settings_are_refused_before_anything_is_built(model, bad, words):
    with mock.patch.object(engine_mod.KVPool, "for_model", side_effect=AssertionError("built")):
        with pytest.raises(RequestError, match=words):
            Engine(model, capacity=64, speculative=bad)


def test_unsupported_combinations_are_refused_before_anything_is_built(model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with mock.patch.object(engine_mod.KVPool, "for_model", side_effect=AssertionError("built")):
        with pytest.raises(ModelError, match="not one"):
            Engine(gpt2, capacity=64, speculative={})
        with pytest.raises(ModelError, match="window cache"):
            Engine(model, capacity=64, cache="window", speculative={})
    assert check_speculative(None) is None
    assert check_speculative({"num_speculative_tokens": 2}) == SpeculativeConfig(
        num_speculative_tokens=2)


# ---------------------------------------------------------------- proposer and acceptance


def reference_proposal(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest n-gram suffix (lo..hi) seen earlier; what followed its earliest start."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 3))
def test_the_proposer_finds_the_longest_earliest_ngram(tokens, k, lo, extra):
    hi = lo + extra
    assert NgramProposer(k, lo, hi).propose(tokens) == reference_proposal(tokens, k, lo, hi)


def test_the_proposer_on_examples():
    p = NgramProposer(3, 2, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]  # "1 2 3" seen at 0: what followed
    assert p.propose([1, 2, 3, 4, 1, 2, 3], limit=1) == [4]
    assert p.propose([1, 2, 3, 4, 1, 2, 3], limit=0) == []
    assert p.propose([5, 1, 2, 9, 7, 1, 2]) == [9, 7, 1]  # only a 2-gram matches
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert NgramProposer(2, 1, 1).propose([7, 7, 7]) == [7, 7]  # overlapping: earliest first


def test_greedy_acceptance():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all + the bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the run, then the target's
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]
    with pytest.raises(RequestError, match="need 3 target tokens"):
        accept_greedy([1, 2], [1, 2])


# ---------------------------------------------------------------- rejection sampling

# chi-square's 0.999 quantile with 5 degrees of freedom (six categories): a correct sampler
# exceeds it once in a thousand seeds, and the seed is fixed.
CHI2_999_DF5 = 20.515


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def sample_first_two(sampler, probs, drafts, n, seed=0):
    """Counts of the first token and, where the first draft was accepted, of the second."""
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(probs.shape[1]), torch.zeros(probs.shape[1])
    for _ in range(n):
        out = sampler(drafts, probs, gen)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            second[out[1]] += 1
    return first, second


PROBS = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10],
                      [0.40, 0.05, 0.15, 0.10, 0.10, 0.20],
                      [0.10, 0.10, 0.10, 0.10, 0.30, 0.30]])


def test_rejection_sampling_keeps_the_target_distribution():
    """20,000 draws with a fixed seed, drafts [1, 0] (first likely, second likely): the first
    token's counts and the second's (after an accepted first draft, about 6,000 draws) fit the
    target's rows 0 and 1 (chi-square below its 0.999 quantile). At this size a sampler off
    by 0.03 in one token's probability lands far above it (the wrong samplers below)."""
    first, second = sample_first_two(rejection_sample, PROBS, [1, 0], 20000)
    assert chi_square(first, PROBS[0]) < CHI2_999_DF5
    assert second.sum() > 5000
    assert chi_square(second, PROBS[1]) < CHI2_999_DF5


def _always_accept(drafts, probs, gen):
    return [*drafts, int(torch.multinomial(probs[-1], 1, generator=gen))]


def _residual_keeps_draft(drafts, probs, gen):  # on rejection, draws from p itself
    out = []
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < float(probs[i, d]):
            out.append(d)
            continue
        return out + [int(torch.multinomial(probs[i], 1, generator=gen))]
    return out + [int(torch.multinomial(probs[-1], 1, generator=gen))]


@pytest.mark.parametrize("wrong", [_always_accept, _residual_keeps_draft])
def test_the_distribution_test_rejects_wrong_samplers(wrong):
    first, _ = sample_first_two(wrong, PROBS, [1, 0], 20000)
    assert chi_square(first, PROBS[0]) > CHI2_999_DF5


def test_target_probs_follow_temperature_and_top_k():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert torch.allclose(target_probs(logits, 1.0), torch.softmax(logits, -1))
    p = target_probs(logits, 0.5, top_k=2)
    assert p[2:].sum() == 0 and torch.allclose(p[:2], torch.softmax(logits[:2] / 0.5, -1))


def test_sampled_requests_speculate_and_stay_consistent(model):
    """Seeded sampled requests speculate through the rejection sampler: drafts verified, some
    accepted and some rejected, integrity and the speculation check after every step, and
    the same seeds give the same tokens in a second engine."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    outs = []
    for _ in range(2):
        engine = Engine(model, capacity=256, check=True, speculative={"prompt_lookup_min": 1})
        batch = [Request(prompt=prompt, max_new_tokens=12, stop_on_eos=False, temperature=0.2,
                         seed=s) for s in range(3)]
        outs.append(engine.generate(batch, progress=False).outputs)
        assert all(len(o) == 12 for o in outs[-1])
        stats = engine.speculator.stats
        assert stats.proposed > stats.accepted > 0 and stats.rolled_back > 0
        assert engine.pool.num_free + engine.cache.evictable_size == engine.pool.capacity
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- greedy equality


def _stemmed(draw, vocab=24):
    """Prompts with repeats (so drafts are proposed) off a few shared stems."""
    stems = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8),
                          min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, 6))):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, vocab - 1), max_size=5))
        prompts.append((stem + tail) * draw(st.integers(1, 3)) or [1])
    return prompts


@st.composite
def workloads(draw):
    prompts = _stemmed(draw)
    warm = draw(st.lists(st.sampled_from(prompts), max_size=2))  # cached prefixes
    max_new = draw(st.integers(1, 12))
    k = draw(st.integers(1, 5))
    page_size = draw(st.sampled_from([1, 2, 4]))
    cache = draw(st.sampled_from(["radix", "hash"]))
    chunked = draw(st.booleans())
    batch = draw(st.integers(1, len(prompts)))
    use_cache = draw(st.sampled_from([True, True, False]))
    return prompts, warm, max_new, k, page_size, cache, chunked, batch, use_cache


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_speculation_gives_the_tokens_plain_decode_gives(model, workload):
    """tiny_model (fp64, so no greedy tie flips on rounding): any prompts, batch sizes,
    cached prefixes, k, page sizes, both caches or none, whole or chunked prefill: the same tokens
    as without speculation; integrity and the speculation check after every step; the tree
    holds only prompts and accepted tokens."""
    prompts, warm, max_new, k, page_size, cache, chunked, batch, use_cache = workload
    outs = {}
    for speculative in (None, {"num_speculative_tokens": k, "prompt_lookup_min": 1}):
        engine = Engine(model, capacity=512, page_size=page_size, cache=cache, check=True,
                        token_budget=9 if chunked else 2048, chunked_prefill=chunked,
                        use_cache=use_cache, speculative=speculative)
        if warm:
            engine.generate(reqs(warm, 2), progress=False)
        out = []
        for i in range(0, len(prompts), batch):
            out += engine.generate(reqs(prompts[i:i + batch], max_new), progress=False).outputs
        outs[speculative is None] = out
        if cache == "radix":
            served = [p + o for p, o in zip(prompts, out, strict=True)]
            served += [w + o for w, o in zip(warm, engine.generate(reqs(warm, 2),
                                                                   progress=False).outputs,
                                             strict=True)]
            assert_tree_holds_only(engine.cache, served)
        assert engine.pool.num_free + engine.cache.evictable_size == engine.pool.capacity
    assert outs[True] == outs[False]


class _WrongDrafts:
    """A proposer whose drafts are mostly wrong: random tokens, a fixed seed."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k, self.vocab, self.gen = k, vocab, torch.Generator().manual_seed(0)

    def propose(self, tokens, limit=None, owner=None):
        n = self.k if limit is None else min(self.k, limit)
        return torch.randint(0, self.vocab, (max(n, 0),), generator=self.gen).tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_rejected_drafts_are_rolled_back_and_never_cached(model, page_size):
    """Random drafts, rejected nearly always: the same tokens as greedy decoding, rejected
    slots go back to the free list (counted), and no rejected token reaches the tree."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    engine = Engine(model, capacity=256, page_size=page_size, check=True,
                    speculative={"num_speculative_tokens": 4})
    engine.speculator.proposer = _WrongDrafts(4, 128)
    rejected_seen: list[list[int]] = []
    verify = spec_mod.Speculator._accept

    def watch(self, r, drafts, logits):  # each rejected draft, with what preceded it
        before = r.tokens.tolist()
        verify(self, r, drafts, logits)
        accepted = len(r.tokens) - len(before) - 1
        if accepted < len(drafts):
            rejected_seen.append(before + drafts[:accepted + 1])

    with mock.patch.object(spec_mod.Speculator, "_accept", watch):
        out = engine.generate(reqs(prompts, 10), progress=False).outputs
    assert out == [greedy_reference(model, p, 10) for p in prompts]
    stats = engine.speculator.stats
    assert stats.proposed > stats.accepted and stats.rolled_back > 0
    served = [p + o for p, o in zip(prompts, out, strict=True)]
    assert_tree_holds_only(engine.cache, served)
    held = tree_sequences(engine.cache)
    assert rejected_seen
    assert not any(s[:len(lost)] == lost for s in held for lost in rejected_seen)


def test_a_stop_string_met_inside_a_verify_step_cuts_there(model):
    """A stop string reached on an accepted draft: the tokens after it are taken back, so the
    output (and the cache) is what plain decoding gives."""

    class Digits:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6]
    plain = Engine(model, Digits(), capacity=256).generate(
        reqs([prompt], 16), progress=False).outputs[0]
    stop = " ".join(map(str, plain[3:5]))
    outs = []
    for speculative in (None, {"prompt_lookup_min": 1}):
        engine = Engine(model, Digits(), capacity=256, check=True, speculative=speculative)
        res = engine.generate(reqs([prompt], 16, stop=[stop]), progress=False).results[0]
        outs.append((res.output_ids, res.finish_reason))
    assert outs[0] == outs[1] and outs[0][1] == "stop"


def test_an_end_of_sequence_token_accepted_mid_run_ends_the_request(model):
    """With the model's first repeated token as end-of-sequence, speculation stops at it."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6]
    plain = greedy_reference(model, prompt, 12)
    eos = plain[2]
    outs = []
    for speculative in (None, {"prompt_lookup_min": 1}):
        engine = Engine(model, capacity=256, check=True, speculative=speculative)
        engine.eos_token_id = eos
        res = engine.generate([Request(prompt=prompt, max_new_tokens=12)], progress=False)
        outs.append(res.results[0].output_ids)
    assert outs[0] == outs[1] == plain[:plain.index(eos) + 1]


def test_speculation_under_a_host_tier_with_evictions(model):
    """A pool too small for the workload, a host tier under the radix cache (load-backs,
    write-through): the same tokens with speculation as without, integrity every step."""
    gen = torch.Generator().manual_seed(1)
    stems = [torch.randint(0, 32, (10,), generator=gen).tolist() for _ in range(3)]
    prompts = [(s + [i, i + 1]) * 2 for i, s in enumerate(stems * 3)]
    outs, evicted = [], []
    for speculative in (None, {"prompt_lookup_min": 1}):
        engine = Engine(model, capacity=96, page_size=2, host_capacity=512, check=True,
                        speculative=speculative)
        out = []
        for _ in range(2):
            out += engine.generate(reqs(prompts, 10), progress=False).outputs
        outs.append(out)
        evicted.append(engine.evicted_tokens)
    assert outs[0] == outs[1] and min(evicted) > 0
    assert engine.speculator.stats.rolled_back > 0


# ---------------------------------------------------------------- faults


def test_a_request_cancelled_between_draft_and_verify_leaks_no_slot(model):
    """Drafts are proposed at the end of a step and verified in the next: cancelled in
    between, the request's slots (none taken for its drafts yet) all go back."""
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7, 8]]
    engine = Engine(model, capacity=128, page_size=2, check=True,
                    speculative={"prompt_lookup_min": 1})
    victim, other = [engine.submit(r) for r in reqs(prompts, 20)]
    while not engine.speculator.draft_for(victim.lc):
        engine.step()
    assert victim.status == "running"
    assert len(victim.lc.page_table) == victim.lc.kv_len  # no slot taken for the drafts yet
    engine.cancel(victim)
    engine.lifecycle.check_integrity()
    counters = engine.lifecycle.counters()
    assert counters["private"] == int(other.lc.private.numel())
    while engine.has_work:
        engine.step()
    assert other.result.output_ids == greedy_reference(model, prompts[1], 20)
    assert engine.pool.num_free + engine.cache.evictable_size == engine.pool.capacity
    assert engine.speculator.draft_for(victim.lc) == []


def test_a_failed_verify_gives_back_what_it_took(model):
    """The forward pass raises after the verify's slots were taken: pool, tree and requests
    are exactly as before the step, the drafts still waiting."""
    pool = KVPool.for_model(model, 128, page_size=2)
    from minirt.cache import RadixCache

    lc = Lifecycle(model, pool, RadixCache(page_size=2))
    s = Speculator(lc, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    a = lc.new_request([3, 4, 5, 3, 4, 5, 3, 4], 12)
    b = lc.new_request([9, 8, 7, 9, 8], 12)
    for r in (a, b):
        lc.admit(r)
    s.step([a, b], [])
    for r in (a, b):
        lc.insert_running(r)
    assert s.draft_for(a)
    before, drafts = state_snapshot(lc), s.draft_for(a)
    with mock.patch.object(spec_mod, "forward_verify", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            s.step([], [a, b])
    assert state_snapshot(lc) == before and s.draft_for(a) == drafts
    lc.check_integrity()
    s.step([], [a, b])  # and it runs afterwards
    lc.check_integrity()
    s.check([a, b])


def test_a_verify_that_cannot_get_slots_changes_nothing(model):
    pool = KVPool.for_model(model, 8)
    from minirt.cache import RadixCache

    lc = Lifecycle(model, pool, RadixCache())
    s = Speculator(lc, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    a = lc.new_request([1, 2, 1, 2, 1, 2], 3)
    lc.admit(a)
    s.step([a], [])
    lc.insert_running(a)
    s.drafts[a.rid] = (a, [1, 2, 1])  # needs 4 slots; 2 are free, none evictable
    before = state_snapshot(lc)
    with pytest.raises(OutOfMemoryError, match="verify needs"):
        s.step([], [a])
    assert state_snapshot(lc) == before


# ---------------------------------------------------------------- deterministic mode


@pytest.mark.parametrize("which", ["tiny_model", "SmolLM2"])
def test_a_verified_position_has_the_bits_of_one_token_decode_in_deterministic_mode(which):
    """bf16, deterministic mode: the logits a verify extend gives at each of its positions
    (beside a prefill in the same pass) are bit for bit those of one-token decode steps at
    the same positions; 40 cached positions cross a 16-key chunk on tiny_model."""
    from minirt import attention
    from minirt.forward import forward_paged, forward_verify
    from minirt.model import fuse_projections, load_model, tiny_model

    if which == "tiny_model":
        m, chunk = tiny_model(7).to(torch.bfloat16), 16
    else:
        m, chunk = load_model(device="cpu", dtype=torch.bfloat16)[0], attention.CHUNK
    fuse_projections(m)
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 128, (45,), generator=gen)
    n_pre = 40
    with mock.patch.object(attention, "CHUNK", chunk):
        pool = KVPool.for_model(m, 128)
        table = PageTable(pool.alloc(45))
        forward_paged(m, pool, [PageTable(table.slots[:n_pre])], [seq[:n_pre]],
                      deterministic=True)
        steps = [forward_paged(m, pool, [PageTable(table.slots[:n + 1])], [seq[n:n + 1]],
                               deterministic=True)[0] for n in range(n_pre, 45)]
        pool2 = KVPool.for_model(m, 128)
        table2 = PageTable(pool2.alloc(45))
        other = PageTable(pool2.alloc(12))  # a prefill beside the verify in the same pass
        forward_paged(m, pool2, [PageTable(table2.slots[:n_pre])], [seq[:n_pre]],
                      deterministic=True)
        _, verify, _ = forward_verify(m, pool2, [other], [torch.arange(12)], [table2],
                                      [seq[n_pre:]], deterministic=True)
    assert [i for i in range(5) if not torch.equal(verify[0][i], steps[i])] == []


@pytest.mark.parametrize("page_size", [1, 16])
def test_deterministic_bf16_speculation_gives_the_same_tokens(page_size):
    """tiny_model in bf16, deterministic mode: speculation, batched or alone, cached prefix
    or not, gives the tokens plain decoding gives."""
    from minirt import attention
    from minirt.model import fuse_projections, tiny_model

    m = tiny_model(7).to(torch.bfloat16)
    fuse_projections(m)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 128, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 128, (1 + i % 5,), generator=gen).tolist()
               for i in range(6)]
    runs = {}
    with mock.patch.object(attention, "CHUNK", 16):
        for speculative in (None, {"prompt_lookup_min": 1}):
            for batch in (6, 1):
                engine = Engine(m, capacity=1024, page_size=page_size, deterministic=True,
                                check=True, speculative=speculative)
                out = []
                for i in range(0, 6, batch):
                    out += engine.generate(reqs(prompts[i:i + batch], 8),
                                           progress=False).outputs
                runs[speculative is None, batch] = out
    assert all(out == runs[True, 1] for out in runs.values())


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smol():
    from minirt.model import load_model

    return load_model(device="cpu", dtype=torch.float32)


def _rag_prompts(tokenizer) -> list[list[int]]:
    doc = ("The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 "
           "metres tall and was the tallest structure in the world until 1930.")
    return [chat_prompt_ids(
        tokenizer, [{"role": "user", "content": f"Document: {doc}\nQuestion: {q} Quote the "
                     "document."}]) for q in ("When was the tower completed?",
                                             "How tall is it?")]


def test_real_model_fp32_speculation_gives_the_same_tokens(smol):
    """SmolLM2 in fp32, two RAG prompts sharing a document, batched: the same greedy tokens
    with and without speculation, and drafts accepted."""
    model, tokenizer = smol
    prompts = _rag_prompts(tokenizer)
    outs = {}
    for speculative in (None, {"num_speculative_tokens": 4}):
        engine = Engine(model, tokenizer, capacity=1024, page_size=16, check=True,
                        speculative=speculative)
        outs[speculative is None] = engine.generate(reqs(prompts, 24), progress=False).outputs
        if speculative:
            assert engine.speculator.stats.accepted > 0
    assert all(len(o) == 24 for o in outs[True])
    assert outs[True] == outs[False]


def test_real_model_bf16_deterministic_speculation_gives_the_same_tokens():
    """SmolLM2 in bf16 under the deterministic mode: the two RAG prompts, batched, give the
    same greedy tokens with speculation as without (each verified position has decode's
    bits: the test above)."""
    from minirt.model import load_model

    model, tokenizer = load_model(device="cpu", dtype=torch.bfloat16)
    prompts = _rag_prompts(tokenizer)
    outs = {}
    for speculative in (None, {"num_speculative_tokens": 4}):
        engine = Engine(model, tokenizer, capacity=1024, page_size=16, check=True,
                        deterministic=True, speculative=speculative)
        outs[speculative is None] = engine.generate(reqs(prompts, 16), progress=False).outputs
        if speculative:
            assert engine.speculator.stats.accepted > 0
    assert all(len(o) == 16 for o in outs[True])
    assert outs[True] == outs[False]


@pytest.mark.parametrize("config, words", [
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"k": 3}', "unknown settings"),
    ("not json", "Expecting value"),
    ("[4]", "a SpeculativeConfig or a dict"),
    ('{"method": "draft_model", "model": "SmolLM2-135M"}', "loaded torch model"),
])
def test_serve_refuses_a_bad_speculative_config_before_loading_the_model(config, words, capsys):
    from minirt import serve

    with mock.patch.object(serve, "make_worker", side_effect=AssertionError("loaded")):
        with pytest.raises(SystemExit):
            serve.main(["--speculative-config", config])
    assert words in capsys.readouterr().err
