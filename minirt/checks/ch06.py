"""Checkers for chapter 06: what the engine prefills, when it admits, and what TTFT costs.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

from ..engine import RequestMetrics
from ._common import expect, passed

__all__ = [
    "check_admission_steps",
    "check_prefill_flops",
    "check_prefill_plan",
    "check_time_per_output_token",
]


def _same_int(got, expected: int) -> bool:
    if isinstance(got, bool):
        return False
    try:
        return operator.index(got) == expected
    except TypeError:
        return False


# ---------------------------------------------------------------- 6.1 prefill plan


def _prefill_plan(prompt_len: int, common_len: int, page_size: int) -> tuple[int, int]:
    """(cached, computed): match all but the last prompt token, in whole pages."""
    matchable = min(common_len, prompt_len - 1)
    cached = matchable // page_size * page_size
    return cached, prompt_len - cached


PLAN_CASES = [
    # (prompt_len, common_len with the cache, page_size)
    (30, 20, 16),     # the seed's case: 20 tokens in common, pages of 16
    (30, 20, 1),
    (12, 12, 1),      # the same prompt again: the last token is still computed
    (12, 40, 1),      # the cache holds a longer sequence that starts with the prompt
    (32, 32, 16),     # whole prompt cached, 2 pages: only 1 full page is usable
    (33, 32, 16),
    (17, 17, 16),
    (16, 16, 16),     # one page, all cached: nothing usable (the last token needs a page)
    (100, 0, 4),
    (1, 0, 1),
    (1, 5, 1),
    (1000, 999, 64),
]


def check_prefill_plan(prefill_plan: Callable[[int, int, int], tuple[int, int]]) -> None:
    """Exercise 6.1: cached and computed prompt tokens at admission."""
    for case in PLAN_CASES:
        expected = _prefill_plan(*case)
        got = prefill_plan(*case)
        ok = (isinstance(got, tuple) and len(got) == 2
              and all(_same_int(g, e) for g, e in zip(got, expected, strict=True)))
        prompt_len, common, page = case
        expect(ok, f"prefill_plan(prompt_len={prompt_len}, common_len={common}, "
                   f"page_size={page}) returned {got!r}, expected {expected}. The engine "
                   "matches all but the last prompt token (its logits give the first output "
                   "token), and only whole pages of that match are reused.")
    passed("6.1", f"{len(PLAN_CASES)} admissions planned right; with pages of 16, a 20-token "
                  f"common prefix saves {_prefill_plan(30, 20, 16)[0]} tokens")


# ---------------------------------------------------------------- 6.2 a new metric


def _tpot(m: RequestMetrics) -> float:
    if m.output_tokens <= 1:
        return 0.0
    return (m.latency - m.ttft) / (m.output_tokens - 1)


def _metrics(prompt: int, cached: int, out: int, ttft: float, latency: float) -> RequestMetrics:
    return RequestMetrics(prompt_tokens=prompt, cached_tokens=cached, output_tokens=out,
                          ttft=ttft, prefill_time=ttft / 2, latency=latency)


TPOT_CASES = [
    _metrics(500, 480, 16, 0.25, 1.75),
    _metrics(500, 0, 16, 1.5, 3.0),
    _metrics(80, 0, 2, 0.1, 0.3),
    _metrics(80, 79, 1, 0.05, 0.05),   # one token: no decode step at all
    _metrics(10, 0, 101, 0.01, 5.01),
]


def check_time_per_output_token(time_per_output_token: Callable[[RequestMetrics], float]) -> None:
    """Exercise 6.2: TPOT, the mean time between output tokens after the first."""
    for m in TPOT_CASES:
        expected = _tpot(m)
        got = time_per_output_token(m)
        ok = isinstance(got, (int, float)) and not isinstance(got, bool) \
            and math.isclose(float(got), expected, rel_tol=1e-9, abs_tol=1e-12)
        expect(ok, f"time_per_output_token({m}) returned {got!r}, expected {expected!r}: the "
                   "time after the first token, (latency - ttft), spread over the "
                   "output_tokens - 1 decode steps that produced the others (0.0 for one "
                   "token).")
    passed("6.2", "TPOT separates decode speed from TTFT; a prefix hit changes TTFT, "
                  "barely TPOT")


# ---------------------------------------------------------------- 6.3 prefill FLOPs


def _prefill_flops(num_new: int, num_cached: int, params: int, layers: int, heads: int,
                   head_dim: int) -> int:
    linear = 2 * params * num_new
    pairs = num_new * num_cached + num_new * (num_new + 1) // 2
    return linear + 4 * layers * heads * head_dim * pairs


SMOLLM2 = dict(params=106_168_320, layers=30, heads=9, head_dim=64)
FLOP_CASES = [
    (64, 0, 1000, 2, 4, 8), (64, 1024, 1000, 2, 4, 8), (1, 1024, 10, 1, 1, 1),
    (1, 0, 10, 1, 1, 1), (7, 3, 0, 1, 2, 3),
    (64, 1024, *SMOLLM2.values()), (64, 0, *SMOLLM2.values()), (1088, 0, *SMOLLM2.values()),
]


def check_prefill_flops(prefill_flops: Callable[[int, int, int, int, int, int], int]) -> None:
    """Exercise 6.3: FLOPs of prefilling ``num_new`` tokens after ``num_cached`` cached ones."""
    for case in FLOP_CASES:
        expected = _prefill_flops(*case)
        got = prefill_flops(*case)
        ok = isinstance(got, (int, float)) and not isinstance(got, bool) \
            and math.isclose(float(got), expected, rel_tol=1e-12)
        names = ("num_new", "num_cached", "params", "layers", "heads", "head_dim")
        args = ", ".join(f"{n}={v}" for n, v in zip(names, case, strict=True))
        expect(ok, f"prefill_flops({args}) returned {got!r}, expected {expected}: 2 * "
                   "params per new token, plus 4 * layers * heads * head_dim per (query, key) "
                   "pair, where new token i (1-based) attends to the cached tokens and to new "
                   "tokens 1..i.")
    ratio = _prefill_flops(64, 1024, **SMOLLM2) / _prefill_flops(64, 0, **SMOLLM2)
    passed("6.3", f"a 64-token prefill after a 1024-token cached prefix costs {ratio:.2f}x the "
                  "bare 64-token prefill on SmolLM2: attention to the prefix is not free")


# ---------------------------------------------------------------- 6.4 FCFS admission


def _admission_steps(uncached: Sequence[int], budget: int) -> list[int]:
    """Straight simulation of the engine's loop (memory ignored)."""
    queue = list(enumerate(uncached))
    steps = [0] * len(uncached)
    step = 0
    while queue:
        left, admitted = budget, 0
        while queue:
            i, n = queue[0]
            if admitted and n > left:
                break
            queue.pop(0)
            steps[i] = step
            left, admitted = left - n, admitted + 1
            if left <= 0:
                break
        step += 1
    return steps


ADMIT_CASES = [
    ([100, 100, 100], 250),
    ([300, 10, 10], 256),        # a long prompt runs alone in its step; nobody overtakes it
    ([10, 300, 10], 256),        # the short one behind the long one waits (FCFS)
    ([1, 1, 1, 1, 1], 2),
    ([1, 1, 500, 5], 100),       # nearly fully cached prompts cost 1 token (see 6.1)
    ([64] * 9, 256),
    ([257, 256, 1, 255], 256),
    ([], 10),
]


def check_admission_steps(admission_steps: Callable[[list[int], int], list[int]]) -> None:
    """Exercise 6.4: the scheduling step at which FCFS-within-a-budget admits each request."""
    for uncached, budget in ADMIT_CASES:
        expected = _admission_steps(uncached, budget)
        got = admission_steps(list(uncached), budget)
        ok = isinstance(got, (list, tuple)) and len(got) == len(expected) \
            and all(_same_int(g, e) for g, e in zip(got, expected, strict=True))
        expect(ok, f"admission_steps({uncached}, token_budget={budget}) returned {got!r}, "
                   f"expected {expected}: strictly first come first served; a step admits "
                   "requests while their uncached tokens fit the budget left, its first "
                   "request always goes, and a step whose budget is used up admits no more.")
    passed("6.4", f"{len(ADMIT_CASES)} queues scheduled right")
