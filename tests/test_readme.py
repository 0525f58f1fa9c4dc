"""README.md is the front door: a newcomer reads it in five minutes (at most 300 lines,
issue 55), and every link in it lands somewhere: on a file or folder of the repository,
and, where it names a page (``.md``, ``.ipynb``), on a page of the website too, since the
README is the site's home page (``site/conf.py``'s ``include_patterns``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from fnmatch import fnmatch
from pathlib import Path

from script_loader import forget_script, load_script

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target); the text may span lines
PAGE_SUFFIXES = (".md", ".ipynb")


def local_links(text: str) -> list[str]:
    """The link targets of Markdown ``text`` that name a place in the repository (no
    scheme, no bare anchor), each without its ``#anchor``."""
    return [t.split("#", 1)[0] for t in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def dead_links(text: str, exists: Callable[[str], bool], pages: Iterable[str]) -> list[str]:
    """Each local link of ``text`` that names no existing path, or names a page (``.md``,
    ``.ipynb``) that matches none of the site's ``pages`` patterns, with why."""
    patterns = list(pages)
    dead = []
    for target in local_links(text):
        if not exists(target):
            dead.append(f"{target}: no such file or folder")
        elif target.endswith(PAGE_SUFFIXES) and not any(fnmatch(target, p) for p in patterns):
            dead.append(f"{target}: not a page of the site (site/conf.py include_patterns)")
    return dead


def site_pages() -> list[str]:
    """``include_patterns`` of the site's Sphinx configuration, read from site/conf.py."""
    conf = load_script("site/conf.py", "_site_conf_for_readme")
    forget_script("_site_conf_for_readme")
    return conf.include_patterns


def test_the_readme_is_at_most_300_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"README.md has {lines} lines, at most {MAX_LINES}: say it "
                                "shorter, or move the detail to a chapter or benchmarks/README.md")


def test_every_link_of_the_readme_lands_on_a_file_and_a_page():
    text = README.read_text(encoding="utf-8")
    assert len(local_links(text)) >= 10  # the chapter table alone links 16 notebooks
    assert dead_links(text, lambda t: (ROOT / t).exists(), site_pages()) == []


def test_dead_links_finds_a_missing_file_and_a_file_the_site_leaves_out():
    text = ("See [the book](chapters/00_a.ipynb), [notes](notes/NOTES.md), [gone](gone.md#x), "
            "[the folder](solutions/), [a site](https://example.org/x.md), [here](#top).")
    have = {"chapters/00_a.ipynb", "notes/NOTES.md", "solutions/"}
    dead = dead_links(text, have.__contains__, ["chapters/*.ipynb", "README.md"])
    assert dead == ["notes/NOTES.md: not a page of the site (site/conf.py include_patterns)",
                    "gone.md: no such file or folder"]
