"""The site builder's pure parts: bibliography split, widget notes, figure counts, titles."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import build_site as bs  # noqa: E402


def test_bibliography_section_becomes_its_own_page_text():
    readme = "# minirt\n\nintro\n\n## Bibliography\n\n- Zheng et al. 2024\n\n## Licence\n\nA\n"
    _, bib = bs.split_bibliography(readme)
    assert bib == "# Bibliography\n\n\n- Zheng et al. 2024\n\n"
    assert bs.split_bibliography("# minirt\n\n## Layout\n")[1] is None


def test_widget_outputs_become_notes_and_figures_are_counted():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Chapter 09 — *beyond*"),
                nbformat.v4.new_code_cell("w", execution_count=1),
                nbformat.v4.new_code_cell("t", execution_count=2)]
    nb.cells[1].outputs = [nbformat.v4.new_output(
        "execute_result", {"application/vnd.jupyter.widget-view+json": {"model_id": "x"},
                           "text/plain": "VBox()"}, execution_count=1),
        nbformat.v4.new_output("display_data", {"image/png": "iVBOR", "text/plain": "<F>"})]
    nb.cells[2].outputs = [nbformat.v4.new_output(
        "execute_result", {"image/svg+xml": "<svg/>", "text/plain": "<Digraph>"},
        execution_count=2)]
    nb.metadata["widgets"] = {"state": {}}
    web = bs.for_the_web(nb)
    assert web.cells[1].outputs[0]["data"] == {"text/html": bs.WIDGET_NOTE}
    assert "widgets" not in web.metadata and "widgets" in nb.metadata  # a copy
    assert bs.figure_count(nb) == bs.figure_count(web) == 2
    assert bs.notebook_title(nb, "fallback") == "Chapter 09 — beyond"
