"""Chapter 09b checkers: each accepts a right answer, rejects plausible wrong ones, and adds
a nudge on a repeated failure."""

from __future__ import annotations

import pytest

import minirt.checks as checks
from minirt.checks._common import reset_attempts
from minirt.simulate import belady_hit_rate, simulate
from minirt.traces import load_trace
from minirt.workloads import unique_prefix_count


@pytest.fixture(autouse=True)
def fresh_hints():
    reset_attempts()
    yield
    reset_attempts()


# ---------------------------------------------------------------- Exercise 9b.1

def _make_ceiling(tokens=True, partial=True, across=True):
    def fn(requests):
        seen: dict = {}
        total = 0
        for k, (n, ids) in enumerate(requests):
            total += n if tokens else len(ids)
            for i, h in enumerate(ids):
                size = 512 if i < len(ids) - 1 or not partial else n - 512 * (len(ids) - 1)
                seen[h if across else (k, h)] = size if tokens else 1
        if not partial and tokens:
            total = sum(512 * len(ids) for _, ids in requests)
        return 1 - sum(seen.values()) / total
    return fn


def test_ceiling_accepts_the_reference(capsys):
    checks.check_trace_ceiling(_make_ceiling(), load_trace("synthetic").requests[:300])
    assert capsys.readouterr().out.startswith("Exercise 9b.1 passed")


@pytest.mark.parametrize("wrong", [
    _make_ceiling(tokens=False),  # blocks, not tokens
    _make_ceiling(partial=False),  # every last block counted as 512 tokens
    _make_ceiling(across=False),  # repeats only within a request
    lambda requests: len({ids for _, ids in requests}) / len(requests),  # whole requests
])
def test_ceiling_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="trace_ceiling"):
        checks.check_trace_ceiling(wrong)


def test_ceiling_checks_the_real_trace_too():
    real = load_trace("conversation").requests[:200]
    cases = {(n, tuple(ids)) for n, ids in
             [(r.input_length, r.hash_ids) for r in real]}
    assert len(cases) > 100
    # a reader's function that is right only on short traces is caught by the real one
    def short_only(requests):
        return _make_ceiling()(requests) if len(requests) < 10 else 0.0
    checks.check_trace_ceiling(short_only)
    with pytest.raises(AssertionError, match="the 200 trace requests"):
        checks.check_trace_ceiling(short_only, real)


def test_ceiling_hints_escalate():
    wrong = _make_ceiling(partial=False)
    with pytest.raises(AssertionError) as first:
        checks.check_trace_ceiling(wrong)
    assert "Hint" not in str(first.value) and "expected" in str(first.value)
    with pytest.raises(AssertionError) as second:
        checks.check_trace_ceiling(wrong)
    assert "Hint (failed 2 times)" in str(second.value)


# ---------------------------------------------------------------- Exercise 9b.2

def _make_share(against_ceiling=False, strict=False, index=False, never=None):
    def fn(prompts, capacities, share):
        total = sum(map(len, prompts))
        for k, cap in enumerate(capacities):
            lru = simulate(prompts, cap, "lru").hit_rate
            best = (1 - unique_prefix_count(prompts) / total) if against_ceiling \
                else belady_hit_rate(prompts, cap)
            if (lru > share * best) if strict else (lru >= share * best):
                return k if index else cap
        return never
    return fn


def test_share_accepts_the_reference(capsys):
    checks.check_lru_share_capacity(_make_share())
    assert capsys.readouterr().out.startswith("Exercise 9b.2 passed")


@pytest.mark.parametrize("wrong", [
    _make_share(against_ceiling=True),  # LRU against the ceiling, not Belady at that size
    _make_share(strict=True),  # equality does not count
    _make_share(index=True),  # the index, not the capacity
    _make_share(never=-1),  # a number where no capacity is enough
    lambda prompts, capacities, share: capacities[-1],  # always the largest
])
def test_share_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="lru_share_capacity"):
        checks.check_lru_share_capacity(wrong)


def test_share_hints_escalate():
    wrong = _make_share(strict=True)
    for _ in range(2):
        with pytest.raises(AssertionError) as err:
            checks.check_lru_share_capacity(wrong)
    assert "Hint (failed 2 times)" in str(err.value) and "Belady" in str(err.value)


# ---------------------------------------------------------------- Exercise 9b.3

def _make_tel(use_end=False, strict=False, cached_history=False, count_nodes=False):
    def fn(node_lengths, history_len, threshold, next_prompt_estimate):
        history = sum(node_lengths) if cached_history else history_len
        budget = max(history + next_prompt_estimate - threshold, 0)
        safe, start = 0, 0
        for n in node_lengths:
            depth = start + n if use_end else start
            if (depth > budget) if strict else (depth >= budget):
                safe += 1 if count_nodes else n
            start += n
        return safe
    return fn


def test_tel_accepts_the_reference(capsys):
    checks.check_tel_safe_tokens(_make_tel())
    assert capsys.readouterr().out.startswith("Exercise 9b.3 passed")


@pytest.mark.parametrize("wrong", [
    _make_tel(use_end=True),  # the node's end instead of what is cached before it
    _make_tel(strict=True),  # a node starting exactly at the budget kept
    _make_tel(cached_history=True),  # L read from what is cached, not the high-water mark
    _make_tel(count_nodes=True),  # nodes, not tokens
])
def test_tel_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="tel_safe_tokens"):
        checks.check_tel_safe_tokens(wrong)


def test_tel_hints_escalate_and_a_crash_names_the_input():
    def crash(node_lengths, *_):
        return node_lengths[0]  # IndexError on the empty branch
    with pytest.raises(AssertionError) as first:
        checks.check_tel_safe_tokens(crash)
    assert "returned" in str(first.value) or "raised" in str(first.value)
    with pytest.raises(AssertionError) as second:
        checks.check_tel_safe_tokens(_make_tel(use_end=True))
    assert "Hint (failed 2 times)" in str(second.value)
