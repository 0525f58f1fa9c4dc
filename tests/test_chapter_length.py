"""Chapter 06 stays a chapter about prefix caching: at most 4,500 words of prose.

Its CPU performance work lives in appendix 06b; this test keeps it from growing back.
Words are counted the obvious way: the source of every markdown cell, split on
whitespace (Python's ``str.split()``), each piece one word. Code cells and outputs do
not count; everything in a markdown cell does, headings, tables (a lone ``|`` is a
piece too), citations and formulas included.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"06_engine.ipynb": 4500}


def prose_words(notebook: dict) -> int:
    """Words of prose in a notebook: its markdown cells' sources, split on whitespace."""
    total = 0
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            source = cell["source"]
            text = "".join(source) if isinstance(source, list) else source
            total += len(text.split())
    return total


def test_prose_words_counts_markdown_only():
    notebook = {"cells": [
        {"cell_type": "markdown", "source": ["# Two words\n", "and  three\tmore | here\n"]},
        {"cell_type": "code", "source": "print('not prose at all')", "outputs": []},
        {"cell_type": "markdown", "source": "one"},
    ]}
    assert prose_words(notebook) == 3 + 5 + 1


def test_chapter_06_prose_is_at_most_4500_words():
    for name, limit in LIMITS.items():
        words = prose_words(json.loads((ROOT / "chapters" / name).read_text()))
        assert words <= limit, (
            f"chapters/{name} has {words} words of prose, over {limit}: move material that is "
            "not about sharing into appendix 06b")


def test_the_limit_fails_a_chapter_over_it():
    over = {"cells": [{"cell_type": "markdown", "source": "word " * 4501}]}
    assert prose_words(over) == 4501 > LIMITS["06_engine.ipynb"]
