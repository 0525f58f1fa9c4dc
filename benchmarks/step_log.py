"""Where a server's engine time went, from ``minirt.serve --step-log``'s JSON lines.

    python -m minirt.serve --step-log steps.jsonl ...   # then load it, then stop it
    python benchmarks/step_log.py steps.jsonl [--gap 1.0] [--steps]

The log splits into bursts wherever the engine sat idle for more than ``--gap`` seconds
(one benchmark run after another, say). For each burst: steps that prefilled prompt
tokens (their admission, then their one forward pass, which prefilled the admitted
requests, or a chunk of one, and decoded the running ones), steps that only decoded, and
the time between steps (the engine idle, waiting for requests), with each one's share of
the burst's span. ``--steps`` also lists every prefilling step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read(path: str | Path) -> list[dict]:
    """The log's steps, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def end(step: dict) -> float:
    """When ``step`` ended, in the log's seconds."""
    return step["start"] + step["step_s"]


def prefills(step: dict) -> bool:
    """Did ``step`` prefill prompt tokens? (Logs written before ``prefill_tokens`` was
    logged: did it admit a request?)"""
    return bool(step.get("prefill_tokens", step["admitted"]))


def bursts(steps: list[dict], gap: float) -> list[list[dict]]:
    """``steps`` cut wherever the engine was idle for more than ``gap`` seconds."""
    out: list[list[dict]] = []
    for s in steps:
        if not out or s["start"] - end(out[-1][-1]) > gap:
            out.append([])
        out[-1].append(s)
    return out


def summary(steps: list[dict]) -> list[tuple[str, int, float]]:
    """(what, steps, seconds) rows: prefilling steps' admission and forward passes (mixed
    where requests were running), decode-only steps, the idle time between steps, and the
    whole span."""
    if not steps:
        raise SystemExit("the step log is empty: no step ran while it was written")
    admitting = [s for s in steps if prefills(s)]
    joined = [s for s in admitting if s["running"]]
    decoding = [s for s in steps if not prefills(s)]
    idle = sum(max(0.0, b["start"] - end(a)) for a, b in zip(steps, steps[1:], strict=False))
    return [
        ("admission", len(admitting), sum(s["admit_s"] for s in admitting)),
        ("prefill passes, requests running (mixed)", len(joined),
         sum(s["forward_s"] for s in joined)),
        ("prefill passes, none running", len(admitting) - len(joined),
         sum(s["forward_s"] for s in admitting if not s["running"])),
        ("decode-only steps", len(decoding), sum(s["step_s"] for s in decoding)),
        ("idle between steps", len(steps) - 1, idle),
        ("span of the burst", len(steps), end(steps[-1]) - steps[0]["start"]),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="the file minirt.serve --step-log wrote")
    p.add_argument("--gap", type=float, default=1.0,
                   help="idle seconds that end a burst (default 1.0)")
    p.add_argument("--steps", action="store_true", help="also list every prefilling step")
    args = p.parse_args()
    for i, burst in enumerate(bursts(read(args.log), args.gap), 1):
        print(f"burst {i}, from {burst[0]['start']:.1f} s:")
        print_burst(burst, args.steps)


def print_burst(steps: list[dict], every: bool) -> None:
    rows = summary(steps)
    span = rows[-1][2]
    print(f"   {'':<52} {'steps':>6} {'seconds':>8} {'share':>6}")
    for what, n, seconds in rows:
        print(f"   {what:<52} {n:>6} {seconds:8.2f} {seconds / span:6.1%}")
    decoding = [s["step_s"] for s in steps if not prefills(s)]
    if decoding:
        print(f"   decode-only step: median {statistics.median(decoding) * 1e3:.1f} ms")
    print(f"   requests whose prompt completed, per prefilling step: "
          f"{[s['admitted'] for s in steps if prefills(s)]}")
    if every:
        print(f"   {'start s':>8} {'running':>7} {'admitted':>8} {'prompt tok':>10} "
              f"{'admit ms':>8} {'forward ms':>10}")
        for s in steps:
            if prefills(s):
                print(f"   {s['start']:8.2f} {s['running']:7} {s['admitted']:8} "
                      f"{s.get('prefill_tokens', '?'):>10} {s['admit_s'] * 1e3:8.0f} "
                      f"{s['forward_s'] * 1e3:10.0f}")


if __name__ == "__main__":
    main()
