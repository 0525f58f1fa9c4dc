"""Checkers for chapter 06a: requests that arrive while others run.

The checker runs the reader's function on several arrival patterns, compares with a
reference simulation of ``Engine.step``'s admission, and names the first that disagrees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._common import as_int_list, call_reader, checker, expect, passed

__all__ = ["PREDICT_CASE", "check_first_token_prediction", "check_first_token_steps"]


def _first_token_steps(arrivals: Sequence[int], uncached: Sequence[int],
                       budget: int, *, mistake: str | None = None) -> list[int]:
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
        while order and (mistake == "early" or arrivals[order[0]] <= step - (mistake == "late")):
            queue.append(order.pop(0))
        if mistake == "shortest":
            queue.sort(key=lambda i: uncached[i])
        left, admitted = budget, 0
        for i in list(queue):
            fits = uncached[i] <= left if mistake != "strict" else uncached[i] < left
            fits = fits or mistake == "budget"
            if admitted and not fits or mistake == "no_first" and not fits:
                if mistake == "overtake":
                    continue
                break
            queue.remove(i)
            steps[i] = step
            left, admitted = left - uncached[i], admitted + 1
            if (left <= 0 and mistake != "budget") or mistake == "one":
                break
        step += 1
        if step > 10_000:  # a broken rule can starve a request: stop, it is wrong anyway
            break
    return steps


# Rules a wrong answer may break, each with the hint that speaks to it.
MISTAKES = {
    "budget": "Each step admits only while the uncached tokens fit what is left of the token "
              "budget; a request that does not fit waits for a later step.",
    "overtake": "Once a request is in the queue it keeps its place: when the head does not "
                "fit what is left of the budget, the step ends, and nobody behind it is "
                "admitted first.",
    "early": "A request cannot be admitted before the step it arrives at: add the new "
             "arrivals to the back of the queue at the start of each step.",
    "strict": "A request whose uncached tokens exactly use up what is left of the budget "
              "still fits.",
    "shortest": "The queue is first come, first served: by arrival step, then by index, "
                "whatever the prompt lengths.",
    "late": "A request submitted just before step s can be admitted at step s itself: it "
            "joins the queue before that step schedules.",
    "one": "A step admits more than one request while their uncached tokens fit the budget.",
    "no_first": "The first request of a step always goes, even if its prompt alone is "
                "longer than the budget.",
}


def _mistake_hint(got, arrivals, uncached, budget) -> str | None:
    """The hint for the first rule whose breaking gives ``got`` (None if none does)."""
    for mistake, hint in MISTAKES.items():
        if list(got) == _first_token_steps(arrivals, uncached, budget, mistake=mistake):
            return hint
    return None


def _as_steps(got, n: int) -> list[int] | None:
    """``got`` as ``n`` step numbers if it is a list or tuple of that many ints, else None."""
    if not isinstance(got, (list, tuple)) or len(got) != n:
        return None
    return as_int_list(got)


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


@checker("6a.1", "Walk the steps one by one: at each, first add the new arrivals to the back "
                 "of the queue, then admit from its head while the uncached tokens fit what "
                 "is left of the budget.")
def check_first_token_steps(
        first_token_steps: Callable[[list[int], list[int], int], list[int]]) -> None:
    """Exercise 6a.1: the step at which each request, arriving over time, gets its first token.

    A repeated failure gets the hint for the rule the answer broke, where one rule explains it.
    """
    for arrivals, uncached, budget in FIRST_TOKEN_CASES:
        expected = _first_token_steps(arrivals, uncached, budget)
        what = (f"first_token_steps(arrivals={arrivals}, uncached={uncached}, "
                f"token_budget={budget})")
        got = call_reader(what, first_token_steps, list(arrivals), list(uncached), budget)
        steps = _as_steps(got, len(expected))
        expect(steps is not None, f"{what} returned {got!r}; expected a list of "
                                  f"{len(expected)} ints, one step per request.",
               "Return one int per request, in index order.")
        expect(steps == expected, f"{what} returned {got!r}, expected {expected}.",
               _mistake_hint(steps, arrivals, uncached, budget))
    waits = [s - a for s, a in zip(_first_token_steps(*FIRST_TOKEN_CASES[2][:2], 256),
                                   FIRST_TOKEN_CASES[2][0], strict=True)]
    passed("6a.1", f"{len(FIRST_TOKEN_CASES)} arrival patterns scheduled right; in the third "
                   f"one the requests wait {waits} steps for their first token")


# The case exercise 6a.1 asks the reader to predict by hand before writing any code.
PREDICT_CASE = ([0, 0, 1, 2], [100, 200, 30, 300], 256)


@checker("6a.1 prediction", "At each step, first add the new arrivals to the back of the "
                            "queue; then admit from its head while the uncached tokens fit "
                            "what is left of the budget (the first request of a step always "
                            "goes), and stop at the first that does not fit.")
def check_first_token_prediction(predicted: Sequence[int]) -> None:
    """Exercise 6a.1, first part: the first-token steps of ``PREDICT_CASE``, worked by hand.

    A wrong step is named but never corrected: the point is to predict first.
    """
    arrivals, uncached, budget = PREDICT_CASE
    expected = _first_token_steps(arrivals, uncached, budget)
    steps = _as_steps(predicted, len(expected))
    expect(steps is not None,
           f"your prediction for arrivals={arrivals}, uncached={uncached}, "
           f"token_budget={budget} is {predicted!r}; write it as a list of {len(expected)} "
           "ints, the first-token step of request 0, 1, 2 and 3.",
           "Copy the template in the cell.")
    wrong = [i for i in range(len(expected)) if steps[i] != expected[i]]
    first = wrong[0] if wrong else 0
    expect(not wrong,
           f"your prediction for arrivals={arrivals}, uncached={uncached}, "
           f"token_budget={budget} is {predicted!r}: the step for request {first} (arriving "
           f"before step {arrivals[first]}, {uncached[first]} uncached tokens) is not right.",
           _mistake_hint(steps, arrivals, uncached, budget) if steps else None)
    passed("6a.1", f"prediction right: first tokens at steps {expected}")
