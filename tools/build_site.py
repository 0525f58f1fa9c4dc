"""Build the book as a static website in ``_build/html`` from the committed notebooks.

Nothing is executed: every page shows the outputs the notebooks store (SVG trees, plots,
the static pictures of widget states). Pages: the README as the home page, every chapter
in file order, the exercises and solutions, and the README's bibliography section as a
page of its own when the README has one. Widgets need a kernel, so each widget output
becomes a short note pointing at ``make lab``. Math is typeset by a local MathJax 2
(Debian's ``libjs-mathjax``; ``--mathjax DIR`` for another copy), so the site loads
nothing from the network.

    python tools/build_site.py                 # -> _build/html/index.html
    python tools/build_site.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import html
import posixpath
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent / "site"
SECTIONS = ("chapters", "exercises", "solutions")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
FIGURE_MIMES = ("image/svg+xml", "image/png", "image/jpeg")
MATHJAX_DIRS = (Path("/usr/share/javascript/mathjax"), Path("/usr/share/mathjax"))
# The parts of MathJax 2 that the lab template's configuration (TeX-AMS_CHTML-full, Safe) loads.
MATHJAX_PARTS = ("MathJax.js", "config/TeX-AMS_CHTML-full.js", "config/Safe.js", "extensions",
                 "jax/input/TeX", "jax/output/CommonHTML", "jax/element",
                 "fonts/HTML-CSS/TeX/woff")
MATHJAX_URL = "_static/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"
WIDGET_NOTE = (
    '<div class="book-widget-note">An interactive widget goes here: it needs a running '
    "Python kernel. Open this notebook in JupyterLab (<code>make lab</code>) and run it to "
    "use it; where the notebook stores a picture of the widget's first state, it follows."
    "</div>")
BIBLIOGRAPHY = re.compile(r"^(#{2,3})\s+(bibliography|references|further reading)\b.*$",
                          re.I | re.M)


@dataclass
class Page:
    """One page of the site: where it comes from, where it goes, what the nav calls it."""

    source: str  # repo-relative path of the source (notebook, README.md, or a section dir)
    target: str  # site-relative path of the HTML file
    title: str
    notebook: nbformat.NotebookNode


def figure_count(nb: nbformat.NotebookNode) -> int:
    """Outputs that store a picture (SVG, PNG or JPEG): the figures a page must show."""
    return sum(1 for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
               if any(m in out.get("data", {}) for m in FIGURE_MIMES))


def notebook_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The text of the first Markdown heading, without Markdown emphasis."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#+\s+(.+)$", cell.source, re.M)
            if m:
                return re.sub(r"[*_`]", "", m.group(1)).strip()
    return fallback


def for_the_web(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy whose widget outputs are notes (no saved widget state is rendered)."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            if WIDGET_MIME in out.get("data", {}):
                out["data"] = {"text/html": WIDGET_NOTE}
    return nb


def markdown_notebook(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell(text))
    return nb


def split_bibliography(readme: str) -> tuple[str, str | None]:
    """The README and its bibliography section (up to the next heading of its level)."""
    m = BIBLIOGRAPHY.search(readme)
    if not m:
        return readme, None
    level = len(m.group(1))
    rest = readme[m.end():]
    nxt = re.search(rf"^#{{1,{level}}}\s", rest, re.M)
    end = m.end() + (nxt.start() if nxt else len(rest))
    return readme, "# " + m.group(0).lstrip("#").strip() + "\n" + readme[m.end():end]


def collect_pages(root: Path) -> list[Page]:
    readme, bibliography = split_bibliography((root / "README.md").read_text())
    pages = [Page("README.md", "index.html", "Home", markdown_notebook(readme))]
    for section in SECTIONS:
        entries = []
        for path in sorted((root / section).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            rel = f"{section}/{path.name}"
            title = notebook_title(nb, path.stem)
            pages.append(Page(rel, f"{section}/{path.stem}.html", title, nb))
            entries.append(f"- [{title}]({path.name})")
        listing = f"# {section.capitalize()}\n\n" + "\n".join(entries) + "\n"
        pages.append(Page(section, f"{section}/index.html", section.capitalize(),
                          markdown_notebook(listing)))
    if bibliography:
        pages.append(Page("README.md", "bibliography.html", "Bibliography",
                          markdown_notebook(bibliography)))
    return pages


def nav_html(pages: list[Page], current: Page) -> str:
    """The sidebar: home, every chapter in order, exercises, solutions, bibliography."""
    up = "../" * current.target.count("/")

    def link(page: Page, text: str | None = None) -> str:
        here = ' aria-current="page"' if page is current else ""
        return f'<a href="{up}{page.target}"{here}>{html.escape(text or page.title)}</a>'

    by_target = {p.target: p for p in pages}
    chapters = [p for p in pages if p.source.startswith("chapters/")]
    items = "".join(f"<li>{link(p)}</li>" for p in chapters)
    home = link(by_target["index.html"], "minirt")
    parts = [f'<nav class="book-nav"><div class="book-title">{home}'
             f"</div><h2>Chapters</h2><ol start=\"0\">{items}</ol><h2>Practice</h2><ul>"
             f'<li>{link(by_target["exercises/index.html"], "Exercises")}</li>'
             f'<li>{link(by_target["solutions/index.html"], "Solutions")}</li></ul>']
    if "bibliography.html" in by_target:
        parts.append(f"<h2>Reading</h2><ul><li>{link(by_target['bibliography.html'])}</li></ul>")
    parts.append("</nav>")
    return "".join(parts)


def pager_html(pages: list[Page], current: Page) -> str:
    """Previous / next links between pages of the same section."""
    section = current.source.split("/")[0]
    siblings = [p for p in pages if p.source.startswith(section + "/")]
    if current not in siblings:
        return ""
    i = siblings.index(current)

    def step(j: int, text: str) -> str:
        if not 0 <= j < len(siblings):
            return "<span></span>"
        return f'<a href="{siblings[j].target.split("/")[-1]}">{text}</a>'

    prev = step(i - 1, "← " + html.escape(siblings[i - 1].title)) if i else "<span></span>"
    nxt = step(i + 1, html.escape(siblings[(i + 1) % len(siblings)].title) + " →")
    return f'<div class="book-pager">{prev}{nxt}</div>'


_URL = re.compile(r'((?:href|src)=")([^"#?]*)([^"]*)(")')


def relink(body: str, page: Page, pages: list[Page], root: Path, out: Path) -> str:
    """Point links at the site's pages; copy other linked repo files beside them."""
    by_source = {p.source: p for p in pages if p.source != "README.md"}
    by_source["README.md"] = next(p for p in pages if p.target == "index.html")
    src_dir = posixpath.dirname(page.source) if page.source not in SECTIONS else page.source
    page_dir = posixpath.dirname(page.target)
    targets = {p.target for p in pages}

    def fix(m: re.Match) -> str:
        url = m.group(2)
        if not url or re.match(r"^[a-z][a-z0-9+.-]*:|^//|^/", url, re.I):
            return m.group(0)
        if posixpath.normpath(posixpath.join(page_dir, html.unescape(url))) in targets:
            return m.group(0)  # already a page of the site (navigation, pager)
        repo_path = posixpath.normpath(posixpath.join(src_dir, html.unescape(url)))
        if repo_path.startswith("_static/") or repo_path.startswith("../"):
            return m.group(0)
        target = by_source.get(repo_path.rstrip("/"))
        if target is not None:
            new = posixpath.relpath(target.target, page_dir or ".")
            return m.group(1) + html.escape(new) + m.group(3) + m.group(4)
        file = root / repo_path
        if file.is_file():
            (out / repo_path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, out / repo_path)
        else:
            print(f"warning: {page.source} links to {url}, which does not exist", file=sys.stderr)
        return m.group(0)

    return _URL.sub(fix, body)


def copy_mathjax(source: Path, out: Path) -> None:
    for part in MATHJAX_PARTS:
        src, dst = source / part, out / "_static" / "mathjax" / part
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def build(root: Path, out: Path, mathjax: Path | None) -> list[Page]:
    if out.exists():
        shutil.rmtree(out)
    (out / "_static").mkdir(parents=True)
    shutil.copyfile(HERE / "book.css", out / "_static" / "book.css")
    if mathjax is not None:
        copy_mathjax(mathjax, out)
    else:
        print("warning: no local MathJax (apt install libjs-mathjax): math loads from a CDN",
              file=sys.stderr)
    exporter = HTMLExporter(template_name="lab", template_file="book.html.j2",
                            extra_template_paths=[str(HERE)])
    pages = collect_pages(root)
    for page in pages:
        up = "../" * page.target.count("/")
        cdn = "https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js?config=TeX-AMS_CHTML-full,Safe"
        resources = {"book": {"root": up, "nav": nav_html(pages, page),
                              "pager": pager_html(pages, page),
                              "mathjax": up + MATHJAX_URL if mathjax else cdn}}
        nb = for_the_web(page.notebook)
        body, _ = exporter.from_notebook_node(nb, resources=resources)
        if page.source == "README.md":
            body = body.replace('<main class="book-main">', '<main class="book-main book-readme">')
        body = re.sub(r"<title>.*?</title>", f"<title>{html.escape(page.title)} · minirt</title>",
                      body, count=1, flags=re.S)
        target = out / page.target
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(relink(body, page, pages, root, out))
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "html")
    parser.add_argument("--mathjax", type=Path, default=None,
                        help="a MathJax 2 folder (default: Debian's libjs-mathjax)")
    args = parser.parse_args(argv)
    mathjax = args.mathjax or next((d for d in MATHJAX_DIRS if (d / "MathJax.js").exists()), None)
    start = time.perf_counter()
    pages = build(ROOT, args.out, mathjax)
    figures = sum(figure_count(p.notebook) for p in pages)
    print(f"built {len(pages)} pages ({figures} stored figures) in {args.out} "
          f"in {time.perf_counter() - start:.1f} s; open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
