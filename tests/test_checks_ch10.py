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


def _padded_alone(product, x, r, p):
    return product(torch.cat([x[r:r + 1], x.new_zeros(p - 1, x.shape[1])]))[0]


def needed_right(product, x):
    n = x.shape[0]
    full = [product(x[:m]) for m in range(1, n + 1)]
    for p in range(1, n + 1):
        if all(torch.equal(full[m - 1][r], _padded_alone(product, x, r, p))
               for m in range(p, n + 1) for r in range(m)):
            return p
    return None


def needed_allclose(product, x):  # the cold run's answer: close, not the same bits
    n = x.shape[0]
    full = [product(x[:m]) for m in range(1, n + 1)]
    for p in range(1, n + 1):
        if all(torch.allclose(full[m - 1][r], _padded_alone(product, x, r, p))
               for m in range(p, n + 1) for r in range(m)):
            return p
    return None


def needed_row_zero(product, x):  # row 0 only, the chapter's old witness: misses positions
    n = x.shape[0]
    for p in range(1, n + 1):
        if all(torch.equal(product(x[:m])[0], _padded_alone(product, x, 0, p))
               for m in range(p, n + 1)):
            return p
    return None


def needed_row_counts(product, x):  # row 0 of each count against the largest count's
    n = x.shape[0]
    last = product(x)[0]
    m = n
    while m > 1 and torch.equal(product(x[:m - 1])[0], last):
        m -= 1
    return m


def needed_never_none(product, x):  # no padding can help: answers the largest count
    got = needed_right(product, x)
    return x.shape[0] if got is None else got


def test_rows_needed_accepts_the_search():
    ch10.check_rows_needed(needed_right)
    ch10.check_rows_needed(ch10.rows_needed)


@pytest.mark.parametrize("wrong", [needed_allclose, needed_row_zero, needed_row_counts,
                                   needed_never_none])
def test_rows_needed_rejects_other_tests(wrong):
    with pytest.raises(AssertionError, match="rows_needed"):
        ch10.check_rows_needed(wrong)


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


def merge_short_last_chunk(scores, values, chunk):  # the cold run's answer: no padding
    w = torch.exp(scores - scores.max())
    total, out = torch.zeros(()), torch.zeros(values.shape[1])
    for s in range(0, len(w), chunk):
        total = total + w[s:s + chunk].sum()
        out = out + w[s:s + chunk] @ values[s:s + chunk]
    return out / total


def merge_padded(scores, values, chunk):
    width = -(-scores.numel() // chunk) * chunk
    w = torch.exp(scores - scores.max())
    w = torch.cat([w, w.new_zeros(width - w.numel())])
    v = torch.cat([values, values.new_zeros(width - values.shape[0], values.shape[1])])
    total, out = torch.zeros(()), torch.zeros(values.shape[1])
    for s in range(0, width, chunk):
        total = total + w[s:s + chunk].sum()
        out = out + w[s:s + chunk] @ v[s:s + chunk]
    return out / total


def test_aligned_merge_accepts_the_reference_order():
    ch10.check_aligned_merge(ch10.aligned_merge)
    ch10.check_aligned_merge(merge_padded)


@pytest.mark.parametrize("wrong", [merge_softmax, merge_from_the_end, merge_by_lse,
                                   merge_short_last_chunk])
def test_aligned_merge_rejects_other_merges(wrong):
    with pytest.raises(AssertionError, match="aligned_merge"):
        ch10.check_aligned_merge(wrong)


def test_the_reference_merge_keeps_its_bits_under_masked_keys():
    """The reference itself: 40 random queries of 300 keys in chunks of 64 (a last chunk of
    44) and 40 of 37 in chunks of 16 (a last chunk of 5), each padded by 1 to 70 masked
    keys, the same bits. (Cut short, its last chunk changed bits in 2 of 40 at n = 300.)"""
    gen = torch.Generator().manual_seed(7)
    for n, chunk in [(300, 64)] * 40 + [(37, 16)] * 40:
        s, v = torch.randn(n, generator=gen) * 3, torch.randn(n, 16, generator=gen)
        want = ch10.aligned_merge(s, v, chunk)
        pad = int(torch.randint(1, 71, (), generator=gen))
        got = ch10.aligned_merge(torch.cat([s, torch.full((pad,), float("-inf"))]),
                                 torch.cat([v, torch.randn(pad, 16, generator=gen)]), chunk)
        assert torch.equal(got, want), (n, chunk, pad)


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


def test_resume_sum_shows_the_returned_bits_in_full():
    with pytest.raises(AssertionError) as failure:
        ch10.check_resume_sum(resume_vectorised)
    assert "tensor(" not in str(failure.value).split(";")[0]


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
