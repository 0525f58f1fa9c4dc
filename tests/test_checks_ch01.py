"""Chapter 01 checkers: each accepts a correct answer and rejects plausible wrong ones."""

from __future__ import annotations

import math
import re

import pytest
import torch
from brute_force import lcp
from exercise_util import accepts, rejects

from minirt import checks
from minirt.checks.ch01 import ToyModel, toy_model

# ---- Exercise 1.1 -------------------------------------------------------------------------


def mask_ok(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


def mask_ok_other_spelling(n):
    i = torch.arange(n)
    return i[None, :] <= i[:, None]


@pytest.mark.parametrize("fn", [mask_ok, mask_ok_other_spelling])
def test_causal_mask_accepts(fn, capsys):
    checks.check_causal_mask(fn)
    assert "Exercise 1.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (lambda n: torch.triu(torch.ones(n, n, dtype=torch.bool)), r"\[0, 1\] is True"),  # transposed
    (lambda n: torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1), r"\[0, 0\]"),
    (lambda n: torch.ones(n, n, dtype=torch.bool), "expected False"),  # no mask at all
    (lambda n: torch.tril(torch.ones(n, n)), "dtype"),  # float 0/1
    (lambda n: torch.ones(n, n).triu(1) * float("-inf"), "dtype"),  # additive mask
    (lambda n: mask_ok(n)[:, : n - 1], "shape"),
    (lambda n: mask_ok(n).tolist(), "torch.Tensor"),
    (lambda n: 1 / 0, "ZeroDivisionError"),
])
def test_causal_mask_rejects(fn, words):
    assert re.search(words, rejects(checks.check_causal_mask, fn, "1.1"))


# ---- Exercise 1.2 -------------------------------------------------------------------------


def equal_ok(a, b, num_layers):
    sig_a, sig_b = [(t,) for t in a], [(t,) for t in b]
    out = []
    for _ in range(num_layers + 1):
        out.append([i for i in range(min(len(a), len(b))) if sig_a[i] == sig_b[i]])
        sig_a = [(sig_a[i], tuple(sorted(sig_a[: i + 1]))) for i in range(len(sig_a))]
        sig_b = [(sig_b[i], tuple(sorted(sig_b[: i + 1]))) for i in range(len(sig_b))]
    return out


def equal_common_prefix(a, b, num_layers):  # the chapter's rule at every layer, layer 0 too
    return [list(range(lcp(a, b)))] * (num_layers + 1)


def equal_same_token(a, b, num_layers):  # ignores the context entirely
    return [[i for i in range(min(len(a), len(b))) if a[i] == b[i]]] * (num_layers + 1)


def equal_prefix_after_layer_0(a, b, num_layers):  # right at layer 0, then the common prefix
    return [equal_same_token(a, b, 0)[0]] + [list(range(lcp(a, b)))] * num_layers


def equal_ordered_context(a, b, num_layers):  # treats the context as a sequence, not a multiset
    return [equal_same_token(a, b, 0)[0]] + [
        [i for i in range(min(len(a), len(b))) if a[: i + 1] == b[: i + 1]]] * num_layers


def test_equal_states_accepts(capsys):
    accepts(checks.check_equal_states, equal_ok, "1.2", capsys)


@pytest.mark.parametrize("fn", [equal_common_prefix, equal_same_token, equal_prefix_after_layer_0,
                                equal_ordered_context, lambda a, b, n: equal_ok(a, b, n)[:-1]])
def test_equal_states_rejects(fn):
    rejects(checks.check_equal_states, fn, "1.2", contains="equal_states(")


def test_equal_states_reference_matches_the_toy():
    from minirt.checks.ch01 import EQUAL_CASES, _measured_equal

    for _, a, b, layers in EQUAL_CASES:
        assert equal_ok(a, b, layers) == _measured_equal(a, b, layers, seed=3)


# ---- Exercise 1.3 -------------------------------------------------------------------------


def forward_ok(toy: ToyModel, ids):
    h = toy.emb[ids]
    states = [h]
    n = len(ids)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for wq, wk, wv in toy.layers:
        q, k, v = h @ wq, h @ wk, h @ wv
        scores = q @ k.T / math.sqrt(toy.dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        h = h + torch.softmax(scores, dim=-1) @ v
        states.append(h)
    return states


def forward_variant(toy, ids, *, causal=True, residual=True, scale=True, self_only=False,
                    softmax_dim=-1, with_embeddings=True):
    h = toy.emb[ids]
    states = [h] if with_embeddings else []
    n = len(ids)
    for wq, wk, wv in toy.layers:
        q, k, v = h @ wq, h @ wk, h @ wv
        if self_only:
            out = v
        else:
            scores = q @ k.T / (math.sqrt(toy.dim) if scale else 1.0)
            if causal:
                scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                            float("-inf"))
            out = torch.softmax(scores, dim=softmax_dim) @ v
        h = h + out if residual else out
        states.append(h)
    return states


def test_toy_forward_accepts(capsys):
    checks.check_toy_forward(forward_ok)
    assert "Exercise 1.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, words", [
    (dict(causal=False), "position 0"),  # no mask: early positions see later tokens
    (dict(residual=False), "state 1"),
    (dict(scale=False), "state 1"),
    (dict(self_only=True), "state 1"),  # no mixing across positions at all
    (dict(softmax_dim=0), "state 1"),
    (dict(with_embeddings=False), "states, expected 4"),
])
def test_toy_forward_rejects(kwargs, words):
    message = rejects(checks.check_toy_forward,
                      lambda toy, ids: forward_variant(toy, ids, **kwargs), "1.3")
    assert re.search(words, message)


# ---- Exercise 1.4 -------------------------------------------------------------------------


def decode_ok(toy: ToyModel, ids):
    caches = [([], []) for _ in toy.layers]
    rows = [[] for _ in range(len(toy.layers) + 1)]
    for token in ids:
        h = toy.emb[token]
        rows[0].append(h)
        for layer, (wq, wk, wv) in enumerate(toy.layers):
            keys, values = caches[layer]
            keys.append(h @ wk)
            values.append(h @ wv)
            k, v = torch.stack(keys), torch.stack(values)
            h = h + torch.softmax(k @ (h @ wq) / math.sqrt(toy.dim), dim=0) @ v
            rows[layer + 1].append(h)
    return [torch.stack(r) for r in rows]


def decode_variant(toy, ids, *, write_after=False, no_cache=False, shared_cache=False,
                   keep_input=False):
    shared = ([], [])
    caches = [shared if shared_cache else ([], []) for _ in toy.layers]
    rows = [[] for _ in range(len(toy.layers) + 1)]
    for token in ids:
        x = toy.emb[token]
        h = x
        rows[0].append(h)
        for layer, (wq, wk, wv) in enumerate(toy.layers):
            inp = x if keep_input else h
            keys, values = caches[layer]
            if no_cache:
                keys, values = [], []
            if not write_after:
                keys.append(inp @ wk)
                values.append(inp @ wv)
            k = torch.stack(keys) if keys else torch.zeros(0, toy.dim, dtype=x.dtype)
            v = torch.stack(values) if values else torch.zeros(0, toy.dim, dtype=x.dtype)
            h = inp + torch.softmax(k @ (inp @ wq) / math.sqrt(toy.dim), dim=0) @ v
            if write_after:
                keys.append(inp @ wk)
                values.append(inp @ wv)
            rows[layer + 1].append(h)
    return [torch.stack(r) for r in rows]


def test_toy_decode_accepts(capsys):
    checks.check_toy_decode(decode_ok)
    checks.check_toy_decode(forward_ok)  # a masked prefill is, of course, also right
    assert capsys.readouterr().out.count("Exercise 1.4 passed") == 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(write_after=True), "position 0"),  # attends to the past only, not to itself
    (dict(no_cache=True), "position 1"),  # attends to itself only
    (dict(shared_cache=True), "state 2"),  # one cache for all layers
    (dict(keep_input=True), "state 2"),  # every layer fed the embedding
])
def test_toy_decode_rejects(kwargs, words):
    message = rejects(checks.check_toy_decode,
                      lambda toy, ids: decode_variant(toy, ids, **kwargs), "1.4")
    assert re.search(words, message)


def test_toy_decode_rejects_unmasked_prefill():
    with pytest.raises(AssertionError, match="position 0"):
        checks.check_toy_decode(lambda toy, ids: forward_variant(toy, ids, causal=False))


def test_toy_model_is_deterministic_and_position_free():
    a, b = toy_model(3), toy_model(3)
    assert torch.equal(a.emb, b.emb) and a.dim == 8 and len(a.layers) == 3
    # no positions: the first token's states do not depend on where the sequence starts
    s = forward_ok(a, [4, 5])
    t = forward_ok(a, [4])
    assert all(torch.allclose(x[0], y[0]) for x, y in zip(s, t, strict=True))
