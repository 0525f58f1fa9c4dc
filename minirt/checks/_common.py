"""Shared pieces of the exercise checkers: success lines, failures, escalating hints.

A checker is a function decorated with :func:`checker`. Inside it, :func:`expect` raises
a :class:`CheckFailure` whose message names the input, what was expected and what came
back. The decorator counts the failures of each exercise: the first failure shows only
that message; a repeated one adds a *nudge*, a hint toward the idea (never the
algorithm). A pass resets the count, so a later slip starts again at the plain message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., None])

# Failed runs per exercise since its last pass ("2.1" -> 2).
_FAILURES: dict[str, int] = {}


class CheckFailure(AssertionError):
    """A checker's failure: ``nudge`` (optional) overrides the checker's general nudge."""

    def __init__(self, message: str, nudge: str | None = None) -> None:
        super().__init__(message)
        self.nudge = nudge


def passed(exercise: str, detail: str = "") -> None:
    """Print the one success line every checker ends with."""
    print(f"Exercise {exercise} passed" + (f": {detail}" if detail else "."))


def expect(condition: bool, message: str, nudge: str | None = None) -> None:
    """Raise ``CheckFailure(message)`` unless ``condition`` holds (never stripped by -O).

    ``nudge`` is shown only when the same exercise fails again; without it, the
    checker's general nudge is used.
    """
    if not condition:
        raise CheckFailure(message, nudge)


def failures(exercise: str) -> int:
    """How many times ``exercise``'s checker has failed since it last passed."""
    return _FAILURES.get(exercise, 0)


def reset_attempts(exercise: str | None = None) -> None:
    """Forget the failure count of one exercise (or of all): the next failure is a first."""
    if exercise is None:
        _FAILURES.clear()
    else:
        _FAILURES.pop(exercise, None)


def checker(exercise: str, nudge: str) -> Callable[[F], F]:
    """Make a checker count its failures and add ``nudge`` to every repeated failure."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                result = fn(*args, **kwargs)
            except AssertionError as exc:
                count = _FAILURES[exercise] = _FAILURES.get(exercise, 0) + 1
                message = str(exc)
                if count == 1:
                    message += ("\n(Fix it and run the check again; if it fails again, "
                                "the message adds a hint.)")
                else:
                    hint = getattr(exc, "nudge", None) or nudge
                    message += f"\nHint (failed {count} times): {hint}"
                raise CheckFailure(message) from exc.__cause__
            _FAILURES.pop(exercise, None)
            return result

        run.exercise = exercise  # type: ignore[attr-defined]
        run.nudge = nudge  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


def call_reader(what: str, fn, *args):
    """Run the reader's function; turn any exception into an AssertionError naming the input.

    ``what`` describes the call (``"split_at(node, 3)"``), so the message says which input
    made the reader's code fail, not only how.
    """
    try:
        return fn(*args)
    except Exception as exc:  # the reader's code may raise anything, AssertionError too
        raise CheckFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc


def same_int(got, expected: int) -> bool:
    """True if ``got`` is an integer (Python, NumPy or 0-d integer tensor) equal to ``expected``."""
    import operator

    if isinstance(got, bool):
        return False
    try:
        return operator.index(got) == expected
    except TypeError:
        return False


def as_int_list(got) -> list[int] | None:
    """``got`` (a list, tuple, set or 1-D integer tensor) as a list of Python ints; else None.

    Checkers use it to accept any reasonable container from the reader while refusing
    floats and bools, which would compare equal to ints by accident.
    """
    import operator

    import torch

    if isinstance(got, torch.Tensor):
        if got.dim() != 1 or got.is_floating_point() or got.dtype == torch.bool:
            return None
        return [int(x) for x in got.tolist()]
    try:
        items = list(got)
    except TypeError:
        return None
    if any(isinstance(x, bool) for x in items):
        return None
    try:
        return [operator.index(x) for x in items]
    except TypeError:
        return None


def expect_per_request(what: str, got, want: Sequence[int], requests: Sequence[Sequence[int]],
                       verb: str, after: str = "") -> None:
    """The reader's ``got`` must be one int per request, each equal to ``want``'s; the
    message names the first request that differs and its length: "request i (n tokens)
    {verb} {want} tokens{after}; got {got}"."""
    got_list = as_int_list(got) if got is not None else None
    expect(got_list is not None and len(got_list) == len(requests),
           f"{what} returned {got!r}; expected a list of {len(requests)} ints.")
    for i, (g, w) in enumerate(zip(got_list, want, strict=True)):
        expect(g == w, f"{what}: request {i} ({len(requests[i])} tokens) {verb} {w} "
                       f"tokens{after}; got {g}.")


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (a plain loop, for references)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expect_value_error(what: str, fn, *args) -> None:
    """Call the reader's ``fn(*args)``, which must refuse with ValueError."""
    try:
        fn(*args)
    except ValueError:
        return
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}; expected "
                             "ValueError") from exc
    expect(False, f"{what} returned normally; expected ValueError.")


def as_permutation(got, n: int) -> list[int] | None:
    """``got`` as a list of ints if it orders the indices 0..n-1 (each once); else None."""
    try:
        order = [int(i) for i in got]
    except (TypeError, ValueError):
        return None
    return order if sorted(order) == list(range(n)) else None
