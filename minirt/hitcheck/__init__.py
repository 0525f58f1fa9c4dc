"""hitcheck: why is my prefix-cache hit rate low? A tool to run on your own request log.

    python -m minirt.hitcheck requests.jsonl [--tokenizer NAME] [--page-size N]
        [--capacity N] [--policy lru] [--policy-config JSON] [--json] [--plot FILE]
        [--base-url URL]

It renders each logged request through the tokenizer's chat template, builds the radix
tree of the prompts (no model, no K/V), and reports the hit rate a cache could reach
(at unlimited capacity, at a page size, at a capacity), and for each request the earlier
request it shares most with, where they part, and why (``CAUSES``). Chapter 12 builds
each cause and measures it on live servers.

Layout: ``load`` reads the log, ``render`` turns requests into token ids, ``causes``
names the causes, ``analyze`` builds the trees and the report, ``live`` replays the log
against a server, ``report`` prints and plots, ``__main__`` is the command line.
"""

from __future__ import annotations

from .analyze import Divergence, Report, RequestReport, analyze, hit_rate_curve
from .causes import (
    BLOCK,
    CAPACITY,
    CAUSES,
    COLD,
    CONTENT,
    DIVERGENCE_CAUSES,
    EXTENDS,
    HIT,
    ISOLATION,
    LOSS_CAUSES,
    REORDERED,
    RETOKENIZATION,
    TEMPLATE,
    VOLATILE,
)
from .live import LiveRecord, prompt_bounds, replay_live
from .load import HitcheckInputError, IsolationKey, LoggedRequest, Reply, load_requests, parse_line
from .render import Rendered, load_tokenizer, render, render_all
from .report import format_live, format_table, plot_curve

__all__ = [
    "BLOCK", "CAPACITY", "CAUSES", "COLD", "CONTENT", "DIVERGENCE_CAUSES", "EXTENDS", "HIT",
    "ISOLATION", "LOSS_CAUSES", "REORDERED", "RETOKENIZATION", "TEMPLATE", "VOLATILE",
    "Divergence", "HitcheckInputError", "IsolationKey", "LiveRecord", "LoggedRequest",
    "Rendered", "Reply", "Report", "RequestReport", "analyze", "format_live", "format_table",
    "hit_rate_curve", "load_requests", "load_tokenizer", "main", "parse_line", "plot_curve",
    "prompt_bounds", "render", "render_all", "replay_live",
]


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m minirt.hitcheck``); returns the exit status."""
    from .cli import main as _main

    return _main(argv)
