"""Sphinx configuration of the book's website (``make html``; BOOK.md section 7).

The source folder is the repository root, this folder only configures it:
``sphinx-build -c site . _build/html``. Pages: the README (home, also ``index.html``),
every notebook in ``chapters/`` in name order, the exercises and the solutions, the
README's bibliography, and the benchmarks' results (``benchmarks/README.md``). Nothing
executes: each page shows the outputs the notebook stores.
Nothing is loaded from the network at view time: MathJax 2 is Debian's ``libjs-mathjax``
(or ``MINIRT_MATHJAX``), the widget JavaScript is vendored by ``site/vendor.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
STARTED = time.perf_counter()

project = "minirt"
author = "the minirt authors"
root_doc = "README"
include_patterns = ["README.md", "chapters/*.ipynb", "exercises/*.ipynb",
                    "solutions/*.ipynb", "site/*.md", "benchmarks/README.md"]
exclude_patterns = ["_build", ".venv*", "**/.ipynb_checkpoints"]
extensions = ["myst_nb", "sphinx_copybutton"]
copybutton_exclude = ".linenos, .gp"  # line numbers and prompts are not copied
smartquotes = False  # `--flags` stay two hyphens, quotes stay straight
# Chapters start at "#" and may skip a level; a few exercise listings hold "?" placeholders.
suppress_warnings = ["myst.header", "misc.highlighting_failure"]

# myst-nb: render the stored outputs only.
nb_execution_mode = "off"
nb_render_markdown_format = "myst"  # Markdown outputs (tables) become real tables
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
# The widget JavaScript, served from _static (site/vendor.py fetched it).
nb_ipywidgets_js = {"require.js": {}, "html-manager/embed-amd.js": {}}

# MathJax 2, local; processClass so that myst's `math` spans and divs are typeset.
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"
mathjax2_config = {"tex2jax": {
    "inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]], "processEscapes": True,
    "ignoreClass": "tex2jax_ignore|mathjax_ignore|document",
    "processClass": "tex2jax_process|mathjax_process|math|output_area|text_latex"}}
MATHJAX_DIRS = [Path(p) for p in (os.environ.get("MINIRT_MATHJAX", ""),
                                  "/usr/share/javascript/mathjax", "/usr/share/mathjax") if p]
# The parts of MathJax 2 that this configuration loads (CommonHTML output, woff fonts).
MATHJAX_PARTS = ("MathJax.js", "config/TeX-AMS_CHTML-full.js", "config/Safe.js", "extensions",
                 "jax/input/TeX", "jax/output/CommonHTML", "jax/element",
                 "fonts/HTML-CSS/TeX/woff")

html_theme = "sphinx_book_theme"
html_title = "minirt"
html_favicon = "_static/favicon.svg"  # else the browser asks for /favicon.ico (a 404)
html_static_path = ["_static", "_vendor"]
html_css_files = ["book.css"]
html_js_files = [("book.js", {"priority": 100})]  # before the widget JS (500)
html_context = {"default_mode": "auto"}
html_copy_source = True  # the download button serves the notebook as committed
html_theme_options = {
    "home_page_in_toc": True,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

SECTIONS = ("chapters", "exercises", "solutions")
FIGURE_MIMES = ("image/svg+xml", "image/png", "image/jpeg")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NBVAL_MARKER = re.compile(r"^[ \t]*# NBVAL_[A-Z_]+[^\n]*\n?", re.M)
WIDGET_NOTE = (
    '<p class="book-widget-note">This widget is drawn from the state the notebook saved; '
    "its controls come alive in JupyterLab (<code>make lab</code>) once the cells above "
    "have run.</p>")
BIBLIOGRAPHY = re.compile(r"^## Bibliography\b.*$", re.M)
# Shown in the sidebar, in this order; chapters and the two practice folders by glob, so a
# new notebook (09a, 10, ...) appears without a change here.
TOC = """

```{toctree}
:hidden:
:caption: Chapters
:glob:

chapters/*
```

```{toctree}
:hidden:
:caption: Practice

site/exercises
site/solutions
```

```{toctree}
:hidden:
:caption: Reading

site/bibliography
benchmarks/README
```
"""


def figure_count(nb: nbformat.NotebookNode) -> int:
    """Outputs that store a picture (SVG, PNG or JPEG): the figures a page must show."""
    return sum(1 for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
               if any(m in out.get("data", {}) for m in FIGURE_MIMES))


def bibliography(readme: str) -> str:
    """The README's bibliography section (up to the next ``##`` heading) as a page."""
    m = BIBLIOGRAPHY.search(readme)
    if not m:
        return "# Bibliography\n\nThe README has no bibliography section.\n"
    rest = readme[m.end():]
    nxt = re.search(r"^##?\s", rest, re.M)
    return "# Bibliography\n" + rest[: nxt.start() if nxt else len(rest)]


def for_the_site(docname: str, nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The page's view of a notebook: markers hidden, solutions titled, widget notes."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.source = NBVAL_MARKER.sub("", cell.source)
        outputs = []
        for out in cell.outputs:
            if WIDGET_VIEW in out.get("data", {}):
                outputs.append(nbformat.v4.new_output(
                    "display_data", data={"text/html": WIDGET_NOTE}))
            outputs.append(out)
        cell.outputs = outputs
    if docname.startswith("solutions/"):
        for cell in nb.cells:
            if cell.cell_type == "markdown" and re.search(r"^#\s", cell.source, re.M):
                cell.source = re.sub(r"^(#\s+)Exercises\b", r"\1Solutions", cell.source,
                                     count=1, flags=re.M)
                break
    return nb


def source_read(app, docname: str, source: list[str]) -> None:
    if docname == root_doc:
        readme = re.sub(r"\]\((exercises|solutions)/\)", r"](site/\1.md)", source[0])
        source[0] = readme + TOC
    elif docname == "site/bibliography":
        source[0] = bibliography((Path(app.srcdir) / "README.md").read_text(encoding="utf-8"))
    elif docname.split("/")[0] in SECTIONS:
        nb = nbformat.reads(source[0], as_version=4)
        source[0] = nbformat.writes(for_the_site(docname, nb))


def finish(app, exception) -> None:
    """Copy MathJax in, serve the README as index.html too, and say what was built."""
    if exception is not None or app.builder.format != "html":
        return
    source = next((d for d in MATHJAX_DIRS if (d / "MathJax.js").exists()), None)
    if source is None:
        raise RuntimeError("no local MathJax 2: `apt install libjs-mathjax`, or set "
                           "MINIRT_MATHJAX to a MathJax 2 folder")
    out = Path(app.outdir) / "_static" / "mathjax"
    for part in MATHJAX_PARTS:
        src, dst = source / part, out / part
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    # The README is the home page; serve it as index.html too (same folder, same links).
    outdir = Path(app.outdir)
    shutil.copyfile(outdir / f"{root_doc}.html", outdir / "index.html")
    pages = len(app.env.found_docs)
    size = sum(f.stat().st_size for f in outdir.rglob("*") if f.is_file())
    print(f"html: {pages} pages in {outdir} ({size / 2**20:.1f} MiB) in "
          f"{time.perf_counter() - STARTED:.1f} s; open {outdir / 'index.html'}")


def setup(app):
    if not (HERE / "_vendor" / "html-manager" / "embed-amd.js").exists():
        raise RuntimeError("the widget JavaScript is missing: run `python site/vendor.py` "
                           "(make html does)")
    app.connect("source-read", source_read)
    app.connect("build-finished", finish)
