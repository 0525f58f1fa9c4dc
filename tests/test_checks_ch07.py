"""Chapter 07 checkers: each accepts a right answer, rejects plausible wrong ones, and
adds a nudge on a repeated failure."""

from __future__ import annotations

import itertools

import pytest

import minirt.checks as checks
from minirt.checks import ch07
from minirt.scheduler import dfs_weight_order, sequential_cost


@pytest.fixture(autouse=True)
def fresh_hints():
    ch07._failures.clear()
    yield
    ch07._failures.clear()


def edge_right(prompts):
    return len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)})


def edge_total_minus_pairs(prompts):  # subtracts only what consecutive prompts share
    total = sum(map(len, prompts))
    for a, b in zip(prompts, prompts[1:], strict=False):
        pairs = enumerate(zip(a, b, strict=False))
        total -= next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
    return total


def edge_distinct_prompts(prompts):  # counts whole prompts, not prefixes
    return sum(len(p) for p in {tuple(p) for p in prompts})


def test_edge_sum():
    checks.check_edge_sum(edge_right)
    for wrong in (edge_total_minus_pairs, edge_distinct_prompts):
        with pytest.raises(AssertionError, match="expected"):
            checks.check_edge_sum(wrong)


def dfs_right(prompts):
    return sorted(range(len(prompts)), key=lambda i: prompts[i])  # lexicographic is DFS


def dfs_by_length(prompts):
    return sorted(range(len(prompts)), key=lambda i: len(prompts[i]))


def dfs_by_first_token(prompts):  # groups the top level only
    return sorted(range(len(prompts)), key=lambda i: prompts[i][0])


def test_dfs_order():
    checks.check_dfs_order(dfs_right)
    checks.check_dfs_order(dfs_weight_order)
    for wrong in (dfs_by_length, dfs_by_first_token, lambda ps: list(range(len(ps)))):
        with pytest.raises(AssertionError, match="computes"):
            checks.check_dfs_order(wrong)
    with pytest.raises(AssertionError, match="permutation"):
        checks.check_dfs_order(lambda ps: [0] * len(ps))


def worst_right(prompts, capacity):
    return max(itertools.permutations(range(len(prompts))),
               key=lambda p: sequential_cost(prompts, capacity, p))


def worst_is_dfs(prompts, capacity):  # the best order, not the worst
    return dfs_weight_order(prompts)


def worst_round_robin_by_first_token(prompts, capacity):  # interleaves the top level only
    groups = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p[0], []).append(i)
    lanes = list(groups.values())
    return [i for row in itertools.zip_longest(*lanes) for i in row if i is not None]


def test_worst_order():
    checks.check_worst_order(worst_right)
    for wrong in (worst_is_dfs, worst_round_robin_by_first_token,
                  lambda ps, c: list(range(len(ps)))):
        with pytest.raises(AssertionError, match="worst order computes"):
            checks.check_worst_order(wrong)


def wait_right(k, steps):
    return steps if k is None else max(1, min(k, steps))


def wait_forgets_k0(k, steps):
    return steps if k is None else min(k, steps)


def wait_plus_one(k, steps):
    return steps if k is None else min(k + 1, steps)


def test_lone_wait():
    checks.check_lone_wait(wait_right)
    for wrong in (wait_forgets_k0, wait_plus_one, lambda k, s: s):
        with pytest.raises(AssertionError, match="expected the lone"):
            checks.check_lone_wait(wrong)


def test_hints_escalate():
    with pytest.raises(AssertionError) as first:
        checks.check_edge_sum(edge_distinct_prompts)
    assert "prompts" in str(first.value) and "Hint" not in str(first.value)
    with pytest.raises(AssertionError) as second:
        checks.check_edge_sum(edge_distinct_prompts)
    assert "Hint:" in str(second.value) and "distinct prefix" in str(second.value)
    with pytest.raises(AssertionError, match="raised ZeroDivisionError"):
        checks.check_edge_sum(lambda ps: 1 // 0)
