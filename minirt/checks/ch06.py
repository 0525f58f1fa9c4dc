"""Checkers for chapter 06: what the engine prefills turn after turn, which order of a
queue gives the best TTFT, what a cached prefill costs, and when FCFS admits.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees (input, expected, got); a
repeated failure adds a hint toward the idea.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from ._common import as_permutation, call_reader, checker, expect, lcp, passed, same_int

__all__ = [
    "check_admission_steps",
    "check_best_ttft_order",
    "check_chat_plan",
    "check_prefill_flops",
    "chat_plan_reference",
]


# ---------------------------------------------------------------- 6.1 a chat, turn by turn

Turn = tuple[Sequence[int], Sequence[int]]


def chat_plan_reference(turns: Sequence[Turn], page_size: int) -> list[tuple[int, int]]:
    """(cached, computed) per request for an engine with an unbounded cache serving
    ``turns`` (prompt, output) one after another."""
    held: list[list[int]] = []
    plan = []
    for prompt, output in turns:
        prompt = list(prompt)
        best = max((lcp(prompt[:-1], h) for h in held), default=0)
        cached = best - best % page_size
        plan.append((cached, len(prompt) - cached))
        with_kv = prompt + list(output)[:-1]  # the last output token never got K/V
        held.append(with_kv[: len(with_kv) - len(with_kv) % page_size])
    return plan


def _chat(first: list[int], replies: list[list[int]], users: list[list[int]]) -> list[Turn]:
    """A conversation: each prompt is the previous prompt + its output + the next user part."""
    turns, prompt = [], list(first)
    for k, reply in enumerate(replies):
        turns.append((list(prompt), list(reply)))
        if k < len(users):
            prompt = prompt + reply + users[k]
    return turns


_SYS = list(range(100, 120))
PLAN_CASES: list[tuple[str, list[Turn], int]] = [
    ("a three-turn chat, pages of 1",
     _chat(_SYS + [1, 2], [[7, 8, 9], [5, 5], [6]], [[3, 4], [1]]), 1),
    ("the same chat, pages of 4", _chat(_SYS + [1, 2], [[7, 8, 9], [5, 5], [6]], [[3, 4], [1]]), 4),
    ("the same prompt twice, one output token each", [(_SYS, [1]), (_SYS, [1])], 1),
    ("the same prompt twice, pages of 16", [(_SYS, [1, 2]), (_SYS, [1, 2])], 16),
    ("two conversations interleaved: the third request continues the first",
     [(_SYS + [1, 2, 3], [9, 9]), ([50, 51, 52, 53], [8]), (_SYS + [1, 2, 3, 9, 9, 4], [3])], 2),
    ("a follow-up that ends where the cached output ends", [([1, 2, 3, 4], [5, 6, 7]),
                                                            ([1, 2, 3, 4, 5, 6], [1])], 1),
    ("nothing shared", [([1, 2, 3], [4]), ([5, 6], [7])], 1),
]


@checker("6.1", "Two questions: what does the tree hold once a request finishes (which of its "
                "tokens ever had K/V computed?), and which part of a new prompt may a match "
                "take from it?")
def check_chat_plan(chat_plan: Callable[[list[Turn], int], Sequence[tuple[int, int]]]) -> None:
    """Exercise 6.1: (cached, computed) prompt tokens of each request in a stream of turns."""
    for name, turns, page in PLAN_CASES:
        want = chat_plan_reference(turns, page)
        short = [(len(p), len(o)) for p, o in turns]
        call = f"chat_plan(turns, page_size={page}) ({name}; (prompt, output) lengths {short})"
        got = call_reader(call, chat_plan, [(list(p), list(o)) for p, o in turns], page)
        try:
            pairs = [(int(c), int(n)) for c, n in got]
        except (TypeError, ValueError):
            pairs = None
        expect(pairs is not None and len(pairs) == len(want),
               f"{call} returned {got!r}; expected one (cached, computed) pair per request, "
               f"e.g. {want}.")
        for i, (have, exp) in enumerate(zip(pairs, want, strict=True)):
            expect(have == exp, f"{call}: request {i} gets (cached, computed) = {have}, "
                                f"expected {exp}.")
    passed("6.1", f"{len(PLAN_CASES)} request streams planned right: a turn reuses the last "
                  "one's prompt and output except its final token, in whole pages")


# ---------------------------------------------------------------- 6.2 best TTFT order

StepTime = Callable[[int, int], float]


def _mean_ttft(requests: Sequence[tuple[int, int]], order: Sequence[int],
               step_time: StepTime) -> float:
    clock, total = 0.0, 0.0
    for i in order:
        clock += step_time(*requests[i])
        total += clock
    return total / len(order) if order else 0.0


def _linear(prompt_len: int, cached_len: int) -> float:
    return 2.0 + 1.0 * (prompt_len - cached_len)


def _attention(prompt_len: int, cached_len: int) -> float:
    """Weights per new token plus attention to every earlier token (cached ones included)."""
    new = prompt_len - cached_len
    return 1.0 + 0.5 * new + 0.01 * new * (cached_len + (new + 1) / 2)


ORDER_CASES: list[tuple[str, list[tuple[int, int]], StepTime, str]] = [
    ("costs linear in uncached tokens", [(100, 0), (40, 30), (300, 290), (60, 0)], _linear,
     "2 + uncached"),
    ("one long prompt mostly cached", [(2000, 1900), (150, 0), (120, 100), (400, 0)], _linear,
     "2 + uncached"),
    ("attention to a long cached prefix costs", [(4000, 3900), (160, 0), (90, 60), (500, 0),
                                                 (1000, 800)], _attention,
     "1 + 0.5 new + 0.01 new (cached + (new + 1) / 2)"),
    ("equal prompts, different hits", [(256, 0), (256, 128), (256, 255), (256, 64)],
     _attention, "1 + 0.5 new + 0.01 new (cached + (new + 1) / 2)"),
    ("a single request", [(10, 3)], _linear, "2 + uncached"),
]


@checker("6.2", "What does the request served first add to everyone's TTFT, and what does "
                "the one served last add? Compare two neighbours in the order: when does "
                "swapping them lower the sum?")
def check_best_ttft_order(best_ttft_order: Callable[[list[tuple[int, int]], StepTime],
                                                    Sequence[int]]) -> None:
    """Exercise 6.2: an order of the waiting requests with the least mean TTFT."""
    for name, requests, step_time, formula in ORDER_CASES:
        call = (f"best_ttft_order({requests}, step_time) ({name}; step_time(prompt_len, "
                f"cached_len) = {formula})")
        got = call_reader(call, best_ttft_order, list(requests), step_time)
        order = as_permutation(got, len(requests))
        expect(order is not None,
               f"{call} returned {got!r}; expected the indices 0..{len(requests) - 1} in the "
               "order to serve them, each once, e.g. [2, 0, 1].")
        best = min(_mean_ttft(requests, perm, step_time)
                   for perm in itertools.permutations(range(len(requests))))
        mine = _mean_ttft(requests, order, step_time)
        expect(math.isclose(mine, best, rel_tol=1e-9),
               f"{call} returned the order {order}, whose mean TTFT is {mine:.3f}; the best "
               f"order's is {best:.3f}.")
    passed("6.2", f"{len(ORDER_CASES)} queues ordered for the least mean TTFT: the shortest "
                  "step first, where a step's time counts attention to the cached prefix too")


# ---------------------------------------------------------------- 6.3 prefill FLOPs


def _prefill_flops(num_new: int, num_cached: int, params: int, layers: int, heads: int,
                   head_dim: int, window: int | None = None) -> int:
    linear = 2 * params * num_new
    if window is None or window >= num_cached + num_new:
        pairs = num_new * num_cached + num_new * (num_new + 1) // 2
    else:  # new token i (1-based) sees min(window, num_cached + i) keys
        pairs = sum(min(window, num_cached + i) for i in range(1, num_new + 1))
    return linear + 4 * layers * heads * head_dim * pairs


SMOLLM2 = dict(params=106_168_320, layers=30, heads=9, head_dim=64)
FLOP_CASES = [
    (64, 0, 1000, 2, 4, 8, None), (64, 1024, 1000, 2, 4, 8, None), (1, 1024, 10, 1, 1, 1, None),
    (1, 0, 10, 1, 1, 1, None), (7, 3, 0, 1, 2, 3, None), (7, 3, 0, 1, 2, 3, 4),
    (2, 3, 0, 1, 1, 1, 3), (5, 0, 0, 1, 1, 1, 2), (64, 1024, 1000, 2, 4, 8, 128),
    (64, 1024, *SMOLLM2.values(), None), (64, 0, *SMOLLM2.values(), None),
    (1088, 0, *SMOLLM2.values(), 4096), (64, 1024, *SMOLLM2.values(), 128),
]


@checker("6.3", "Take one new token: how many keys does it see with full attention, and "
                "how many once a window caps them? Then add up over the new tokens.")
def check_prefill_flops(prefill_flops: Callable[..., int]) -> None:
    """Exercise 6.3: FLOPs of prefilling ``num_new`` tokens after ``num_cached`` cached ones,
    with full (``window=None``) or sliding-window attention."""
    names = ("num_new", "num_cached", "params", "layers", "heads", "head_dim", "window")
    for case in FLOP_CASES:
        expected = _prefill_flops(*case)
        args = ", ".join(f"{n}={v}" for n, v in zip(names, case, strict=True))
        got = call_reader(f"prefill_flops({args})", prefill_flops, *case)
        ok = isinstance(got, (int, float)) and not isinstance(got, bool) \
            and math.isclose(float(got), expected, rel_tol=1e-12)
        expect(ok, f"prefill_flops({args}) returned {got!r}, expected {expected}.")
    full = _prefill_flops(64, 1024, **SMOLLM2) / _prefill_flops(64, 0, **SMOLLM2)
    local = _prefill_flops(64, 1024, **SMOLLM2, window=128) / _prefill_flops(64, 0, **SMOLLM2)
    passed("6.3", f"64 new tokens after 1024 cached cost {full:.2f}x a bare 64-token prefill "
                  f"with full attention, {local:.2f}x with a 128-token window")


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
    ([1, 1, 500, 5], 100),       # nearly fully cached prompts cost 1 token
    ([64] * 9, 256),
    ([257, 256, 1, 255], 256),
    ([], 10),
]


@checker("6.4", "Walk the queue by hand with the budget written beside it. What happens "
                "to a request that does not fit, and to the ones behind it?")
def check_admission_steps(admission_steps: Callable[[list[int], int], list[int]]) -> None:
    """Exercise 6.4: the scheduling step at which FCFS-within-a-budget admits each request."""
    for uncached, budget in ADMIT_CASES:
        expected = _admission_steps(uncached, budget)
        call = f"admission_steps({uncached}, token_budget={budget})"
        got = call_reader(call, admission_steps, list(uncached), budget)
        ok = isinstance(got, (list, tuple)) and len(got) == len(expected) \
            and all(same_int(g, e) for g, e in zip(got, expected, strict=True))
        expect(ok, f"{call} returned {got!r}, expected {expected}.")
    passed("6.4", f"{len(ADMIT_CASES)} queues scheduled right")
