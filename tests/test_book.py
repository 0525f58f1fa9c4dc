"""Book helpers: reproducible set-up, listings with repository-relative paths, the chapter map."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from minirt import book
from minirt.model import load_model


def test_setup_seeds_everything_and_prints_versions(capsys):
    book.setup(seed=3)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    book.setup(seed=3)
    b = (random.random(), np.random.rand(), torch.rand(1).item())
    assert a == b
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "device" in out


def test_show_titles_a_listing_with_a_relative_path_and_line_numbers():
    listing = book.show(load_model)
    text = repr(listing)
    assert listing.title.startswith("minirt/model.py:")
    assert "(load_model)" in listing.title
    first_body_line = text.split("\n")[1]
    assert first_body_line.lstrip().startswith(str(listing.first_line))
    assert "def load_model(" in text
    assert "/work/" not in text and "/home/" not in text
    assert "<pre" in listing._repr_html_() or "<div" in listing._repr_html_()


def test_show_methods_and_properties():
    assert "(Listing.__repr__)" in book.show(book.Listing.__repr__).title
    with pytest.raises(TypeError, match="show"):
        book.show(42)


def test_chapter_map_is_consistent():
    seen = [m for mods in book.CHAPTER_MODULES.values() for m in mods]
    assert len(seen) == len(set(seen)), "a module is introduced twice"
    assert book.introduced_in("model") == 0 and book.introduced_in("cache") == 3
    with pytest.raises(KeyError):
        book.introduced_in("nonexistent")


def _minirt_imports(path) -> set[str]:
    """The minirt modules a source file imports, anywhere in it (top level, functions,
    TYPE_CHECKING blocks): ``from .x import``, ``from minirt.x import``, ``import minirt.x``."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1 and mod:
                found.add(mod.split(".")[0])
            elif node.level == 0 and mod.startswith("minirt."):
                found.add(mod.split(".")[1])
            elif node.level == 1 or mod == "minirt":  # from . import x / from minirt import x
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("minirt."))
    return found


def test_chapter_map_names_existing_modules_only():
    from pathlib import Path

    pkg = Path(book.__file__).parent
    for chapter, modules in book.CHAPTER_MODULES.items():
        for mod in modules:
            exists = (pkg / f"{mod}.py").exists() or (pkg / mod / "__init__.py").exists()
            assert exists, f"CHAPTER_MODULES[{chapter}] names minirt.{mod}, which does not exist"


def test_imports_run_one_way():
    """No cycle among minirt's modules, counting imports inside functions and TYPE_CHECKING."""
    from pathlib import Path

    pkg = Path(book.__file__).parent
    files = [p for p in pkg.glob("*.py") if p.stem != "__init__"]
    graph = {p.stem: _minirt_imports(p) - {p.stem} for p in files}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [mod, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])


PRESENTATION = {"viz", "widgets"}  # HTML, SVG, widgets and text renders of state (BOOK.md s.4)


def test_no_mechanism_module_imports_a_presentation_module():
    """Presentation reads every layer; no mechanism module (nor a checker) reads it, not even
    inside a function."""
    from pathlib import Path

    pkg = Path(book.__file__).parent
    files = [p for p in [*pkg.glob("*.py"), *pkg.glob("checks/*.py")]
             if p.stem not in PRESENTATION | {"__init__"}]
    assert len(files) > 20
    bad = {str(p.relative_to(pkg)): sorted(_minirt_imports(p) & PRESENTATION) for p in files}
    assert {f: mods for f, mods in bad.items() if mods} == {}


def test_the_forward_pass_sits_between_the_pool_and_the_lifecycle():
    """BOOK.md s.4's layers: pool -> the attention and layer arithmetic -> the forward pass
    over pooled K/V (the decode working set, the forward module) -> lifecycle. The pool knows
    nothing above it, the model loader nothing of the pool; the attention and layer
    arithmetic take tensors (no pool, no forward pass); the working set and the forward
    module read the pool through them; the lifecycle runs through the forward module."""
    from pathlib import Path

    pkg = Path(book.__file__).parent
    names = ("pool", "model", "llama", "attention", "working_set", "forward", "lifecycle")
    deps = {m: _minirt_imports(pkg / f"{m}.py") for m in names}
    above_pool = {"llama", "attention", "working_set", "forward", "lifecycle"}
    assert not deps["pool"] & (above_pool | {"model"})
    assert not deps["model"] & (above_pool | {"pool"})
    assert "model" in deps["llama"]
    assert not deps["llama"] & (above_pool | {"pool"})
    assert not deps["attention"] & {"pool", "working_set", "forward", "lifecycle"}
    assert {"pool", "attention", "llama"} <= deps["working_set"]
    assert not deps["working_set"] & {"forward", "lifecycle"}
    assert {"pool", "llama", "attention", "working_set"} <= deps["forward"]
    assert "lifecycle" not in deps["forward"] and "forward" in deps["lifecycle"]


def test_progress_yields_every_item_and_leaves_no_bar(capsys, monkeypatch):
    from minirt.book import progress

    assert list(progress(range(3), desc="rounds")) == [0, 1, 2]
    assert list(progress(iter("ab"), desc="letters")) == ["a", "b"]  # no len: still works
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert list(progress([5], desc="quiet")) == [5]
    captured = capsys.readouterr()
    assert "%|" not in captured.out  # outside a notebook, tqdm's text bar is erased (stderr)


def test_the_split_modules_sit_where_book_md_draws_them():
    """BOOK.md s.4's layers for the modules issue 55 split off: the checked token ids sit
    between the radix tree's nodes and the cache (the cache reads them, they read no cache,
    pool or model); the router sees only text (no engine, request, workload or replica
    harness), and the replica harness runs routers on engines; the engine thread sits under
    the HTTP layer and knows no HTTP."""
    import ast
    from pathlib import Path

    pkg = Path(book.__file__).parent
    names = ("radix", "token_ids", "cache", "router", "replicas", "engine_worker", "serve")
    deps = {m: _minirt_imports(pkg / f"{m}.py") for m in names}
    assert "radix" in deps["token_ids"] and "token_ids" in deps["cache"]
    assert not deps["token_ids"] & {"cache", "eviction", "pool", "lifecycle", "engine", "model"}
    assert "token_ids" not in deps["radix"]
    assert deps["router"] <= {"errors"}
    assert {"router", "engine"} <= deps["replicas"] and "replicas" not in deps["router"]
    assert "engine" in deps["engine_worker"] and "engine_worker" in deps["serve"]
    assert not deps["engine_worker"] & {"serve", "replay", "router", "replicas"}
    absolute: set[str] = set()  # the engine thread's imports from outside minirt
    for node in ast.walk(ast.parse((pkg / "engine_worker.py").read_text())):
        if isinstance(node, ast.Import):
            absolute.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            absolute.add((node.module or "").split(".")[0])
    assert "asyncio" in absolute and not absolute & {"fastapi", "starlette", "uvicorn", "httpx"}
