"""What the prefix cache buys the serving engine on the real model, measured in one run.

    python benchmarks/engine.py                 # TTFT table, where the time goes, workloads
    python benchmarks/engine.py --repeats 15    # more repeats per point
    python benchmarks/engine.py --threads 1     # torch threads (default: torch's choice)

1. TTFT of a prompt whose first P tokens (256, 512, 1024) are cached and whose last S
   (32, 64) are not, through ``Engine`` with the cache, against
   * the ideal: a bare prefill of the S suffix tokens alone (plain model forward), and
   * no cache: the same engine with ``use_cache=False``, prefilling all P + S tokens.
   Medians of ``--repeats`` runs after a warm-up, the three timed in turn; every cached
   run uses a fresh suffix (so it never hits a suffix cached by the previous run).
2. Where the cached time goes (P=1024, S=64): one forward through the pool, as
   transformers' forward over chapter 04's ``PoolCache`` with transformers' sdpa (which
   copies each grouped K/V head per query head) and with ``minirt.model.ATTENTION``
   (reads them in place), and as the engine runs it (``llama_forward``, the cached
   prefix read once and merged with the new tokens' causal attention), against the ideal;
   the profiler's split of the engine's forward; and the FLOP model of exercise 6.3
   (attention to the cached prefix is arithmetic the ideal does not do: with exact
   attention, the floor).
3. The chapter's workloads with a pool large enough never to evict: prompt tokens
   computed against the unique-token bound, and the hit rate (deterministic counts).

Timings on a shared machine are noisy: run it on a quiet one; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch

from minirt.chat import chat_script, serve_chat
from minirt.engine import Engine
from minirt.forward import forward_paged
from minirt.model import ATTENTION, load_model
from minirt.pool import KVPool, PageTable
from minirt.request import Request
from minirt.workloads import few_shot, rag


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn (a, b, c, a, b, c, ...) after a warm-up.

    Taking turns makes slow drifts of a shared machine hit every contender alike. A
    function may return its own measurement (seconds) instead of being timed whole.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            own = fn()
            if round_:  # round 0 is the warm-up
                times[name].append(own if isinstance(own, float) else
                                   time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class TTFTBench:
    """Fresh random prompts (seeded) and the engines the TTFT table needs."""

    def __init__(self, model, tokenizer, repeats: int) -> None:
        self.model, self.repeats = model, repeats
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = model.config.vocab_size
        self.cached = Engine(model, tokenizer, capacity=16384)
        self.plain = Engine(model, tokenizer, capacity=16384, use_cache=False)

    def ids(self, n: int) -> list[int]:
        # Ids from 1000 up: ordinary word pieces, no special tokens.
        return torch.randint(1000, self.vocab, (n,), generator=self.gen).tolist()

    def ttft(self, engine: Engine, prompt: list[int], expect_cached: int | None = None) -> float:
        r = engine.generate([Request(prompt=prompt, max_new_tokens=1)], progress=False)[0]
        if expect_cached is not None:
            assert r.metrics.cached_tokens == expect_cached, r.metrics
        return r.metrics.ttft

    def point(self, prefix_len: int, suffix_len: int) -> dict[str, float]:
        prefix = self.ids(prefix_len)
        self.cached.flush()
        self.ttft(self.cached, prefix)  # the prefix is now cached
        suffix = torch.tensor(self.ids(suffix_len))[None].to(self.model.device)

        def bare() -> None:
            with torch.inference_mode():
                self.model(suffix, logits_to_keep=1).logits[0, -1].argmax().item()

        return interleaved_medians({
            "cached": lambda: self.ttft(self.cached, prefix + self.ids(suffix_len), prefix_len),
            "ideal": bare,
            "full": lambda: self.ttft(self.plain, prefix + self.ids(suffix_len), 0),
        }, self.repeats)


def ttft_table(bench: TTFTBench) -> list[dict]:
    rows = []
    print("\n1. TTFT: cached prefix P + uncached suffix S (median ms of "
          f"{bench.repeats} after a warm-up)")
    print(f"{'P':>5} {'S':>4} {'cached':>8} {'ideal':>8} {'no cache':>9} "
          f"{'cached/ideal':>13} {'full/cached':>12}")
    for p in (256, 512, 1024):
        for s in (32, 64):
            r = bench.point(p, s)
            rows.append({"P": p, "S": s, **r})
            print(f"{p:>5} {s:>4} {r['cached'] * 1e3:>8.1f} {r['ideal'] * 1e3:>8.1f} "
                  f"{r['full'] * 1e3:>9.1f} {r['cached'] / r['ideal']:>13.2f} "
                  f"{r['full'] / r['cached']:>12.2f}")
    return rows


def where_time_goes(model, repeats: int) -> None:
    """P=1024, S=64 forward through the pool: attention variants, profiler split, FLOP model."""
    from minirt.checks.ch06 import _prefill_flops

    print("\n2. Where the cached time goes (P=1024, S=64, one forward through the pool; "
          f"median ms of {repeats}, timed in turn)")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, model.config.vocab_size, (1088,), generator=gen)
    pool = KVPool.for_model(model, 2048)
    table = PageTable(pool.alloc(1088))
    forward_paged(model, pool, [PageTable(table.slots[:1024])], [ids[:1024]])

    def paged(attention):
        def run() -> None:
            model.set_attn_implementation(attention)
            with mock.patch("minirt.forward.is_llama", lambda m: False):  # transformers' forward
                forward_paged(model, pool, [table], [ids[1024:]])
        return run

    def engine_path() -> None:
        model.set_attn_implementation(ATTENTION)
        forward_paged(model, pool, [table], [ids[1024:]])

    def bare() -> None:
        model.set_attn_implementation(ATTENTION)
        with torch.inference_mode():
            model(ids[None, 1024:].to(model.device), logits_to_keep=1)

    variants = {
        "through the pool, transformers' sdpa (K/V heads copied)": paged("sdpa"),
        f"through the pool, {ATTENTION} (K/V heads read in place)": paged(ATTENTION),
        "through the pool, llama_forward, prefix read once (minirt)": engine_path,
        "bare prefill of the 64 suffix tokens (the ideal)": bare,
    }
    times = interleaved_medians(variants, repeats)
    model.set_attn_implementation(ATTENTION)
    ideal = times["bare prefill of the 64 suffix tokens (the ideal)"]
    for name, t in times.items():
        print(f"   {name:<58} {t * 1e3:7.1f} ms  {t / ideal:5.2f}x ideal")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            forward_paged(model, pool, [table], [ids[1024:]])
    groups = {"linear layers (GEMMs)": ("aten::mm", "aten::addmm",
                                        "mkldnn::_linear_pointwise"),
              "attention (sdpa)": ("minirt::attention",
                                   "aten::_scaled_dot_product_flash_attention_for_cpu",
                                   "aten::_scaled_dot_product_attention_math",
                                   "aten::_scaled_dot_product_efficient_attention",
                                   "aten::_scaled_dot_product_flash_attention"),
              "K/V gather + write (index_select, index, index_copy_)":
                  ("aten::index_select", "aten::index", "aten::index_copy_")}
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shown = 0.0
    for label, names in groups.items():
        t = sum(e.self_cpu_time_total for e in events if e.key in names)
        shown += t
        print(f"   {label:<55} {100 * t / total:5.1f}% of self CPU time")
    print(f"   {'everything else (norms, RoPE, copies, mask, ...)':<55} "
          f"{100 * (total - shown) / total:5.1f}%")
    config = model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv, hd = (config.num_attention_heads, config.num_key_value_heads,
                     getattr(config, "head_dim", hidden // config.num_attention_heads))
    params = config.num_hidden_layers * (2 * hidden * heads * hd + 2 * hidden * kv * hd
                                         + 3 * hidden * inter)
    args = (params, config.num_hidden_layers, heads, hd)
    ratio = _prefill_flops(64, 1024, *args) / _prefill_flops(64, 0, *args)
    print(f"   FLOP model (exercise 6.3): cached 1024+64 / bare 64 = {ratio:.2f}x "
          "(attention to the 1024 cached keys)")


def workload_totals(model, tokenizer) -> None:
    print("\n3. Workloads, pool large enough never to evict (deterministic counts)")
    print(f"   {'workload':<34} {'prompt':>7} {'computed':>9} {'bound':>6} "
          f"{'computed/bound':>15} {'hit rate':>9}")

    def row(name, t) -> None:
        print(f"   {name:<34} {t.prompt_tokens:>7} {t.computed_tokens:>9} {t.unique_bound:>6} "
              f"{t.computed_over_bound:>15.3f} {t.hit_rate:>9.3f}")

    engine = Engine(model, tokenizer, capacity=32768)
    chat = serve_chat(engine, chat_script(tokenizer, 8, 4, 500), max_new_tokens=8,
                      progress=False)
    row("chat 8 x 4 turns, 500-token system", chat.totals())
    for name, w in (("few-shot 8 prompts, 8 examples", few_shot(tokenizer, 8, 8)),
                    ("RAG 16 prompts, 4 documents", rag(tokenizer, 4, 16))):
        engine = Engine(model, tokenizer, capacity=32768)
        res = engine.generate([Request(prompt=ids, max_new_tokens=4) for ids in w.requests],
                              progress=False)
        row(name, res.totals)
    print("   (chat computes less than its bound: earlier answers, part of later prompts,\n"
          "    were computed while decoding and cached at finish)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    device = next(model.parameters()).device
    print(f"device {device}, dtype {model.dtype}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} (1 min)")
    start = time.perf_counter()
    ttft_table(TTFTBench(model, tokenizer, args.repeats))
    where_time_goes(model, args.repeats)
    workload_totals(model, tokenizer)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average now "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
