"""Notebook hygiene, the chapter import map, and proof that nbval really compares outputs."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minirt.book import CHAPTER_MODULES, introduced_in

ROOT = Path(__file__).resolve().parent.parent
EXECUTED = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted(
    (ROOT / "solutions").glob("*.ipynb"))
ALL = EXECUTED + sorted((ROOT / "exercises").glob("*.ipynb"))
# Places an author's machine leaks into stored outputs.
ABSOLUTE_PATH = re.compile(r"(/root/|/home/\w|/Users/\w|/work/|/private/var/|[A-Z]:\\\\Users)")
PRINTS = re.compile(r"^\s*(print|display)\(", re.M)


def _ids(paths):
    return [f"{p.parent.name}/{p.name}" for p in paths]


def _code_cells(path: Path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _outputs_text(cell) -> str:
    return json.dumps(cell.get("outputs", []))


# An appendix to chapter NN is chapters/NNx_name.ipynb (e.g. 05a): no exercises of its own.
APPENDIX = re.compile(r"^(\d\d)[a-z]_")


def test_every_chapter_has_an_exercise_and_a_solution():
    """Every chapter NN has both; a lettered part (06a) may have them, an appendix (05a)
    need not, but each follows a chapter that exists."""
    notebooks = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    chapters = {name for name in notebooks if not APPENDIX.match(name)}
    assert chapters, "no chapters yet"
    solutions = {p.name for p in (ROOT / "solutions").glob("*.ipynb")}
    assert solutions == {p.name for p in (ROOT / "exercises").glob("*.ipynb")}
    assert chapters <= solutions <= notebooks
    numbers = {name[:2] for name in chapters}
    for part in notebooks - chapters:
        assert APPENDIX.match(part).group(1) in numbers, f"{part} has no chapter"


@pytest.mark.parametrize("path", EXECUTED, ids=_ids(EXECUTED))
def test_executed_in_order_without_unexpected_errors(path):
    cells = _code_cells(path)
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: execution counts {counts}"
    for i, cell in enumerate(cells, 1):
        src = _source(cell)
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        if errors:
            assert "# NBVAL_RAISES_EXCEPTION" in src, f"{path.name} cell {i} stored an error"
        if PRINTS.search(src) and "# NBVAL_SKIP" not in src:
            assert cell["outputs"], f"{path.name} cell {i} prints but has no stored output"


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_no_run_timestamps(path):
    """Execute with record_timing=False (see the Makefile): timestamps only churn diffs."""
    assert all("execution" not in c.get("metadata", {}) for c in _code_cells(path))


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_kernelspec_is_stored(path):
    """Without it JupyterLab asks for a kernel and marks the notebook changed on open."""
    meta = json.loads(path.read_text())["metadata"]
    assert meta.get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: no python3 kernelspec; run `python tools/nb_kernelspec.py`")
    assert meta.get("kernelspec", {}).get("language") == "python"
    assert meta.get("language_info", {}).get("name") == "python", (
        f"{path.name}: no language_info; run `python tools/nb_kernelspec.py`")


def test_kernelspec_tool_fixes_only_metadata(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import nb_kernelspec

    source = ROOT / "chapters" / "02_radix_tree.ipynb"
    copy = tmp_path / source.name
    nb = json.loads(source.read_text())
    nb["metadata"] = {"jupytext": {"main_language": "python"},
                      "language_info": {"name": "python", "version": "3.11.7"}}
    copy.write_text(json.dumps(nb, indent=1))
    assert nb_kernelspec.main(["--check", str(copy)]) == 1
    assert nb_kernelspec.main([str(copy)]) == 0
    fixed = json.loads(copy.read_text())
    assert fixed["cells"] == nb["cells"]
    assert fixed["metadata"]["kernelspec"] == nb_kernelspec.KERNELSPEC
    assert fixed["metadata"]["language_info"]["version"] == "3.11.7"
    assert "jupytext" not in fixed["metadata"]
    assert nb_kernelspec.main(["--check", str(copy)]) == 0


@pytest.mark.parametrize("path", EXECUTED, ids=_ids(EXECUTED))
def test_first_code_cell_is_setup(path):
    first = _source(_code_cells(path)[0])
    assert "# NBVAL_IGNORE_OUTPUT" in first and "setup(" in first


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_no_absolute_paths_in_outputs(path):
    for i, cell in enumerate(_code_cells(path), 1):
        found = ABSOLUTE_PATH.search(_outputs_text(cell))
        assert not found, f"{path.name} cell {i} stores a machine path: {found.group(0)!r}"


@pytest.mark.parametrize("path", sorted((ROOT / "exercises").glob("*.ipynb")),
                         ids=_ids(sorted((ROOT / "exercises").glob("*.ipynb"))))
def test_exercises_are_blank(path):
    text = path.read_text()
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    assert all(not c["outputs"] for c in _code_cells(path))
    sources = "".join(_source(c) for c in _code_cells(path))
    assert 'raise NotImplementedError("Exercise' in sources


def minirt_modules_used(source: str) -> set[str]:
    """Names X of every `minirt.X` a piece of notebook code imports or touches.

    Reads the code, not its strings: a printed table that mentions a later module is fine.
    """
    lines = source.split("\n")
    code = "\n".join(ln for ln in lines if not ln.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:  # not Python: fall back to a textual scan
        return set(re.findall(r"\bminirt\.([a-z_]+)", source))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("minirt."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "minirt" and len(parts) > 1:
                found.add(parts[1])
            elif node.module == "minirt":
                found.update(a.name for a in node.names)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "minirt"):
            found.add(node.attr)
    return found


def test_import_scan_sees_every_form():
    src = ("import minirt.cache\nfrom minirt import pool, kv\n"
           "from minirt.radix import X\nminirt.viz.draw_tree\nprint('minirt.engine')")
    assert minirt_modules_used(src) == {"cache", "pool", "kv", "radix", "viz"}


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_notebook_imports_only_earlier_chapters(path):
    chapter = int(path.name[:2])
    used = set()
    for cell in _code_cells(path):
        used |= minirt_modules_used(_source(cell))
    for module in sorted(used):
        assert (ROOT / "minirt" / f"{module}.py").exists() or (ROOT / "minirt" / module).is_dir(), (
            f"{path.name} uses minirt.{module}, which does not exist")
        assert introduced_in(module) <= chapter, (
            f"{path.name} (chapter {chapter}) uses minirt.{module}, introduced in chapter "
            f"{introduced_in(module)}")


def test_every_module_is_in_the_chapter_map():
    mapped = {m for mods in CHAPTER_MODULES.values() for m in mods}
    modules = {p.stem for p in (ROOT / "minirt").glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in (ROOT / "minirt").iterdir() if (p / "__init__.py").exists()}
    assert modules <= mapped, f"modules missing from CHAPTER_MODULES: {sorted(modules - mapped)}"


def test_nbval_fails_on_an_altered_output(tmp_path):
    """Copy chapter 00, change one stored output, and nbval must report the mismatch."""
    nb = json.loads((ROOT / "chapters" / "00_introduction.ipynb").read_text())
    target = None
    for cell in nb["cells"]:
        src = _source(cell) if cell["cell_type"] == "code" else ""
        if "NBVAL_IGNORE_OUTPUT" in src or "NBVAL_SKIP" in src:
            continue
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream" and out["name"] == "stdout":
                target = out
                break
        if target:
            break
    assert target is not None, "chapter 00 has no compared stdout output to alter"
    text = "".join(target["text"])
    target["text"] = text.rstrip("\n") + " (altered)\n"
    copy = tmp_path / "00_introduction.ipynb"
    copy.write_text(json.dumps(nb))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
         "--nbval-current-env", "--nbval-sanitize-with", str(ROOT / "tools/nbval_sanitize.cfg"),
         "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), str(copy)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "(altered)" in proc.stdout and "1 failed" in proc.stdout, proc.stdout[-2000:]
