"""Write ``exercises/`` from ``solutions/``: every solution region becomes a stub.

In a code cell, the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` are
replaced by ``raise NotImplementedError("Exercise N.k")`` at the marker's
indentation, where N.k is the number of the nearest ``## Exercise N.k`` heading
above the region (a region with no such heading is an error). In a Markdown cell
the region becomes a prompt for the reader's own answer. Every output is
cleared: the exercise notebook is a fresh start.

    python tools/make_exercises.py           # regenerate exercises/
    python tools/make_exercises.py --check   # exit 1 if exercises/ is stale
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
ROOT = Path(__file__).resolve().parent.parent
MARKDOWN_STUB = "*Your answer here.*"
HEADING = re.compile(r"^#+\s*Exercise\s+(\d+[a-z]?\.\d+)\b", re.MULTILINE)


class MarkerError(ValueError):
    """Unbalanced or nested solution markers."""


def strip_regions(source: str, chapter: int | str, counter: list[int], markdown: bool = False,
                  label: str | None = None) -> str:
    """Replace each solution region of ``source``; stubs say ``Exercise {label}``.

    Without ``label``, ``counter[0]`` numbers the regions across cells (``chapter.k``).
    """
    out: list[str] = []
    inside = False
    for lineno, line in enumerate(source.split("\n"), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise MarkerError(f"nested {BEGIN} at line {lineno}")
            inside = True
            counter[0] += 1
            indent = line[: len(line) - len(line.lstrip())]
            number = label or f"{chapter}.{counter[0]}"
            stub = MARKDOWN_STUB if markdown else (
                f'raise NotImplementedError("Exercise {number}")')
            out.append(indent + stub)
        elif stripped == END:
            if not inside:
                raise MarkerError(f"{END} without {BEGIN} at line {lineno}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{BEGIN} without {END}")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode, chapter: int | str) -> nbformat.NotebookNode:
    """The exercise notebook for one solution notebook."""
    nb = copy.deepcopy(solution)
    counter = [0]
    label: str | None = None  # the number of the last "## Exercise N.k" heading seen
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # run timestamps say nothing to a reader
        if cell.cell_type == "code":
            if BEGIN in cell.source and label is None:
                raise MarkerError("a solution region with no '## Exercise N.k' heading above it")
            cell.source = strip_regions(cell.source, chapter, counter, label=label)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            headings = HEADING.findall(cell.source)
            if headings:
                label = headings[-1]
            stripped = strip_regions(cell.source, chapter, counter, markdown=True)
            if stripped != cell.source:  # the answer's numbers, declared, would give it away
                cell.metadata.pop("prose_numbers", None)
                cell.metadata.pop("prose_numbers_baseline", None)
            cell.source = stripped
    nb.metadata.pop("widgets", None)
    return nb


def chapter_number(path: Path) -> str:
    """The chapter as exercises number it: "6" for 06_engine, "6a" for 06a_online."""
    match = re.match(r"(\d+)([a-z]?)_", path.name)
    if not match:
        raise ValueError(f"{path.name}: solution notebooks are named NN_name.ipynb "
                         "(or NNa_name.ipynb for a part of chapter NN)")
    return f"{int(match.group(1))}{match.group(2)}"


def render(solution_path: Path) -> str:
    nb = nbformat.read(solution_path, as_version=4)
    return nbformat.writes(make_exercise(nb, chapter_number(solution_path))) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if exercises/ is stale")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=ROOT / "exercises")
    args = parser.parse_args(argv)
    stale = []
    wanted = set()
    for sol in sorted(args.solutions.glob("*.ipynb")):
        target = args.exercises / sol.name
        wanted.add(target.name)
        text = render(sol)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    extra = sorted(p.name for p in args.exercises.glob("*.ipynb") if p.name not in wanted)
    if args.check:
        if stale or extra:
            print("exercises/ is out of date with solutions/: "
                  f"stale {stale}, without a solution {extra}. Run `make exercises`.")
            return 1
        print(f"exercises/ is up to date ({len(wanted)} notebooks).")
        return 0
    for name in extra:
        print(f"note: exercises/{name} has no solution notebook; left alone")
    print(f"wrote {len(stale)} of {len(wanted)} exercise notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
