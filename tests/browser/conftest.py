"""Real headless Chromium (the system's, driven by Playwright) for the browser tests.

These tests run only with ``pytest --browser tests/browser`` (``make test-browser``):
they need ``make html``, Debian's ``chromium`` and a machine with a few minutes to spare.
Each check keeps a screenshot in ``_build/screenshots/``.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("MINIRT_SITE", ROOT / "_build" / "html"))  # another build
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = os.environ.get("MINIRT_CHROMIUM", "/usr/bin/chromium")
# Without the networking flags Chromium keeps calling Google's hosts, which a closed
# machine refuses; a fresh profile keeps every run the same.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
# The machines that run CI are small and busy: waits are generous.
TIMEOUT_MS = 120_000
DESKTOP = {"width": 1400, "height": 900}
PHONE = {"width": 390, "height": 844}
LOCAL_SCHEMES = ("data", "blob", "about", "chrome", "chrome-extension")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def port_finder():
    """``free_port`` for tests in other modules (conftest is not importable)."""
    return free_port


@pytest.fixture(scope="session")
def shots() -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS


@pytest.fixture(scope="session")
def browser_context(tmp_path_factory):
    """A persistent Chromium context on a fresh, throw-away profile."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: apt-get install chromium (or set MINIRT_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport=DESKTOP)
        context.set_default_timeout(TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()
    shutil.rmtree(profile, ignore_errors=True)


class Page:
    """A browser tab that records console errors, failed requests and requests that leave
    127.0.0.1 (``offsite``)."""

    def __init__(self, context) -> None:
        self.page = context.new_page()
        self.errors: list[str] = []
        self.offsite: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("requestfailed",
                     lambda r: self.errors.append(f"request failed: {r.url} {r.failure}"))
        self.page.on("response", lambda r: r.status >= 400 and self.errors.append(
            f"HTTP {r.status}: {r.url}"))
        self.page.on("request", self._request)

    def _request(self, request) -> None:
        url = urlsplit(request.url)
        if url.scheme not in LOCAL_SCHEMES and url.hostname != "127.0.0.1":
            self.offsite.append(request.url)

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def tab(browser_context):
    page = Page(browser_context)
    yield page
    page.close()


@pytest.fixture
def phone(browser_context):
    """A tab at a phone's 390x844."""
    page = Page(browser_context)
    page.page.set_viewport_size(PHONE)
    yield page
    page.close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest's output readable
        pass


@pytest.fixture(scope="session")
def site_url():
    """``_build/html`` served on 127.0.0.1 at a free port, for the length of the session."""
    if not (SITE / "index.html").exists():
        pytest.fail("no site in _build/html: run `make html` first")
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
