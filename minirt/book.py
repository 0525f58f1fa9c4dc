"""Helpers the notebooks use: a reproducible set-up cell, code listings, and the chapter map.

``CHAPTER_MODULES`` is the one place that says which chapter introduces which
``minirt`` module; a test checks that every notebook imports only modules introduced
by its own chapter or an earlier one, so the book can be read in order.
"""

from __future__ import annotations

import html
import inspect
import os
import platform
import random
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

__all__ = ["CHAPTER_MODULES", "Listing", "introduced_in", "progress", "setup", "show"]

_T = TypeVar("_T")

# Chapter number -> the minirt modules it introduces (later chapters may extend a module).
CHAPTER_MODULES: dict[int, tuple[str, ...]] = {
    0: ("model", "book", "errors", "checks"),
    1: ("kv",),
    2: ("radix", "viz", "workloads"),
    3: ("cache", "token_ids", "widgets"),
    4: ("pool", "forward", "lifecycle"),  # forward: over 06's llama, attention, working_set
    5: ("eviction", "simulate"),
    6: ("request", "engine", "chat", "llama", "attention", "working_set", "serve", "engine_worker",
        "replay", "kernels"),  # serve, engine_worker, replay: 06a; kernels: appendix 06b
    7: ("scheduler",),
    8: ("hashcache", "sidechannel"),
    # 09a: server_map; 09b (real traffic): traces, traffic; 09c (KV events): the last three
    9: ("tiers", "router", "replicas", "server_map", "traces", "traffic",
        "kv_events", "kv_event_caches", "precise_router"),
    11: ("hybrid", "window_lifecycle", "state"),
    12: ("hitcheck",),
    13: ("speculative", "draft_proposer", "eagle_blocks"),  # speculation; EAGLE block keys
}


def introduced_in(module: str) -> int:
    """The chapter that introduces ``minirt.<module>``; KeyError if no chapter does."""
    for chapter, modules in CHAPTER_MODULES.items():
        if module in modules:
            return chapter
    raise KeyError(f"minirt.{module} is not introduced by any chapter (see CHAPTER_MODULES)")


def setup(seed: int = 0, quiet: bool = False) -> torch.device:
    """Make a notebook reproducible and say what it runs on; returns the device.

    Seeds Python, NumPy and torch, asks torch for deterministic algorithms where
    they exist, silences warnings that are noise for a reader, and prints versions.
    """
    from .model import default_device

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        tf_version = "missing"
    device = default_device()
    if not quiet:
        print(f"python {platform.python_version()} | torch {torch.__version__} | "
              f"transformers {tf_version} | device {device} | threads {torch.get_num_threads()}")
    return device


def _package_root() -> Path:
    return Path(__file__).resolve().parent.parent


class Listing:
    """Source code with a title; plain text in a terminal, highlighted HTML in Jupyter."""

    def __init__(self, title: str, source: str, first_line: int) -> None:
        self.title = title
        self.source = source
        self.first_line = first_line

    def __repr__(self) -> str:
        lines = self.source.rstrip("\n").split("\n")
        width = len(str(self.first_line + len(lines) - 1))
        body = "\n".join(f"{self.first_line + i:>{width}}  {line}" for i, line in enumerate(lines))
        return f"# {self.title}\n{body}"

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:  # pragma: no cover - pygments ships with IPython
            return f"<pre>{html.escape(repr(self))}</pre>"
        formatter = HtmlFormatter(linenos="inline", linenostart=self.first_line, noclasses=True)
        code = highlight(self.source, PythonLexer(), formatter)
        return f"<div><b><code>{html.escape(self.title)}</code></b>{code}</div>"


def show(obj) -> Listing:
    """The source of a minirt function, class or method, titled with its file and lines.

    Paths are relative to the repository (``minirt/cache.py:40-88``), so stored
    notebook outputs do not depend on where the book was cloned.
    """
    target = inspect.unwrap(obj)
    if isinstance(target, property):
        target = target.fget
    try:
        lines, first = inspect.getsourcelines(target)
        path = Path(inspect.getsourcefile(target) or "?").resolve()
    except (TypeError, OSError) as exc:
        msg = f"show() needs a function, class or method with source, got {obj!r}"
        raise TypeError(msg) from exc
    try:
        rel = path.relative_to(_package_root()).as_posix()
    except ValueError:
        rel = path.name
    name = getattr(target, "__qualname__", getattr(target, "__name__", "?"))
    title = f"{rel}:{first}-{first + len(lines) - 1}  ({name})"
    return Listing(title, "".join(lines), first)


if __name__ == "__main__":  # pragma: no cover
    setup()
    print(sys.version)


def progress(iterable: Iterable[_T], desc: str, total: int | None = None) -> Iterator[_T]:
    """Iterate with a live progress bar that leaves one clean line behind, not a frozen bar.

    A notebook stores the last thing a cell displayed, so a tqdm widget reads "0%" wherever
    no kernel runs (GitHub, nbviewer, the HTML book). In a notebook the bar is shown through
    a display handle and replaced, when the loop ends, by the line "``desc``: n/n done";
    elsewhere it is tqdm's text bar, erased at the end. ``TQDM_DISABLE=1`` shows nothing.
    """
    from tqdm.auto import tqdm as auto_tqdm
    from tqdm.notebook import tqdm as notebook_tqdm

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not issubclass(auto_tqdm, notebook_tqdm):  # a terminal, or no ipywidgets
        yield from auto_tqdm(iterable, desc=desc, total=total, leave=False)
        return
    from IPython.display import display

    bar = notebook_tqdm(iterable, desc=desc, total=total, leave=False, display=False)
    if bar.disable:
        yield from bar
        return
    handle = display(bar.container, display_id=True)
    yield from bar
    bar.close()
    handle.update({"text/plain": f"{desc}: {bar.n}/{bar.n if total is None else total} done"},
                  raw=True)
