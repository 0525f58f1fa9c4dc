"""How fast ``minirt.hitcheck`` analyses a large request log: 100,000 requests in a minute?

    .venv/bin/python benchmarks/hitcheck.py                     # 100,000 requests
    .venv/bin/python benchmarks/hitcheck.py --requests 10000 --capacity 200000

Writes a synthetic log shaped like a chat service's (multi-turn conversations that resend
their history with the server's replies as text, system prompts from a small pool, a
share of them stamped with the time, RAG requests whose documents come in varying
order, tool lists in varying order, a share of requests under a cache salt), then times
each phase of the analysis on the book's tokenizer, as ``python -m minirt.hitcheck``
runs it: reading the log, rendering and tokenizing, the trees and the causes. It prints
one table: each phase's wall time, the requests and tokens per second, and the causes
found. The goal (issue 51) is under 60 s for 100,000 requests on 2 cores; the verdict
line says whether this run met it. Timings vary with the machine's load: no test times
anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

from minirt.hitcheck import analyze, load_requests, load_tokenizer, render_all

SYLLABLES = ["ka", "lo", "mi", "ten", "ra", "vis", "on", "de", "pul", "sa", "ver", "in",
             "ta", "mon", "gre", "al", "to", "ber", "ne", "qui", "st", "or", "ex", "an"]


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
                    for _ in range(n))


def generate(n: int, seed: int = 0) -> list[str]:
    """``n`` JSONL lines in arrival order: conversations interleaved as they would arrive."""
    rng = random.Random(seed)
    systems = [f"You are assistant {k} of the support desk. " + words(rng, 60)
               for k in range(20)]
    documents = [f"Document {k}: " + words(rng, 40) for k in range(200)]
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description":
              words(rng, 12), "parameters": {"type": "object", "properties": {}}}}
             for k in range(8)]
    active: list[dict] = []
    out: list[str] = []
    conv_id = 0
    while len(out) < n:
        if not active or (len(active) < 64 and rng.random() < 0.3):
            kind = rng.choices(("chat", "rag", "tools"), (0.7, 0.2, 0.1))[0]
            system = rng.choice(systems)
            if rng.random() < 0.15:  # a time stamp in the system prompt
                system += f" Current time: 2024-05-{rng.randint(1, 28):02d} " \
                          f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:" \
                          f"{rng.randint(0, 59):02d}."
            conv = {"id": conv_id, "kind": kind, "messages": [{"role": "system",
                                                              "content": system}],
                    "turns": rng.randint(1, 9), "salt": "tenant-b" if rng.random() < 0.05
                    else None}
            if kind == "rag":
                docs = rng.sample(documents[:30], 4)  # popular documents, any order
                conv["messages"][0]["content"] += "\n\n" + "\n\n".join(docs)
            if kind == "tools":
                conv["tools"] = rng.sample(tools, 4)
            conv_id += 1
            active.append(conv)
        conv = rng.choice(active)
        conv["messages"].append({"role": "user", "content": words(rng, rng.randint(8, 40))})
        reply = words(rng, rng.randint(20, 90))
        body: dict = {"model": "SmolLM2-135M-Instruct", "messages": conv["messages"]}
        if conv.get("tools"):
            body["tools"] = conv["tools"]
        if conv["salt"]:
            body["cache_salt"] = conv["salt"]
        out.append(json.dumps({"conversation": conv["id"], "reply": reply, **body}))
        conv["messages"].append({"role": "assistant", "content": reply})
        conv["turns"] -= 1
        if conv["turns"] == 0:
            active.remove(conv)
    return out


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the rendering process)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--capacity", type=int, default=None,
                   help="also replay through a cache of this many tokens")
    p.add_argument("--phases", action="store_true",
                   help="also time rendering and the trees one after the other, in one process")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = []
    t = time.perf_counter()
    lines = generate(args.requests, args.seed)
    generated = time.perf_counter() - t
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.jsonl"
        path.write_text("\n".join(lines) + "\n")
        size = path.stat().st_size
        del lines
        t, c = time.perf_counter(), _cpu()
        requests = load_requests(path)
        rows.append(("read and check the log", time.perf_counter() - t, _cpu() - c))
    t, c = time.perf_counter(), _cpu()
    report = analyze(requests, tokenizer, page_size=args.page_size, capacity=args.capacity,
                     parallel=True)
    rows.append(("render, tokenize, trees, causes (3 processes)", time.perf_counter() - t,
                 _cpu() - c))
    rows.append(("analysis in all, as the command line runs it", rows[0][1] + rows[1][1],
                 rows[0][2] + rows[1][2]))
    if args.phases:
        t, c = time.perf_counter(), _cpu()
        rendered = render_all(requests, tokenizer)
        rows.append(("  phase: render and tokenize (1 process)", time.perf_counter() - t,
                     _cpu() - c))
        t, c = time.perf_counter(), _cpu()
        analyze(requests, tokenizer, page_size=args.page_size, capacity=args.capacity,
                rendered=rendered)
        rows.append(("  phase: trees, bounds and causes", time.perf_counter() - t, _cpu() - c))
    tokens = report.prompt_tokens
    n = len(requests)
    print(f"hitcheck on {n:,} requests ({size / 1e6:.0f} MB of JSONL written in "
          f"{generated:.0f} s, {tokens:,} prompt tokens, {tokens / n:.0f} a request), page "
          f"size {args.page_size}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"{'':<48} {'wall s':>8} {'CPU s':>8} {'requests/s':>11} {'tokens/s':>11}")
    for name, sec, cpu in rows:
        print(f"{name:<48} {sec:>8.1f} {cpu:>8.1f} {n / sec:>11,.0f} {tokens / sec:>11,.0f}")
    print(f"\nbound {100 * report.bound_rate:.1f} %, at page {args.page_size} "
          f"{100 * report.paged_rate:.1f} %"
          + ("" if report.hit_rate is None else f", at capacity {args.capacity} "
             f"{100 * report.hit_rate:.1f} %"))
    print("causes:", ", ".join(f"{c} {k}" for c, k in report.cause_counts.items() if k))
    total = rows[2][1]
    goal = 60.0 * n / 100_000
    verdict = "met" if total < goal else "NOT met"
    print(f"goal: 100,000 requests in under 60 s on 2 cores (pro rata {goal:.0f} s): {verdict} "
          f"({total:.1f} s wall, {rows[2][2]:.1f} CPU s; a loaded machine inflates the wall "
          "time, the CPU seconds much less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
