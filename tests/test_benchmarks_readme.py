"""benchmarks/README.md has one section per benchmark script, and no section for a script
that is gone. A script is a ``.py`` file in ``benchmarks/`` whose name does not start with
``_`` (those are helpers the scripts import); a section is a ``## <name>.py`` heading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^## (\S+)\s*$", re.M)


def scripts(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py") if not p.name.startswith("_")}


def sections(text: str) -> dict[str, str]:
    """Each ``## name`` heading's name and the text up to the next heading."""
    parts = HEADING.split(text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def mismatches(folder: Path, text: str) -> dict[str, list[str]]:
    """Scripts without a section, sections naming no script, and names given two sections."""
    names = HEADING.findall(text)
    have = scripts(folder)
    return {"no section": sorted(have - set(names)),
            "no such script": sorted(set(names) - have),
            "twice": sorted({n for n in names if names.count(n) > 1})}


def test_every_script_has_one_section_and_every_section_a_script():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert len(scripts(ROOT / "benchmarks")) > 10
    assert mismatches(ROOT / "benchmarks", text) == {"no section": [], "no such script": [],
                                                    "twice": []}


def test_each_measuring_section_gives_a_command_a_result_and_a_bound():
    """A script's section says how to run it, its latest result (or that none is recorded)
    and what bounds the figure; a worker's section names the script that runs it."""
    for name, body in sections((ROOT / "benchmarks" / "README.md").read_text()).items():
        if "A worker:" in body:
            runner = re.search(r"`(\w+\.py) --vllm`", body)
            assert runner and (ROOT / "benchmarks" / runner.group(1)).exists(), name
            continue
        assert f"benchmarks/{name}" in body, f"{name}: no command"
        assert "**Latest result**" in body, f"{name}: no latest result"
        assert "**What bounds it.**" in body, f"{name}: nothing on what bounds it"
        recorded = "not yet recorded" not in body and "not recorded" not in body
        if recorded:
            assert re.search(r"20\d\d-\d\d-\d\d", body), f"{name}: a result without its date"
            assert re.search(r"commit `[0-9a-f]{7}`", body), f"{name}: a result without its commit"


def test_mismatches_catch_a_missing_a_stale_and_a_doubled_section(tmp_path):
    for name in ("a.py", "b.py", "_helper.py"):
        (tmp_path / name).write_text("")
    text = "# B\n\n## a.py\n\nx\n\n## gone.py\n\ny\n\n## a.py\n"
    assert mismatches(tmp_path, text) == {"no section": ["b.py"], "no such script": ["gone.py"],
                                          "twice": ["a.py"]}
    assert mismatches(tmp_path, "## a.py\n\n## b.py\n") == {"no section": [],
                                                            "no such script": [], "twice": []}
