"""Exercises as a whole: labels, no copied listings, enough of them, honest wording."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from exercise_util import HEADING, ROOT, solution_regions, squash

CHAPTERS = sorted(p.name for p in (ROOT / "solutions").glob("[0-9][0-9]*_*.ipynb"))


def _label(name: str) -> str:
    """A notebook's exercise label prefix: "03_..." -> "3", "06a_..." -> "6a"."""
    return name.split("_")[0].lstrip("0") or "0"


def _minimum(name: str) -> int:
    """Whole chapters keep at least four exercises; a chapter part (06a) at least one."""
    return 1 if name.split("_")[0][-1].isalpha() else 4
STUB = re.compile(r'raise NotImplementedError\("Exercise (\d+[a-z]?\.\d+)"\)')


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("name", CHAPTERS)
def test_placeholder_labels_match_the_heading_above(name):
    label, stubs = None, 0
    for cell in _cells(ROOT / "exercises" / name):
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            found = HEADING.findall(src)
            label = found[-1] if found else label
        for number in STUB.findall(src):
            stubs += 1
            assert number == label, f"{name}: a stub says Exercise {number} below {label}"
    assert stubs >= _minimum(name)


@pytest.mark.parametrize("name", CHAPTERS)
def test_every_chapter_keeps_at_least_four_exercises(name):
    numbers = {n for n in solution_regions() if n and n.split(".")[0] == _label(name)}
    assert len(numbers) >= _minimum(name), numbers


def _chapter_text(name: str) -> str:
    """Every code cell and every stored output (listings are ``show`` outputs) of a chapter."""
    chapter = ROOT / "chapters" / name
    parts = []
    for cell in _cells(chapter):
        if cell["cell_type"] != "code":
            continue
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            for data in out.get("data", {}).values():
                parts.append(data if isinstance(data, str) else "".join(data)
                             if isinstance(data, list) else "")
    return squash("\n".join(parts))


@pytest.mark.parametrize("name", CHAPTERS)
def test_no_solution_body_is_printed_in_its_chapter(name):
    text = _chapter_text(name)
    for number, bodies in solution_regions().items():
        if number is None or number.split(".")[0] != _label(name):
            continue
        for body in bodies:
            code = "\n".join(line.split("#")[0] for line in body.split("\n"))
            assert squash(code) not in text, f"Exercise {number}'s solution is in {name}"


FORBIDDEN = re.compile(r"\bthe seed\b|\bseed's\b|source material|original example|"
                       r"\bseed (example|case|tree|chapter)", re.IGNORECASE)


@pytest.mark.parametrize("folder", ["solutions", "exercises", "minirt/checks"])
def test_no_wording_about_documents_the_reader_never_sees(folder):
    for path in sorted((ROOT / folder).glob("*.*")):
        if path.suffix in (".ipynb", ".py"):
            found = FORBIDDEN.search(path.read_text())
            assert found is None, f"{path.name}: {found.group(0)!r}"
