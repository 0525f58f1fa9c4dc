"""The website in a real browser: pages, links, pictures, search, math, widgets, dark mode,
the phone, and that nothing is fetched from anywhere but the local server."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urldefrag, urljoin

import nbformat

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("MINIRT_SITE", ROOT / "_build" / "html"))
sys.path.insert(0, str(ROOT / "site"))
from conf import WIDGET_VIEW, figure_count  # noqa: E402

# The pages (the theme leaves two template fragments in _static/: not pages).
PAGES = sorted(p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html")
               if not p.relative_to(SITE).as_posix().startswith("_static/"))
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

# Every link and picture on a page, and whether each picture really drew.
_INVENTORY = """() => ({
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  images: [...document.querySelectorAll('img')].map(i => ({src: i.currentSrc || i.src,
           ok: i.complete && i.naturalWidth > 0})),
  // links into the page itself whose target is not there (myst writes a link to a missing
  // file as one of these)
  dangling: [...document.querySelectorAll('a[href^="#"]')].map(a => a.getAttribute('href'))
    .filter(h => h.length > 1 && !document.getElementById(decodeURIComponent(h.slice(1)))),
})"""
# The notebook's stored pictures (myst-nb writes each as an <img> in the cell's output).
_FIGURES = """() => [...document.querySelectorAll('div.cell_output > img')]
  .map(e => { const r = e.getBoundingClientRect();
              return r.width > 0 && r.height > 0 && e.naturalWidth > 0; })"""
_LINKS = "() => [...document.querySelectorAll('a[href]')].map(a => a.href)"
_SIDEWAYS = "() => document.documentElement.scrollWidth - window.innerWidth"


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
    assert "index.html" in PAGES and "site/bibliography.html" in PAGES


def test_every_page_loads_without_errors_broken_links_or_offsite_requests(tab, site_url, shots):
    """Each page: HTTP 200, no console error, every local link and picture resolves, and
    not one request goes anywhere but 127.0.0.1."""
    checked: set[str] = set()
    problems: list[str] = []
    for rel in PAGES:
        tab.errors.clear()
        _open(tab, site_url + rel)
        problems += [f"{rel}: {e}" for e in tab.errors]
        inventory = tab.page.evaluate(_INVENTORY)
        problems += [f"{rel}: broken image {i['src'][:80]}" for i in inventory["images"]
                     if not i["ok"]]
        problems += [f"{rel}: link to {h}, which is nowhere on the page"
                     for h in inventory["dangling"]]
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
    assert len(tab.offsite) == 0, f"{len(tab.offsite)} requests left 127.0.0.1: {tab.offsite[:5]}"
    assert len(checked) >= len(CHAPTERS)


def test_each_chapter_page_shows_every_stored_figure(tab, site_url, shots):
    for path in CHAPTERS:
        stored = figure_count(nbformat.read(path, as_version=4))
        _open(tab, f"{site_url}chapters/{path.stem}.html")
        drawn = tab.page.evaluate(_FIGURES)
        assert len(drawn) == stored, (
            f"{path.name}: {len(drawn)} figures on the page, {stored} stored")
        assert all(drawn), f"{path.name}: a figure did not draw ({drawn})"
        assert tab.page.evaluate(_SIDEWAYS) <= 0, f"{path.name}: the page scrolls sideways"
        if stored:
            tab.page.locator("div.cell_output > img").first.scroll_into_view_if_needed()
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
    # and by clicking, as a reader would: the sidebar's first chapter, then "next"
    _open(tab, site_url)
    tab.page.locator("nav.bd-docs-nav a[href*='chapters/']").first.click()
    tab.page.wait_for_load_state("load")
    assert tab.page.url == urljoin(site_url, f"chapters/{CHAPTERS[0].stem}.html")
    tab.page.locator("a.right-next").first.click()
    tab.page.wait_for_load_state("load")
    assert tab.page.url == urljoin(site_url, f"chapters/{CHAPTERS[1].stem}.html")


def test_sidebar_numbers_match_the_chapters(tab, site_url):
    """The sidebar lists the chapters in file order, each under its notebook's own title."""
    _open(tab, site_url)
    entries = tab.page.evaluate("""() => [...document.querySelectorAll(
        "nav.bd-docs-nav a[href*='chapters/']")].map(a => [a.getAttribute('href'),
                                                           a.textContent.trim()])""")
    assert [h.split("/")[-1] for h, _ in entries] == [f"{p.stem}.html" for p in CHAPTERS]
    for (_, text), path in zip(entries, CHAPTERS, strict=True):
        number = path.stem.split("_")[0].lstrip("0") or "0"
        assert number in text.split("—")[0].split("·")[0], (path.name, text)


def test_search_for_split_at_finds_chapter_02(tab, site_url, shots):
    _open(tab, site_url)
    tab.page.keyboard.press("Control+k")
    box = tab.page.locator("#pst-search-dialog input[name='q']")
    box.fill("split_at")
    box.press("Enter")
    tab.page.wait_for_url("**/search.html?q=split_at*")
    tab.page.locator("#search-results ul.search li a").first.wait_for()
    hits = tab.page.evaluate(
        "() => [...document.querySelectorAll('#search-results ul.search li a')].map(a => a.href)")
    tab.page.screenshot(path=str(shots / "site_search_split_at.png"))
    assert any("chapters/02_radix_tree.html" in h for h in hits), hits
    assert not tab.offsite


def test_math_is_typeset_on_chapter_01(tab, site_url, shots):
    _open(tab, f"{site_url}chapters/01_why_prefixes.html")
    state = tab.page.evaluate("""() => { const m = [...document.querySelectorAll(
        'span.math, div.math')]; return {math: m.length,
        typeset: m.filter(e => e.querySelector('.MathJax_CHTML')).length,
        raw: (document.querySelector('article').innerText.match(/\\$\\$|\\\\\\(|\\\\\\[/g)
              || []).length}; }""")
    tab.page.locator("div.math").first.scroll_into_view_if_needed()
    tab.page.screenshot(path=str(shots / "site_01_math.png"))
    assert state["math"] >= 3, state
    assert state["typeset"] == state["math"], state
    assert state["raw"] == 0, state


def test_widgets_are_drawn_from_saved_state_with_a_note(tab, site_url, shots):
    pages = [p for p in CHAPTERS if WIDGET_VIEW in p.read_text()
             and "widget-state+json" in p.read_text()]
    assert pages, "no chapter stores a widget with its state: nothing to check"
    for path in pages:
        _open(tab, f"{site_url}chapters/{path.stem}.html")
        views = tab.page.locator("div.cell_output .jupyter-widgets.widget-vbox")
        views.first.wait_for()
        assert tab.page.locator(".book-widget-note").count() >= 1, path.name
        drawn = tab.page.evaluate("""() => [...document.querySelectorAll(
            'div.cell_output .widget-vbox')].map(v => ({buttons: v.querySelectorAll(
            'button').length, svg: [...v.querySelectorAll('.widget-html svg')].filter(
            s => s.getBoundingClientRect().width > 0).length}))""")
        assert drawn and all(d["buttons"] or d["svg"] for d in drawn), (path.name, drawn)
        assert any(d["svg"] for d in drawn), (path.name, "no saved drawing shown", drawn)
        views.first.scroll_into_view_if_needed()
        tab.page.screenshot(path=str(shots / f"site_widget_{path.stem}.png"))


def test_listings_are_monospace_and_wide_pictures_scroll_in_their_box(tab, site_url, shots):
    _open(tab, f"{site_url}chapters/04_lifecycle.html")
    fonts = tab.page.evaluate("""() => [...document.querySelectorAll(
        'div.cell_output .text_html div.highlight pre')]
        .map(p => getComputedStyle(p).fontFamily)""")
    assert fonts, "chapter 04 shows no minirt.book.show listing"
    assert all("mono" in f.lower() for f in fonts), set(fonts)
    boxes = tab.page.evaluate("""() => [...document.querySelectorAll('div.cell_output')]
        .filter(b => b.scrollWidth > b.clientWidth + 1).map(b => getComputedStyle(b).overflowX)""")
    assert boxes and all(o in ("auto", "scroll") for o in boxes), boxes
    assert tab.page.evaluate(_SIDEWAYS) <= 0
    _widest_table_shot(tab, site_url, shots / "site_09_table.png")


def _widest_table_shot(tab, site_url: str, path: Path) -> None:
    """Chapter 09's widest table (the map to SGLang and vLLM), scrolled in its own box."""
    _open(tab, f"{site_url}chapters/09_beyond.html")
    index = tab.page.evaluate("""() => { const t = [...document.querySelectorAll(
        'article table')]; let best = 0; t.forEach((e, i) => { if (e.scrollWidth >
        t[best].scrollWidth) best = i; }); return t.length ? best : -1; }""")
    assert index >= 0, "chapter 09 shows no table"
    tab.page.locator("article table").nth(index).scroll_into_view_if_needed()
    assert tab.page.evaluate(_SIDEWAYS) <= 0, "chapter 09 scrolls sideways"
    tab.page.screenshot(path=str(path))


def test_page_tools_copy_download_and_contents(tab, site_url):
    _open(tab, f"{site_url}chapters/02_radix_tree.html")
    assert tab.page.locator("button.copybtn").count() >= 5
    download = tab.page.locator("a[href$='_sources/chapters/02_radix_tree.ipynb']")
    assert download.count() == 1
    href = download.first.get_attribute("href")
    notebook = tab.page.request.get(urljoin(tab.page.url, href))
    assert notebook.status == 200 and nbformat.reads(notebook.text(), as_version=4).cells
    assert tab.page.locator("nav.bd-toc-nav a, .bd-sidebar-secondary nav a").count() >= 3
    assert "NBVAL_" not in tab.page.locator("article").inner_text()


def test_dark_mode_toggles_and_pictures_stay_readable(tab, site_url, shots):
    _open(tab, f"{site_url}chapters/02_radix_tree.html")
    assert tab.page.evaluate("() => document.documentElement.dataset.theme") == "light"
    tab.page.locator("button.theme-switch-button:visible").first.click()  # a menu opens
    tab.page.locator("button.theme-change-button[data-mode='dark']:visible").first.click()
    assert tab.page.evaluate("() => document.documentElement.dataset.theme") == "dark"
    look = tab.page.evaluate("""() => ({body: getComputedStyle(document.body).backgroundColor,
        figures: [...document.querySelectorAll('div.cell_output > img')].map(
          i => getComputedStyle(i).backgroundColor)})""")

    def light(rgb: str) -> bool:
        r, g, b = (float(x) for x in rgb[rgb.index("(") + 1:].rstrip(")").split(",")[:3])
        return 0.2126 * r + 0.7152 * g + 0.0722 * b > 200

    assert not light(look["body"]), look["body"]
    assert look["figures"] and all(light(c) for c in look["figures"]), look["figures"]
    tab.page.locator("div.cell_output > img").nth(1).scroll_into_view_if_needed()
    tab.page.screenshot(path=str(shots / "site_dark_02.png"))
    tab.page.evaluate("() => localStorage.clear()")


def test_phone_no_page_scrolls_sideways_and_the_drawers_open(phone, site_url, shots):
    wide = []
    for rel in PAGES:
        _open(phone, site_url + rel)
        over = phone.page.evaluate(_SIDEWAYS)
        if over > 0:
            wide.append(f"{rel}: {over} px wider than the screen")
        if rel.startswith("chapters/"):
            phone.page.screenshot(path=str(shots / f"phone_{Path(rel).stem}.png"))
    assert not wide, "\n".join(wide)
    _widest_table_shot(phone, site_url, shots / "phone_09_table.png")
    _open(phone, f"{site_url}chapters/04_lifecycle.html")
    phone.page.locator("div.cell_output .widget-vbox").first.scroll_into_view_if_needed()
    phone.page.screenshot(path=str(shots / "phone_widget_04_lifecycle.png"))
    for kind, dialog, links in [("primary", "#pst-primary-sidebar-modal", "a[href$='.html']"),
                                ("secondary", "#pst-secondary-sidebar-modal", "a[href^='#']")]:
        phone.page.locator(f"button.{kind}-toggle:visible").first.click()
        drawer = phone.page.locator(f"{dialog}[open]")
        drawer.wait_for()
        links = drawer.locator(links)
        assert links.count() >= 3 and links.first.is_visible(), f"{kind} drawer is empty"
        phone.page.screenshot(path=str(shots / f"phone_drawer_{kind}.png"))
        phone.page.keyboard.press("Escape")
        phone.page.locator(f"{dialog}[open]").wait_for(state="detached")
    assert not phone.errors, phone.errors
    assert not phone.offsite, phone.offsite


def test_pages_list_is_complete():
    assert len(PAGES) >= 3 * len(CHAPTERS) + 1
    assert all(Path(SITE / p).stat().st_size > 0 for p in PAGES)
