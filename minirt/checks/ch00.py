"""Checkers for chapter 00: how much prefill a workload repeats, and what sharing saves.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees (input, expected, got); a
repeated failure adds a hint toward the idea.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._common import as_permutation, call_reader, checker, expect, lcp, passed, same_int

__all__ = [
    "check_best_order",
    "check_keep_last_prefill",
    "check_prefill_waste",
    "check_requests_that_fit",
]


def _keep_last_prefill(requests: Sequence[Sequence[int]]) -> int:
    """Tokens prefilled when only the previous request's KV is kept."""
    total, previous = 0, []
    for r in requests:
        total += len(r) - lcp(r, previous)
        previous = r
    return total


KEEP_LAST_WORKLOADS: list[tuple[str, list[list[int]]]] = [
    ("two requests sharing [1, 2, 3]", [[1, 2, 3, 4], [1, 2, 3, 5]]),
    ("a shared prefix comes back after an unrelated request",
     [[1, 2, 3, 4], [9, 9], [1, 2, 3, 5]]),
    ("the same request three times", [[7, 7, 7], [7, 7, 7], [7, 7, 7]]),
    ("the same suffix after different first tokens", [[1, 9, 9], [2, 9, 9]]),
    ("a request that is a prefix of the one before", [[1, 2, 3], [1, 2]]),
    ("the second request shares with the first, the third with the first only",
     [[5, 6, 7, 8], [5, 6, 1], [5, 6, 7, 2]]),
    ("no requests", []),
]


@checker("0.1", "The server forgets everything except one request. Which earlier request "
                "can the current one still take tokens from, and which part of it?")
def check_keep_last_prefill(keep_last_prefill: Callable[[list[list[int]]], int]) -> None:
    """Exercise 0.1: prefill tokens of a server that keeps only the previous request's KV."""
    for name, workload in KEEP_LAST_WORKLOADS:
        expected = _keep_last_prefill(workload)
        got = call_reader(f"keep_last_prefill({workload})", keep_last_prefill,
                          [list(r) for r in workload])
        expect(same_int(got, expected),
               f"keep_last_prefill({workload}) ({name}) returned {got!r}, expected {expected}.")
    passed("0.1", f"{len(KEEP_LAST_WORKLOADS)} workloads right: keeping one request reuses "
                  "only what the next request shares with it")


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


@checker("0.2", "With sharing, what does the one shared copy cost, and what does each "
                "request cost on top of it? Only whole requests run.")
def check_requests_that_fit(requests_that_fit: Callable[[int, int, int, int, bool], int]) -> None:
    """Exercise 0.2: concurrent requests whose KV fits in memory, with and without sharing
    the prompt's KV."""
    for case in FIT_CASES:
        expected = _requests_that_fit(*case)
        budget, per_token, prompt_len, own_len, shared = case
        call = (f"requests_that_fit(budget_bytes={budget}, bytes_per_token={per_token}, "
                f"prompt_len={prompt_len}, own_len={own_len}, shared={shared})")
        got = call_reader(call, requests_that_fit, *case)
        expect(same_int(got, expected), f"{call} returned {got!r}, expected {expected}.")
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


@checker("0.3", "When is a token's KV the same in two requests? Think of a token together "
                "with everything before it.")
def check_prefill_waste(prefill_waste: Callable[[list[list[int]]], tuple[int, int]]) -> None:
    """Exercise 0.3: (tokens a cache-less server prefills, tokens an ideal cache prefills)."""
    for name, workload in PREFILL_WORKLOADS:
        expected = _prefill_waste(workload)
        got = call_reader(f"prefill_waste({workload})", prefill_waste,
                          [list(r) for r in workload])
        ok = (isinstance(got, tuple) and len(got) == 2
              and all(same_int(g, e) for g, e in zip(got, expected, strict=True)))
        expect(ok, f"prefill_waste({workload}) ({name}) returned {got!r}, expected "
                   f"{expected} as (naive, ideal).")
    passed("0.3", f"{len(PREFILL_WORKLOADS)} workloads counted right")


ORDER_WORKLOADS: list[tuple[str, list[list[int]]]] = [
    ("a shared prefix split by an unrelated request", [[1, 2, 3, 4], [9, 9], [1, 2, 3, 5]]),
    ("two chats interleaved", [[1, 2], [5, 6], [1, 2, 3], [5, 6, 7], [1, 2, 3, 4]]),
    ("same first token, deeper sharing further on", [[1, 2, 3], [1, 5], [1, 2, 4]]),
    ("long and short requests mixed", [[4, 4, 4, 4, 4], [3], [4, 4, 1], [3, 3, 3], [4, 2]]),
    ("already in a good order", [[1, 2, 3], [1, 2, 4]]),
    ("duplicates", [[2, 2], [1], [2, 2], [1]]),
    ("a tree three levels deep", [[1, 2, 3, 4], [7], [1, 2, 9], [1, 8], [1, 2, 3, 6],
                                  [7, 7], [1, 8, 8]]),
    ("no requests", []),
]


@checker("0.4", "Which order would a depth-first walk of all the requests' prefixes give? "
                "How does it make consecutive requests share as much as possible?")
def check_best_order(best_order: Callable[[list[list[int]]], Sequence[int]]) -> None:
    """Exercise 0.4: an order of the requests in which a keep-the-last-request server
    prefills no more than an unlimited prefix cache would."""
    for name, workload in ORDER_WORKLOADS:
        call = f"best_order({workload})"
        got = call_reader(call, best_order, [list(r) for r in workload])
        order = as_permutation(got, len(workload))
        expect(order is not None,
               f"{call} ({name}) returned {got!r}; expected a list of the request indices "
               f"0..{len(workload) - 1}, each once (for example [2, 0, 1]).")
        reordered = [workload[i] for i in order]
        ideal = _prefill_waste(workload)[1]
        prefill = _keep_last_prefill(reordered)
        expect(prefill == ideal,
               f"{call} ({name}) returned the order {order}: keeping only the last request, "
               f"that order prefills {prefill} tokens, expected {ideal} (what an unlimited "
               "prefix cache prefills).")
    passed("0.4", f"{len(ORDER_WORKLOADS)} workloads: in your order, keeping one request's KV "
                  "is as good as keeping them all")
