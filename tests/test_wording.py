"""The book speaks of sources a reader can open, never of documents the reader never sees.

The chapters were planned from source texts that are not part of the book. Prose, stored
outputs, checker messages and docstrings must not point at them ("the seed's example",
"the source material", "the original example"): an example is the book's own, and a fact
is credited to a paper, a source file or a docs page. Seeding a random generator is fine
(``seed=0``, ``torch.manual_seed``, "seeded workloads").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# "seed" meaning a document: the seed('s), a seed chapter/example/..., seed 000, seeds/.
# Allowed right after "the seed": the words of random number generation.
_RNG_AFTER = (r"(?!\s*(?:argument|parameter|value|number|=|:|\)"
              r"|of (?:the|a|each|its) (?:random|generator|rng)))")
FORBIDDEN = [
    re.compile(r"\bseed's\b", re.IGNORECASE),
    re.compile(r"\bthe seeds?\b" + _RNG_AFTER, re.IGNORECASE),
    re.compile(r"\bseed (?:chapter|example|text|document|runtime|book|material|source|"
               r"quiz|figure|table|design)s?\b", re.IGNORECASE),
    re.compile(r"\bseed \d{3}\b", re.IGNORECASE),
    re.compile(r"\bseeds/", re.IGNORECASE),
    re.compile(r"\bsource (?:material|chapter|text)s?\b", re.IGNORECASE),
    re.compile(r"\boriginal example\b", re.IGNORECASE),
    re.compile(r"\bbook's sources?\b", re.IGNORECASE),
]


def offending(text: str) -> list[str]:
    """Each forbidden phrase in ``text``, with a little context."""
    hits = []
    for pattern in FORBIDDEN:
        for m in pattern.finditer(text):
            hits.append(text[max(0, m.start() - 30):m.end() + 30].replace("\n", " "))
    return hits


def notebook_text(path: Path) -> str:
    """Every cell's source and every stored text output of a notebook."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    parts = []
    for cell in nb["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
            parts.extend(out.get("traceback", []))
    return "\n".join(parts)


def book_files() -> list[Path]:
    files = [p for folder in ("chapters", "exercises", "solutions")
             for p in sorted((ROOT / folder).glob("*.ipynb"))]
    files += sorted((ROOT / "minirt").rglob("*.py"))
    files.append(ROOT / "README.md")
    return files


@pytest.mark.parametrize("path", book_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_to_unseen_sources(path: Path):
    text = notebook_text(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")
    hits = offending(text)
    assert not hits, f"{path.relative_to(ROOT)} refers to documents the reader never sees: {hits}"


@pytest.mark.parametrize("phrase", [
    "The seed example of this book's source material makes the same point",
    "in the seed's 1024-token × 100-turn example",
    "Steps 1 to 5 of the seed's lifecycle",
    "The ids above are made up, as in the original example.",
    "One of the book's sources describes a block-level cache",
    "Reference counts per block, seed 000 style",
    "expected the seed's tree",
    "the seed chapter's quiz",
    "The seed follows two requests",
])
def test_old_wording_is_caught(phrase: str):
    assert offending(phrase), phrase


@pytest.mark.parametrize("phrase", [
    "model = tiny_model(seed=0)",
    "torch.manual_seed(0); gen = torch.Generator().manual_seed(seed)",
    "def setup(seed: int = 0, quiet: bool = False):",
    '"""Seeds Python, NumPy and torch."""',
    "rng = random.Random(f'chat-{seed}')",
    "seeded realistic request streams; greedy or seeded sampling (`temperature`, `seed`)",
    "a request with the seed argument set draws the same tokens; pass the seed=1",
    "if request.seed is not None: raise RequestError(f'seed must be an int, got {seed}')",
    "for seed in (0, 1):",
])
def test_random_seeds_are_allowed(phrase: str):
    assert not offending(phrase), offending(phrase)
