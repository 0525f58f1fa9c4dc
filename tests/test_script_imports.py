"""The scripts outside the package import one way too: ``benchmarks/``, ``tools/`` and
``site/`` each run with their own folder on ``sys.path``, so a script imports a sibling by its
bare name (``from _servers import ...``). No circle among them, counting imports inside
functions; and ``minirt`` imports none of them (``tests/test_book.py``'s
``test_imports_run_one_way`` checks minirt's own modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("benchmarks", "tools", "site")


def _imported_names(path: Path) -> set[str]:
    """Every top-level name ``path`` imports, at any depth of the file (absolute imports)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _graph(folder: Path) -> dict[str, set[str]]:
    scripts = {p.stem: p for p in folder.glob("*.py")}
    return {stem: (_imported_names(p) & scripts.keys()) - {stem} for stem, p in scripts.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a list that starts and ends with the same name)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(mod: str, path: list[str]) -> list[str] | None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod, [mod])):
            return found
    return None


def test_the_cycle_finder_finds_a_circle_and_passes_a_line():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"vs_vllm": {"serve_bench"}, "serve_bench": {"vs_vllm"}}) == [
        "serve_bench", "vs_vllm", "serve_bench"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imported_names_reads_imports_inside_functions(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("import os\n\ndef f():\n    from serve_bench import run\n"
                      "    import vs_vllm.sub\n    from . import y\n")
    assert _imported_names(script) == {"os", "serve_bench", "vs_vllm"}


@pytest.mark.parametrize("folder", FOLDERS)
def test_scripts_import_one_way(folder):
    graph = _graph(ROOT / folder)
    assert graph, f"no scripts found in {folder}/"
    found = _cycle(graph)
    assert found is None, f"import circle in {folder}/: " + " -> ".join(found or [])


def test_the_vllm_scripts_share_their_server_start_up_below_both():
    graph = _graph(ROOT / "benchmarks")
    assert "_servers" in graph["vs_vllm"] and "_servers" in graph["serve_bench"]
    assert "vs_vllm" not in graph["serve_bench"] and graph["_servers"] == set()


def test_minirt_imports_no_script():
    scripts = {p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py")}
    scripts |= set(FOLDERS)
    for path in (ROOT / "minirt").rglob("*.py"):
        bad = _imported_names(path) & scripts
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
