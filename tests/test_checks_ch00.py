"""Chapter 00 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest
from brute_force import lcp
from exercise_util import accepts, rejects

import minirt.checks as checks
from minirt.checks import ch00

# ---------------------------------------------------------------- Exercise 0.1


def keep_last_right(requests):
    total, kept = 0, []
    for r in requests:
        total += len(r) - lcp(r, kept)
        kept = r
    return total


def keep_last_any_earlier(requests):  # reuses from every earlier request: the unlimited cache
    return ch00._prefill_waste(requests)[1]


def keep_last_first_only(requests):  # keeps the first request forever
    return sum(len(r) - lcp(r, requests[0]) for r in requests[1:]) + (
        len(requests[0]) if requests else 0)


def keep_last_shared_tokens(requests):  # counts equal tokens at equal positions, not prefixes
    total, kept = 0, []
    for r in requests:
        total += sum(1 for i, t in enumerate(r) if i >= len(kept) or kept[i] != t)
        kept = r
    return total


def test_keep_last_accepts_reference(capsys):
    accepts(checks.check_keep_last_prefill, keep_last_right, "0.1", capsys)


@pytest.mark.parametrize("wrong", [keep_last_any_earlier, keep_last_first_only,
                                   keep_last_shared_tokens])
def test_keep_last_rejects(wrong):
    rejects(checks.check_keep_last_prefill, wrong, "0.1", contains="expected")


def test_keep_last_by_hand():
    assert keep_last_right([[1, 2, 3, 4], [9, 9], [1, 2, 3, 5]]) == 10
    assert ch00._keep_last_prefill([[1, 2, 3, 4], [9, 9], [1, 2, 3, 5]]) == 10


# ---------------------------------------------------------------- Exercise 0.2

def fit_right(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return max(budget - prompt_len * per_token, 0) // (own_len * per_token)
    return budget // ((prompt_len + own_len) * per_token)


def fit_forgets_shared_copy(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return budget // (own_len * per_token)
    return fit_right(budget, per_token, prompt_len, own_len, shared)


def fit_rounds_up(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return max(-(-(budget - prompt_len * per_token) // (own_len * per_token)), 0)
    return -(-budget // ((prompt_len + own_len) * per_token))


def fit_negative_when_short(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return (budget - prompt_len * per_token) // (own_len * per_token)
    return fit_right(budget, per_token, prompt_len, own_len, shared)


def fit_ignores_own_tokens(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return fit_right(budget, per_token, prompt_len, own_len, shared)
    return budget // (prompt_len * per_token)


def test_fit_accepts_reference(capsys):
    checks.check_requests_that_fit(fit_right)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 0.2 passed") and "428" in out and "2616" in out


@pytest.mark.parametrize("wrong", [fit_forgets_shared_copy, fit_rounds_up,
                                   fit_negative_when_short, fit_ignores_own_tokens])
def test_fit_rejects(wrong):
    rejects(checks.check_requests_that_fit, wrong, "0.2", contains="requests_that_fit(")


def test_fit_by_hand():
    # 64 GiB / 128 KiB = 524288 tokens: 524288 // 1224 = 428; (524288 - 1024) // 200 = 2616.
    assert ch00._requests_that_fit(64 << 30, 131072, 1024, 200, False) == 428
    assert ch00._requests_that_fit(64 << 30, 131072, 1024, 200, True) == 2616
    assert ch00._requests_that_fit(100, 10, 20, 1, True) == 0


# ---------------------------------------------------------------- Exercise 0.3

def waste_right(requests):
    prefixes = {tuple(r[: i + 1]) for r in requests for i in range(len(r))}
    return sum(map(len, requests)), len(prefixes)


def waste_token_set(requests):  # distinct tokens, ignoring what comes before them
    return sum(map(len, requests)), len({t for r in requests for t in r})


def waste_common_prefix_of_all(requests):  # shares only what every request has in common
    if not requests:
        return 0, 0
    common = 0
    while all(len(r) > common and r[common] == requests[0][common] for r in requests):
        common += 1
    return sum(map(len, requests)), sum(len(r) - common for r in requests) + common


def waste_distinct_requests(requests):  # caches whole requests, not prefixes
    return sum(map(len, requests)), sum(len(r) for r in {tuple(r) for r in requests})


def waste_list(requests):  # right numbers, wrong type
    return list(waste_right(requests))


def test_waste_accepts_reference(capsys):
    checks.check_prefill_waste(waste_right)
    assert capsys.readouterr().out.startswith("Exercise 0.3 passed")


@pytest.mark.parametrize("wrong", [waste_token_set, waste_common_prefix_of_all,
                                   waste_distinct_requests, waste_list])
def test_waste_rejects(wrong):
    rejects(checks.check_prefill_waste, wrong, "0.3", contains="prefill_waste(")


def test_waste_reference_by_hand():
    assert ch00._prefill_waste([[1, 2, 3], [1, 2, 4], [5, 6]]) == (8, 6)
    assert ch00._prefill_waste([[1, 9, 9], [2, 9, 9]]) == (6, 6)


# ---------------------------------------------------------------- Exercise 0.4


def order_right(requests):
    return sorted(range(len(requests)), key=lambda i: requests[i])


def order_arrival(requests):
    return list(range(len(requests)))


def order_by_length(requests):
    return sorted(range(len(requests)), key=lambda i: len(requests[i]))


def order_by_first_token(requests):  # groups by the first token only; ties keep arrival order
    return sorted(range(len(requests)), key=lambda i: requests[i][:1])


def order_not_a_permutation(requests):
    return [0] * len(requests)


def test_order_accepts_reference(capsys):
    accepts(checks.check_best_order, order_right, "0.4", capsys)


@pytest.mark.parametrize("wrong", [order_arrival, order_by_length, order_by_first_token,
                                   order_not_a_permutation])
def test_order_rejects(wrong):
    rejects(checks.check_best_order, wrong, "0.4", contains="best_order(")


def test_all_checkers_exported():
    for name in ch00.__all__:
        assert getattr(checks, name) is getattr(ch00, name)
