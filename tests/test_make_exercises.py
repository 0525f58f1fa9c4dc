"""The solutions -> exercises tool: stubs keep indentation, outputs go, markers never leak."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_exercises as mx  # noqa: E402

SOLUTION_CELL = '''def f(x):
    """Double x."""
    ### BEGIN SOLUTION
    y = x * 2
    return y
    ### END SOLUTION

### BEGIN SOLUTION
answer = f(21)
### END SOLUTION
print(answer)'''


def _notebook(*sources: str, markdown: str | None = None,
              headings: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    """Code cells from ``sources``, each below a heading "## Exercise <heading>"."""
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(sources, 1):
        number = headings[i - 1] if i <= len(headings) else f"1.{i}"
        nb.cells.append(nbformat.v4.new_markdown_cell(f"## Exercise {number} · a title"))
        cell = nbformat.v4.new_code_cell(src, execution_count=i)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
        nb.cells.append(cell)
    if markdown is not None:
        nb.cells.append(nbformat.v4.new_markdown_cell(markdown))
    return nb


def test_regions_become_numbered_stubs_at_their_indentation():
    out = mx.strip_regions(SOLUTION_CELL, chapter=3, counter=[0])
    assert out.split("\n") == [
        "def f(x):",
        '    """Double x."""',
        '    raise NotImplementedError("Exercise 3.1")',
        "",
        'raise NotImplementedError("Exercise 3.2")',
        "print(answer)",
    ]


def test_numbering_runs_across_cells_and_outputs_are_cleared():
    nb = _notebook(SOLUTION_CELL, "x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION",
                   headings=("7.1", "7.3"))
    nb.cells[1].metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00Z"}
    ex = mx.make_exercise(nb, chapter=7)
    assert "execution" not in ex.cells[1].metadata
    sources = [c.source for c in ex.cells]
    # both regions below heading 7.1 say 7.1; the one below 7.3 says 7.3
    assert sources[1].count('"Exercise 7.1"') == 2 and 'Exercise 7.3' in sources[3]
    assert "x = 2" not in sources[3]
    code = [c for c in ex.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    # The solution notebook itself is untouched.
    assert nb.cells[1].outputs and "y = x * 2" in nb.cells[1].source


def test_a_markdown_answer_region_does_not_shift_the_next_label():
    md = "## Exercise 2.3 · why\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"
    nb = _notebook("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", headings=("2.3",))
    nb.cells.append(nbformat.v4.new_markdown_cell(md))
    nb.cells.append(nbformat.v4.new_markdown_cell("## Exercise 2.4 · next"))
    nb.cells.append(nbformat.v4.new_code_cell("### BEGIN SOLUTION\ny = 2\n### END SOLUTION"))
    ex = mx.make_exercise(nb, chapter=2)
    assert '"Exercise 2.4"' in ex.cells[-1].source


def test_a_code_region_without_a_heading_is_refused():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))
    with pytest.raises(mx.MarkerError):
        mx.make_exercise(nb, chapter=1)


def test_markers_and_solution_code_never_leak():
    md = "Why?\n### BEGIN SOLUTION\nBecause of causality.\n### END SOLUTION"
    ex = mx.make_exercise(_notebook(SOLUTION_CELL, markdown=md), chapter=1)
    text = nbformat.writes(ex)
    for leaked in ("BEGIN SOLUTION", "END SOLUTION", "y = x * 2", "answer = f(21)", "causality"):
        assert leaked not in text
    assert mx.MARKDOWN_STUB in ex.cells[-1].source


@pytest.mark.parametrize("source", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",
])
def test_unbalanced_markers_are_rejected(source):
    with pytest.raises(mx.MarkerError):
        mx.strip_regions(source, chapter=1, counter=[0])


def test_check_mode_detects_stale_and_orphan_exercises(tmp_path, capsys):
    sols, exs = tmp_path / "solutions", tmp_path / "exercises"
    sols.mkdir()
    nbformat.write(_notebook(SOLUTION_CELL), sols / "04_demo.ipynb")
    args = ["--solutions", str(sols), "--exercises", str(exs)]
    assert mx.main(args + ["--check"]) == 1  # missing
    assert mx.main(args) == 0
    assert mx.main(args + ["--check"]) == 0  # fresh
    stale = exs / "04_demo.ipynb"
    stale.write_text(stale.read_text().replace("Exercise 1.1", "Exercise 1.9"))
    assert mx.main(args + ["--check"]) == 1  # edited by hand
    mx.main(args)
    (exs / "05_orphan.ipynb").write_text(stale.read_text())
    assert mx.main(args + ["--check"]) == 1  # no solution behind it
    assert "make exercises" in capsys.readouterr().out


def test_repository_exercises_are_up_to_date():
    assert mx.main(["--check"]) == 0


def test_chapter_labels_include_parts_of_a_chapter():
    assert mx.chapter_number(Path("06_engine.ipynb")) == "6"
    assert mx.chapter_number(Path("06a_online.ipynb")) == "6a"
    with pytest.raises(ValueError, match="NN_name"):
        mx.chapter_number(Path("online.ipynb"))


def test_exercise_keeps_the_kernelspec_and_drops_widget_state():
    nb = _notebook(SOLUTION_CELL)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["widgets"] = {"state": {}}
    out = mx.make_exercise(nb, chapter=3)
    assert out.metadata["kernelspec"]["name"] == "python3"
    assert out.metadata["language_info"] == {"name": "python"}
    assert "widgets" not in out.metadata


def test_an_answer_cell_loses_its_declared_numbers_and_a_question_keeps_them():
    answer = "Prediction:\n### BEGIN SOLUTION\nAbove half: 0.66 of them.\n### END SOLUTION"
    nb = _notebook("x = 1", markdown=answer)
    nb.cells[-1].metadata["prose_numbers"] = ["half 0.66 of them"]
    nb.cells[0].metadata["prose_numbers"] = ["exercise 1.1 a title"]
    ex = mx.make_exercise(nb, chapter=1)
    assert "0.66" not in ex.cells[-1].source
    assert "prose_numbers" not in ex.cells[-1].metadata  # it would give the answer away
    assert ex.cells[0].metadata["prose_numbers"] == ["exercise 1.1 a title"]
