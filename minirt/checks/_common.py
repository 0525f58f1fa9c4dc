"""Shared pieces of the exercise checkers."""

from __future__ import annotations


def passed(exercise: str, detail: str = "") -> None:
    """Print the one success line every checker ends with."""
    print(f"Exercise {exercise} passed" + (f": {detail}" if detail else "."))


def expect(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``condition`` holds (never stripped by -O)."""
    if not condition:
        raise AssertionError(message)
