"""Replay a book workload against any OpenAI-compatible server and measure what it caches.

    python -m minirt.replay --base-url http://127.0.0.1:8000/v1 --workload chat --rate 2

Workloads: ``chat`` (chapter 06's support-desk conversations: each conversation starts
at its arrival time and sends turn k+1 as soon as turn k's answer is back, with the whole
history), ``few-shot`` and ``rag`` (chapter 03's prompts, sent as token ids to
``/v1/completions``), or a JSONL file of chat requests (one ``{"messages": [...]}`` per
line, optionally with ``max_tokens``; OpenAI batch lines with a ``body`` work too).
Arrivals are a Poisson process (or evenly spaced) at ``--rate`` per second; 0 sends
everything at once.

Every request streams (with ``stream_options.include_usage``) through the official
``openai`` client, so the same command runs against ``minirt.serve``, vLLM's server
(start it with ``--enable-prompt-tokens-details``) or SGLang's. Per request it records
TTFT (send to first text), latency, prompt, cached and completion tokens; the summary
compares the hit rate with the workload's unique-token bound (chapter 03), computed
from the prompts' token ids with the model's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .workloads import support_chats, unique_prefix_count

__all__ = ["ReplayReport", "ReplayRecord", "arrival_times", "load_jsonl", "main", "replay"]


@dataclass
class ReplayRecord:
    """One request as the client saw it. Times in seconds; ``arrival`` from the start."""

    index: int
    conversation: int
    turn: int
    arrival: float
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    server: str | None = None  # the system_fingerprint the answer carried, if any
    prompt_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class ReplayReport:
    """All records of one replay, and the totals a reader compares across servers."""

    workload: str
    base_url: str
    model: str
    rate: float
    records: list[ReplayRecord]
    wall_time: float

    @property
    def ok(self) -> list[ReplayRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.ok)

    @property
    def cached_tokens(self) -> int | None:
        cached = [r.cached_tokens for r in self.ok]
        return None if any(c is None for c in cached) else sum(cached)

    @property
    def hit_rate(self) -> float | None:
        cached = self.cached_tokens
        return None if cached is None or not self.prompt_tokens else cached / self.prompt_tokens

    @property
    def unique_bound(self) -> int:
        """Distinct prompt prefixes: what any prefix cache prefills at least (no decode reuse)."""
        return unique_prefix_count([r.prompt_ids for r in self.ok])

    @property
    def best_hit_rate(self) -> float:
        """The hit rate of a cache that never forgets, by the unique-token bound."""
        total = sum(len(r.prompt_ids) for r in self.ok)
        return 1.0 - self.unique_bound / total if total else 0.0

    def summary(self) -> str:
        ok = self.ok
        ttft = [r.ttft for r in ok if r.ttft is not None]
        lat = [r.latency for r in ok if r.latency is not None]
        local = sum(len(r.prompt_ids) for r in ok)
        lines = [
            f"replay {self.workload} -> {self.base_url} ({self.model}): {len(self.records)} "
            f"requests, {len(self.records) - len(ok)} failed, rate "
            f"{'all at once' if not self.rate else f'{self.rate:g}/s'}, "
            f"wall {self.wall_time:.1f} s",
        ]
        if ttft:
            lines.append(f"  TTFT s: median {statistics.median(ttft):.3f}, mean "
                         f"{statistics.fmean(ttft):.3f}, max {max(ttft):.3f}; latency s: "
                         f"median {statistics.median(lat):.3f}, max {max(lat):.3f}")
        hit = self.hit_rate
        lines.append(
            f"  prompt tokens {self.prompt_tokens} (tokenized here: {local}), cached "
            + ("not reported by the server" if hit is None else
               f"{self.cached_tokens}: hit rate {hit:.3f}")
            + f"; unique-token bound {self.unique_bound}: best hit rate {self.best_hit_rate:.3f}")
        if local != self.prompt_tokens:
            lines.append("  note: the server counts prompt tokens differently (another "
                         "tokenizer or chat template?): the bound is approximate")
        return "\n".join(lines)

    def table(self) -> str:
        """One line per request."""
        rows = [f"{'req':>4} {'conv':>4} {'turn':>4} {'arrive':>7} {'ttft':>7} {'latency':>7} "
                f"{'prompt':>6} {'cached':>6} {'out':>4}  finish"]
        for r in self.records:
            if r.error:
                rows.append(f"{r.index:>4} {r.conversation:>4} {r.turn:>4} {r.arrival:>7.2f}  "
                            f"error: {r.error}")
                continue
            cached = "-" if r.cached_tokens is None else r.cached_tokens
            ttft = float("nan") if r.ttft is None else r.ttft
            rows.append(f"{r.index:>4} {r.conversation:>4} {r.turn:>4} {r.arrival:>7.2f} "
                        f"{ttft:>7.3f} {r.latency:>7.3f} {r.prompt_tokens:>6} {cached:>6} "
                        f"{r.completion_tokens:>4}  {r.finish_reason}")
        return "\n".join(rows)


def arrival_times(n: int, rate: float, kind: str = "poisson", seed: int = 0) -> list[float]:
    """Start offsets (s) of ``n`` arrivals at ``rate`` per second; all 0 if ``rate`` is 0."""
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate}")
    if not rate:
        return [0.0] * n
    if kind == "uniform":
        return [i / rate for i in range(n)]
    if kind != "poisson":
        raise ValueError(f"arrivals must be 'poisson' or 'uniform', got {kind!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def load_jsonl(path: str | Path) -> list[dict]:
    """Chat requests from a JSONL file: ``{"messages": [...], "max_tokens": n}`` per line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        obj = obj.get("body", obj)
        if not isinstance(obj.get("messages"), list):
            raise ValueError(f"{path}:{i}: each line needs a 'messages' list")
        out.append(obj)
    return out


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# Awaited with each record just before its request goes out.
Hook = Callable[["ReplayRecord"], Awaitable[None]]


async def _request(client, model: str, rec: ReplayRecord, t0: float, *, messages=None,
                   prompt=None, max_tokens: int, temperature: float, seed: int | None,
                   extra: dict, hook: Hook | None = None) -> None:
    """Send one streaming request; fill ``rec`` with what came back."""
    if hook is not None:
        await hook(rec)
    start = time.perf_counter()
    rec.arrival = start - t0
    common = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
              "stream": True, "stream_options": {"include_usage": True}, "extra_body": extra}
    if seed is not None:
        common["seed"] = seed
    try:
        if messages is not None:
            stream = await client.chat.completions.create(messages=messages, **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                piece = choice.delta.content if messages is not None else choice.text
                if piece:
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - start
                    pieces.append(piece)
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
            rec.server = getattr(chunk, "system_fingerprint", None) or rec.server
        rec.latency = time.perf_counter() - start
        rec.text = "".join(pieces)
        if usage is not None:
            rec.prompt_tokens = usage.prompt_tokens
            rec.completion_tokens = usage.completion_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
            rec.cached_tokens = None if cached is None else int(cached)
    except Exception as exc:  # one failed request is a record, not the end of the replay
        rec.error = f"{type(exc).__name__}: {exc}"


async def _replay(base_url: str, workload: str, tokenizer, *, rate: float, arrivals: str,
                  seed: int, max_tokens: int, temperature: float, model: str | None,
                  api_key: str, conversations: int, turns: int, system_tokens: int,
                  num_requests: int, ignore_eos: bool, hook: Hook | None) -> ReplayReport:
    import openai

    from .workloads import few_shot, rag

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                timeout=3600)
    if model is None:
        model = (await client.models.list()).data[0].id
    extra = {"ignore_eos": True} if ignore_eos else {}
    sampling = {"max_tokens": max_tokens, "temperature": temperature,
                "seed": seed if temperature > 0 else None, "extra": extra, "hook": hook}
    records: list[ReplayRecord] = []
    t0 = time.perf_counter()

    async def at(offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))

    if workload == "chat":
        chats = support_chats(tokenizer, conversations, turns, system_tokens, seed)
        starts = arrival_times(conversations, rate, arrivals, seed)

        async def conversation(c: int) -> None:
            await at(starts[c])
            history = [{"role": "system", "content": chats.system}]
            for t, user in enumerate(chats.users[c]):
                history.append({"role": "user", "content": user})
                rec = ReplayRecord(len(records), c, t + 1, 0.0,
                                   prompt_ids=_chat_ids(tokenizer, history))
                records.append(rec)
                await _request(client, model, rec, t0, messages=[dict(m) for m in history],
                               **sampling)
                if rec.error:
                    return
                history.append({"role": "assistant", "content": rec.text})

        await asyncio.gather(*(conversation(c) for c in range(conversations)))
    else:
        if workload in ("few-shot", "rag"):
            w = (few_shot(tokenizer, num_requests=num_requests, seed=seed)
                 if workload == "few-shot" else rag(tokenizer, num_requests=num_requests,
                                                      seed=seed))
            items = [{"prompt": ids} for ids in w.requests]
        else:
            items = [{"messages": obj["messages"], "max_tokens": obj.get("max_tokens")}
                     for obj in load_jsonl(workload)]
        starts = arrival_times(len(items), rate, arrivals, seed)
        for i, item in enumerate(items):
            ids = item["prompt"] if "prompt" in item else _chat_ids(tokenizer, item["messages"])
            records.append(ReplayRecord(i, i, 1, starts[i], prompt_ids=list(ids)))

        async def one(i: int) -> None:
            await at(starts[i])
            item, opts = items[i], dict(sampling)
            if item.get("max_tokens"):
                opts["max_tokens"] = int(item["max_tokens"])
            if "prompt" in item:
                await _request(client, model, records[i], t0, prompt=item["prompt"], **opts)
            else:
                await _request(client, model, records[i], t0, messages=item["messages"],
                               **opts)

        await asyncio.gather(*(one(i) for i in range(len(items))))
    await client.close()
    records.sort(key=lambda r: r.index)
    return ReplayReport(workload, base_url, model, rate, records, time.perf_counter() - t0)


def replay(base_url: str, workload: str = "chat", *, rate: float = 1.0,
           arrivals: str = "poisson", seed: int = 0, max_tokens: int = 16,
           temperature: float = 0.0, model: str | None = None, api_key: str = "unused",
           conversations: int = 4, turns: int = 3, system_tokens: int = 500,
           num_requests: int = 8, ignore_eos: bool = False, tokenizer=None,
           hook: Hook | None = None) -> ReplayReport:
    """Replay ``workload`` against the server at ``base_url`` (ending in ``/v1``).

    ``workload``: "chat", "few-shot", "rag" or a JSONL path. ``tokenizer``: the served
    model's (default: the book's model), used to build the workload and the bound.
    ``hook``: an async callable awaited with each record just before its request is
    sent, say to read a router's loads at each arrival.
    """
    if workload not in ("chat", "few-shot", "rag") and not Path(workload).is_file():
        raise ValueError(f"workload must be chat, few-shot, rag or a JSONL file; got "
                         f"{workload!r}")
    if tokenizer is None:
        from .workloads import default_tokenizer

        tokenizer = default_tokenizer()
    return asyncio.run(_replay(
        base_url.rstrip("/"), workload, tokenizer, rate=rate, arrivals=arrivals, seed=seed,
        max_tokens=max_tokens, temperature=temperature, model=model, api_key=api_key,
        conversations=conversations, turns=turns, system_tokens=system_tokens,
        num_requests=num_requests, ignore_eos=ignore_eos, hook=hook))


def main(argv: Sequence[str] | None = None) -> ReplayReport:
    """``python -m minirt.replay``: replay, print the per-request table and the summary."""
    p = argparse.ArgumentParser(prog="python -m minirt.replay",
                                description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--workload", default="chat", help="chat, few-shot, rag or a JSONL file")
    p.add_argument("--rate", type=float, default=1.0,
                   help="arrivals per second (conversations for chat); 0: all at once")
    p.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-tokens (vLLM and minirt.serve accept it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer (default: the book's model)")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--num-requests", type=int, default=8, help="few-shot and rag")
    p.add_argument("--out", default=None, help="write every record to this JSONL file")
    p.add_argument("--quiet", action="store_true", help="summary only")
    args = p.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    report = replay(args.base_url, args.workload, rate=args.rate, arrivals=args.arrivals,
                    seed=args.seed, max_tokens=args.max_tokens, temperature=args.temperature,
                    model=args.model, api_key=args.api_key, conversations=args.conversations,
                    turns=args.turns, system_tokens=args.system_tokens,
                    num_requests=args.num_requests, ignore_eos=args.ignore_eos,
                    tokenizer=tokenizer)
    if not args.quiet:
        print(report.table())
    print(report.summary())
    if args.out:
        with open(args.out, "w") as f:
            for r in report.records:
                f.write(json.dumps(asdict(r)) + "\n")
    return report


if __name__ == "__main__":
    main()
