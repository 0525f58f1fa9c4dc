"""Chapter 12's request logs replayed on vLLM's server and minirt.serve, beside hitcheck.

    make peer-vllm                       # builds .venv-vllm once, then vs_vllm.py and this
    python benchmarks/hitcheck_vllm.py   # if .venv-vllm exists already

The logs are chapter 12's (sections 2, 5 and 6): six support-desk requests with the time
at the top of the system prompt (``volatile``), the same with the time at the end of the
user's message (``stable``), eight product questions behind six product sheets in one
order (``sheets``) and in shuffled orders (``shuffled``), four more stable requests with
other sampling settings (``sampled``), and a two-turn chat whose second turn sends the
server's own first reply back as text (``retok``). They are sent one request at a time,
in that order, to three servers up at once: vLLM's OpenAI server (its CPU build,
prefix caching on, blocks of 128 tokens by default, ``--enable-prompt-tokens-details``)
and ``minirt.serve`` with pages of 128 and of 1. Per request it prints each server's
``cached_tokens`` beside hitcheck's bound from the earlier prompts at page 1 and at 128
(``possible``), and per log the sums, and writes everything to
``benchmarks/hitcheck_vllm.json``, which chapter 12 reads as its recorded run.

It exits 1 unless minirt at page 128 caches what vLLM caches, request by request, and
minirt at page 1 what hitcheck says is possible at page 1 (the second turn of ``retok``
excepted: there the server's own reply is cached too, which a log of prompts alone cannot
know).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

from _servers import MODEL_NAME, ROOT, start_vllm_server, stop_group

OUT = ROOT / "benchmarks" / "hitcheck_vllm.json"
BLOCK = 128  # vLLM's CPU block size for this model when none is given

# The logs of chapter 12 (the chapter asserts that the recorded lines equal its own).
SYSTEM = ("You are the support assistant of Northwind Outfitters, an online shop for hiking "
          "and camping gear. Answer in two or three sentences, politely and precisely. "
          "Our return window is 30 days from delivery; items must be unused and in their "
          "original packaging. Shipping is free above 50 euros; standard delivery takes "
          "three to five working days, express delivery one to two. Never promise a refund "
          "before the returned item has been inspected, and never ask for card numbers.")
QUESTIONS = ["Can I return a tent I have already slept in once?",
             "How long does express delivery take to Lyon?",
             "Is shipping free for an order of 45 euros?",
             "My boots arrived in the wrong size. What now?",
             "Do you sell gas canisters for camping stoves?",
             "When will I get my refund for the returned jacket?"]
STAMPS = [f"2026-05-0{1 + i // 3} 09:{14 + 7 * i:02d}:{37 * i % 60:02d}" for i in range(6)]
SETTINGS = [{"temperature": 0.7, "seed": 7}, {"temperature": 1.3, "top_k": 5},
            {"temperature": 0}, {"temperature": 1.0, "seed": 123, "top_k": 50}]
SHEETS = {
    "bag": "Summit sleeping bag: down fill, comfort rating minus five degrees, 1.1 kg, packs "
           "to the size of a melon, zip on either side.",
    "filter": "Squeeze filter: removes bacteria and protozoa with a 0.1 micron hollow fibre, "
              "good for 2000 litres, fits standard bottles.",
    "lamp": "Ridge headlamp: 400 lumens, red night mode, three AAA batteries or a USB "
            "battery pack, 80 g.",
    "mat": "Cloud sleeping mat: self-inflating foam, 5 cm thick, insulation value 4.2, rolls "
           "to the size of a water bottle.",
    "stove": "Pocket stove: screws onto a standard gas canister, boils a litre of water in "
             "four minutes, weighs 90 g.",
    "tent": "Trailhead 2 tent: two-person, 1.9 kg, double wall, waterproof to 3000 mm, "
            "pitches in four minutes.",
}
ASKED = ["Which item is the heaviest?", "Can the filter remove viruses?",
         "How long does the stove take to boil water?", "Is the tent waterproof?",
         "Which of these would I need for a cold night?", "What does the bag pack down to?",
         "How bright is the headlamp?", "How thick is the mat?"]
ITALY = [{"role": "user", "content": "What is the capital of Italy?"}]


def support_request(stamp: str, question: str, stable: bool) -> dict:
    if stable:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{question}\n\n(Sent at {stamp}.)"}]
    else:
        messages = [{"role": "system", "content": f"Current time: {stamp}.\n\n{SYSTEM}"},
                    {"role": "user", "content": question}]
    return {"messages": messages, "temperature": 0}


def sheets_request(question: str, order: list[str]) -> dict:
    sheets = "\n\n".join(SHEETS[name] for name in order)
    return {"messages": [{"role": "system", "content": "Answer from the product sheets "
                                                       "below.\n\n" + sheets},
                         {"role": "user", "content": question}]}


def logs() -> dict[str, list[dict]]:
    """Chapter 12's logs by name, in the order they are sent."""
    rng = random.Random(12)
    orders = [rng.sample(sorted(SHEETS), k=len(SHEETS)) for _ in ASKED]
    return {
        "volatile": [support_request(s, q, False) for s, q in zip(STAMPS, QUESTIONS, strict=True)],
        "stable": [support_request(s, q, True) for s, q in zip(STAMPS, QUESTIONS, strict=True)],
        "sampled": [{**support_request(f"2026-05-04 1{i}:05:00", q, True), **opts}
                    for i, (q, opts) in enumerate(zip(QUESTIONS[:4], SETTINGS, strict=True))],
        "sheets": [sheets_request(q, sorted(SHEETS)) for q in ASKED],
        "shuffled": [sheets_request(q, o) for q, o in zip(ASKED, orders, strict=True)],
    }


def send(client, url: str, body: dict) -> tuple[int, int, str]:
    """One chat request: (prompt tokens, cached tokens, reply text)."""
    resp = client.post(url + "/chat/completions",
                       json={**body, "model": MODEL_NAME, "max_tokens": body.get("max_tokens", 1),
                             "stream": False})
    data = resp.json()
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status_code}: {str(data)[:300]}")
    usage = data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        raise RuntimeError(f"{url} does not report cached_tokens")
    return usage["prompt_tokens"], int(cached), data["choices"][0]["message"]["content"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(OUT), help="where the results go (JSON)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import httpx

    from minirt.hitcheck import load_requests, load_tokenizer, render_all
    from minirt.hitcheck.live import prompt_bounds
    from minirt.model import fetch_default_model
    from minirt.serve import launch

    tokenizer = load_tokenizer()
    named = logs()
    stream = [(name, row) for name, rows in named.items() for row in rows]
    requests = load_requests([json.dumps(row) for _, row in stream])
    rendered = render_all(requests, tokenizer)
    possible = {page: prompt_bounds(requests, rendered, page) for page in (1, BLOCK)}

    model_path = str(fetch_default_model())
    results: dict[str, list] = {}
    replies: dict[str, str] = {}
    started = time.time()
    with contextlib.ExitStack() as servers:
        proc, vllm_url, _ = start_vllm_server(model_path)
        servers.callback(stop_group, proc)
        urls = {"vLLM": vllm_url}
        for page in (BLOCK, 1):
            srv = servers.enter_context(launch("--page-size", str(page), "--capacity", "16384"))
            urls[f"minirt page {page}"] = srv.url
        with httpx.Client(timeout=300) as client:
            for server, url in urls.items():
                got = [send(client, url, row) for _, row in stream]
                # retok: the first turn answered by the server, its text sent back
                first = send(client, url, {"messages": ITALY, "temperature": 0,
                                           "max_tokens": 16})
                second = send(client, url, {"messages": ITALY + [
                    {"role": "assistant", "content": first[2]},
                    {"role": "user", "content": "Tell me more about it."}],
                    "temperature": 0, "max_tokens": 1})
                replies[server] = first[2]
                results[server] = [list(g[:2]) for g in got] + [list(first[:2]),
                                                                list(second[:2])]
    print(f"servers: {', '.join(urls)}; {time.time() - started:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f}")

    names = [name for name, _ in stream] + ["retok", "retok"]
    possible_1 = possible[1] + [None, None]
    possible_b = possible[BLOCK] + [None, None]
    print(f"\n{'log':9s} {'#':>2s} {'prompt':>6s} {'page 1':>6s} {'p 128':>6s} "
          + " ".join(f"{s:>14s}" for s in results))
    counter: dict[str, int] = {}
    for i, name in enumerate(names):
        counter[name] = counter.get(name, 0) + 1
        cells = " ".join(f"{results[s][i][1]:14d}" for s in results)
        p1 = "-" if possible_1[i] is None else possible_1[i]
        pb = "-" if possible_b[i] is None else possible_b[i]
        print(f"{name:9s} {counter[name]:2d} {results['vLLM'][i][0]:6d} {p1!s:>6s} {pb!s:>6s} "
              f"{cells}")
    print("\nper log (sums of cached tokens):")
    summary = {}
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        summary[name] = {
            "prompt": sum(results["vLLM"][i][0] for i in idx),
            "possible page 1": sum(possible_1[i] or 0 for i in idx),
            f"possible page {BLOCK}": sum(possible_b[i] or 0 for i in idx),
            **{s: sum(results[s][i][1] for i in idx) for s in results},
        }
        print(f"  {name:9s} {summary[name]}")
    print("\nfirst replies to the Italian question:", replies)

    problems = []
    for i, name in enumerate(names):
        if results["minirt page 128"][i][1] != results["vLLM"][i][1]:
            problems.append(f"{name} #{i}: minirt page {BLOCK} cached "
                            f"{results['minirt page 128'][i][1]}, vLLM {results['vLLM'][i][1]}")
        if possible_1[i] is not None and results["minirt page 1"][i][1] != possible_1[i]:
            problems.append(f"{name} #{i}: minirt page 1 cached "
                            f"{results['minirt page 1'][i][1]}, hitcheck {possible_1[i]}")
    Path(args.out).write_text(json.dumps({
        "logs": named, "names": names, "possible": {"1": possible_1, str(BLOCK): possible_b},
        "servers": results, "replies": replies, "summary": summary,
        "problems": problems}, indent=1) + "\n")
    print(f"\nwrote {os.path.relpath(args.out, ROOT)}")
    for line in problems:
        print("PROBLEM:", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
