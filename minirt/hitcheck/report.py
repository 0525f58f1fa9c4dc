"""hitcheck's output: a table a person reads, and a plot of the hit rate against capacity.

(``Report.to_json`` is the machine-readable form.)
"""

from __future__ import annotations

import os

from .analyze import Report
from .causes import CAUSES, DIVERGENCE_CAUSES

__all__ = ["format_live", "format_table", "plot_curve"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def format_table(report: Report, *, limit: int | None = 50) -> str:
    """The summary, the cause counts and one row per request (the first ``limit``; None:
    all)."""
    lines = [
        f"hitcheck: {len(report.requests)} requests, {report.prompt_tokens} prompt tokens, "
        f"tokenizer {report.tokenizer}",
        f"  bound at unlimited capacity, page 1 (unique-token bound): "
        f"{_pct(report.bound_rate)} ({report.bound_tokens} tokens hit, "
        f"{report.unique_tokens} computed)",
        f"  bound at page size {report.page_size}: {_pct(report.paged_rate)} "
        f"({report.paged_tokens} tokens)",
    ]
    if report.capacity is not None:
        lines.append(f"  replayed at capacity {report.capacity} tokens, page size "
                     f"{report.page_size}, {report.policy}: {_pct(report.hit_rate)} "
                     f"({report.hit_tokens} tokens)")
    lines += ["", "causes (requests; tokens lost where measured):"]
    for cause in CAUSES:
        n = report.cause_counts.get(cause, 0)
        tokens = report.cause_tokens.get(cause)
        extra = f"  {tokens} tokens" if tokens is not None and cause not in DIVERGENCE_CAUSES \
            else ""
        lines.append(f"  {cause:<15} {n:>7}{extra}")
    rows = report.requests if limit is None else report.requests[:limit]
    lines += ["", f"{'line':>6} {'prompt':>7} {'shared':>7} {'bound':>7} {'paged':>7} "
              f"{'hit':>7} {'partner':>7}  {'cause':<22} where they part"]
    for r in rows:
        d = r.divergence
        hit = "-" if r.hit is None else str(r.hit)
        partner = "-" if d.partner_line is None else str(d.partner_line)
        cause = "+".join(r.causes)
        where = ""
        if d.partner is not None and d.cause not in ("hit", "extends"):
            where = (f"@{d.position} …{d.before[-20:]!r} | ours "
                     f"{_clip(d.ours, 24)!r} theirs {_clip(d.theirs, 24)!r}")
        lines.append(f"{r.line:>6} {r.prompt_tokens:>7} {r.shared:>7} {r.bound:>7} "
                     f"{r.paged:>7} {hit:>7} {partner:>7}  {cause:<22} {where}")
        if d.detail and (d.cause != "hit" or len(r.causes) > 1):
            lines.append(f"{'':>6} {d.detail}")
    if limit is not None and len(report.requests) > limit:
        lines.append(f"... {len(report.requests) - limit} more (--limit 0 shows all, --json "
                     "gives every request)")
    if report.live is not None:
        lines += ["", format_live(report)]
    return "\n".join(lines)


def format_live(report: Report) -> str:
    """What the live server cached beside what was possible, request by request."""
    lines = ["live server: cached tokens beside what was possible (prompts only, page size "
             f"{report.page_size})",
             f"{'line':>6} {'prompt':>7} {'server':>7} {'cached':>7} {'possible':>8}  note"]
    cached_total = possible_total = 0
    for rec in report.live or []:
        cached = "-" if rec.cached_tokens is None else str(rec.cached_tokens)
        served = "-" if rec.prompt_tokens is None else str(rec.prompt_tokens)
        note = rec.error or ""
        if rec.error is None and rec.prompt_tokens is not None \
                and rec.prompt_tokens != rec.expected_prompt_tokens:
            note = "the server counts another prompt length (another template or tokenizer?)"
        if rec.cached_tokens is None and rec.error is None:
            note = "no cached_tokens in the response"
        elif rec.cached_tokens is not None and rec.cached_tokens > rec.possible:
            note = ("cached more than possible: the server shares across isolation keys, "
                    "or cached its own reply")
        cached_total += rec.cached_tokens or 0
        possible_total += rec.possible
        lines.append(f"{rec.line:>6} {rec.expected_prompt_tokens:>7} {served:>7} {cached:>7} "
                     f"{rec.possible:>8}  {note}")
    lines.append(f"{'total':>6} {'':>7} {'':>7} {cached_total:>7} {possible_total:>8}")
    return "\n".join(lines)


def plot_curve(report: Report, path: str | os.PathLike) -> None:
    """Save the hit rate against cache capacity (``report.curve``), with the bounds drawn
    as lines, to ``path`` (any format matplotlib writes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if report.curve:
        xs, ys = zip(*report.curve, strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o",
                label=f"replayed ({report.policy}, page {report.page_size})")
    ax.axhline(100 * report.bound_rate, color="gray", linestyle="--",
               label="unlimited capacity, page 1")
    if report.page_size > 1:
        ax.axhline(100 * report.paged_rate, color="gray", linestyle=":",
                   label=f"unlimited capacity, page {report.page_size}")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right")
    ax.set_title(f"hit rate against capacity: {len(report.requests)} requests")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
