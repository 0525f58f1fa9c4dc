"""vLLM's CPU build with its n-gram speculator on the prompts of ``benchmarks/speculative.py``.

    .venv-vllm/bin/python benchmarks/speculative_vllm.py          # writes speculative_vllm.json
    .venv-vllm/bin/python benchmarks/speculative_vllm.py --batches 1 --workloads rag
    make peer-vllm                                                 # runs it after the others

Run by vLLM's environment (``.venv-vllm``, built by ``make peer-vllm``): it builds the same
token ids as ``benchmarks/speculative.py`` (its ``workloads``: ``rag``, ``code_edit``,
``chat``, 16 prompts each, the book's model's tokenizer) and serves the first B of each
workload, for each batch size B, to ``--max-new`` greedy tokens (``temperature=0``,
``ignore_eos=True``) through vLLM's offline ``LLM`` API (fp32, ``enforce_eager``, prefix
caching on, as ``benchmarks/vs_vllm.py`` does) twice over: once without speculation and once
with ``speculative_config={"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": lo, "prompt_lookup_max": hi}``, vLLM's names
(vllm 0.32.0 `config/speculative.py: SpeculativeConfig`), the same k and n-gram lengths as
minirt's benchmark. Each side runs in a fresh child process of its own, one after the
other, the n-gram side first, so that one side's engine is never alive while the other is
timed (unlike minirt's benchmark, which alternates its engines in one process); per cell, each
batch is cached by an untimed one-token run, then served ``--reps`` times and the best wall
time kept, as minirt's benchmark does. The acceptance counts are the differences of vLLM's
spec-decode counters over the timed runs of a cell (``LLM.get_metrics``; the counters of
vllm 0.32.0 `v1/spec_decode/metrics.py: SpecDecodingProm`); vLLM counts a draft for every
request-step that had at least one draft token (vllm 0.32.0
`v1/core/sched/scheduler.py: Scheduler.make_spec_decoding_stats` returns before counting when
a request had none) and reports ``1 + accepted / drafts`` as its mean acceptance length
(vllm 0.32.0 `v1/spec_decode/metrics.py: SpecDecodingLogging.log`).

If vLLM refuses the n-gram speculator, the exception's type and message are recorded with
the source line that raises it, and no cell is written.

The JSON (``benchmarks/speculative_vllm.json``)::

    {
      "vllm_version": "0.32.0",
      "model": "SmolLM2-135M-Instruct",       # the book's model, loaded in float32
      "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                             "prompt_lookup_min": 2, "prompt_lookup_max": 4},
      "max_new_tokens": 48,                   # greedy, ignore_eos: every output this long
      "reps": 2,                              # timed runs per cell and side; best kept
      "batches": [1, 4, 16],
      "cpus": 2, "load_average": [3.1, 4.0],  # 1-minute load at start and at end
      "error": null,                          # or {"type": ..., "message": ...,
                                              #     "source": "file: symbol"} if refused
      "prompts": {"rag": [[id, ...], ...16], "code_edit": [...], "chat": [...]},
      "cells": [
        {"workload": "rag", "batch": 1,       # prompts[workload][:batch]
         "plain": {"wall_s": 1.23,            # best timed run, seconds
                   "outputs": [[id, ...], ...batch]},
         "ngram": {"wall_s": 0.98, "outputs": [[id, ...], ...batch],
                   "num_drafts": 30,          # request-steps that verified drafts
                   "num_draft_tokens": 112,   # draft tokens verified
                   "num_accepted_tokens": 80, # of them accepted
                   "accepted_per_pos": [25, 20, 18, 17],   # accepted at draft position i
                   "acceptance_rate": 0.71,   # num_accepted_tokens / num_draft_tokens
                   "mean_acceptance_length": 3.67},  # 1 + accepted / drafts (vLLM's)
         "speed_up": 1.26,                    # plain wall_s / ngram wall_s
         "same": 1},                          # requests whose two outputs are equal
        ...
      ]
    }

The counters cover every timed run of the cell (``reps`` times the batch), the outputs are
the last run's (greedy: every run gives the same). ``tests/test_speculative_vllm.py``
checks the stored outputs against minirt's greedy outputs on the stored prompts (no vLLM
needed at test time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

OUT = HERE / "speculative_vllm.json"
METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
           "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
QUIET_S = 1.5  # vLLM's engine spins 1 s after its last request (_servers.QUIET_S)


def spec_counters(llm, k: int) -> dict:
    """vLLM's cumulative spec-decode counters, summed over engines."""
    out = {name.removeprefix("vllm:spec_decode_"): 0 for name in METRICS}
    per_pos = [0] * k
    for m in llm.get_metrics():
        if m.name in METRICS:
            out[m.name.removeprefix("vllm:spec_decode_")] += int(m.value)
        elif m.name == PER_POS:
            values = getattr(m, "values", None)
            if values is not None:  # a Vector: one value per position
                for i, v in enumerate(values[:k]):
                    per_pos[i] += int(v)
            else:
                per_pos[int(m.labels["position"])] += int(m.value)
    out["accepted_per_pos"] = per_pos
    return out


def refusing_source(exc: BaseException) -> str:
    """``file: function`` of the innermost vLLM frame that raised ``exc``, relative to the
    vllm package."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('/vllm/', 1)[1]}: {f.name} (line {f.lineno})"


def serve_side(side: str, job: dict) -> dict:
    """Inside a fresh process: one ``LLM`` (``side`` "plain" or "ngram") through every cell
    of ``job``; per cell the best wall time, the outputs and (ngram) the counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config, k = job["speculative_config"], job["speculative_config"]["num_speculative_tokens"]
    extra = {"speculative_config": config} if side == "ngram" else {}
    llm = LLM(model=job["model_path"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, disable_log_stats=False, max_model_len=4096,
              seed=0, **extra)

    def run(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        time.sleep(QUIET_S)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                            use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    cells = []
    for name, ps in job["prompts"].items():
        for b in job["batches"]:
            batch = ps[:b]
            run(batch, 1)  # the prompts cached: the timed runs decode
            before = spec_counters(llm, k) if side == "ngram" else None
            best: dict = {}
            for _ in range(job["reps"]):
                seconds, outs = run(batch, job["max_new_tokens"])
                if not best or seconds < best["wall_s"]:
                    best = {"wall_s": seconds, "outputs": outs}
            if before is not None:
                after = spec_counters(llm, k)
                counts = {key: after[key] - before[key] for key in after
                          if key != "accepted_per_pos"}
                counts["accepted_per_pos"] = [a - c for a, c in zip(
                    after["accepted_per_pos"], before["accepted_per_pos"], strict=True)]
                drafted, accepted = counts["num_draft_tokens"], counts["num_accepted_tokens"]
                counts["acceptance_rate"] = accepted / drafted if drafted else 0.0
                counts["mean_acceptance_length"] = (1 + accepted / counts["num_drafts"]
                                                    if counts["num_drafts"] else 1.0)
                best.update(counts)
            cells.append({"workload": name, "batch": b, side: best})
            print(f"{side} {name} B={b}: {best['wall_s']:.2f} s", flush=True)
    return {"cells": cells}


def run_side(side: str, job_file: Path) -> dict:
    """``serve_side`` in a child process of this interpreter (vLLM's engine and its
    threads end with it); the exception it raised, if it raised one."""
    out = job_file.with_suffix(f".{side}.json")
    done = subprocess.run([sys.executable, __file__, "--side", side, str(job_file), str(out)],
                          env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    tail = "\n".join(line for line in done.stdout.splitlines() if "WARNING" not in line)
    print(tail[-1500:], flush=True)
    if not out.exists():
        sys.exit(f"vLLM's {side} run failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return json.loads(out.read_text())


def side_main(side: str, job_file: str, out_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    try:
        result = serve_side(side, job)
    except Exception as exc:  # vLLM refuses: record why and where
        result = {"error": {"type": type(exc).__name__, "message": str(exc),
                            "source": refusing_source(exc)}}
    Path(out_file).write_text(json.dumps(result))


def main() -> None:
    from speculative import add_cell_args, check_batches, workloads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cell_args(ap)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--side", nargs=3, metavar=("SIDE", "JOB", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    from _servers import MODEL_NAME, VLLM_ENV
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    if args.side:
        side_main(*args.side)
        return
    check_batches(args.batches)
    import vllm

    from minirt.model import fetch_default_model
    from minirt.workloads import default_tokenizer

    load = [round(os.getloadavg()[0], 2)]
    prompts = workloads(default_tokenizer(), args.workloads)
    top = max(args.batches)
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    record = {"vllm_version": vllm.__version__, "model": MODEL_NAME,
              "speculative_config": config, "max_new_tokens": args.max_new,
              "reps": args.reps, "batches": args.batches, "cpus": os.cpu_count(),
              "load_average": load, "error": None,
              "prompts": {n: [list(p) for p in ps[:top]] for n, ps in prompts.items()},
              "cells": []}
    job_file = Path(tempfile.mkstemp(prefix="speculative-vllm-", suffix=".json")[1])
    job_file.write_text(json.dumps({**record, "model_path": str(fetch_default_model())}))
    print(f"vLLM {vllm.__version__} speculative_config {config}, {args.max_new} greedy tokens, "
          f"best of {args.reps}", flush=True)
    fast = run_side("ngram", job_file)
    if "error" in fast:
        record["error"] = fast["error"]
        record["load_average"].append(round(os.getloadavg()[0], 2))
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"vLLM refused the n-gram speculator: {record['error']}")
        return
    plain = run_side("plain", job_file)
    if "error" in plain:
        sys.exit(f"vLLM's plain run failed: {plain['error']}")
    header = (f"{'workload':<10} {'B':>3} {'plain tok/s':>11} {'spec tok/s':>10} "
              f"{'speed-up':>8} {'tok/draft':>9} {'accept':>7} {'same':>5}")
    print(f"\n{header}\n{'-' * len(header)}")
    for p_cell, f_cell in zip(plain["cells"], fast["cells"], strict=True):
        b, pl, ng = p_cell["batch"], p_cell["plain"], f_cell["ngram"]
        same = sum(a == c for a, c in zip(pl["outputs"], ng["outputs"], strict=True))
        speed_up = pl["wall_s"] / ng["wall_s"]
        record["cells"].append({"workload": p_cell["workload"], "batch": b, "plain": pl,
                                "ngram": ng, "speed_up": speed_up, "same": same})
        tokens = b * args.max_new
        print(f"{p_cell['workload']:<10} {b:>3} {tokens / pl['wall_s']:>11.1f} "
              f"{tokens / ng['wall_s']:>10.1f} {speed_up:>7.2f}x "
              f"{ng['mean_acceptance_length']:>9.2f} {ng['acceptance_rate']:>7.2f} "
              f"{same:>2}/{b:<2}")
    record["load_average"].append(round(os.getloadavg()[0], 2))
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nload average {load[0]:.2f} at start, {load[-1]:.2f} at end (1 min); tok/draft: "
          "vLLM's mean acceptance length, 1 + accepted / drafts; accept: accepted / draft "
          f"tokens; same: requests whose outputs equal plain decode's. Wrote {args.out}")


if __name__ == "__main__":
    main()
