"""Speculative decoding against plain decode on the real model: tokens per second and per
step, acceptance rate and speed-up, on three workloads at batch 1, 4 and 16, in one run.

    python benchmarks/speculative.py                       # the whole grid
    python benchmarks/speculative.py --batches 1 --workloads rag --max-new 64
    python benchmarks/speculative.py -k 6 --lookup-min 1 --lookup-max 3
    python benchmarks/speculative.py --draft-batches        # no draft-model rows

Workloads (``minirt.workloads`` where it has one, built here otherwise), 16 prompts each:

* ``rag``: ``workloads.rag`` (documents, a question, "quote the sentence that supports
  your answer"): answers copy their documents, so prompt lookup finds them;
* ``code_edit``: a small Python function and an edit to make ("rename this variable,
  return the whole function"): the answer repeats the function;
* ``chat``: the first turns of ``workloads.multi_turn_chat`` (support-desk questions):
  little to copy.

For each workload and batch size B, the first B prompts are served to ``--max-new`` greedy
tokens by two engines stepped in one process, one without speculation and one with
``Engine(speculative=...)``, each prompt already cached by an untimed run, so the timed run
is decode (and its one-token prefill). The two are alternated ``--reps`` times and the
best wall time of each is kept. Printed per cell: output tokens per second of both, the
speed-up (plain time / speculative time), Engine.step calls of both, the tokens a
request gains per verify step, the acceptance rate (accepted / proposed drafts), and
whether the greedy outputs are identical (fp32: a verify's rows come from the prefill
kernels, a decode step's from the decode kernels, so a near-tie could flip; it is counted,
not assumed). Timings on a shared machine are noisy: the load average is printed.

At the batch sizes of ``--draft-batches`` (default 1) a third engine, stepped in turn with
the two, speculates with a draft model (``method="draft_model"``, ``minirt.draft_proposer``):
the target model itself, a self-check (the book's model is the smallest of its family), so
nearly every draft is accepted and the row shows what verifying k + 1 rows a step costs
when the drafts are right, plus the draft's own k forwards a step, which make it slower
than plain decode. Its row is marked ``draft``; prompt lookup's ``ngram``.

The vLLM columns come from ``benchmarks/speculative_vllm.json`` (vLLM's CPU build with its
n-gram speculator on the same prompts, written by ``benchmarks/speculative_vllm.py`` in
``.venv-vllm``; another run, at another time): vLLM's acceptance rate and speed-up against
its own plain decode, on ``ngram`` rows whose settings match, "-" where it has no cell.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from _setup import timing_model

from minirt.engine import Engine
from minirt.request import Request
from minirt.workloads import default_tokenizer, multi_turn_chat, rag

VLLM_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speculative_vllm.json")

_FUNCTIONS = [
    ("def total_price(items, tax_rate):\n"
     "    subtotal = 0\n"
     "    for item in items:\n"
     "        subtotal += item.price * item.quantity\n"
     "    tax = subtotal * tax_rate\n"
     "    return subtotal + tax\n", "subtotal", "net_total"),
    ("def count_words(text):\n"
     "    counts = {}\n"
     "    for word in text.lower().split():\n"
     "        word = word.strip('.,;:!?')\n"
     "        counts[word] = counts.get(word, 0) + 1\n"
     "    return counts\n", "counts", "frequencies"),
    ("def moving_average(values, window):\n"
     "    result = []\n"
     "    for i in range(len(values) - window + 1):\n"
     "        chunk = values[i:i + window]\n"
     "        result.append(sum(chunk) / window)\n"
     "    return result\n", "chunk", "segment"),
    ("def find_duplicates(names):\n"
     "    seen = set()\n"
     "    duplicates = []\n"
     "    for name in names:\n"
     "        if name in seen:\n"
     "            duplicates.append(name)\n"
     "        seen.add(name)\n"
     "    return duplicates\n", "seen", "visited"),
]


def code_edit(tokenizer, num_requests: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompts asking for a renamed variable in a small function, the whole function back."""
    rng = random.Random(f"code-edit-{seed}")
    prompts = []
    for i in range(num_requests):
        source, old, new = _FUNCTIONS[i % len(_FUNCTIONS)]
        new = new if i < len(_FUNCTIONS) else f"{new}_{rng.randint(2, 99)}"
        messages = [{"role": "user", "content": f"Rename the variable `{old}` to `{new}` in "
                     f"this function and return the whole function.\n\n```python\n{source}```"}]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True))
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def workloads(tokenizer, names: list[str]) -> dict[str, list[list[int]]]:
    made = {"rag": lambda: rag(tokenizer, num_requests=16).requests,
            "code_edit": lambda: code_edit(tokenizer),
            "chat": lambda: multi_turn_chat(tokenizer, num_conversations=16, turns=1).requests}
    return {n: made[n]() for n in names}


def run(engine: Engine, prompts: list[list[int]], max_new: int) -> tuple[float, int, list]:
    """Serve ``prompts`` to ``max_new`` greedy tokens: wall seconds, steps, outputs."""
    handles = [engine.submit(Request(prompt=p, max_new_tokens=max_new, stop_on_eos=False))
               for p in prompts]
    steps, start = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps, [h.result.output_ids for h in handles]


def vllm_cells(spec: dict, max_new: int) -> dict:
    """(workload, B) -> vLLM's stored ngram cell, where its run used these settings."""
    try:
        with open(VLLM_JSON) as f:
            record = json.load(f)
    except FileNotFoundError:
        return {}
    if record.get("error") or record["max_new_tokens"] != max_new or any(
            record["speculative_config"][k] != v for k, v in spec.items()):
        return {}
    return {(c["workload"], c["batch"]): c for c in record["cells"]}


def add_cell_args(ap: argparse.ArgumentParser) -> None:
    """The arguments that pick the cells and the speculator: this script's and
    ``speculative_vllm.py``'s, so that the two runs can be asked for the same cells."""
    ap.add_argument("--workloads", nargs="+", default=["rag", "code_edit", "chat"],
                    choices=["rag", "code_edit", "chat"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)


def check_batches(batches: list[int]) -> None:
    """Exit with a message unless every batch size has its prompts (16 a workload)."""
    if any(not 1 <= b <= 16 for b in batches):
        sys.exit("--batches: each between 1 and 16 (16 prompts per workload)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cell_args(ap)
    ap.add_argument("--draft-batches", nargs="*", type=int, default=[1],
                    help="batch sizes that also get a draft-model row (the target itself)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    check_batches(args.batches)
    model = timing_model(args.threads)
    tokenizer = default_tokenizer()
    spec = {"num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    print(f"speculative {spec}, {args.max_new} greedy tokens per request, best of "
          f"{args.reps} alternated runs\n")
    peer = vllm_cells(spec, args.max_new)
    header = (f"{'workload':<10} {'B':>3} {'method':<6} {'plain tok/s':>11} {'spec tok/s':>10} "
              f"{'speed-up':>8} {'steps':>11} {'tok/req-step':>12} {'accept':>7} "
              f"{'same':>5} {'vLLM accept':>11} {'vLLM speed-up':>13}")
    print(header)
    print("-" * len(header))
    for name, prompts in workloads(tokenizer, args.workloads).items():
        for b in args.batches:
            batch = prompts[:b]
            cap = -(-(sum(len(p) + args.max_new for p in batch) + 1024) // 16) * 16
            engines = {"plain": Engine(model, tokenizer, capacity=cap, page_size=16),
                       "ngram": Engine(model, tokenizer, capacity=cap, page_size=16,
                                       speculative=spec)}
            if b in args.draft_batches:
                engines["draft"] = Engine(model, tokenizer, capacity=cap, page_size=16,
                                          speculative={"method": "draft_model",
                                                       "num_speculative_tokens":
                                                       args.num_speculative_tokens})
            for e in engines.values():  # the prompts cached: the timed runs decode
                run(e, batch, 1)
            for e in engines.values():
                if e.speculator is not None:
                    e.speculator.stats = type(e.speculator.stats)()  # the timed runs only
            best = {}
            for _ in range(args.reps):
                for label, e in engines.items():
                    seconds, steps, outs = run(e, batch, args.max_new)
                    if label not in best or seconds < best[label][0]:
                        best[label] = (seconds, steps, outs)
            t0, s0, o0 = best["plain"]
            for label in [m for m in engines if m != "plain"]:
                t1, s1, o1 = best[label]
                st = engines[label].speculator.stats  # over all reps: the same requests
                tokens = sum(len(o) for o in o1)
                same = sum(a == c for a, c in zip(o0, o1, strict=True))
                v = peer.get((name, b)) if label == "ngram" else None
                vllm = (f"{v['ngram']['acceptance_rate']:>11.2f} {v['speed_up']:>12.2f}x"
                        if v else f"{'-':>11} {'-':>13}")
                print(f"{name:<10} {b:>3} {label:<6} {tokens / t0:>11.1f} "
                      f"{tokens / t1:>10.1f} {t0 / t1:>7.2f}x {s0:>5}/{s1:<5} "
                      f"{st.tokens_per_step:>12.2f} {st.acceptance_rate:>7.2f} "
                      f"{same:>2}/{b:<2} {vllm}")
    print(f"\nload average {os.getloadavg()[0]:.2f} (1 min); steps: plain/speculative "
          "Engine.step calls; tok/req-step: tokens a request gains per verify step "
          "(1.00 is plain decode); accept: accepted / proposed drafts; same: requests whose "
          "greedy outputs are identical; method draft: the target model as its own draft; "
          "vLLM: its stored n-gram run (speculative_vllm.json), acceptance and speed-up over "
          "its own plain decode")


if __name__ == "__main__":
    main()
