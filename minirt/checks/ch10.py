"""Checkers for chapter 10: resuming a sum where the cache stopped, the row count from which
a matrix product's row stops changing, a chunk-aligned attention merge, and the decode
steps a rounding can flip.

Each checker runs the reader's function on several inputs, compares with a reference
computed here and names the first input that disagrees; a repeated failure adds a nudge.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._common import as_int_list, call_reader, checker, expect, passed, same_int

__all__ = ["aligned_merge", "at_risk", "check_aligned_merge", "check_at_risk",
           "check_first_invariant_rows", "check_resume_sum", "first_invariant_rows",
           "resume_sum"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- 10.1 resume a sum

def resume_sum(total: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Reference for 10.1: ``total`` (the fp32 left-to-right sum of the cached values) with
    ``rest`` added one value at a time, left to right: the full pass's bits."""
    for x in rest:
        total = total + x
    return total


def _sequential(values: torch.Tensor) -> torch.Tensor:
    return resume_sum(values.new_zeros(()), values)


_NUDGE_101 = ("The full pass adds one value after another, left to right. Which additions "
              "does it perform after the last cached value, and in what order?")


@checker("10.1", _NUDGE_101)
def check_resume_sum(fn: Callable) -> None:
    """Exercise 10.1: ``fn(total, rest)`` -> the full left-to-right sum's exact bits."""
    gen = _gen(101)
    cases = []
    for n, cut in ((8, 3), (100, 40), (300, 256), (257, 1), (64, 0)):
        values = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 100).float()
        cases.append((values, cut))
    for values, cut in cases:
        want = _sequential(values)
        total = _sequential(values[:cut])
        got = call_reader(f"resume_sum(total of {cut} values, {values.numel() - cut} more)",
                          fn, total.clone(), values[cut:].clone())
        ok = isinstance(got, torch.Tensor) and got.dtype == torch.float32 \
            and got.numel() == 1 and torch.equal(got.reshape(()), want)
        expect(ok, f"resume_sum after {cut} cached of {values.numel()} fp32 values returned "
                   f"{got!r}; the full left-to-right pass gives {want.item()!r} "
                   "(a 0-d fp32 tensor, equal bit for bit).")
    passed("10.1", f"{len(cases)} sums resumed with the full pass's bits")


# ---------------------------------------------------------------- 10.2 the invariant row count

def first_invariant_rows(weight: torch.Tensor, max_rows: int) -> int:
    """Reference for 10.2: the smallest ``m`` such that row 0 of ``x[:k] @ weight.T`` has
    the same bits for every ``k`` from ``m`` to ``max_rows`` (``x``: the fixed input)."""
    x = _gemm_input(weight, max_rows)
    last = torch.nn.functional.linear(x, weight)[0]
    m = max_rows
    while m > 1 and torch.equal(torch.nn.functional.linear(x[:m - 1], weight)[0], last):
        m -= 1
    return m


def _gemm_input(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The input rows 10.2 uses: ``torch.randn(rows, in_features)`` from generator seed 0,
    in the weight's dtype."""
    return torch.randn(rows, weight.shape[1], generator=_gen(0)).to(weight.dtype)


_NUDGE_102 = ("Compare each row count's row 0 with the largest count's, and walk down from "
              "the top: the answer is where the run of equal bits ends.")


@checker("10.2", _NUDGE_102)
def check_first_invariant_rows(fn: Callable) -> None:
    """Exercise 10.2: ``fn(weight, max_rows)`` -> the smallest row count from which row 0
    keeps its bits up to ``max_rows``."""
    gen = _gen(102)
    cases = [(torch.randn(out_f, in_f, generator=gen).to(dtype), rows)
             for out_f, in_f in ((1536, 576), (576, 1536), (96, 64))
             for dtype in (torch.float32, torch.bfloat16) for rows in (16, 6)]
    for weight, rows in cases:
        want = first_invariant_rows(weight, rows)
        what = f"first_invariant_rows({weight.dtype} weight {tuple(weight.shape)}, {rows})"
        got = call_reader(what, fn, weight, rows)
        expect(same_int(got, want), f"{what} returned {got!r}; on this machine it is {want}.")
    passed("10.2", f"{len(cases)} weights and row limits")


# ---------------------------------------------------------------- 10.3 an aligned merge

def aligned_merge(scores: torch.Tensor, values: torch.Tensor, chunk: int) -> torch.Tensor:
    """Reference for 10.3: one query's attention output ``[d]`` from its fp32 ``scores``
    ``[n]`` (``-inf`` where a key is masked) and ``values`` ``[n, d]``: the exact maximum,
    ``exp(score - max)``, then per chunk of ``chunk`` keys from position 0 the sum of the
    weights and ``weights @ values``, the chunks added left to right, one division."""
    top = scores.max()
    weights = torch.exp(scores - top)
    total, out = weights.new_zeros(()), values.new_zeros(values.shape[1])
    for start in range(0, scores.numel(), chunk):
        w = weights[start:start + chunk]
        total = total + w.sum()
        out = out + w @ values[start:start + chunk]
    return out / total


_NUDGE_103 = ("Padding with masked keys must add exact zeros and nothing else: the chunks "
              "have to start at the same positions whatever the length, and the partial "
              "results have to be combined in one fixed order.")


@checker("10.3", _NUDGE_103)
def check_aligned_merge(fn: Callable) -> None:
    """Exercise 10.3: ``fn(scores, values, chunk)`` -> the aligned merge's exact bits, the
    same with masked keys appended."""
    gen = _gen(103)
    cases = []
    for n, chunk in ((5, 4), (33, 8), (100, 16), (256, 64), (300, 64)):
        scores = torch.randn(n, generator=gen) * 3
        cases.append((scores, torch.randn(n, 16, generator=gen), chunk))
    for scores, values, chunk in cases:
        want = aligned_merge(scores, values, chunk)
        for pad in (0, 3, chunk, 2 * chunk + 1):
            s = torch.cat([scores, torch.full((pad,), float("-inf"))])
            v = torch.cat([values, torch.randn(pad, values.shape[1], generator=gen)])
            what = (f"aligned_merge({scores.numel()} scores + {pad} masked, values "
                    f"{tuple(values.shape)}, chunk={chunk})")
            got = call_reader(what, fn, s.clone(), v.clone(), chunk)
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape \
                and torch.equal(got, want)
            close = isinstance(got, torch.Tensor) and got.shape == want.shape \
                and torch.allclose(got.float(), want, atol=1e-5)
            expect(ok, f"{what}: " + ("close to softmax attention but not the aligned "
                                      "merge's bits" if close else f"returned {got!r}")
                   + f"; expected {want.tolist()[:3]}... (shape {tuple(want.shape)}, "
                   "equal bit for bit).")
    passed("10.3", f"{len(cases)} queries, each padded four ways, same bits")


# ---------------------------------------------------------------- 10.4 steps at risk

def at_risk(logits: torch.Tensor, eps: float) -> list[int]:
    """Reference for 10.4: the decode steps (rows of ``logits`` ``[steps, vocab]``) whose
    greedy token can change when every logit moves by at most ``eps``: top-1 minus top-2
    at most ``2 * eps``."""
    top = logits.float().topk(2, -1).values
    return [i for i, gap in enumerate((top[:, 0] - top[:, 1]).tolist()) if gap <= 2 * eps]


_NUDGE_104 = ("In the worst case the best token's logit moves down and the runner-up's up, "
              "each by as much as they can. How far apart must they start for the order "
              "to survive?")


@checker("10.4", _NUDGE_104)
def check_at_risk(fn: Callable) -> None:
    """Exercise 10.4: ``fn(logits, eps)`` -> the steps at risk, in order."""
    gen = _gen(104)
    cases: list[tuple[torch.Tensor, float]] = []
    for steps, vocab, eps in ((6, 10, 0.1), (20, 50, 0.05), (8, 30, 0.5), (12, 8, 0.0)):
        logits = torch.randn(steps, vocab, generator=gen) * 2
        # make some steps near-ties at about eps and 2 * eps
        for i in range(0, steps, 3):
            best = int(logits[i].argmax())
            other = (best + 1) % vocab
            logits[i, other] = logits[i, best] - (1.5 if i % 2 else 0.75) * eps
        cases.append((logits, eps))
    for logits, eps in cases:
        want = at_risk(logits, eps)
        what = f"at_risk(logits {tuple(logits.shape)}, eps={eps})"
        got = as_int_list(call_reader(what, fn, logits.clone(), eps))
        expect(got == want, f"{what} returned {got!r}; expected {want}.")
    passed("10.4", f"{len(cases)} runs of logits")
