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
