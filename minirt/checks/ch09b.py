"""Checkers for chapter 09b's exercises (real traffic): a trace's ceiling in tokens from its
hash ids (9b.1), the smallest capacity at which LRU reaches a share of Belady's hits
(9b.2), and the tokens tail-optimized LRU lets go first (9b.3).

Each checker runs the reader's function on inputs of its own, compares with a reference
computed here (or by ``minirt.simulate``) and names the first input that disagrees. A
second failure of the same exercise adds a nudge toward the idea.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from ._common import call_reader, checker, expect, passed, same_int

__all__ = ["check_lru_share_capacity", "check_tel_safe_tokens", "check_trace_ceiling"]

BLOCK = 512  # tokens per hash id in Mooncake's traces


# ---------------------------------------------------------------- 9b.1 the ceiling in tokens

def trace_ceiling(requests: Sequence[tuple[int, Sequence[int]]]) -> float:
    """Reference for 9b.1: ``1 - unique / total`` in tokens for ``(input_length, hash_ids)``
    requests; a hash id names one block of one length wherever it occurs."""
    length: dict[int, int] = {}
    total = 0
    for n, ids in requests:
        total += n
        for i, h in enumerate(ids):
            length[h] = BLOCK if i < len(ids) - 1 else n - BLOCK * (len(ids) - 1)
    return 1 - sum(length.values()) / total if total else 0.0


def _request(length: int, ids: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    assert len(ids) == -(-length // BLOCK)
    return length, tuple(ids)


CEILING_CASES: list[list[tuple[int, tuple[int, ...]]]] = [
    # one request: nothing repeats
    [_request(1024, [0, 1])],
    # the same two full blocks twice: half the tokens are hits
    [_request(1024, [0, 1]), _request(1024, [0, 1])],
    # a shared first block, then different partial last blocks
    [_request(600, [0, 1]), _request(700, [0, 2])],
    # a partial last block (100 tokens) repeated: it counts 100 tokens, not 512
    [_request(612, [0, 1]), _request(612, [0, 1]), _request(1024, [0, 2])],
    # a request that is one partial block, repeated three times
    [_request(10, [5]), _request(10, [5]), _request(10, [5])],
    # a longer conversation: each turn extends the last one
    [_request(300, [0]), _request(512 + 300, [7, 8]), _request(1024 + 40, [7, 9, 10]),
     _request(1024 + 40, [7, 9, 10])],
]

_NUDGE_91 = ("A cache that never forgets computes each distinct block once. Count tokens, "
             "not blocks: how many tokens does a request's last block hold, and does a block "
             "that appears in many requests cost more than once?")


@checker("9b.1", _NUDGE_91)
def check_trace_ceiling(fn: Callable, trace_requests: Sequence | None = None) -> None:
    """Exercise 9b.1: ``fn(requests)`` -> the ceiling in tokens, where ``requests`` is a list
    of ``(input_length, hash_ids)``. ``trace_requests``: optional ``TraceRequest``s of a real
    trace to try as well (the solution passes the first ones of the conversation trace)."""
    cases = list(CEILING_CASES)
    if trace_requests is not None:
        cases.append([(r.input_length, tuple(r.hash_ids)) for r in trace_requests])
    for case in cases:
        want = trace_ceiling(case)
        got = call_reader(f"trace_ceiling({case!r:.120})", fn, [tuple(r) for r in case])
        ok = isinstance(got, (int, float)) and not isinstance(got, bool) \
            and math.isclose(float(got), want, abs_tol=1e-9)
        shown = case if len(case) <= 6 else f"the {len(case)} trace requests"
        expect(ok, f"trace_ceiling({shown}) returned {got!r}; expected {want!r}.")
    passed("9b.1", f"{len(cases)} traces, partial last blocks included")


# ---------------------------------------------------------------- 9b.2 LRU against Belady

def lru_share_capacity(prompts: Sequence[Sequence[int]], capacities: Sequence[int],
                       share: float) -> int | None:
    """Reference for 9b.2: the first capacity (in the given, increasing order) at which
    LRU's hit rate is at least ``share`` of Belady's there, or None."""
    from ..simulate import belady_hit_rate, simulate

    for cap in capacities:
        if simulate(prompts, cap, "lru").hit_rate >= share * belady_hit_rate(prompts, cap):
            return cap
    return None


def _family_prompts() -> list[list[int]]:
    # Two families take turns with a third that comes back rarely: LRU forgets the rare
    # one in a small cache, Belady keeps it.
    a, b, c = list(range(10)), list(range(100, 110)), list(range(200, 212))
    out = []
    for k in range(6):
        out += [a + [1000 + k], b + [2000 + k]]
        if k % 3 == 2:
            out.append(c + [3000 + k])
    return out


def _scan_prompts() -> list[list[int]]:
    # A loop over four prompts, longer than a small cache: LRU hits nothing, Belady some.
    base = [list(range(50 * i, 50 * i + 8)) for i in range(4)]
    return [base[k % 4] for k in range(12)]


def _random_families(seed: int) -> list[list[int]]:
    # Four families of random length, mostly drawn at random, each prompt a new last token.
    rng = random.Random(seed)
    fams = [[rng.randrange(1000) for _ in range(rng.randint(4, 10))] for _ in range(4)]
    return [(rng.choice(fams) if rng.random() < 0.7 else fams[k % 4]) + [5000 + k]
            for k in range(14)]


LRU_SHARE_CASES: list[tuple[str, list[list[int]], list[int], float]] = [
    # LRU reaches Belady's share well before it reaches that share of the ceiling
    ("random families", _random_families(5), [10 + 4 * i for i in range(8)], 0.9),
    ("families", _family_prompts(), [13, 16, 20, 24, 28, 32, 40], 0.9),
    ("families", _family_prompts(), [13, 16, 20, 24, 28, 32, 40], 0.5),
    ("loop of four", _scan_prompts(), [8, 16, 24, 32], 0.9),
    ("loop of four", _scan_prompts(), [8, 16], 0.9),  # never within the list: None
    ("no sharing", [[1, 2, 3], [4, 5, 6], [7, 8, 9]], [3, 6, 9], 0.9),  # Belady 0 too
    ("families", _family_prompts(), [13, 16, 20, 24, 28, 32, 40], 1.0),
]

_NUDGE_92 = ("Compare LRU with Belady at the same capacity, not with the ceiling, and "
             "'reaches' includes equality. What should happen where Belady itself hits "
             "nothing, and where no capacity in the list is enough?")


@checker("9b.2", _NUDGE_92)
def check_lru_share_capacity(fn: Callable) -> None:
    """Exercise 9b.2: ``fn(prompts, capacities, share)`` -> the first capacity of
    ``capacities`` where LRU reaches ``share`` of Belady's hit rate, or None."""
    for name, prompts, caps, share in LRU_SHARE_CASES:
        want = lru_share_capacity(prompts, caps, share)
        what = f"lru_share_capacity(<{name}: {len(prompts)} prompts>, {caps}, {share})"
        got = call_reader(what, fn, [list(p) for p in prompts], list(caps), share)
        ok = got is None if want is None else same_int(got, want)
        expect(ok, f"{what} returned {got!r}; expected {want!r}.")
    passed("9b.2", f"{len(LRU_SHARE_CASES)} sweeps, one where no capacity is enough")


# ---------------------------------------------------------------- 9b.3 tail-optimized LRU

def tel_safe_tokens(node_lengths: Sequence[int], history_len: int, threshold: int,
                    next_prompt_estimate: int) -> int:
    """Reference for 9b.3: tokens of a cached branch (its nodes' lengths, root first) whose
    node starts at or past ``history_len + next_prompt_estimate - threshold`` tokens."""
    budget = max(history_len + next_prompt_estimate - threshold, 0)
    safe, start = 0, 0
    for n in node_lengths:
        if start >= budget:
            safe += n
        start += n
    return safe


TEL_CASES: list[tuple[list[int], int, int, int]] = [
    # (node lengths root first, history L, threshold T, next prompt estimate Q)
    ([4, 4], 8, 16, 2),  # a short conversation: the budget is 0, everything goes first
    ([8, 8, 8], 24, 10, 2),  # budget 16: only the node starting at 16
    ([8, 8, 8], 24, 10, 3),  # budget 17: the node starting at 16 must stay
    ([8, 8, 8], 24, 8, 0),  # budget 16 exactly at a node's start: that node is safe
    ([10, 2, 2], 40, 20, 4),  # trimmed: L (40) is past what is cached (14), nothing safe
    ([10, 2, 2], 20, 20, 4),  # the same branch, a shorter history: budget 4
    ([1, 1, 1, 1, 1], 5, 3, 1),  # budget 3: the last two nodes
    ([], 0, 5, 1),  # nothing cached
]

_NUDGE_93 = ("A node is safe to lose when the tokens cached *before* it already cover what "
             "the next turn needs to stay under the budget. Which history length does the "
             "budget use: what is cached now, or the longest the conversation has been?")


@checker("9b.3", _NUDGE_93)
def check_tel_safe_tokens(fn: Callable) -> None:
    """Exercise 9b.3: ``fn(node_lengths, history_len, threshold, next_prompt_estimate)`` ->
    the TEL-safe tokens of the branch."""
    for case in TEL_CASES:
        want = tel_safe_tokens(*case)
        what = (f"tel_safe_tokens(node_lengths={case[0]}, history_len={case[1]}, "
                f"threshold={case[2]}, next_prompt_estimate={case[3]})")
        got = call_reader(what, fn, list(case[0]), *case[1:])
        expect(same_int(got, want), f"{what} returned {got!r}; expected {want}.")
    passed("9b.3", f"{len(TEL_CASES)} branches, a trimmed one included")
