"""tools/check_prose.py: numbers in prose are tagged to computed values, declared, or exempt.

The four errors of issue 50's "prose against the notebook's own output" are planted back
into the fixed notebooks (in memory) and must be flagged.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
cp = load_script("tools/check_prose.py", "check_prose")


def _load(rel: str):
    return nbformat.read(ROOT / rel, as_version=4)


def _cell(nb, cid: str):
    return next(c for c in nb.cells if c.get("id") == cid)


def _problems(nb, cid: str) -> list:
    return [p for p in cp.check_notebook(nb, "nb").problems if p.cell == cid]


def _plant(nb, cid: str, pattern: str, wrong: str) -> None:
    """Replace the fixed sentence (``pattern``, a regex) of cell ``cid`` by ``wrong``."""
    cell = _cell(nb, cid)
    new, n = re.subn(pattern, lambda _: wrong, cell.source, flags=re.S)
    assert n == 1, f"the fixed sentence is no longer in {cid}: update this test"
    cell.source = new


def _code(src: str, out: str | None = None):
    cell = new_code_cell(src)
    if out is not None:
        cell.outputs = [new_output("stream", name="stdout", text=out)]
    return cell


def _nb(*cells):
    nb = new_notebook(cells=list(cells))
    for i, c in enumerate(nb.cells):
        c["id"] = f"c{i}"
    return nb


# --- the adopted notebooks pass, and each planted error is flagged ------------------------

@pytest.mark.parametrize("rel", cp.ADOPTED)
def test_adopted_notebooks_pass(rel):
    report = cp.check_notebook(_load(rel), rel)
    assert report.problems == [], "\n".join(map(str, report.problems))
    assert report.tagged + report.declared > 0
    assert report.baseline == 0, f"{rel} is listed as reviewed but has a baseline"


def test_item1_fcfs_passes_planted_back():
    nb = _load("chapters/07_scheduling.ipynb")
    assert _problems(nb, "6e8e98e5") == []
    _plant(nb, "6e8e98e5", r"So FCFS's order\s+`TMSL TMSL \.\.\.`.*?<!--=pass_3-->\.",
           "FCFS's order `TMSL TMSL ...`\nadmits four families in the first step and the "
           "other eight, all cached, in the second.")
    flagged = {p.number for p in _problems(nb, "6e8e98e5")}
    assert {"four", "eight"} <= flagged


def test_item1_wrong_count_with_a_tag_is_a_mismatch():
    nb = _load("chapters/07_scheduling.ipynb")
    _plant(nb, "6e8e98e5", r"takes 3<!--=fcfs--> passes", "takes 2<!--=fcfs--> passes")
    [p] = _problems(nb, "6e8e98e5")
    assert p.number == "2" and "fcfs = 3" in p.what


def test_item2_aging_ratios_planted_back():
    nb = _load("chapters/07_scheduling.ipynb")
    assert _problems(nb, "404ceb39") == []
    _plant(nb, "404ceb39", r"By step 2 the lone request.*?\(ratio 1/2<!--=s1_ratio-->\)",
           "by step 2 the lone\nrequest has waited through the warm request's 33 tokens and a "
           "stream request's 2 (ratio\n35/20), while the stream request that arrived at step 1 "
           "has waited through 2 (ratio\n2/2)")
    flagged = {p.number for p in _problems(nb, "404ceb39")}
    assert {"35/20", "2/2"} <= flagged
    # and tagged, the wrong ratios disagree with what the cell printed
    nb = _load("chapters/07_scheduling.ipynb")
    _plant(nb, "404ceb39", r"34/20<!--=lone_ratio-->", "35/20<!--=lone_ratio-->")
    _plant(nb, "404ceb39", r"1/2<!--=s1_ratio-->", "2/2<!--=s1_ratio-->")
    whats = {p.number: p.what for p in _problems(nb, "404ceb39")}
    assert "lone_ratio = 34/20" in whats["35/20"] and "s1_ratio = 1/2" in whats["2/2"]


def test_item3_load_back_ratio_planted_back():
    nb = _load("chapters/09_beyond.ipynb")
    assert _problems(nb, "6c3fe1c7") == []
    _plant(nb, "6c3fe1c7",
           r"it is still about\s+15<!--=load_back_x--> times cheaper over PCIe 5\.0"
           r".*?\(an estimate\)",
           "over PCIe 5.0 it is still\n  about 8 times cheaper (an estimate)")
    assert "8 times" in {p.number for p in _problems(nb, "6c3fe1c7")}
    nb = _load("chapters/09_beyond.ipynb")
    _plant(nb, "6c3fe1c7", r"15<!--=load_back_x--> times", "8<!--=load_back_x--> times")
    [p] = _problems(nb, "6c3fe1c7")
    assert p.number == "8" and "load_back_x = 15" in p.what


def test_item4_reuse_percentage_planted_back():
    """Chapter 03 (fixed: 80 %) is adopted in memory, then the 75 % goes back."""
    nb = _load("chapters/03_match_and_insert.ipynb")
    tag = r"(?:<!--=[^>]*-->)?"
    pattern = rf"Only 16{tag} of the 20{tag} common tokens are reused \([^)]*\)\."
    assert "75 %" not in _cell(nb, "bf608d9a").source        # the fixed chapter
    cp.accept(nb, "ch03", {"bf608d9a"})
    assert _problems(nb, "bf608d9a") == []
    _plant(nb, "bf608d9a", pattern, "Only 16 of the 20 common tokens are reused (75 %).")
    flagged = [p for p in _problems(nb, "bf608d9a") if not p.what.startswith("stale")]
    assert [p.number for p in flagged] == ["75 %"]


# --- the rules on small notebooks ------------------------------------------------------------

def test_tagged_value_printed_in_the_section_matches_at_prose_precision():
    nb = _nb(new_markdown_cell("## A\nWe reuse 80 %<!--=pct--> of it, 15 times<!--=ratio--> "
                               "cheaper, 2.25x<!--=over--> the bound, eight<!--=n--> requests."),
             _code("print(...)", "pct = 80\nratio = 15.38, over: 2.2499\n{'n': 8}\n"))
    report = cp.check_notebook(nb)
    assert report.problems == [] and report.tagged == 4


def test_tagged_value_mismatch_missing_and_ambiguous():
    nb = _nb(new_markdown_cell("## A\nWe reuse 75 %<!--=pct-->, ratio 35/20<!--=r--> "
                               "and 3<!--=nowhere--> and 4<!--=twice-->."),
             _code("print(...)", "pct = 80\nr = 34/20\ntwice = 4\n"),
             _code("assert twice == 5"),
             new_markdown_cell("## B\nAlso 80 %<!--=pct--> here."))
    whats = {p.number: p.what for p in cp.check_notebook(nb).problems}
    assert "pct = 80" in whats["75 %"]
    assert "r = 34/20" in whats["35/20"]
    assert "no code cell" in whats["3"]
    assert "ambiguous" in whats["4"]
    assert "no code cell of section 'B'" in whats["80 %"]   # section A's value, not B's


def test_asserted_literal_defines_a_value_and_summary_sees_the_whole_notebook():
    nb = _nb(new_markdown_cell("## A\nIt took 3<!--=passes--> passes."),
             _code("passes = 3\nassert passes == 3"),
             new_markdown_cell("## Summary\n- 3<!--=passes--> passes.\n\n## Quiz\n1. Answer: "
                               "3<!--=passes--> passes."))
    assert cp.check_notebook(nb).problems == []


def test_untagged_numbers_are_flagged_until_declared_and_again_after_an_edit():
    nb = _nb(new_markdown_cell("## A\nA pool of 40 tokens holds one family; the other eight "
                               "wait, twice as long, at half the rate."))
    assert {p.number for p in cp.check_notebook(nb).problems} == {"40", "eight", "twice", "half"}
    assert cp.accept(nb) == 4
    assert nb.cells[0].metadata["prose_numbers"][0] == "pool of 40 tokens holds"
    assert cp.check_notebook(nb).problems == []
    nb.cells[0].source = nb.cells[0].source.replace("40 tokens", "48 tokens")
    whats = {p.number: p.what for p in cp.check_notebook(nb).problems}
    assert "neither tagged nor declared" in whats["48"]
    assert "stale declaration" in whats["pool of 40 tokens holds"]


def test_a_baseline_passes_until_an_edit_and_a_reviewed_accept_clears_it():
    nb = _nb(new_markdown_cell("## A\nA pool of 40 tokens holds one family; eight wait."))
    assert cp.accept(nb, baseline=True) == 2
    meta = nb.cells[0].metadata
    assert "prose_numbers" not in meta and len(meta["prose_numbers_baseline"]) == 2
    report = cp.check_notebook(nb)
    assert report.problems == [] and report.baseline == 2 and report.declared == 0
    nb.cells[0].source = nb.cells[0].source.replace("eight wait", "nine wait")
    assert {p.number for p in cp.check_notebook(nb).problems} == {"nine", "one family eight wait"}
    assert cp.accept(nb) == 2
    assert "prose_numbers_baseline" not in meta and len(meta["prose_numbers"]) == 2
    assert cp.accept(nb, baseline=True) == 0      # reviewed keys stay reviewed
    assert len(meta["prose_numbers"]) == 2 and "prose_numbers_baseline" not in meta


def test_accept_refuses_while_a_tag_is_wrong():
    nb = _nb(new_markdown_cell("## A\nIt is 7<!--=x-->."), _code("", "x = 8\n"))
    with pytest.raises(SystemExit, match="fix the tags first"):
        cp.accept(nb)


def test_a_tag_must_follow_a_number():
    nb = _nb(new_markdown_cell("## A\nSome words<!--=x--> here."), _code("", "x = 8\n"))
    [p] = cp.check_notebook(nb).problems
    assert "not right after a number" in p.what


@pytest.mark.parametrize("text", [
    "The `capacity=40` argument and ``x = 3``.",
    "See chapter 07, chapters 02-06, section 3, §2.2, exercise 9.1, exercises 7.1 and 7.2.",
    "Theorem 3.1 (Zheng et al., NeurIPS 2024, arXiv:2312.07104) and CVE-2025-25183.",
    "sglang 0.5.23 and vllm 0.32.0, PCIe 5.0 and Python 3.12, on an H100 in bf16, fp32, x16.",
    "A Llama-3-8B model, an 8B model, the 3rd try.",
    "A [link](https://example.com/42) and $x^2 + 3$.",
    "1. a list item\n2. another one, first and second, one of them.",
    "```\nprint(12)\n```",
    "<!-- a comment with 12 -->",
])
def test_exempt_forms_have_no_numbers(text):
    assert cp.numbers_in("c", text) == []


def test_headings_are_exempt_and_split_sections():
    nb = _nb(new_markdown_cell("## 3. Results over 4 pools\nFour<!--=n--> pools.\n\n"
                               "### 3.1 Twelve requests\nFour<!--=n--> again."),
             _code("", "n = 4\n"))
    whats = [p.what for p in cp.check_notebook(nb).problems]
    # the code cell follows the second heading: section 3.1's number has it, section 3's not
    assert len(whats) == 1 and "'3. Results over 4 pools'" in whats[0]


def test_cli_checks_and_accepts(tmp_path, capsys):
    path = tmp_path / "nb.ipynb"
    nbformat.write(_nb(new_markdown_cell("## A\nWe keep 40 tokens.")), path)
    assert cp.main([str(path)]) == 1
    assert "'40'" in capsys.readouterr().out
    assert cp.main(["--accept", str(path)]) == 0
    assert cp.main([str(path)]) == 0
    assert nbformat.read(path, as_version=4).cells[0].metadata["prose_numbers"] == [
        "we keep 40 tokens"]


def test_sections_with_the_same_title_stay_apart():
    nb = _nb(new_markdown_cell("## Notes\nIt took 3<!--=n--> steps."), _code("", "n = 3\n"),
             new_markdown_cell("## Notes\nAgain 3<!--=n--> steps."))
    [p] = cp.check_notebook(nb).problems
    assert p.cell == "c2" and "no code cell" in p.what
