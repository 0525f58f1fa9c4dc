"""How long the default model takes to load: first time (fetch + convert) and cached.

    python benchmarks/model_load.py            # cached loads, each in a fresh process
    python benchmarks/model_load.py --first    # also a first load into an empty cache

Each load runs in its own Python process, as a reader's new kernel would. The table
splits a cached load into the process as a whole (interpreter start and exit included),
importing torch, and the ``load_model()`` call itself (which imports the parts of
transformers it needs, reads the tokenizer and the safetensors weights).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CODE = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from minirt.model import load_model
load_model(device="cpu")
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def timed_load(env: dict[str, str]) -> tuple[float, float, float]:
    """(whole process, import torch, load_model call) in seconds."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, check=True,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    torch_s, load_s = map(float, proc.stdout.split()[-2:])
    return wall, torch_s, load_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--first", action="store_true", help="also time a first load")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    if args.first:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "MINIRT_CACHE": tmp}
            rows.append(("first load (fetch + convert)", *timed_load(env)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cached = [timed_load(env) for _ in range(args.repeat)]
    medians = [statistics.median(c[i] for c in cached) for i in range(3)]
    rows.append((f"cached load, offline (median of {args.repeat})", *medians))
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  process s  import torch s  load_model() s")
    for name, wall, torch_s, load_s in rows:
        print(f"{name:<{width}}  {wall:9.2f}  {torch_s:14.2f}  {load_s:14.2f}")


if __name__ == "__main__":
    main()
