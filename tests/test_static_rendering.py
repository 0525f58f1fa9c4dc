"""Stored outputs read well where no kernel runs (GitHub, nbviewer, the HTML book).

BOOK.md section 5: no frozen progress bars; every widget cell also stores a static picture
of its initial state; every chapter ends with annotated further reading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
EXECUTED = CHAPTERS + sorted((ROOT / "solutions").glob("*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"
PICTURES = ("image/svg+xml", "image/png")
# A tqdm bar, widget or text: "desc:  33%|███▎      | 1/3 [00:01<00:02, ...]".
PROGRESS_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\[\d\d:\d\d<")


def _ids(paths):
    return [f"{p.parent.name}/{p.name}" for p in paths]


def _code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
            if c["cell_type"] == "code"]


def _texts(output: dict) -> list[str]:
    data = output.get("data", {})
    return ["".join(output.get("text", "")), "".join(data.get("text/plain", ""))]


def frozen_bars(cells: list[dict]) -> list[str]:
    """Stored outputs that show a progress bar (it would stay frozen without a kernel)."""
    return [text.strip()[:80] for cell in cells for out in cell.get("outputs", [])
            for text in _texts(out) if PROGRESS_BAR.search(text)]


def widgets_without_picture(cells: list[dict]) -> list[str]:
    """Cells that store a widget but no static picture, in that cell or the next one."""
    missing = []
    for i, cell in enumerate(cells):
        outputs = cell.get("outputs", [])
        if not any(WIDGET in out.get("data", {}) for out in outputs):
            continue
        nearby = outputs + (cells[i + 1].get("outputs", []) if i + 1 < len(cells) else [])
        if not any(kind in out.get("data", {}) for out in nearby for kind in PICTURES):
            missing.append("".join(cell["source"])[:80])
    return missing


@pytest.mark.parametrize("path", EXECUTED, ids=_ids(EXECUTED))
def test_no_frozen_progress_bars(path):
    assert not frozen_bars(_code_cells(path)), frozen_bars(_code_cells(path))


@pytest.mark.parametrize("path", EXECUTED, ids=_ids(EXECUTED))
def test_widgets_store_a_static_picture(path):
    assert not widgets_without_picture(_code_cells(path)), widgets_without_picture(
        _code_cells(path))


@pytest.mark.parametrize("path", CHAPTERS, ids=_ids(CHAPTERS))
def test_chapter_ends_with_further_reading(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    markdown = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "## Further reading" in markdown, f"{path.name} has no further-reading section"
    section = markdown.split("## Further reading", 1)[1].split("\n## ", 1)[0]
    items = [ln for ln in section.splitlines() if ln.startswith("- ")]
    assert len(items) >= 3, f"{path.name}: further reading lists {len(items)} items"


def test_the_checks_catch_what_they_should():
    bar = {"outputs": [{"output_type": "display_data", "data": {
        WIDGET: {}, "text/plain": ["prefill rounds:   0%|          | 0/3 [00:00<?, ?it/s]"]}}]}
    text_bar = {"outputs": [{"output_type": "stream", "name": "stderr",
                             "text": ["turns: 100%|##########| 4/4 [00:03<00:00,  1.2it/s]"]}]}
    clean = {"outputs": [{"output_type": "display_data",
                          "data": {"text/plain": ["prefill rounds: 3/3 done"]}}]}
    assert frozen_bars([bar]) and frozen_bars([text_bar]) and not frozen_bars([clean])
    widget = {"source": ["explorer_widget()"], "outputs": [
        {"output_type": "display_data", "data": {WIDGET: {}, "text/plain": ["VBox(...)"]}}]}
    picture = {"source": ["render()"], "outputs": [
        {"output_type": "display_data", "data": {"image/svg+xml": ["<svg/>"]}}]}
    assert widgets_without_picture([widget]) and widgets_without_picture([widget, clean])
    assert not widgets_without_picture([widget, picture])
