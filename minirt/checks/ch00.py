"""Checkers for chapter 00: what the KV cache costs and how much prefill a workload repeats.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from ._common import expect, passed

__all__ = [
    "check_kv_bytes_per_token",
    "check_prefill_waste",
    "check_requests_that_fit",
    "check_system_prompt_prefill",
]

# Model shapes the reader's formula is tried on: (what it is like, config).
KV_CONFIGS: list[tuple[str, dict]] = [
    ("Llama-3-8B-like, bf16", dict(num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, dtype="bfloat16")),
    ("SmolLM2-135M, fp32", dict(num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, head_dim=64, dtype="float32")),
    ("GPT-2-small-like (no GQA), fp16", dict(num_hidden_layers=12, num_attention_heads=12,
                                             num_key_value_heads=12, head_dim=64,
                                             dtype="float16")),
    ("Qwen2.5-7B-like, bf16", dict(num_hidden_layers=28, num_attention_heads=28,
                                   num_key_value_heads=4, head_dim=128, dtype="bfloat16")),
    ("a 70B-like model with fp8 KV", dict(num_hidden_layers=80, num_attention_heads=64,
                                          num_key_value_heads=8, head_dim=128,
                                          dtype="float8_e4m3fn")),
]


def _element_size(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _kv_bytes_per_token(config: dict) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element."""
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
            * config["head_dim"] * _element_size(config["dtype"]))


def _same_int(got, expected: int) -> bool:
    """True if ``got`` is an integer (Python, NumPy or 0-d integer tensor) equal to ``expected``."""
    if isinstance(got, bool):
        return False
    try:
        return operator.index(got) == expected
    except TypeError:
        return False


def check_kv_bytes_per_token(kv_bytes_per_token: Callable[[dict], int]) -> None:
    """Exercise 0.1: bytes of K and V one token occupies, from a model's config dict."""
    for name, config in KV_CONFIGS:
        expected = _kv_bytes_per_token(config)
        got = kv_bytes_per_token(dict(config))
        expect(_same_int(got, expected),
               f"kv_bytes_per_token({config}) ({name}) returned {got!r}, expected {expected}: "
               "K and V, for every layer and every KV head (not query head), head_dim "
               "elements each, times the bytes of one element of that dtype.")
    llama = _kv_bytes_per_token(KV_CONFIGS[0][1])
    passed("0.1", f"{len(KV_CONFIGS)} configs right; a Llama-3-8B-like model keeps "
                  f"{llama} bytes ({llama // 1024} KiB) of KV per token in bf16")


def _requests_that_fit(budget_bytes: int, bytes_per_token: int, prompt_len: int,
                       own_len: int, shared: bool) -> int:
    """How many requests' KV fits in the budget, with or without one shared prompt copy."""
    if not shared:
        return budget_bytes // ((prompt_len + own_len) * bytes_per_token)
    left = budget_bytes - prompt_len * bytes_per_token
    return max(left, 0) // (own_len * bytes_per_token)


GIB = 1 << 30
FIT_CASES = [
    (64 * GIB, 131072, 1024, 200, False), (64 * GIB, 131072, 1024, 200, True),
    (1 * GIB, 46080, 1024, 64, False), (1 * GIB, 46080, 1024, 64, True),
    (10 * 131072, 131072, 16, 4, True), (10 * 131072, 131072, 16, 4, False),
    (100_000, 1000, 30, 7, True), (100_000, 1000, 30, 7, False),
]


def check_requests_that_fit(requests_that_fit: Callable[[int, int, int, int, bool], int]) -> None:
    """Exercise 0.2: concurrent requests whose KV fits in memory, with and without sharing
    the prompt's KV."""
    for case in FIT_CASES:
        expected = _requests_that_fit(*case)
        got = requests_that_fit(*case)
        budget, per_token, prompt_len, own_len, shared = case
        expect(_same_int(got, expected),
               f"requests_that_fit(budget_bytes={budget}, bytes_per_token={per_token}, "
               f"prompt_len={prompt_len}, own_len={own_len}, shared={shared}) returned "
               f"{got!r}, expected {expected}. Only whole requests count; with sharing, one "
               "copy of the prompt's KV is paid for first.")
    alone, together = _requests_that_fit(*FIT_CASES[0]), _requests_that_fit(*FIT_CASES[1])
    passed("0.2", f"in 64 GiB, {alone} Llama-3-8B-like requests fit with private copies of a "
                  f"1024-token prompt, {together} when they share it")


def _prefill_waste(requests: Sequence[Sequence[int]]) -> tuple[int, int]:
    naive = sum(len(r) for r in requests)
    prefixes = {tuple(r[: i + 1]) for r in requests for i in range(len(r))}
    return naive, len(prefixes)


PREFILL_WORKLOADS: list[tuple[str, list[list[int]]]] = [
    ("two requests sharing [1, 2, 3]", [[1, 2, 3, 4], [1, 2, 3, 5]]),
    ("the same request three times", [[7, 7, 7], [7, 7, 7], [7, 7, 7]]),
    ("the same suffix after different first tokens", [[1, 9, 9], [2, 9, 9]]),
    ("a request that is a prefix of another", [[1, 2], [1, 2, 3]]),
    ("pairs share prefixes, all three share nothing", [[1, 2, 3], [1, 2, 4], [5, 6]]),
    ("a small tree", [[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3, 8, 8]]),
    ("no requests", []),
]


def check_prefill_waste(prefill_waste: Callable[[list[list[int]]], tuple[int, int]]) -> None:
    """Exercise 0.3: (tokens a cache-less server prefills, tokens an ideal cache prefills)."""
    for name, workload in PREFILL_WORKLOADS:
        expected = _prefill_waste(workload)
        got = prefill_waste([list(r) for r in workload])
        ok = (isinstance(got, tuple) and len(got) == 2
              and all(_same_int(g, e) for g, e in zip(got, expected, strict=True)))
        expect(ok, f"prefill_waste({workload}) ({name}) returned {got!r}, expected "
                   f"{expected}: (sum of all lengths, number of distinct prefixes). A token's "
                   "KV can be reused only when the whole prefix up to it matches.")
    passed("0.3", f"{len(PREFILL_WORKLOADS)} workloads counted right")


def _system_prompt_prefill(system_len: int, turns: int, user_len: int) -> tuple[int, int]:
    return turns * (system_len + user_len), system_len + turns * user_len


SYSTEM_PROMPT_CASES = [(1024, 100, 0), (1024, 100, 32), (500, 1, 20), (0, 5, 10),
                       (300, 4, 40)]


def check_system_prompt_prefill(system_prompt_prefill: Callable[[int, int, int],
                                                                 tuple[int, int]]) -> None:
    """Exercise 0.4: prefill tokens of `turns` requests sharing a system prompt, without and
    with a prefix cache."""
    for system_len, turns, user_len in SYSTEM_PROMPT_CASES:
        expected = _system_prompt_prefill(system_len, turns, user_len)
        got = system_prompt_prefill(system_len, turns, user_len)
        ok = (isinstance(got, tuple) and len(got) == 2
              and all(_same_int(g, e) for g, e in zip(got, expected, strict=True)))
        expect(ok, f"system_prompt_prefill(system_len={system_len}, turns={turns}, "
                   f"user_len={user_len}) returned {got!r}, expected {expected} "
                   "(without cache, with a prefix cache).")
    without, with_cache = _system_prompt_prefill(1024, 100, 0)
    passed("0.4", f"the seed's case: {without} prefill tokens without a cache, {with_cache} "
                  f"with one ({without - with_cache} saved)")
