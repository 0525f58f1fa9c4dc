"""Helpers for the checker tests: rejections escalate, and never leak the solution.

``rejects(check, answer, exercise)`` runs a checker twice on a wrong answer. The first
failure must name what came back (no hint yet); the second must add the checker's hint;
neither message may contain a line of the reference solution in ``solutions/``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from minirt.checks import _common

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^#+\s*Exercise\s+(\d+[a-z]?\.\d+)\b", re.MULTILINE)


def squash(text: str) -> str:
    """``text`` without any whitespace (so layout never hides a copy)."""
    return re.sub(r"\s+", "", text)


@cache
def solution_regions() -> dict[str, list[str]]:
    """Exercise number -> the code of its solution regions, from every solution notebook."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        label = None
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                found = HEADING.findall(src)
                label = found[-1] if found else label
                continue
            for body in re.findall(r"### BEGIN SOLUTION\n(.*?)\n\s*### END SOLUTION", src, re.S):
                out.setdefault(label, []).append(body)
    return out


def key_lines(exercise: str, min_len: int = 16) -> list[str]:
    """The solution's code lines worth hiding: long enough to say something, not comments."""
    lines = []
    for body in solution_regions()[exercise]:
        for line in body.split("\n"):
            text = line.split("#")[0].strip()
            short_return = text.startswith("return") and len(text) < 25
            if len(text) >= min_len and not short_return and not text.startswith(("def ", '"""')):
                lines.append(text)
    return lines


def rejects(check, answer, exercise: str, *, contains: str | None = None) -> str:
    """Run ``check(answer)`` twice; both fail; the second adds the hint; no solution line leaks.

    Returns the first message, for further asserts.
    """
    _common.reset_attempts(exercise)
    with pytest.raises(AssertionError) as first:
        check(answer)
    with pytest.raises(AssertionError) as second:
        check(answer)
    _common.reset_attempts(exercise)
    one, two = str(first.value), str(second.value)
    assert "Hint" not in one, one
    assert "Hint (failed 2 times)" in two, two
    def digits_out(text: str) -> str:  # node ids differ from run to run
        return re.sub(r"\d+", "#", text)

    assert digits_out(two).startswith(digits_out(one.split("\n(Fix it")[0])), (one, two)
    if contains is not None:
        assert contains in one, one
    for line in key_lines(exercise):
        for message in (one, two):
            assert squash(line) not in squash(message), (line, message)
    return one


def accepts(check, answer, exercise: str, capsys) -> str:
    """``check(answer)`` passes (after a failure too: a pass resets the count)."""
    check(answer)
    out = capsys.readouterr().out
    assert out.startswith(f"Exercise {exercise} passed"), out
    assert _common.failures(exercise) == 0
    return out
