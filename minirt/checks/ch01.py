"""Checkers for chapter 01: causal masks, how much K/V two requests share, a position-free toy.

The toy is a stack of single-head causal attention layers with residual connections and
no position encoding at all (:class:`ToyModel`, made by :func:`toy_model`). It is the
smallest model in which the chapter's claims can be checked exactly, in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ._common import call_reader, checker, expect, passed

__all__ = [
    "ToyModel",
    "check_causal_mask",
    "check_equal_states",
    "check_toy_decode",
    "check_toy_forward",
    "toy_model",
]


@dataclass(frozen=True)
class ToyModel:
    """A position-free causal attention stack: ``emb`` [vocab, dim] and, per layer, (W_q, W_k, W_v).

    Layer l maps states ``h`` [n, dim] to ``h + softmax(mask(q k^T / sqrt(dim))) v`` with
    ``q, k, v = h @ W_q, h @ W_k, h @ W_v``. Nothing in it depends on a token's position.
    """

    emb: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def dim(self) -> int:
        return self.emb.shape[1]


def toy_model(seed: int = 0, vocab: int = 16, dim: int = 8, num_layers: int = 3) -> ToyModel:
    """A random :class:`ToyModel` in float64, so results can be compared to about 1e-9."""
    g = torch.Generator().manual_seed(seed)

    def weight() -> torch.Tensor:
        return torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)

    emb = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    return ToyModel(emb, [(weight(), weight(), weight()) for _ in range(num_layers)])


# ---- Exercise 1.1: the causal mask ------------------------------------------------------

def _causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@checker("1.1", "Rows are queries, columns are keys. In prefill, which keys exist yet for "
                "the query at position i when it is decoded one token at a time?")
def check_causal_mask(causal_mask: Callable[[int], torch.Tensor]) -> None:
    """Exercise 1.1: ``causal_mask(n)``, a bool [n, n] tensor, True where query i may see key j."""
    for n in (1, 2, 3, 5, 8):
        got = call_reader(f"causal_mask({n})", causal_mask, n)
        expect(isinstance(got, torch.Tensor),
               f"causal_mask({n}) returned {type(got).__name__}, expected a torch.Tensor")
        expect(tuple(got.shape) == (n, n),
               f"causal_mask({n}) has shape {tuple(got.shape)}, expected ({n}, {n})")
        expect(got.dtype == torch.bool,
               f"causal_mask({n}) has dtype {got.dtype}, expected torch.bool "
               "(True = may attend, False = masked)")
        expected = _causal_mask(n)
        if not torch.equal(got.cpu(), expected):
            i, j = (got.cpu() != expected).nonzero()[0].tolist()
            expect(False, f"causal_mask({n})[{i}, {j}] is {bool(got[i, j])}, expected "
                          f"{bool(expected[i, j])} (row = query position, column = key "
                          f"position).\nexpected:\n{expected.int()}\ngot:\n{got.int()}")
    passed("1.1", "position i attends to positions 0..i, itself included")


# ---- Exercise 1.2: which states two requests share in a position-free model ------------

def _measured_equal(a: Sequence[int], b: Sequence[int], num_layers: int,
                    seed: int = 0) -> list[list[int]]:
    """Positions whose states are equal (1e-9) at each layer boundary of a random toy."""
    toy = toy_model(seed, num_layers=num_layers)
    states_a, states_b = _toy_forward(toy, a), _toy_forward(toy, b)
    n = min(len(a), len(b))
    return [[i for i in range(n) if float((x[i] - y[i]).abs().max()) <= 1e-9]
            for x, y in zip(states_a, states_b, strict=True)]


EQUAL_CASES: list[tuple[str, list[int], list[int], int]] = [
    ("identical requests", [3, 1, 4], [3, 1, 4], 3),
    ("differ only in the last token", [3, 1, 4, 1], [3, 1, 4, 5], 3),
    ("the first two tokens swapped", [1, 2, 3], [2, 1, 3], 3),
    ("the first two tokens swapped, one layer", [1, 2, 3], [2, 1, 3], 1),
    ("the same suffix after a different first token", [2, 7, 7, 5], [11, 7, 7, 5], 2),
    ("a rotation of the first three tokens", [5, 6, 7, 8, 9], [6, 7, 5, 8, 9], 4),
    ("equal tokens at equal positions after a difference", [1, 2, 9, 4], [1, 3, 9, 4], 3),
    ("a repeated token swapped with itself", [4, 4, 2], [4, 4, 2], 2),
    ("different lengths", [1, 2, 3, 4, 5], [2, 1, 3], 3),
    ("the same multiset at position 2, not at 1", [1, 2, 2, 6], [2, 1, 2, 6], 3),
    ("nothing in common", [1, 2], [3, 4], 2),
]


@checker("1.2", "Without position encoding, what does attention at position i see of the "
                "positions before it: their order, or only which states there are and how "
                "many of each? Then ask the same question one layer up.")
def check_equal_states(equal_states: Callable[[list[int], list[int], int], list[list[int]]]
                       ) -> None:
    """Exercise 1.2: at each layer boundary of the position-free toy, the positions whose
    states (and so K/V) are equal in two requests, predicted without running a model."""
    for name, a, b, layers in EQUAL_CASES:
        expected = _measured_equal(a, b, layers)
        call = f"equal_states({a}, {b}, num_layers={layers})"
        got = call_reader(call, equal_states, list(a), list(b), layers)
        try:
            lists = [sorted(int(i) for i in row) for row in got]
        except (TypeError, ValueError):
            lists = None
        expect(lists is not None and len(lists) == layers + 1,
               f"{call} ({name}) returned {got!r}; expected one list of positions per layer "
               f"boundary, {layers + 1} lists (the embeddings, then each layer's output), "
               "e.g. [[2], [2], []].")
        for layer, (want, have) in enumerate(zip(expected, lists, strict=True)):
            expect(have == want,
                   f"{call} ({name}): at layer boundary {layer} you predicted equal states at "
                   f"positions {have}, the toy model computes equal states at {want}.")
    passed("1.2", f"{len(EQUAL_CASES)} pairs predicted exactly; without positions a swapped "
                  "prefix still reaches deeper layers, and only a common prefix is safe at "
                  "every layer")


# ---- Exercise 1.3: the position-free toy, prefill with a mask ----------------------------

def _toy_forward(toy: ToyModel, ids: Sequence[int]) -> list[torch.Tensor]:
    h = toy.emb[list(ids)]
    states = [h]
    mask = _causal_mask(len(ids))
    for wq, wk, wv in toy.layers:
        q, k, v = h @ wq, h @ wk, h @ wv
        scores = (q @ k.T / math.sqrt(toy.dim)).masked_fill(~mask, float("-inf"))
        h = h + scores.softmax(dim=-1) @ v
        states.append(h)
    return states


def _compare_states(label: str, got, expected: list[torch.Tensor], tol: float = 1e-9) -> None:
    expect(isinstance(got, (list, tuple)),
           f"{label} returned {type(got).__name__}, expected a list of tensors (one per layer "
           "boundary: the embeddings first, then the output of each layer)")
    expect(len(got) == len(expected),
           f"{label} returned {len(got)} states, expected {len(expected)}: the embeddings, "
           f"then one per layer ({len(expected) - 1} layers)")
    for layer, (g, e) in enumerate(zip(got, expected, strict=True)):
        expect(isinstance(g, torch.Tensor) and tuple(g.shape) == tuple(e.shape),
               f"{label}: state {layer} has shape "
               f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}, "
               f"expected {tuple(e.shape)} ([positions, dim])")
        diff = (g.to(e.dtype) - e).abs()
        if not bool((diff <= tol).all()):  # also catches NaN
            pos = int(torch.nan_to_num(diff, nan=float("inf")).amax(dim=1).argmax())
            expect(False, f"{label}: state {layer} (after {layer} layers), position {pos}: "
                          f"expected {e[pos].numpy().round(4)}, got "
                          f"{g[pos].detach().numpy().round(4)}")


TOY_INPUTS = [[3], [3, 1], [1, 2, 3, 4, 5], [9, 9, 9, 0, 15, 2, 7]]


@checker("1.3", "Compare one layer by hand with the formula above: which scores must be "
                "-inf, and over which axis does the softmax run?")
def check_toy_forward(toy_forward: Callable[[ToyModel, list[int]], list[torch.Tensor]]) -> None:
    """Exercise 1.3: a causal, position-free prefill of the toy stack, every layer's states."""
    for seed in (0, 1):
        toy = toy_model(seed)
        for ids in TOY_INPUTS:
            got = call_reader(f"toy_forward(toy_model({seed}), {ids})", toy_forward, toy, list(ids))
            _compare_states(f"toy_forward(toy_model({seed}), {ids})", got, _toy_forward(toy, ids))
    passed("1.3", "causal, position-free prefill matches the reference at every layer")


# ---- Exercise 1.4: the toy decoded token by token, without a mask -------------------------

@checker("1.4", "When token i is decoded, which rows must the layer's cache hold at the "
                "moment it attends, and in which order do you write and read?")
def check_toy_decode(toy_decode: Callable[[ToyModel, list[int]], list[torch.Tensor]]) -> None:
    """Exercise 1.4: decoding one token at a time with per-layer K/V caches and no mask."""
    for seed in (0, 1):
        toy = toy_model(seed)
        for ids in TOY_INPUTS:
            label = f"toy_decode(toy_model({seed}), {ids})"
            got = call_reader(label, toy_decode, toy, list(ids))
            _compare_states(label + " (compared with the masked prefill)", got,
                            _toy_forward(toy, ids))
    passed("1.4", "token-by-token decode without a mask equals the masked prefill")
