"""A draft model as the proposer (minirt.draft_proposer, ``method="draft_model"``): its
drafts are the draft model's greedy tokens, its K/V follows the request's tokens across
steps; greedy outputs with it equal plain decode's; the target as its own draft (the
self-check) accepts every draft where rounding cannot differ (float64) and nearly all on
the real model in fp32; bad settings are refused before anything is built."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from minirt import engine as engine_mod
from minirt.draft_proposer import DraftModelProposer
from minirt.engine import Engine
from minirt.errors import ModelError, RequestError
from minirt.lifecycle import greedy_reference
from minirt.model import tiny_model
from minirt.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")

SELF = {"method": "draft_model", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def model(tiny64):
    return tiny64


@pytest.fixture(scope="module")
def stranger():
    """A float64 tiny Llama whose output head is its embedding plus noise of twice its
    spread: its greedy tokens agree with ``tiny64``'s some of the time (two tied tiny
    models mostly repeat the last token: they would agree always)."""
    draft = tiny_model(1).to(torch.float64)
    torch.manual_seed(5)
    w = draft.model.embed_tokens.weight.detach()
    draft.lm_head.weight = torch.nn.Parameter(w + 2 * w.std() * torch.randn_like(w))
    return draft


def prompts(seed: int, sizes=(21, 34, 9, 50)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in sizes]


def serve(model, ps, n, speculative=None, page_size=4, **kw):
    engine = Engine(model, capacity=1024, page_size=page_size, check=True,
                    speculative=speculative, **kw)
    out = engine.generate([Request(prompt=p, max_new_tokens=n, stop_on_eos=False) for p in ps],
                          progress=False).outputs
    return out, engine


# ---------------------------------------------------------------- the proposer


def test_the_drafts_are_the_draft_models_greedy_tokens(stranger):
    proposer = DraftModelProposer(stranger, 5)
    for p in prompts(1):
        assert proposer.propose(p) == greedy_reference(stranger, p, 5)
        assert proposer.propose(p, limit=2) == greedy_reference(stranger, p, 2)
        assert proposer.propose(p, limit=0) == []


def test_the_kept_cache_follows_the_request_forward_and_back(stranger):
    """One owner's calls with its tokens grown, unchanged, shrunk and changed mid-way give
    what a fresh proposer gives, and its K/V holds exactly the tokens it was last given."""
    class Owner:
        pass

    owner, proposer = Owner(), DraftModelProposer(stranger, 3)
    base = prompts(2, (40,))[0]
    for tokens in (base[:20], base[:24], base[:24], base[:31], base[:18], base[:10] + [1, 2, 3],
                   base[:40]):
        assert proposer.propose(tokens, owner=owner) == greedy_reference(stranger, tokens, 3)
        cache, seen = proposer._caches[owner]
        assert cache.get_seq_length() == len(tokens) and seen.tolist() == tokens
    assert proposer.held() == 1
    proposer.release(owner)
    assert proposer.held() == 0


# ---------------------------------------------------------------- in the engine


@pytest.mark.parametrize("page_size, k", [(1, 1), (4, 4), (16, 3)])
def test_the_target_as_its_own_draft_accepts_every_draft(model, page_size, k):
    """float64: the draft's one-token forwards and the verify's k + 1 rows agree, so every
    draft is accepted, each verify appends k + 1 tokens, nothing is rolled back, and the
    outputs are plain decode's."""
    ps = prompts(3)
    plain, _ = serve(model, ps, 17, page_size=page_size)
    spec, engine = serve(model, ps, 17, {**SELF, "num_speculative_tokens": k},
                         page_size=page_size)
    st = engine.speculator.stats
    assert spec == plain
    assert st.proposed > 0 and st.accepted == st.proposed and st.rolled_back == 0
    assert engine.speculator.proposer.held() == 0  # finished requests' draft K/V dropped


def test_a_different_draft_is_partly_accepted_and_changes_no_token(model, stranger):
    ps = prompts(4) + [[5, 6, 7] * 9]
    plain, _ = serve(model, ps, 20)
    spec, engine = serve(model, ps, 20, {**SELF, "model": stranger})
    st = engine.speculator.stats
    assert spec == plain
    assert 0 < st.accepted < st.proposed and st.rolled_back > 0


def test_a_cancelled_request_drops_its_draft_cache(model):
    engine = Engine(model, capacity=512, page_size=4, check=True, speculative=SELF)
    victim, other = (engine.submit(Request(prompt=p, max_new_tokens=30, stop_on_eos=False))
                     for p in prompts(6, (12, 15)))
    while not engine.speculator.draft_for(victim.lc):
        engine.step()
    assert engine.speculator.proposer.held() == 2
    engine.cancel(victim)
    engine.step()
    assert engine.speculator.proposer.held() == 1
    while engine.has_work:
        engine.step()
    assert other.result.output_ids == greedy_reference(model, prompts(6, (12, 15))[1], 30)
    assert engine.speculator.proposer.held() == 0


def test_sampled_requests_speculate_with_a_draft_model(model, stranger):
    """Temperature > 0: drafts go through rejection sampling; the run is consistent (the
    integrity check after every step) and reproducible with the same seeds."""
    ps = prompts(7, (14, 25))

    def run():
        engine = Engine(model, capacity=512, page_size=4, check=True,
                        speculative={**SELF, "model": stranger})
        res = engine.generate([Request(prompt=p, max_new_tokens=16, stop_on_eos=False,
                                       temperature=0.8, seed=i) for i, p in enumerate(ps)],
                              progress=False)
        return res.outputs, engine.speculator.stats

    (a, st), (b, _) = run(), run()
    assert a == b and all(len(o) == 16 for o in a)
    assert st.proposed > 0


@pytest.mark.parametrize("bad, error, words", [
    ({"method": "draft_model", "model": "SmolLM2-135M"}, RequestError, "loaded torch model"),
    ({"method": "ngram", "model": None, "prompt_lookup_min": 1}, None, None),
    ({"method": "medusa"}, RequestError, "not built"),
    ({"model": "x"}, RequestError, "method='draft_model'"),
])
def test_bad_draft_settings_are_refused_before_anything_is_built(model, bad, error, words):
    with mock.patch.object(engine_mod.KVPool, "for_model", side_effect=AssertionError("built")):
        if error is None:
            with pytest.raises(AssertionError, match="built"):  # accepted: it gets as far
                Engine(model, capacity=64, speculative=bad)
            return
        with pytest.raises(error, match=words):
            Engine(model, capacity=64, speculative=bad)


def test_a_draft_with_another_vocabulary_is_refused(model):
    other = tiny_model(0, vocab_size=96)
    with mock.patch.object(engine_mod.KVPool, "for_model", side_effect=AssertionError("built")):
        with pytest.raises(ModelError, match="vocabulary"):
            Engine(model, capacity=64, speculative={**SELF, "model": other})


# ---------------------------------------------------------------- the real model


def test_real_model_fp32_self_check(smol_fp32):
    """SmolLM2 in fp32 as its own draft on two RAG prompts, batched: plain decode's tokens,
    and (rounding aside: the draft's one-row forwards against the verify's rows) every
    draft accepted or nearly."""
    from minirt.request import chat_prompt_ids

    model, tokenizer = smol_fp32
    doc = ("The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 "
           "metres tall and was the tallest structure in the world until 1930.")
    ps = [chat_prompt_ids(tokenizer, [{"role": "user", "content": f"Document: {doc}\n"
                                       f"Question: {q} Quote the document."}])
          for q in ("When was the tower completed?", "How tall is it?")]
    plain, _ = serve(model, ps, 24, page_size=16)
    spec, engine = serve(model, ps, 24, SELF, page_size=16)
    st = engine.speculator.stats
    assert spec == plain
    assert st.proposed > 0 and st.accepted >= 0.9 * st.proposed
    assert st.tokens_per_step > 3.5  # k + 1 = 5 when all are accepted


@pytest.fixture(scope="module")
def smol_fp32():
    from minirt.model import load_model

    return load_model(device="cpu", dtype=torch.float32)
