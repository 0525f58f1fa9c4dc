"""Checkers for chapter 07: the edge-sum bound, a depth-first order, the order FCFS
handles worst, and how long aging lets a request wait.

Each checker runs the reader's function on inputs of its own, compares with the
reference (``minirt.scheduler``: ``edge_sum``, ``sequential_cost``, ``best_order``'s
brute force, ``simulate_schedule``) and names the first input that disagrees. A second
failure of the same exercise adds a nudge toward the idea.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import torch

from ..scheduler import Scheduler, SimRequest, edge_sum, sequential_cost, simulate_schedule
from ._common import as_int_list, call_reader, expect, passed

__all__ = ["check_dfs_order", "check_edge_sum", "check_lone_wait", "check_worst_order"]

_failures: dict[str, int] = {}

NUDGES = {
    "7.1": "Each token of the tree is the last token of exactly one distinct prefix of "
           "some prompt, and a prompt that is a prefix of another adds no token of its own.",
    "7.2": "Prompts that share a longer prefix must run next to each other: finish "
           "everything below a node before you leave it.",
    "7.3": "The cache keeps the most recent request whole. To lose a shared prefix, put "
           "requests that do not share it between the ones that do.",
    "7.4": "Look at the corner cases: no guard at all, a guard of 0 steps (every request "
           "is already 'old'), and a guard longer than the stream.",
}


def _fail(exercise: str, message: str) -> None:
    """Raise with the failing input; from the second failure on, add the nudge."""
    _failures[exercise] = _failures.get(exercise, 0) + 1
    if _failures[exercise] > 1:
        message += f"\nHint: {NUDGES[exercise]}"
    raise AssertionError(message)


def _random_batch(rng: random.Random, n: int, max_len: int, vocab: int) -> list[list[int]]:
    prompts: set[tuple[int, ...]] = set()
    while len(prompts) < n:
        prompts.add(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, max_len))))
    out = [list(p) for p in prompts]
    rng.shuffle(out)
    return out


_FAMILIES = [[1, 2, 3, 4, 10], [5, 6, 7, 8, 20], [1, 2, 3, 4, 11], [5, 6, 7, 8, 21],
             [1, 2, 3, 4, 12], [5, 6, 7, 8, 22]]

EDGE_CASES: list[tuple[str, list[list[int]]]] = [
    ("the chapter-02 A/B/C prompts", [[101, 11, 12, 21, 22], [101, 11, 12, 31, 32],
                                      [101, 11, 99]]),
    ("two families, interleaved", _FAMILIES),
    ("a prompt that is a prefix of another", [[4, 5, 6, 7], [4, 5], [4, 5, 9]]),
    ("nothing shared", [[1, 2], [3, 4, 5], [6]]),
    ("one prompt", [[8, 8, 8]]),
]


def check_edge_sum(fn: Callable[[list[list[int]]], int]) -> None:
    """Exercise 7.1: ``fn(prompts) -> int``, the sum of the edge lengths of their radix tree."""
    rng = random.Random(71)
    cases = EDGE_CASES + [(f"random batch {i}", _random_batch(rng, rng.randint(2, 6), 7, 3))
                          for i in range(20)]
    for name, prompts in cases:
        got = call_reader(f"edge_sum({prompts})", fn, [list(p) for p in prompts])
        want = edge_sum(prompts)
        if isinstance(got, bool) or not isinstance(got, int) or got != want:
            _fail("7.1", f"{name}: prompts {prompts}\nexpected {want}, got {got!r}")
    passed("7.1", f"the bound of {len(cases)} batches")


def _as_order(got, n: int) -> list[int] | None:
    order = as_int_list(got)
    if order is None or sorted(order) != list(range(n)):
        return None
    return order


def check_dfs_order(fn: Callable[[list[list[int]]], Sequence[int]]) -> None:
    """Exercise 7.2: ``fn(prompts) -> order`` (indices) that computes exactly the edge sum
    when served one at a time through an LRU cache as large as the longest prompt."""
    rng = random.Random(72)
    cases = EDGE_CASES + [(f"random batch {i}", _random_batch(rng, rng.randint(3, 7), 7, 2))
                          for i in range(25)]
    for name, prompts in cases:
        got = call_reader(f"dfs_order({prompts})", fn, [list(p) for p in prompts])
        order = _as_order(got, len(prompts))
        if order is None:
            _fail("7.2", f"{name}: prompts {prompts}\nexpected a permutation of "
                         f"0..{len(prompts) - 1}, got {got!r}")
        capacity = max(map(len, prompts))
        cost, bound = sequential_cost(prompts, capacity, order), edge_sum(prompts)
        if cost != bound:
            _fail("7.2", f"{name}: prompts {prompts}, cache {capacity}\nyour order {order} "
                         f"computes {cost} tokens; expected the edge sum, {bound}")
    passed("7.2", f"{len(cases)} batches computed at the bound")


def check_worst_order(fn: Callable[[list[list[int]], int], Sequence[int]]) -> None:
    """Exercise 7.3: ``fn(prompts, capacity) -> order`` under which serving the prompts one
    at a time computes the most tokens (ties: any order reaching the maximum)."""
    rng = random.Random(73)
    cases = [("two families, cache of one prompt", _FAMILIES, 5)]
    for i in range(15):
        prompts = _random_batch(rng, rng.randint(3, 6), 6, 2)
        cases.append((f"random batch {i}", prompts, max(map(len, prompts)) + rng.randint(0, 2)))
    for name, prompts, capacity in cases:
        got = call_reader(f"worst_order({prompts}, {capacity})", fn,
                          [list(p) for p in prompts], capacity)
        order = _as_order(got, len(prompts))
        if order is None:
            _fail("7.3", f"{name}: prompts {prompts}\nexpected a permutation of "
                         f"0..{len(prompts) - 1}, got {got!r}")
        worst = max(sequential_cost(prompts, capacity, p)
                    for p in itertools.permutations(range(len(prompts))))
        cost = sequential_cost(prompts, capacity, order)
        if cost != worst:
            _fail("7.3", f"{name}: prompts {prompts}, cache {capacity}\nyour order {order} "
                         f"computes {cost} tokens; the worst order computes {worst}")
    passed("7.3", f"the worst order of {len(cases)} batches")


def lone_wait_simulated(max_wait_steps: int | None, stream_steps: int) -> int:
    """The lone request's wait in the chapter's stream (LPM, about one admission per step)."""
    hot = list(range(200, 232))
    reqs = [SimRequest(torch.tensor(hot + [0]), rid="warm"),
            SimRequest(torch.tensor([7] * 20), rid="lone")]
    reqs += [SimRequest(torch.tensor(hot + [i % 100, i // 100]), arrival=i, rid=f"s{i}")
             for i in range(stream_steps)]
    res = simulate_schedule(reqs, 256, Scheduler("lpm", max_wait_steps=max_wait_steps),
                            token_budget=8)
    return next(r for r in res.requests if r.rid == "lone").wait


def check_lone_wait(fn: Callable[[int | None, int], int]) -> None:
    """Exercise 7.4: ``fn(max_wait_steps, stream_steps) -> steps`` the lone request waits."""
    cases = [(k, s) for s in (2, 4, 10, 25) for k in (None, 0, 1, 2, 3, 9, 10, 11, 30)]
    for k, s in cases:
        got = call_reader(f"lone_wait({k}, {s})", fn, k, s)
        want = lone_wait_simulated(k, s)
        if isinstance(got, bool) or not isinstance(got, int) or got != want:
            _fail("7.4", f"max_wait_steps={k}, a stream of {s} steps\nexpected the lone "
                         f"request to wait {want} steps, got {got!r}")
    passed("7.4", f"{len(cases)} settings predicted")


expect(set(NUDGES) == {"7.1", "7.2", "7.3", "7.4"}, "every exercise has a nudge")
