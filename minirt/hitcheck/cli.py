"""The command line: ``python -m minirt.hitcheck FILE [options]``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..errors import MinirtError
from ..eviction import POLICIES
from .analyze import analyze, hit_rate_curve
from .live import replay_live
from .load import load_requests
from .render import load_tokenizer, render_all
from .report import format_table, plot_curve

__all__ = ["curve_capacities", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minirt.hitcheck",
        description="Why is my prefix-cache hit rate low? Reads a JSONL log of OpenAI chat "
                    "or completions requests (in arrival order; optional per line: "
                    "'conversation' and 'reply'), renders and tokenizes them, and reports "
                    "the hit rate a cache could reach and why each request stops sharing.",
        epilog="With --base-url the server must report usage.prompt_tokens_details."
               "cached_tokens: start vLLM with --enable-prompt-tokens-details (vllm 0.32.0 "
               "`entrypoints/launchers/cli_args.py: "
               "BaseFrontendArgs.enable_prompt_tokens_details`) and SGLang with "
               "--enable-cache-report (sglang 0.5.23 `srt/arg_groups/fields/serving.py: "
               "Serving.enable_cache_report`); minirt.serve always reports it. Set "
               "--page-size to the server's page or block size. Exit status 2: the log, the "
               "tokenizer or an option could not be used (the message names the line and "
               "the field).")
    p.add_argument("file", help="the JSONL request log")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer id or local folder (default: the book's "
                        "SmolLM2-135M-Instruct, from minirt's model cache)")
    p.add_argument("--page-size", type=int, default=1,
                   help="the server's page or block size in tokens (default 1)")
    p.add_argument("--capacity", type=int, default=None,
                   help="replay through a cache of this many tokens and report its hit rate")
    p.add_argument("--policy", default="lru", choices=sorted(POLICIES),
                   help="eviction policy of the capacity replay (default lru; SGLang's "
                        "--radix-eviction-policy names)")
    p.add_argument("--policy-config", type=_json_object, default=None, metavar="JSON",
                   help="the policy's settings as SGLang's --radix-eviction-policy-config "
                        "takes them, e.g. '{\"threshold\": 4096, \"next_prompt_estimate\": "
                        "512}' for tlru (which has no defaults)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="save a plot of the hit rate against capacity (matplotlib)")
    p.add_argument("--base-url", default=None,
                   help="replay the log against this OpenAI-compatible server (…/v1) and "
                        "print what it cached beside what was possible")
    p.add_argument("--model", default=None,
                   help="with --base-url: model name for requests that name none (default: "
                        "the server's first)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="with --base-url: the most tokens each request may generate (default 1)")
    p.add_argument("--limit", type=int, default=50,
                   help="requests shown in the table (0: all; default 50)")
    return p


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of settings, got {text!r:.80}")
    return value


def curve_capacities(tree_tokens: int, points: int = 8) -> list[int]:
    """Capacities from 1/2^(points-1) of the tree's tokens up to all of them, doubling."""
    top = max(tree_tokens, 1)
    caps = sorted({max(1, top >> k) for k in range(points)})
    return caps


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        requests = load_requests(args.file)
        tokenizer = load_tokenizer(args.tokenizer)
        keep = args.plot is not None or args.base_url is not None
        rendered = render_all(requests, tokenizer) if keep else None
        report = analyze(requests, tokenizer, page_size=args.page_size,
                         capacity=args.capacity, policy=args.policy,
                         policy_config=args.policy_config, rendered=rendered)
        if args.plot is not None:
            caps = curve_capacities(report.tree_tokens)
            if args.capacity is not None and args.capacity not in caps:
                caps = sorted([*caps, args.capacity])
            report.curve = hit_rate_curve(requests, rendered, caps,
                                          page_size=args.page_size, policy=args.policy,
                                          policy_config=args.policy_config)
            plot_curve(report, args.plot)
        if args.base_url is not None:
            report.live = replay_live(requests, rendered, args.base_url,
                                      page_size=args.page_size, model=args.model,
                                      max_tokens=args.max_tokens)
    except MinirtError as exc:
        print(f"hitcheck: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(format_table(report, limit=None if args.limit == 0 else args.limit))
    return 0
