"""The static site in a real browser: pages, links, images, figures, navigation."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urldefrag, urljoin

import nbformat

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "_build" / "html"
sys.path.insert(0, str(ROOT / "tools"))
from build_site import figure_count  # noqa: E402

PAGES = sorted(p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html"))
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

# Every link and picture on a page, and whether each picture really drew.
_INVENTORY = """() => ({
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  images: [...document.querySelectorAll('img')].map(i => ({src: i.currentSrc || i.src,
           ok: i.complete && i.naturalWidth > 0})),
})"""
# Pictures among the notebook's outputs (nbconvert draws SVG and PNG alike as <img>), drawn.
_FIGURES = """() => [...document.querySelectorAll(
    '.jp-OutputArea-output.jp-RenderedImage img, .jp-OutputArea-output.jp-RenderedSVG img,'
    + ' .jp-OutputArea-output.jp-RenderedSVG svg')]
  .map(e => { const r = e.getBoundingClientRect();
              return r.width > 0 && r.height > 0
                     && (e.tagName.toLowerCase() !== 'img' || e.naturalWidth > 0); })"""


_LINKS = "() => [...document.querySelectorAll('a[href]')].map(a => a.href)"


def _open(tab, url: str) -> None:
    response = tab.page.goto(url, wait_until="load")
    assert response is not None and response.ok, f"{url}: HTTP {response and response.status}"
    # MathJax typesets after load; wait until it is idle, where a page uses it.
    tab.page.wait_for_function(
        "() => !window.MathJax || !MathJax.Hub || MathJax.Hub.queue.pending === 0")


def test_site_has_every_notebook():
    for folder in ("chapters", "exercises", "solutions"):
        for nb in (ROOT / folder).glob("*.ipynb"):
            assert (SITE / folder / f"{nb.stem}.html").exists(), f"no page for {folder}/{nb.name}"
    assert "index.html" in PAGES


def test_every_page_loads_without_errors_or_broken_links(tab, site_url, shots):
    """Each page: HTTP 200, no console error, every local link and picture resolves."""
    checked: set[str] = set()
    problems: list[str] = []
    for rel in PAGES:
        tab.errors.clear()
        _open(tab, site_url + rel)
        problems += [f"{rel}: {e}" for e in tab.errors]
        inventory = tab.page.evaluate(_INVENTORY)
        problems += [f"{rel}: broken image {i['src'][:80]}" for i in inventory["images"]
                     if not i["ok"]]
        for link in inventory["links"]:
            target = urldefrag(link)[0]
            if not target.startswith(site_url) or target in checked:
                continue
            checked.add(target)
            status = tab.page.request.get(target).status
            if status != 200:
                problems.append(f"{rel}: link to {target} gives HTTP {status}")
    tab.page.goto(site_url, wait_until="load")
    tab.page.screenshot(path=str(shots / "site_home.png"))
    assert not problems, "\n".join(problems)
    assert len(checked) >= len(CHAPTERS)


def test_each_chapter_page_shows_every_stored_figure(tab, site_url, shots):
    for path in CHAPTERS:
        stored = figure_count(nbformat.read(path, as_version=4))
        _open(tab, f"{site_url}chapters/{path.stem}.html")
        drawn = tab.page.evaluate(_FIGURES)
        assert len(drawn) == stored, (
            f"{path.name}: {len(drawn)} figures on the page, {stored} stored")
        assert all(drawn), f"{path.name}: a figure did not draw ({drawn})"
        first = tab.page.locator(".jp-RenderedSVG img, .jp-RenderedImage img").first
        if stored:
            first.scroll_into_view_if_needed()
        tab.page.screenshot(path=str(shots / f"site_{path.stem}.png"))


def test_navigation_from_home_reaches_every_chapter(tab, site_url):
    """Follow links from the home page only (breadth first, two clicks deep)."""
    wanted = {urljoin(site_url, f"chapters/{p.stem}.html") for p in CHAPTERS}
    frontier, seen = [site_url], {site_url}
    for _ in range(2):
        nxt = []
        for url in frontier:
            _open(tab, url)
            for link in tab.page.evaluate(_LINKS):
                link = urldefrag(link)[0]
                if link.startswith(site_url) and link.endswith(".html") and link not in seen:
                    seen.add(link)
                    nxt.append(link)
        frontier = nxt
    assert wanted <= seen, f"not reachable from home: {sorted(wanted - seen)}"
    # and by clicking, as a reader would: the sidebar's first chapter
    _open(tab, site_url)
    tab.page.locator("nav.book-nav ol a").first.click()
    tab.page.wait_for_load_state("load")
    assert tab.page.url == urljoin(site_url, f"chapters/{CHAPTERS[0].stem}.html")


def test_widget_cells_say_they_need_a_kernel(tab, site_url):
    widget_pages = [p for p in CHAPTERS if "application/vnd.jupyter.widget-view+json"
                    in p.read_text()]
    assert widget_pages, "no chapter stores a widget: nothing to check"
    for path in widget_pages:
        _open(tab, f"{site_url}chapters/{path.stem}.html")
        assert tab.page.locator(".book-widget-note").count() >= 1, path.name


def test_pages_list_is_complete():
    assert len(PAGES) >= 3 * len(CHAPTERS) + 1
    assert all(Path(SITE / p).stat().st_size > 0 for p in PAGES)
