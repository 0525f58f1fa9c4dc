"""The book in live JupyterLab, driven by headless Chromium as a reader would use it.

A JupyterLab server runs on 127.0.0.1 at a free port with a token, on copies of the
chapters (running cells must not rewrite the committed notebooks), with fresh settings,
workspaces and runtime folders; it is stopped by its process id whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "site"))
from conf import figure_count  # noqa: E402

EXPLORER = ROOT / "chapters" / "03_match_and_insert.ipynb"
STEPPER = ROOT / "chapters" / "04_lifecycle.ipynb"
STATIC = ROOT / "chapters" / "02_radix_tree.ipynb"
JUPYTER = Path(sys.executable).parent / "jupyter"
LAB_CONFIG = ROOT / "tools" / "lab"  # what `make lab` sets as JUPYTER_CONFIG_DIR
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
RUN_TIMEOUT_S = 600  # a chapter runs in ~90 s alone; CI machines are shared
CLICK_TIMEOUT_S = 120  # a button's handler answers in well under a second when it works


def _cell_index(path: Path, needle: str) -> int:
    cells = json.loads(path.read_text())["cells"]
    return next(i for i, c in enumerate(cells) if needle in "".join(c["source"]))


@pytest.fixture(scope="module")
def lab(tmp_path_factory, port_finder):
    """(base url, token, folder of the notebook copies) of a running JupyterLab."""
    work = tmp_path_factory.mktemp("lab")
    book = work / "book" / "chapters"
    book.mkdir(parents=True)
    for path in (EXPLORER, STEPPER, STATIC):
        shutil.copy(path, book / path.name)
    # The control: chapter 02 with one changed word, so that trusting 02 does not cover it
    # (trust is kept per content signature, not per file name).
    control = nbformat.read(STATIC, as_version=4)
    control.cells[0].source += "\n\n(An untrusted copy.)"
    nbformat.write(control, book / "untrusted.ipynb")
    # `make lab`'s configuration folder (custom CSS on), copied so that nothing writes there.
    shutil.copytree(LAB_CONFIG, work / "config")
    settings = work / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No news or update check: that pop-up would cover the page.
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(work / "config"),
           "JUPYTER_DATA_DIR": str(work / "data"), "JUPYTER_RUNTIME_DIR": str(work / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(work / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(work / "workspaces"), "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # What `make lab` does first: trust the book's notebooks (not the control copy).
    subprocess.run([str(JUPYTER), "trust", *(str(book / p.name) for p in (EXPLORER, STEPPER,
                                                                          STATIC))],
                   env=env, check=True, capture_output=True)
    token, port = secrets.token_hex(16), port_finder()
    cmd = [str(JUPYTER), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work / 'book'}",
           "--LabApp.expose_app_in_browser=True"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "lab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}api/status?token={token}", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (work / "lab.log").read_text())
                time.sleep(1)
        yield base, token, book
    finally:
        # The server and its kernels share a process group: end them all, by its id.
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        except ProcessLookupError:
            pass
        log.close()


def _open_notebook(tab, lab, name: str):
    base, token, _ = lab
    page = tab.page
    page.goto(f"{base}lab/tree/chapters/{name}?token={token}", wait_until="load")
    page.wait_for_function(
        """(name) => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;
                       const k = w && w.sessionContext && w.sessionContext.session
                                 && w.sessionContext.session.kernel;
                       return w && w.context && w.context.path.endsWith(name)
                              && k && k.status === 'idle'; }""", arg=name)
    for text in ("No", "Dismiss"):  # the news pop-up, should a setting not hold
        button = page.locator(f".jp-toast-button:has-text('{text}')")
        if button.count():
            button.first.click()
    return page


def _run_through(page, last: int) -> None:
    """Run cells 0..last one by one, as Shift+Enter would, and fail on an error output."""
    errors = page.evaluate(
        """async (last) => {
             const panel = jupyterapp.shell.currentWidget;
             for (let i = 0; i <= last; i++) {
               panel.content.activeCellIndex = i;
               await jupyterapp.commands.execute('notebook:run-cell');
             }
             const found = [];
             const cells = panel.content.model.cells;
             for (let i = 0; i <= last; i++) {
               const cell = cells.get(i);
               if (cell.type !== 'code') continue;
               for (let j = 0; j < cell.outputs.length; j++) {
                 const o = cell.outputs.get(j).toJSON();
                 if (o.output_type === 'error') found.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
               }
             }
             return found;
           }""", last)
    assert not errors, "\n".join(errors)


def _cell(page, index: int):
    """Scroll the windowed notebook until cell ``index`` exists in the page; return it."""
    selector = f"{PANEL} .jp-Cell[data-windowed-list-index='{index}']"
    for _ in range(400):
        if page.locator(selector).count():
            cell = page.locator(selector).first
            cell.scroll_into_view_if_needed()
            return cell
        page.evaluate(f"""() => {{ const p = document.querySelector(
            "{PANEL} .jp-WindowedPanel-outer"); p.scrollTop += p.clientHeight * 0.7; }}""")
        page.wait_for_timeout(200)
    raise AssertionError(f"cell {index} never appeared while scrolling the notebook")


def _settled(locator, quiet_ms: int = 1500, timeout_s: float = 120) -> str:
    """The element's HTML once it stopped changing for ``quiet_ms``."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = locator.inner_html()
        if now != last:
            last, since = now, time.monotonic()
        elif (time.monotonic() - since) * 1000 >= quiet_ms:
            return now
        time.sleep(0.25)
    raise AssertionError("the widget kept changing")


def _svg_text(box) -> str:
    return box.locator(".widget-html svg").last.evaluate("s => s.textContent")


def test_explorer_inserts_a_typed_prompt(tab, lab, shots):
    page = _open_notebook(tab, lab, EXPLORER.name)
    index = _cell_index(EXPLORER, "explorer_widget(")
    page.set_default_timeout(RUN_TIMEOUT_S * 1000)
    _run_through(page, index)
    box = _cell(page, index).locator(".widget-vbox").first
    box.locator(".widget-html svg").last.wait_for()
    _settled(box)
    before = box.locator(".widget-html svg").last.evaluate("s => s.outerHTML")
    prompt = "Zebras queue politely for prefix caches."
    assert "Zebras" not in _svg_text(box)
    box.locator("input[type='text']").first.fill(prompt)
    box.locator("input[type='text']").first.press("Tab")
    box.locator("button:has-text('Insert')").click()
    page.wait_for_function("(b) => b.querySelector('.widget-html svg:last-of-type') && "
                           "b.textContent.includes('insert')", arg=box.element_handle(),
                           timeout=CLICK_TIMEOUT_S * 1000)
    _settled(box)
    after = box.locator(".widget-html svg").last.evaluate("s => s.outerHTML")
    box.screenshot(path=str(shots / "lab_explorer_insert.png"))
    assert after != before, "the drawn tree did not change after Insert"
    assert "Zebras" in _svg_text(box), "the new node is not in the drawing"
    assert not [e for e in tab.errors if "favicon" not in e], tab.errors


def _steps(path: Path, before: int) -> list[str]:
    """The frames the chapter records, in order (the record("...") calls above ``before``)."""
    cells = nbformat.read(path, as_version=4).cells[:before]
    return [m for c in cells if c.cell_type == "code"
            for m in re.findall(r'record\(\s*"([^"]+)"', c.source)]


def test_stepper_next_and_back(tab, lab, shots):
    page = _open_notebook(tab, lab, STEPPER.name)
    index = _cell_index(STEPPER, "lifecycle_stepper(frames)")
    steps = _steps(STEPPER, index)
    assert len(steps) >= 4 and "match" in steps, steps
    page.set_default_timeout(RUN_TIMEOUT_S * 1000)
    _run_through(page, index)
    box = _cell(page, index).locator(".widget-vbox").first
    box.locator("button:has-text('Next')").wait_for()
    _settled(box)
    title = box.locator(".widget-html").first

    def red() -> int:  # highlighted shapes in the drawing (the legend's swatch is one)
        return box.locator(".widget-html svg [stroke='#d62728']").count()

    start_red = red()
    shown = []
    for press in ["Next"] * 3 + ["Back"]:
        box.locator(f"button:has-text('{press}')").click()
        _settled(box)
        shown.append((title.inner_text(), red()))
        if len(shown) == steps.index("match"):
            box.screenshot(path=str(shots / "lab_stepper_match.png"))
    box.screenshot(path=str(shots / "lab_stepper_next3_back1.png"))
    label, _ = shown[-1]
    assert label.startswith(f"3/{len(steps)}: {steps[2]}"), (label, steps[:4])
    assert steps[2] in _svg_text(box), "the drawing is not the third frame's"
    match_label, match_red = shown[steps.index("match") - 1]
    assert "match" in match_label
    assert match_red > start_red, "the match frame highlights no matched path"
    assert not [e for e in tab.errors if "favicon" not in e], tab.errors


def _pictures_while_scrolling(page, passes: int = 2) -> dict[int, int]:
    """Scroll the whole windowed notebook; {cell index: most pictures seen in its outputs}.

    Cells and their outputs render a moment after they scroll in: each step waits until
    the count holds still, and the notebook is scrolled through twice.
    """
    count = f"""() => [...document.querySelectorAll("{PANEL} .jp-Cell")].map(
        c => [Number(c.dataset.windowedListIndex), c.querySelectorAll(
          '.jp-OutputArea-output.jp-RenderedSVG img, .jp-OutputArea-output.jp-RenderedSVG svg,'
          + ' .jp-OutputArea-output.jp-RenderedImage img').length])"""
    seen: dict[int, int] = {}
    for _ in range(passes):
        page.evaluate(f"""() => {{ document.querySelector(
            "{PANEL} .jp-WindowedPanel-outer").scrollTop = 0; }}""")
        for _ in range(400):
            found, previous = None, page.evaluate(count)
            for _ in range(20):  # until two looks 400 ms apart agree
                page.wait_for_timeout(400)
                found = page.evaluate(count)
                if found == previous:
                    break
                previous = found
            for i, n in found:
                seen[i] = max(n, seen.get(i, 0))
            at_end = page.evaluate(f"""() => {{ const p = document.querySelector(
                "{PANEL} .jp-WindowedPanel-outer"); const end = p.scrollTop + p.clientHeight
                >= p.scrollHeight - 2; p.scrollTop += p.clientHeight * 0.6; return end; }}""")
            if at_end:
                break
    return seen


def test_static_view_shows_stored_pictures_once_trusted(tab, lab, shots):
    """`make lab` trusts the notebooks: stored SVG trees and plots show before any run."""
    stored = figure_count(nbformat.read(STATIC, as_version=4))
    assert stored, "chapter 02 stores no figure"
    page = _open_notebook(tab, lab, STATIC.name)
    page.locator(f"{PANEL} .jp-RenderedSVG, {PANEL} .jp-RenderedImage").first.wait_for()
    page.screenshot(path=str(shots / "lab_static_trusted.png"))
    trusted = sum(_pictures_while_scrolling(page).values())
    assert trusted == stored, f"trusted: {trusted} pictures shown, {stored} stored"
    # The control: the same notebook, untrusted, hides its SVG (why `make lab` trusts).
    page = _open_notebook(tab, lab, "untrusted.ipynb")
    page.wait_for_timeout(2000)
    page.screenshot(path=str(shots / "lab_static_untrusted.png"))
    untrusted = sum(_pictures_while_scrolling(page).values())
    assert untrusted < stored, f"untrusted copy shows all {stored} pictures: control is void"


@pytest.mark.parametrize(("source", "needle"), [(STEPPER, "lifecycle_stepper(frames)"),
                                                 (EXPLORER, "explorer_widget(")],
                         ids=["stepper", "explorer"])
def test_unrun_widget_shows_its_stored_picture_and_a_note(tab, lab, shots, source, needle):
    """Before its cell runs, a widget is drawn from the notebook's saved widget state: the
    stored tree shows, with one line saying so, and no dead control or broken-link icon."""
    _, _, book = lab
    copy = book / f"unrun_{source.name}"  # a copy no kernel has touched
    shutil.copy(source, copy)
    page = _open_notebook(tab, lab, copy.name)
    box = _cell(page, _cell_index(source, needle)).locator(".widget-vbox").first
    box.locator(".widget-html svg").last.wait_for()
    box.scroll_into_view_if_needed()
    box.screenshot(path=str(shots / f"lab_unrun_{source.stem}.png"))
    seen = box.evaluate("""b => {
        const before = e => getComputedStyle(e, '::before').content;
        const views = [b, ...b.querySelectorAll('.jupyter-widgets-disconnected')];
        return {disconnected: b.classList.contains('jupyter-widgets-disconnected'),
                note: before(b),
                icons: views.slice(1).filter(e => before(e) !== 'none').length,
                controls: [...b.querySelectorAll('button, input')].filter(
                  e => e.getClientRects().length > 0).length,
                pictures: [...b.querySelectorAll('.widget-html svg')].filter(
                  e => e.getClientRects().length > 0).length}; }""")
    assert seen["disconnected"], "the unrun widget is live: the check has nothing to look at"
    assert "Run this cell" in seen["note"], seen
    assert seen["icons"] == 0 and seen["controls"] == 0, seen
    assert seen["pictures"] >= 1, seen
    assert not [e for e in tab.errors if "favicon" not in e], tab.errors


def test_open_and_save_changes_nothing(tab, lab):
    """Open an unchanged notebook in JupyterLab, save it, diff it with nbformat: the same
    notebook, byte for byte (the stored kernelspec is exactly what ipykernel writes)."""
    _, _, book = lab
    problems = []
    for source in (STATIC, STEPPER):
        copy = book / f"saved_{source.name}"
        shutil.copy(source, copy)
        before, mtime = copy.read_bytes(), copy.stat().st_mtime_ns
        page = _open_notebook(tab, lab, copy.name)
        page.wait_for_timeout(2000)  # let the kernel's info reach the notebook's metadata
        if page.evaluate("() => jupyterapp.shell.currentWidget.context.model.dirty"):
            problems.append(f"{source.name}: marked changed on open")
        page.evaluate("() => jupyterapp.commands.execute('docmanager:save')")
        deadline = time.monotonic() + 60
        while copy.stat().st_mtime_ns == mtime and time.monotonic() < deadline:
            time.sleep(0.5)
        assert copy.stat().st_mtime_ns != mtime, f"{source.name}: JupyterLab did not save"
        old, new = (nbformat.reads(b.decode(), as_version=4) for b in (before, copy.read_bytes()))
        if new.metadata != old.metadata:
            problems.append(f"{source.name}: metadata {dict(old.metadata)} -> "
                            f"{dict(new.metadata)}"[:600])
        if new.cells != old.cells:
            problems.append(f"{source.name}: cells changed on save")
        if copy.read_bytes() != before:
            problems.append(f"{source.name}: bytes differ after save")
    assert not problems, "\n".join(problems)
