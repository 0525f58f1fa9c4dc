"""The same prompts through vLLM (its CPU build) and minirt, side by side, in one run.

    make peer-vllm                      # builds .venv-vllm once, then runs this script
    python benchmarks/vs_vllm.py        # if .venv-vllm exists already
    python benchmarks/vs_vllm.py --reps 7 --skip-servers

1. Offline, on token-id prompts: a 1,000-token shared prefix followed by 64-token
   suffixes. Each round empties the cache, sends one prompt (cold) and then another with
   the same prefix and a new suffix (warm); rounds repeat ``--reps`` times, so cold and
   warm runs interleave. Four configurations: vLLM with prefix caching on and off
   (``LLM(...)``, ``enforce_eager``, float32), minirt's ``Engine`` with pages of 128
   tokens (vLLM's CPU block size) and of 1 token. For each: cached tokens per request,
   median cold and warm TTFT, warm/cold, and whether the greedy tokens equal vLLM's
   without caching (vLLM's ``ignore_eos``, minirt's ``stop_on_eos=False``).
2. The chat workload (chapter 03's support-desk conversations, canned replies, as token
   ids), one request after another through the same four: cached tokens per request.
   minirt at page 128 must cache exactly what vLLM caches, request by request, in 1 and
   2: the script exits 1 if not.
4. Throughput: a burst of 16 requests, each a 500-token shared prefix and 50 tokens of
   its own, 64 greedy tokens each, sent at once; ``--reps`` times, cache emptied in
   between. Per engine (medians): wall time, output tokens/s, time to the last first
   token, decode ms per step ((wall - last first token) / 63), and minirt/vLLM for
   each. The 16 x 64 output tokens must equal vLLM's: the script exits 1 if not. minirt
   gets vLLM's token budget per step (4,096 tokens), so both prefill the 15 requests
   after the first in one step.
   ``--throughput-only`` runs this part alone.
3. Servers: vLLM's OpenAI server (``--enable-prompt-tokens-details``) and
   ``minirt.serve`` (pages of 128 and of 1), all three up at once, each replayed with
   ``minirt.replay`` on the chat workload with the model's own answers, ``--replay-reps``
   times in turn (a new system prompt and new conversations each time, ``seed`` = the
   rep, so no rep finds another's prompts cached; the order of the servers rotates):
   cached tokens per request in the first rep; the median TTFT and latency over every
   request of every rep, with minirt/vLLM; and the paired TTFT ratio, the median of
   minirt's TTFT over vLLM's for the same request. Every replay starts ``QUIET_S`` after
   the one before it, once vLLM's worker has stopped spinning (``_servers.QUIET_S``).
5. Servers under vLLM's own benchmark client (``benchmarks/serve_bench.py``): both
   servers up at once, ``prefix_repetition`` and ``random`` at concurrency 1, 4 and 16,
   alternated runs; duration, output tokens/s, TTFT, TPOT, request latency (E2EL),
   minirt/vLLM, cached tokens, and the greedy texts compared prompt by prompt (exits 1
   if a request fails, or if minirt's text leaves the plain model's greedy decode other
   than at a near tie of its logits; a vLLM text that does is reported as PEER).
   ``--serve-bench-only`` runs this part alone; ``--bench-reps`` (default 5).

vLLM runs in its own virtual environment (``.venv-vllm``, see the Makefile): its
transformers pin conflicts with minirt's. This file is also its worker (``--vllm-worker``),
so it imports nothing outside the standard library at the top (``_servers``, which holds
what it shares with ``serve_bench.py``, likewise). Timings on a shared
machine are noisy; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _servers import QUIET_S, VLLM_ENV, VLLM_PYTHON, start_vllm_server, stop_group

PREFIX, SUFFIX, BLOCK = 1000, 64, 128
BURST, SHARED, OWN, BURST_TOKENS = 16, 500, 50, 64
VLLM_BATCH_TOKENS = 4096  # vLLM's CPU default max_num_batched_tokens for LLM(...); minirt's: 2,048


# ---------------------------------------------------------------- the protocol (both venvs)


def protocol(run, reset, spec: dict) -> dict:
    """Run the shared-prefix rounds and the chat sequence through ``run(ids, n)``, which
    returns (output ids, cached tokens, ttft seconds); ``reset()`` empties the cache."""
    n = spec["max_tokens"]
    run(spec["warmup"], n)  # first-call costs (allocations, kernels) are not measured
    rounds = []
    prefix = spec["prefix"]
    for r in range(spec["reps"]):
        reset()
        cold = run(prefix + spec["suffixes"][2 * r], n)
        warm = run(prefix + spec["suffixes"][2 * r + 1], n)
        rounds.append({"cold": cold, "warm": warm})
    reset()
    chat = [run(ids, n) for ids in spec["chat"]]
    return {"rounds": rounds, "chat": chat}


def throughput(run_batch, reset, spec: dict) -> list[dict]:
    """The burst ``--reps`` times through ``run_batch(prompts, n)``, which returns (outputs,
    first-token latencies, wall seconds); ``reset()`` empties the cache before each."""
    run_batch(spec["burst"][:2], 4)  # warm-up: batched prefill and decode kernels
    reps = []
    for _ in range(spec["reps"]):
        reset()
        outputs, ttfts, wall = run_batch(spec["burst"], spec["burst_tokens"])
        reps.append({"outputs": outputs, "last_ttft": max(ttfts), "wall": wall})
    return reps


def vllm_worker(spec_path: str, out_path: str, caching: bool) -> None:
    """Inside .venv-vllm: vLLM's offline ``LLM`` through the protocol."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model_path"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=caching, disable_log_stats=False,
              max_model_len=4096, seed=0)

    def run(ids, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        ttft = out.metrics.first_token_latency
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), float(ttft)

    def run_batch(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        wall = time.perf_counter() - start
        return ([list(o.outputs[0].token_ids) for o in outs],
                [float(o.metrics.first_token_latency) for o in outs], wall)

    result = {} if spec["throughput_only"] else protocol(run, llm.reset_prefix_cache, spec)
    if caching:
        result["throughput"] = throughput(run_batch, llm.reset_prefix_cache, spec)
    Path(out_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- minirt side


def minirt_offline(model, page_size: int, spec: dict) -> dict:
    from minirt.engine import Engine
    from minirt.request import Request

    engine = Engine(model, capacity=16384, page_size=page_size, token_budget=VLLM_BATCH_TOKENS)

    def run(ids, n):
        r = engine.generate([Request(prompt=ids, max_new_tokens=n, stop_on_eos=False)],
                            progress=False)[0]
        return r.output_ids, r.metrics.cached_tokens, r.metrics.ttft

    def run_batch(prompts, n):
        res = engine.generate([Request(prompt=p, max_new_tokens=n, stop_on_eos=False)
                               for p in prompts], progress=False)
        return res.outputs, [r.metrics.ttft for r in res], res.totals.wall_time

    result = {} if spec["throughput_only"] else protocol(run, engine.flush, spec)
    if page_size == BLOCK:
        result["throughput"] = throughput(run_batch, engine.flush, spec)
    return result


def build_spec(tokenizer, reps: int, max_tokens: int, model_path: str,
               throughput_only: bool = False) -> dict:
    """Token ids both sides use: a 1,000-token prefix, 64-token suffixes, the chat prompts,
    the burst (16 prompts: 500 shared tokens, 50 of their own)."""
    from minirt.workloads import multi_turn_chat, rag, support_chats

    system = support_chats(tokenizer, 1, 1, system_tokens=PREFIX + 50).system
    prefix = tokenizer(system, add_special_tokens=False)["input_ids"][:PREFIX]
    text = " ".join(rag(tokenizer, num_documents=6, num_requests=24, sentences=12).texts)
    pool = tokenizer(text, add_special_tokens=False)["input_ids"]
    suffixes = [pool[i * SUFFIX:(i + 1) * SUFFIX] for i in range(2 * reps)]
    assert len(prefix) == PREFIX and all(len(s) == SUFFIX for s in suffixes)
    chat = multi_turn_chat(tokenizer, num_conversations=2, turns=3, system_tokens=500)
    own = pool[len(pool) // 2:]
    burst = [prefix[:SHARED] + own[i * OWN:(i + 1) * OWN] for i in range(BURST)]
    assert all(len(b) == SHARED + OWN for b in burst) and len(own) >= BURST * OWN
    return {"model_path": model_path, "reps": reps, "max_tokens": max_tokens,
            "prefix": prefix, "suffixes": suffixes, "chat": chat.requests,
            "warmup": pool[-200:], "burst": burst, "burst_tokens": BURST_TOKENS,
            "throughput_only": throughput_only}


def run_vllm_offline(spec_file: Path, caching: bool) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [str(VLLM_PYTHON), __file__, "--vllm-worker", str(spec_file), str(out),
           "on" if caching else "off"]
    log = Path(tempfile.mkstemp(prefix="vllm-offline-", suffix=".log")[1])
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env={**os.environ, **VLLM_ENV}, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"vLLM worker failed ({rc}); its log: {log}\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------- report


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def cached_list(res: dict, part: str) -> list[int]:
    """Cached tokens per request, in the order sent."""
    if part == "rounds":
        return [x[1] for r in res["rounds"] for x in (r["cold"], r["warm"])]
    return [x[1] for x in res["chat"]]


def offline_tables(results: dict[str, dict]) -> tuple[str, list[str]]:
    ref = results["vLLM, caching off"]
    ref_out = [x[0] for r in ref["rounds"] for x in (r["cold"], r["warm"])] + \
        [x[0] for x in ref["chat"]]
    lines = [f"{'configuration':<24} {'cached cold/warm':>16} {'TTFT cold s':>11} "
             f"{'TTFT warm s':>11} {'warm/cold':>9}  {'chat cached tokens (per request)':<34} "
             f"same tokens"]
    for name, res in results.items():
        cold = [r["cold"] for r in res["rounds"]]
        warm = [r["warm"] for r in res["rounds"]]
        cc = sorted({x[1] for x in cold})
        cw = sorted({x[1] for x in warm})
        tc, tw = median([x[2] for x in cold]), median([x[2] for x in warm])
        outs = [x[0] for r in res["rounds"] for x in (r["cold"], r["warm"])] + \
            [x[0] for x in res["chat"]]
        same = sum(a == b for a, b in zip(outs, ref_out, strict=True))
        chat = [x[1] for x in res["chat"]]
        lines.append(f"{name:<24} {'/'.join(map(str, cc)) + ' / ' + '/'.join(map(str, cw)):>16} "
                     f"{tc:>11.3f} {tw:>11.3f} {tw / tc:>9.2f}  {str(chat):<34} "
                     f"{same}/{len(outs)}")
    problems = []
    on, m128 = results["vLLM, caching on"], results["minirt, page 128"]
    for part in ("rounds", "chat"):
        a, b = cached_list(on, part), cached_list(m128, part)
        if a != b:
            problems.append(f"{part}: vLLM cached {a} but minirt (page 128) cached {b}")
    return "\n".join(lines), problems


def throughput_table(vllm: list[dict], minirt: list[dict]) -> tuple[str, list[str]]:
    """Medians per engine and minirt/vLLM; problems if any output differs from vLLM's."""
    steps = BURST_TOKENS - 1
    rows = {}
    for name, reps in (("vLLM", vllm), ("minirt", minirt)):
        wall = median([r["wall"] for r in reps])
        ttft = median([r["last_ttft"] for r in reps])
        rows[name] = {"wall time s": wall,
                      "output tokens/s": median([BURST * BURST_TOKENS / r["wall"]
                                                 for r in reps]),
                      "last first token s": ttft,
                      "decode ms per step": median([(r["wall"] - r["last_ttft"]) / steps * 1e3
                                                    for r in reps])}
    lines = [f"{'measurement (median of ' + str(len(vllm)) + ')':<28} {'vLLM':>9} "
             f"{'minirt':>9} {'minirt/vLLM':>12}"]
    for key in rows["vLLM"]:
        a, b = rows["vLLM"][key], rows["minirt"][key]
        lines.append(f"{key:<28} {a:>9.3f} {b:>9.3f} {b / a:>12.2f}")
    ref = vllm[0]["outputs"]
    problems = [f"throughput rep {i} ({name}): outputs differ from vLLM's first rep"
                for name, reps in (("vLLM", vllm), ("minirt", minirt))
                for i, r in enumerate(reps) if r["outputs"] != ref]
    same = sum(a == b for r in minirt for a, b in zip(r["outputs"], ref, strict=True))
    lines.append(f"identical outputs: {same}/{BURST * len(minirt)} requests")
    return "\n".join(lines), problems


def server_table(reports: dict[str, list]) -> str:
    """Per server: the first rep's tokens and cached tokens per request; the median TTFT and
    latency over every request of every rep, with minirt/vLLM; and the paired TTFT ratio,
    the median over requests of minirt's TTFT over vLLM's for the same request (same rep,
    conversation and turn), which the spread between a rep's cold and warm requests and
    the timing of two overlapping conversations do not move."""
    def pooled(runs: list, what: str) -> float:
        return median([getattr(r, what) for run in runs for r in run.ok])

    def by_request(runs: list) -> dict[tuple, float]:
        return {(rep, r.conversation, r.turn): r.ttft
                for rep, run in enumerate(runs) for r in run.ok}

    vllm = reports["vLLM server"]
    base = {what: pooled(vllm, what) for what in ("ttft", "latency")}
    ref = by_request(vllm)
    lines = [f"{'server':<24} {'requests':>8} {'prompt':>7} {'cached':>7} {'hit rate':>8} "
             f"{'TTFT s':>7} {'ratio':>5} {'paired':>6} {'latency s':>9} {'ratio':>5}  "
             "cached per request (first rep)"]
    for name, runs in reports.items():
        first, ttft, latency = runs[0], pooled(runs, "ttft"), pooled(runs, "latency")
        mine = by_request(runs)
        paired = median([mine[k] / ref[k] for k in mine.keys() & ref.keys()])
        lines.append(f"{name:<24} {sum(len(run.ok) for run in runs):>8} "
                     f"{first.prompt_tokens:>7} {first.cached_tokens:>7} "
                     f"{first.hit_rate:>8.3f} {ttft:>7.3f} {ttft / base['ttft']:>5.2f} "
                     f"{paired:>6.2f} {latency:>9.3f} {latency / base['latency']:>5.2f}  "
                     f"{[r.cached_tokens for r in first.records]}")
    per_rep = {name: [f"{median([r.ttft for r in run.ok]):.3f}" for run in runs]
               for name, runs in reports.items()}
    lines.append(f"median TTFT s of each rep: {per_rep}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5, help="cold/warm rounds (medians)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--skip-servers", action="store_true")
    p.add_argument("--throughput-only", action="store_true",
                   help="only part 4, the 16-request burst")
    p.add_argument("--serve-bench-only", action="store_true",
                   help="only part 5, vllm.benchmarks.serve against both servers")
    p.add_argument("--replay-reps", type=int, default=5,
                   help="replays of the chat workload per server in part 3 (medians)")
    p.add_argument("--bench-reps", type=int, default=5,
                   help="runs per cell in part 5 (0: parts 1-4 only)")
    p.add_argument("--vllm-worker", nargs=3, metavar=("SPEC", "OUT", "CACHING"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bench_reps < 0 or (args.serve_bench_only and args.bench_reps < 1):
        p.error(f"--bench-reps must be at least {1 if args.serve_bench_only else 0}")
    if args.replay_reps < 1:
        p.error("--replay-reps must be at least 1")
    if args.vllm_worker:
        spec, out, caching = args.vllm_worker
        vllm_worker(spec, out, caching == "on")
        return
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: run `make peer-vllm` (it builds .venv-vllm)")
    import serve_bench

    if args.serve_bench_only:
        sys.exit(0 if serve_bench.run(reps=args.bench_reps) else 1)

    import torch

    from minirt.model import load_model
    from minirt.replay import replay
    from minirt.serve import launch

    model, tokenizer = load_model(dtype=torch.float32)
    model_path = str(model.name_or_path)
    spec = build_spec(tokenizer, args.reps, args.max_tokens, model_path,
                      args.throughput_only)
    spec_file = Path(tempfile.mkstemp(suffix=".json")[1])
    spec_file.write_text(json.dumps(spec))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{args.reps} cold/warm rounds; prompts {PREFIX} + {SUFFIX} tokens; "
          f"{len(spec['chat'])} chat requests; {args.max_tokens} output tokens each",
          flush=True)

    results = {}
    for caching in ((True,) if args.throughput_only else (True, False)):
        t = time.perf_counter()
        results[f"vLLM, caching {'on' if caching else 'off'}"] = run_vllm_offline(spec_file,
                                                                                  caching)
        print(f"  vLLM caching {'on' if caching else 'off'}: {time.perf_counter() - t:.0f} s "
              "(start-up included)", flush=True)
    for page in ((BLOCK,) if args.throughput_only else (BLOCK, 1)):
        results[f"minirt, page {page}"] = minirt_offline(model, page, spec)
    problems = []
    if not args.throughput_only:
        results = {k: results[k] for k in ("vLLM, caching on", "vLLM, caching off",
                                           "minirt, page 128", "minirt, page 1")}
        table, problems = offline_tables(results)
        print(f"\n1-2. Offline, same token ids (load average now {os.getloadavg()[0]:.1f}):")
        print(table)
    table, burst_problems = throughput_table(results["vLLM, caching on"]["throughput"],
                                             results[f"minirt, page {BLOCK}"]["throughput"])
    print(f"\n4. Throughput: {BURST} requests x ({SHARED} shared + {OWN} own tokens) x "
          f"{BURST_TOKENS} greedy tokens, sent at once; vLLM ran its reps first, then minirt "
          f"(page {BLOCK}); load average now {os.getloadavg()[0]:.1f}:")
    print(table)
    problems += burst_problems

    if not args.skip_servers and not args.throughput_only:
        del model
        chat_args = {"rate": 0.5, "conversations": 2, "turns": 3, "system_tokens": 500,
                     "max_tokens": args.max_tokens, "ignore_eos": True,
                     "tokenizer": tokenizer}
        with contextlib.ExitStack() as servers:
            proc, url, _ = start_vllm_server(model_path)
            servers.callback(stop_group, proc)
            urls = {"vLLM server": url}
            for page in (BLOCK, 1):
                srv = servers.enter_context(launch("--page-size", str(page),
                                                   "--capacity", "16384"))
                urls[f"minirt.serve, page {page}"] = srv.url
            reports: dict[str, list] = {name: [] for name in urls}
            names = list(urls)
            for r in range(args.replay_reps):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    time.sleep(QUIET_S)
                    reports[name].append(replay(urls[name], "chat", seed=r, **chat_args))
        print(f"\n3. Servers, minirt.replay chat (2 conversations x 3 turns, 0.5 conversations/s, "
              f"the model's own answers; {args.replay_reps} reps in turn; load average now "
              f"{os.getloadavg()[0]:.1f}):")
        print(server_table(reports))
        texts = {name: [sorted((r.conversation, r.turn, r.text) for r in run.records)
                        for run in runs] for name, runs in reports.items()}
        print("answers identical across servers:", len({json.dumps(t) for t in texts.values()})
              == 1)
    bench_ok = True
    if not args.skip_servers and not args.throughput_only and args.bench_reps:
        bench_ok = serve_bench.run(reps=args.bench_reps)
    if problems:
        print("\nFAIL: minirt at page 128 does not cache or generate what vLLM does:\n  "
              + "\n  ".join(problems))
        sys.exit(1)
    if not bench_ok:
        print("\nFAIL: part 5 (vllm.benchmarks.serve against both servers), see above")
        sys.exit(1)
    if args.throughput_only:
        print("\nminirt generated exactly vLLM's burst outputs.")
    else:
        print("\nminirt at page 128 cached exactly the tokens vLLM cached, request by request; "
              "the burst's outputs are identical.")


if __name__ == "__main__":
    main()
