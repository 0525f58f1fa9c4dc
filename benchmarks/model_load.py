"""How long the default model takes to load: first time (fetch + convert) and cached.

    python benchmarks/model_load.py            # cached loads, each in a fresh process
    python benchmarks/model_load.py --first    # also a first load into an empty cache

Each load runs in its own Python process, as a reader's new kernel would, and the time
includes importing torch and transformers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CODE = "from minirt.model import load_model; load_model(device='cpu')"


def timed_load(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", CODE], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--first", action="store_true", help="also time a first load")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    if args.first:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "MINIRT_CACHE": tmp}
            rows.append(("first load (fetch + convert)", timed_load(env)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cached = [timed_load(env) for _ in range(args.repeat)]
    rows.append((f"cached load, offline (median of {args.repeat})", statistics.median(cached)))
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  seconds")
    for name, secs in rows:
        print(f"{name:<{width}}  {secs:7.2f}")


if __name__ == "__main__":
    main()
