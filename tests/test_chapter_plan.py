"""Chapter 00's plan of the book covers every chapter and agrees with ``CHAPTER_MODULES``.

The plan is a Markdown table in section 0.5 of ``chapters/00_introduction.ipynb``: one row
per chapter or appendix, its number first and the ``minirt`` modules it introduces last.
A row marked *planned* has no notebook yet; the modules it lists are those built ahead
of it (registered under its chapter number in ``CHAPTER_MODULES``), or none.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minirt.book import CHAPTER_MODULES

ROOT = Path(__file__).resolve().parent.parent
INTRO = ROOT / "chapters" / "00_introduction.ipynb"
ROW = re.compile(r"^\|\s*(\d\d[a-z]?)\s*\|(.*)\|\s*$")


def plan_rows(text: str) -> list[tuple[str, str, set[str]]]:
    """(number, chapter column, modules introduced) for each row of section 0.5's table."""
    section = text.split("## 0.5 The plan of the book", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        found = ROW.match(line.strip())
        if found:
            cols = [c.strip() for c in found.group(2).split("|")]
            # the modules: backticked bare names in the last column (`minirt.forward` is not new)
            modules = set(re.findall(r"`([a-z_]+)`", cols[-1]))
            rows.append((found.group(1), cols[0], modules))
    return rows


def intro_text() -> str:
    cells = json.loads(INTRO.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def notebooks() -> dict[str, str]:
    """Chapter number ("05a") -> notebook stem, for every notebook in chapters/."""
    return {p.stem.split("_", 1)[0]: p.stem for p in (ROOT / "chapters").glob("*.ipynb")}


def check_plan(rows, modules_map, books) -> list[str]:
    """Every way the plan disagrees with the chapter map and the notebooks (empty: none)."""
    errors = []
    numbers = [n for n, _, _ in rows]
    if len(set(numbers)) != len(numbers):
        errors.append(f"a chapter is listed twice: {numbers}")
    planned = {n for n, chapter, _ in rows if "planned" in chapter}
    for n in sorted(set(books) - set(numbers)):
        errors.append(f"notebook {books[n]} has no row in the plan")
    for n in sorted(set(numbers) - set(books) - planned):
        errors.append(f"the plan lists chapter {n}, but chapters/ has no {n}_*.ipynb "
                      "(mark it planned, or remove it)")
    for n in sorted(planned & set(books)):
        errors.append(f"chapter {n} is marked planned, but {books[n]} exists")
    introduced: dict[int, set[str]] = {}
    known = {m for ms in modules_map.values() for m in ms}
    for n, _, mods in rows:
        if n in planned:
            # a module built ahead of its planned chapter is listed there and counts; one of
            # another chapter is an error; a name not built yet is a plan, not a module
            own = set(modules_map.get(int(n[:2]), ()))
            stray = (mods & known) - own
            if stray:
                errors.append(f"planned chapter {n} lists modules of another chapter "
                              f"{sorted(stray)}")
            mods = mods & own
        introduced.setdefault(int(n[:2]), set()).update(mods)
    for chapter in sorted(set(modules_map) | set(introduced)):
        want, have = set(modules_map.get(chapter, ())), introduced.get(chapter, set())
        if want != have:
            errors.append(f"chapter {chapter}: the plan introduces {sorted(have)}, "
                          f"CHAPTER_MODULES says {sorted(want)}")
    return errors


def test_the_plan_agrees_with_chapter_modules_and_the_notebooks():
    rows = plan_rows(intro_text())
    assert len(rows) >= len(notebooks())
    assert check_plan(rows, CHAPTER_MODULES, notebooks()) == []


def test_the_plan_lists_the_planned_chapters_of_the_blueprint():
    """BOOK.md's table plans 12_hit_rate and 13_speculative; the plan shows them as planned."""
    rows = {n: chapter for n, chapter, _ in plan_rows(intro_text())}
    for n in ("12", "13"):
        assert n in rows and ("planned" in rows[n] or n in notebooks()), rows


@pytest.mark.parametrize("damage, words", [
    (lambda rows: rows[:-3], "has no row"),                          # the plan stops early
    (lambda rows: [(n, c, m - {"workloads"} | ({"workloads"} if n == "03" else set()))
                   for n, c, m in rows], "chapter 2"),               # workloads in chapter 3
    (lambda rows: [r for r in rows if r[0] != "06b"], "06b_kernels"),  # an appendix left out
    (lambda rows: rows + [("14", "more", set())], "has no 14_"),     # a chapter that is not there
    (lambda rows: [(n, c, m - {"sidechannel"}) for n, c, m in rows], "chapter 8"),
    (lambda rows: rows + [("14", "more (*planned*)", {"tiers"})], "another chapter"),
])
def test_the_check_finds_a_damaged_plan(damage, words):
    """The comparison is not vacuous: each kind of drift the third reading found is caught."""
    rows = plan_rows(intro_text())
    errors = check_plan(damage(rows), CHAPTER_MODULES, notebooks())
    assert any(words in e for e in errors), errors
