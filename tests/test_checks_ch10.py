"""Chapter 10 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest
import torch

import minirt.checks.ch10 as ch10
from minirt.checks._common import reset_attempts


@pytest.fixture(autouse=True)
def _fresh_attempts():
    reset_attempts()
    yield
    reset_attempts()


# ---------------------------------------------------------------- 10.1


def resume_right(total, rest):
    for x in rest:
        total = total + x
    return total


def resume_vectorised(total, rest):  # one sum of the rest, then one addition
    return total + rest.sum()


def resume_in_fp64(total, rest):  # more precise, other bits
    return (total.double() + rest.double().sum()).float()


def resume_reversed(total, rest):
    for x in rest.flip(0):
        total = total + x
    return total


def test_resume_sum_accepts_the_left_to_right_pass():
    ch10.check_resume_sum(resume_right)


@pytest.mark.parametrize("wrong", [resume_vectorised, resume_in_fp64, resume_reversed])
def test_resume_sum_rejects_other_orders(wrong):
    with pytest.raises(AssertionError, match="resume_sum"):
        ch10.check_resume_sum(wrong)


# ---------------------------------------------------------------- 10.2


def rows_right(weight, max_rows):
    x = torch.randn(max_rows, weight.shape[1],
                    generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    last = torch.nn.functional.linear(x, weight)[0]
    m = max_rows
    while m > 1 and torch.equal(torch.nn.functional.linear(x[:m - 1], weight)[0], last):
        m -= 1
    return m


def rows_always_four(weight, max_rows):  # MIN_ROWS from fp32, assumed for every dtype
    return 4


def rows_off_by_one(weight, max_rows):  # the last count that differs, not the first equal
    return max(rows_right(weight, max_rows) - 1, 1)


def test_first_invariant_rows_accepts_the_walk_down():
    ch10.check_first_invariant_rows(rows_right)


@pytest.mark.parametrize("wrong", [rows_always_four, rows_off_by_one])
def test_first_invariant_rows_rejects_guesses(wrong):
    with pytest.raises(AssertionError, match="first_invariant_rows"):
        ch10.check_first_invariant_rows(wrong)


# ---------------------------------------------------------------- 10.3


def merge_softmax(scores, values, chunk):  # one softmax, no chunks
    return torch.softmax(scores, 0) @ values


def merge_from_the_end(scores, values, chunk):  # chunks aligned to the last key
    top = scores.max()
    weights = torch.exp(scores - top)
    total, out = weights.new_zeros(()), values.new_zeros(values.shape[1])
    for end in range(scores.numel(), 0, -chunk):
        w = weights[max(end - chunk, 0):end]
        total = total + w.sum()
        out = out + w @ values[max(end - chunk, 0):end]
    return out / total


def merge_by_lse(scores, values, chunk):  # two halves merged by their log-sum-exps
    half = max(scores.numel() // 2, 1)
    parts = []
    for s, v in ((scores[:half], values[:half]), (scores[half:], values[half:])):
        lse = torch.logsumexp(s, 0)
        parts.append((torch.softmax(s, 0) @ v if torch.isfinite(lse) else v.new_zeros(
            v.shape[1]), lse))
    (a, la), (b, lb) = parts
    return torch.lerp(a, b, torch.sigmoid(lb - la))


def test_aligned_merge_accepts_the_reference_order():
    ch10.check_aligned_merge(ch10.aligned_merge)


@pytest.mark.parametrize("wrong", [merge_softmax, merge_from_the_end, merge_by_lse])
def test_aligned_merge_rejects_other_merges(wrong):
    with pytest.raises(AssertionError, match="aligned_merge"):
        ch10.check_aligned_merge(wrong)


# ---------------------------------------------------------------- 10.4


def risk_right(logits, eps):
    top = logits.float().topk(2, -1).values
    return [i for i, gap in enumerate((top[:, 0] - top[:, 1]).tolist()) if gap <= 2 * eps]


def risk_one_eps(logits, eps):  # only one of the two logits moves
    top = logits.float().topk(2, -1).values
    return [i for i, gap in enumerate((top[:, 0] - top[:, 1]).tolist()) if gap <= eps]


def risk_strict(logits, eps):  # a tie is not at risk
    top = logits.float().topk(2, -1).values
    return [i for i, gap in enumerate((top[:, 0] - top[:, 1]).tolist()) if gap < 2 * eps]


def test_at_risk_accepts_the_two_sided_bound():
    ch10.check_at_risk(risk_right)


@pytest.mark.parametrize("wrong", [risk_one_eps, risk_strict])
def test_at_risk_rejects_other_bounds(wrong):
    with pytest.raises(AssertionError, match="at_risk"):
        ch10.check_at_risk(wrong)


def test_a_repeated_failure_adds_the_nudge():
    with pytest.raises(AssertionError) as first:
        ch10.check_at_risk(risk_one_eps)
    with pytest.raises(AssertionError) as second:
        ch10.check_at_risk(risk_one_eps)
    assert "worst case" not in str(first.value) and "worst case" in str(second.value)
