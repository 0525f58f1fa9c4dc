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

from ._common import call_reader, expect, passed

__all__ = [
    "ToyModel",
    "check_causal_mask",
    "check_reusable_length",
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
                          f"{bool(expected[i, j])}: row = query position i, column = key "
                          f"position j, and i may attend to j exactly when j <= i.\n"
                          f"expected:\n{expected.int()}\ngot:\n{got.int()}")
    passed("1.1", "position i attends to positions 0..i, itself included")


# ---- Exercise 1.2: how many positions' K/V two requests share ---------------------------

def _reusable_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


REUSE_CASES: list[tuple[str, list[int], list[int]]] = [
    ("two empty requests", [], []),
    ("one empty request", [], [5, 8]),
    ("identical requests", [5, 8, 13, 21], [5, 8, 13, 21]),
    ("a is a prefix of b", [5, 8], [5, 8, 13, 21]),
    ("b is a prefix of a", [5, 8, 13, 21], [5, 8, 13]),
    ("differ in the middle, same tokens after", [5, 8, 13, 21], [5, 8, 2, 21]),
    ("differ at the first token, same suffix (the 天气很好 / 心情很好 case)",
     [18614, 119, 177, 125, 238, 29157, 226, 48392, 138],
     [41467, 221, 177, 221, 223, 29157, 226, 48392, 138]),
    ("same tokens, shifted by one position", [7, 7, 1, 2, 3], [7, 1, 2, 3]),
    ("differ only at the last token", [1, 2, 3, 4], [1, 2, 3, 9]),
]


def check_reusable_length(reusable_length: Callable[[list[int], list[int]], int]) -> None:
    """Exercise 1.2: how many leading positions' K/V requests ``a`` and ``b`` can share."""
    cases = list(REUSE_CASES)
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        n, m = (int(x) for x in torch.randint(0, 12, (2,), generator=g))
        a = torch.randint(0, 3, (n,), generator=g).tolist()
        b = torch.randint(0, 3, (m,), generator=g).tolist()
        cases.append(("random", a, b))
    for name, a, b in cases:
        expected = _reusable_length(a, b)
        got = call_reader(f"reusable_length({a}, {b})", reusable_length, list(a), list(b))
        expect(isinstance(got, int) and not isinstance(got, bool) and got == expected,
               f"reusable_length({a}, {b}) ({name}) returned {got!r}, expected {expected}: "
               "K/V can be shared only up to the first position where the tokens differ; "
               "equal tokens after that point do not count.")
    passed("1.2", f"{len(cases)} request pairs right; only the common prefix is shared")


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


def check_toy_forward(toy_forward: Callable[[ToyModel, list[int]], list[torch.Tensor]]) -> None:
    """Exercise 1.3: a causal, position-free prefill of the toy stack, every layer's states."""
    for seed in (0, 1):
        toy = toy_model(seed)
        for ids in TOY_INPUTS:
            got = call_reader(f"toy_forward(toy_model({seed}), {ids})", toy_forward, toy, list(ids))
            _compare_states(f"toy_forward(toy_model({seed}), {ids})", got, _toy_forward(toy, ids))
    passed("1.3", "causal, position-free prefill matches the reference at every layer")


# ---- Exercise 1.4: the toy decoded token by token, without a mask -------------------------

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
