"""Checkers for chapter 06a: requests that arrive while others run.

The checker runs the reader's function on several arrival patterns, compares with a
reference simulation of ``Engine.step``'s admission, and names the first that disagrees.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from ._common import expect, passed

__all__ = ["PREDICT_CASE", "check_first_token_prediction", "check_first_token_steps"]

_failures = {"6a.1": 0, "6a.1 prediction": 0}


def _first_token_steps(arrivals: Sequence[int], uncached: Sequence[int],
                       budget: int) -> list[int]:
    """The step whose prefill gives each request its first token (memory ignored).

    Request i is submitted just before step ``arrivals[i]``; each step admits from the
    head of the queue (arrival order, then index) while the uncached tokens fit the
    budget left; the first request of a step always goes; a used-up budget ends it.
    """
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    steps = [0] * len(arrivals)
    queue: list[int] = []
    step = 0
    while order or queue:
        while order and arrivals[order[0]] <= step:
            queue.append(order.pop(0))
        left, admitted = budget, 0
        while queue:
            i = queue[0]
            if admitted and uncached[i] > left:
                break
            queue.pop(0)
            steps[i] = step
            left, admitted = left - uncached[i], admitted + 1
            if left <= 0:
                break
        step += 1
    return steps


FIRST_TOKEN_CASES = [
    # (arrival step of each request, its uncached prompt tokens, token budget)
    ([0, 0, 0], [100, 100, 100], 250),
    ([0, 2, 2], [10, 10, 10], 100),          # the engine idles until step 2
    ([0, 0, 1], [300, 10, 10], 256),          # a late arrival queues behind the waiting one
    ([3, 0, 1], [5, 5, 5], 5),                # submitted out of index order
    ([0, 1, 1, 1], [1, 200, 200, 1], 256),
    ([1, 0, 0], [10, 300, 10], 15),        # request 0 arrived last: it queues last
    ([5], [7], 1),
    ([0, 0, 4, 4], [64, 64, 64, 300], 128),
    ([], [], 10),
]


def check_first_token_steps(
        first_token_steps: Callable[[list[int], list[int], int], list[int]]) -> None:
    """Exercise 6a.1: the step at which each request, arriving over time, gets its first token."""
    for arrivals, uncached, budget in FIRST_TOKEN_CASES:
        expected = _first_token_steps(arrivals, uncached, budget)
        try:
            got = first_token_steps(list(arrivals), list(uncached), budget)
        except Exception as exc:  # the reader's code may raise anything
            got = f"<raised {type(exc).__name__}: {exc}>"
        ok = isinstance(got, (list, tuple)) and len(got) == len(expected) and all(
            not isinstance(g, bool) and isinstance(g, int) and operator.index(g) == e
            for g, e in zip(got, expected, strict=True))
        if not ok:
            _failures["6a.1"] += 1
            nudge = ("" if _failures["6a.1"] < 2 else
                     " Hint: a request cannot be admitted before it arrives, and once it is in "
                     "the queue it keeps its place: nobody who arrived later overtakes it. "
                     "Walk the steps one by one, adding the new arrivals to the queue first.")
            expect(False, f"first_token_steps(arrivals={arrivals}, uncached={uncached}, "
                          f"token_budget={budget}) returned {got!r}, expected {expected}.{nudge}")
    waits = [s - a for s, a in zip(_first_token_steps(*FIRST_TOKEN_CASES[2][:2], 256),
                                   FIRST_TOKEN_CASES[2][0], strict=True)]
    passed("6a.1", f"{len(FIRST_TOKEN_CASES)} arrival patterns scheduled right; in the third "
                   f"one the requests wait {waits} steps for their first token")


# The case exercise 6a.1 asks the reader to predict by hand before writing any code.
PREDICT_CASE = ([0, 0, 1, 2], [100, 200, 30, 300], 256)


def check_first_token_prediction(predicted: Sequence[int]) -> None:
    """Exercise 6a.1, first part: the first-token steps of ``PREDICT_CASE``, worked by hand."""
    arrivals, uncached, budget = PREDICT_CASE
    expected = _first_token_steps(arrivals, uncached, budget)
    ok = isinstance(predicted, (list, tuple)) and len(predicted) == len(expected) and all(
        not isinstance(g, bool) and isinstance(g, int) and g == e
        for g, e in zip(predicted, expected, strict=True))
    if not ok:
        _failures["6a.1 prediction"] += 1
        nudge = ("" if _failures["6a.1 prediction"] < 2 else
                 " Hint: at each step, first add the new arrivals to the back of the queue; "
                 "then admit from its head while the uncached tokens fit what is left of the "
                 "budget (the first request of a step always goes), and stop at the first "
                 "that does not fit.")
        expect(False, f"your prediction for arrivals={arrivals}, uncached={uncached}, "
                      f"token_budget={budget} is {predicted!r}, expected {expected}.{nudge}")
    passed("6a.1", f"prediction right: first tokens at steps {expected}")
