"""Shared pieces of the exercise checkers."""

from __future__ import annotations


def passed(exercise: str, detail: str = "") -> None:
    """Print the one success line every checker ends with."""
    print(f"Exercise {exercise} passed" + (f": {detail}" if detail else "."))


def expect(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``condition`` holds (never stripped by -O)."""
    if not condition:
        raise AssertionError(message)


def call_reader(what: str, fn, *args):
    """Run the reader's function; turn any exception into an AssertionError naming the input.

    ``what`` describes the call (``"split_at(node, 3)"``), so the message says which input
    made the reader's code fail, not only how.
    """
    try:
        return fn(*args)
    except Exception as exc:  # the reader's code may raise anything, AssertionError too
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from exc


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
