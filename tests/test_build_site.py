"""The website's build (site/): page transforms, the vendored JavaScript, a small real build.

The full site is built and checked in a browser by ``make test-browser``; these tests
need only Sphinx and run in seconds.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "site"))
import conf as site_conf  # noqa: E402
import vendor  # noqa: E402

WIDGET = site_conf.WIDGET_VIEW


def _notebook(title: str, code: str = "x = 1", outputs=()) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell(f"# {title}\n\nText."))
    cell = nbformat.v4.new_code_cell(code)
    cell.outputs = list(outputs)
    nb.cells.append(cell)
    return nb


def test_nbval_markers_are_hidden_and_code_kept():
    nb = _notebook("Chapter 01 — A", "# NBVAL_IGNORE_OUTPUT\nx = 1\n  # NBVAL_SKIP\ny = 2")
    out = site_conf.for_the_site("chapters/01_a", nb)
    assert out.cells[1].source == "x = 1\ny = 2"


def test_solutions_are_titled_as_solutions_and_exercises_are_not():
    title = "Exercises 04 — The request lifecycle"
    solution = site_conf.for_the_site("solutions/04_x", _notebook(title))
    assert solution.cells[0].source.startswith("# Solutions 04 — The request lifecycle")
    exercise = site_conf.for_the_site("exercises/04_x", _notebook(title))
    assert exercise.cells[0].source.startswith("# " + title)


def test_a_widget_output_gets_a_note_before_it():
    view = nbformat.v4.new_output("display_data", data={
        WIDGET: {"model_id": "abc", "version_major": 2, "version_minor": 0},
        "text/plain": "VBox()"})
    picture = nbformat.v4.new_output("execute_result", data={"image/svg+xml": "<svg/>"},
                                     execution_count=2)
    nb = site_conf.for_the_site("chapters/03_a", _notebook("C", outputs=[view, picture]))
    outputs = nb.cells[1].outputs
    assert len(outputs) == 3
    assert "book-widget-note" in outputs[0]["data"]["text/html"]
    assert "JupyterLab" in outputs[0]["data"]["text/html"]
    assert WIDGET in outputs[1]["data"] and "image/svg+xml" in outputs[2]["data"]


def test_bibliography_is_the_readme_section_up_to_the_next_heading():
    readme = "# minirt\n\nintro\n\n## Bibliography\n\n- Zheng et al. 2024\n\n## Licence\n\nA\n"
    page = site_conf.bibliography(readme)
    assert page.startswith("# Bibliography\n")
    assert "Zheng et al. 2024" in page and "Licence" not in page and "intro" not in page
    real = site_conf.bibliography((ROOT / "README.md").read_text())
    assert "Licence" not in real and len(real) > 500


def test_figure_count_counts_pictures_only():
    outs = [nbformat.v4.new_output("display_data", data={"image/png": "AA=="}),
            nbformat.v4.new_output("display_data", data={"text/plain": "x"}),
            nbformat.v4.new_output("execute_result", data={"image/svg+xml": "<svg/>"},
                                   execution_count=1)]
    assert site_conf.figure_count(_notebook("C", outputs=outs)) == 2


def test_vendored_packages_are_pinned_with_their_integrity():
    for name, version, integrity, files, _ in vendor.PACKAGES:
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), (name, version)
        assert integrity.startswith("sha512-") and files
        assert vendor.tarball_url(name, version).startswith("https://registry.npmjs.org/")
    assert vendor.tarball_url("@jupyter-widgets/html-manager", "1.0.15").endswith(
        "/@jupyter-widgets/html-manager/-/html-manager-1.0.15.tgz")


def test_checksum_check_rejects_other_bytes():
    data = b"define(function () { return 1; });"
    good = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    assert vendor.verified(data, good)
    assert not vendor.verified(data + b" ", good)
    assert not vendor.verified(data, good[:-4] + "AAA=")


def test_site_configuration_stays_offline():
    assert site_conf.nb_execution_mode == "off"
    assert site_conf.smartquotes is False
    assert site_conf.nb_render_markdown_format == "myst"
    assert not re.match(r"https?:", site_conf.mathjax_path)
    assert all(not re.match(r"https?:", path) for path in site_conf.nb_ipywidgets_js)
    assert "math" in site_conf.mathjax2_config["tex2jax"]["processClass"].split("|")


@pytest.fixture
def tiny_book(tmp_path):
    """A repository-shaped folder: README, chapters 00, 09a and 10, one exercise, one solution,
    and this repository's site/ (with stand-ins for the vendored JS and MathJax)."""
    src = tmp_path / "book"
    (src / "chapters").mkdir(parents=True)
    (src / "exercises").mkdir()
    (src / "solutions").mkdir()
    readme = ("# Tiny\n\nSee [chapter 10](chapters/10_c.ipynb) and [the answers](solutions/).\n\n"
              "## Bibliography\n\n- A paper.\n\n## Licence\n\nA.\n")
    (src / "README.md").write_text(readme)
    for stem, title in [("10_c", "Chapter 10 — C"), ("00_a", "Chapter 0 · A"),
                        ("09a_b", "Chapter 09a — B")]:
        nbformat.write(_notebook(title, "# NBVAL_IGNORE_OUTPUT\nsecret_marker = 1"),
                       src / "chapters" / f"{stem}.ipynb")
    nbformat.write(_notebook("Exercises 00 — A"), src / "exercises" / "00_a.ipynb")
    nbformat.write(_notebook("Exercises 00 — A"), src / "solutions" / "00_a.ipynb")
    site = src / "site"
    shutil.copytree(ROOT / "site", site, ignore=shutil.ignore_patterns("_vendor", "__pycache__"))
    (site / "_vendor" / "html-manager").mkdir(parents=True)
    for name in ("require.js", "html-manager/embed-amd.js"):
        (site / "_vendor" / name).write_text("// stand-in\n")
    mathjax = tmp_path / "mathjax"
    for part in site_conf.MATHJAX_PARTS:
        target = mathjax / part
        if target.suffix == ".js":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("// stand-in\n")
        else:
            target.mkdir(parents=True, exist_ok=True)
    return src, mathjax


def test_a_small_build_has_glob_order_titles_and_no_markers(tiny_book, tmp_path, monkeypatch):
    from sphinx.cmd.build import build_main

    src, mathjax = tiny_book
    monkeypatch.setenv("MINIRT_MATHJAX", str(mathjax))
    monkeypatch.syspath_prepend(str(src / "site"))
    sys.modules.pop("conf", None)
    out = tmp_path / "html"
    try:
        rc = build_main(["-q", "-b", "html", "-c", str(src / "site"), "-d",
                         str(tmp_path / "doctrees"), str(src), str(out)])
    finally:
        sys.modules.pop("conf", None)
    assert rc == 0
    home = (out / "index.html").read_text()
    sidebar = home[home.index('bd-sidebar-primary'):]
    order = [sidebar.index(t) for t in ("Chapter 0 · A", "Chapter 09a — B", "Chapter 10 — C")]
    assert order == sorted(order), "chapters are not in file-name order in the sidebar"
    assert "Solutions 00 — A" in (out / "solutions" / "00_a.html").read_text()
    assert "Exercises 00 — A" in (out / "exercises" / "00_a.html").read_text()
    chapter = (out / "chapters" / "10_c.html").read_text()
    assert "secret_marker" in chapter and "NBVAL_IGNORE_OUTPUT" not in chapter
    assert "A paper." in (out / "site" / "bibliography.html").read_text()
    assert (out / "_static" / "mathjax" / "MathJax.js").exists()
    # the download button serves the notebook as committed, markers included
    assert "NBVAL_IGNORE_OUTPUT" in (out / "_sources" / "chapters" / "10_c.ipynb").read_text()
    assert 'href="site/solutions.html"' in home
