"""Where a request's time to first token goes inside ``minirt.serve``, hand-off by hand-off.

    python benchmarks/serve_path.py [--page-size 128] [--reps 3] [--port 8765]

Runs ``minirt.serve`` in this process (engine on the main thread, HTTP beside it, as
``python -m minirt.serve`` does) with ``EngineWorker``'s hand-offs wrapped to take the
time, and replays vLLM-comparison's chat workload against it (``minirt.replay``, 2
conversations x 3 turns, 0.5 conversations/s, 8 tokens; seeds 0 .. reps-1) from a
second process. Per request, in ms:

- ``tokenize``: the chat template and tokenizer, on the tokenizer thread;
- ``queued``: from tokenized to the engine thread taking the request (a step running
  when it came makes this long);
- ``to step``: from taken to the start of the step that prefills it;
- ``step``: from that step's start to its first token (admission and the forward pass);
- ``to loop``: from the first token to the HTTP thread writing it;
- ``outside``: the client's TTFT less all of the above (HTTP in and out, the client).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import minirt.serve as serve
from minirt.engine import Engine
from minirt.engine_worker import EngineWorker

MARKS = ("tokenize0", "tokenize1", "taken", "step0", "token", "sent")


def instrument() -> dict[str, list]:
    """Wrap the worker's hand-offs; return the lists they append their times to."""
    times: dict[str, list] = {m: [] for m in MARKS}
    seen: set[str] = set()
    encode, command, on_token = (EngineWorker.encode, EngineWorker._command,
                                 EngineWorker._on_token)
    step, sse = Engine.step, serve._sse

    async def timed_encode(self, prompt=None, messages=None):
        times["tokenize0"].append(time.perf_counter())
        ids = await encode(self, prompt, messages)
        times["tokenize1"].append(time.perf_counter())
        return ids

    def timed_command(self, cmd):
        if cmd[0] == "submit":
            times["taken"].append(time.perf_counter())
        return command(self, cmd)

    def timed_on_token(self, rid, token):
        if rid not in seen:
            seen.add(rid)
            times["token"].append(time.perf_counter())
        return on_token(self, rid, token)

    def timed_step(self, on_token=None):
        start = time.perf_counter()
        out = step(self, on_token)
        times["step0"] += [start] * len(out.admitted)
        return out

    async def timed_sse(*args, **kwargs):
        first = True
        async for piece in sse(*args, **kwargs):
            if first and '"content": ""' not in piece:  # the role chunk carries no text
                times["sent"].append(time.perf_counter())
                first = False
            yield piece

    EngineWorker.encode, EngineWorker._command = timed_encode, timed_command
    EngineWorker._on_token, Engine.step, serve._sse = timed_on_token, timed_step, timed_sse
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    times = instrument()
    base, out = f"http://127.0.0.1:{args.port}", Path(tempfile.mkdtemp())

    def client() -> None:
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        try:
            for seed in range(args.reps):
                subprocess.run([sys.executable, "-m", "minirt.replay", "--base-url",
                                base + "/v1", "--rate", "0.5", "--conversations", "2",
                                "--turns", "3", "--system-tokens", "500", "--max-tokens", "8",
                                "--ignore-eos", "--seed", str(seed), "--quiet",
                                "--out", str(out / f"{seed}.jsonl")], check=True)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # serve.main's way out

    threading.Thread(target=client, daemon=True).start()
    serve.main(["--port", str(args.port), "--page-size", str(args.page_size),
                "--capacity", "16384"])
    ttft = [json.loads(line)["ttft"] for seed in range(args.reps)
            for line in (out / f"{seed}.jsonl").read_text().splitlines()]
    if not all(len(v) == len(ttft) for v in times.values()):
        sys.exit(f"unmatched hand-offs: {({k: len(v) for k, v in times.items()})}, "
                 f"{len(ttft)} requests")
    t = {k: [x * 1e3 for x in v] for k, v in times.items()}
    rows = {"tokenize": [b - a for a, b in zip(t["tokenize0"], t["tokenize1"], strict=True)],
            "queued": [b - a for a, b in zip(t["tokenize1"], t["taken"], strict=True)],
            "to step": [b - a for a, b in zip(t["taken"], t["step0"], strict=True)],
            "step": [b - a for a, b in zip(t["step0"], t["token"], strict=True)],
            "to loop": [b - a for a, b in zip(t["token"], t["sent"], strict=True)],
            "outside": [f * 1e3 - (b - a) for f, a, b
                        in zip(ttft, t["tokenize0"], t["sent"], strict=True)],
            "client TTFT": [f * 1e3 for f in ttft]}
    print(f"\nminirt.serve --page-size {args.page_size}, {len(ttft)} requests "
          f"({args.reps} replays), ms per request:")
    print(f"{'part':<12} {'median':>7} {'min':>7} {'max':>7}   request by request")
    for name, xs in rows.items():
        print(f"{name:<12} {statistics.median(xs):7.1f} {min(xs):7.1f} {max(xs):7.1f}   "
              + " ".join(f"{x:.0f}" for x in xs))


if __name__ == "__main__":
    main()
