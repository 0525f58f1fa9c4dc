"""Checkers for chapter 13: the tokens a greedy verify appends, the slots a partial
acceptance frees, the expected tokens per step, and the hits under EAGLE's last-block rule
and the lookahead key.

Each checker runs the reader's function on several inputs, compares with a reference
computed here (minirt's own code where it has one), and names the first input that
disagrees (input, expected, got); a repeated failure adds a hint toward the idea, never
the algorithm.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from ..eagle_blocks import replay_hits
from ..speculative import accept_greedy
from ._common import as_int_list, call_reader, checker, expect, expect_per_request, passed, same_int

__all__ = ["check_accepted", "check_eagle_hits", "check_slots_to_free",
           "check_tokens_per_step"]


# --------------------------------------------------------------------------- 13.1


def _accept_cases() -> list[tuple[list[int], list[int]]]:
    cases = [([5, 6, 7], [5, 6, 7, 8]),      # all kept, then the bonus
             ([5, 6, 7], [9, 6, 7, 8]),      # the first one rejected
             ([5, 6, 7], [5, 9, 7, 8]),      # later drafts agree again: still dropped
             ([], [4]),                      # no drafts: one token
             ([3, 3, 3, 3], [3, 3, 3, 1, 2])]
    rng = random.Random(13)
    for _ in range(6):
        k = rng.randrange(1, 7)
        target = [rng.randrange(4) for _ in range(k + 1)]
        drafts = [t if rng.random() < 0.7 else rng.randrange(4) for t in target[:k]]
        cases.append((drafts, target))
    return cases


@checker("13.1", "Every step appends the model's own token once. Which drafts may come "
                 "before it?")
def check_accepted(accepted: Callable[[list[int], list[int]], list[int]]) -> None:
    """Exercise 13.1: ``accepted(drafts, target) -> list[int]``, the tokens a greedy verify
    appends; ``target[i]`` is the model's argmax at draft i's position (one more than the
    drafts)."""
    for drafts, target in _accept_cases():
        what = f"accepted({drafts}, {target})"
        got = call_reader(what, accepted, list(drafts), list(target))
        want = accept_greedy(drafts, target)
        got_list = as_int_list(got) if got is not None else None
        expect(got_list == want, f"{what} returned {got!r}; expected {want}.")
    passed("13.1", f"{len(_accept_cases())} verify steps")


# --------------------------------------------------------------------------- 13.2


def _slots_to_free(cached_len: int, num_private: int, kv_len: int, page_size: int) -> int:
    keep = -(-(kv_len - cached_len) // page_size) * page_size
    return num_private - keep


def _slot_cases() -> list[tuple[int, int, int, int]]:
    cases = [(336, 32, 350, 16),   # two pages, the second wholly rejected
             (336, 32, 352, 16),   # accepted up to a page boundary
             (336, 32, 353, 16),   # one position into the second page: it stays
             (0, 8, 5, 1),         # pages of one token: every rejected slot goes
             (32, 16, 32, 16),     # nothing accepted past the cached part
             (48, 48, 81, 16)]
    rng = random.Random(132)
    for _ in range(6):
        ps = rng.choice([1, 4, 16, 64])
        cached = rng.randrange(0, 200) // ps * ps
        pages = rng.randrange(1, 4)
        kv = cached + rng.randrange(0, pages * ps + 1)
        cases.append((cached, pages * ps, kv, ps))
    return cases


@checker("13.2", "Only whole pages go back to the free list. Which page holds the last "
                 "accepted position, and where do the request's own pages start?")
def check_slots_to_free(slots_to_free: Callable[[int, int, int, int], int]) -> None:
    """Exercise 13.2: ``slots_to_free(cached_len, num_private, kv_len, page_size) -> int``:
    the request holds ``num_private`` private slots (whole pages, for positions from
    ``cached_len`` on) and keeps ``kv_len`` accepted positions; how many slots go back."""
    for cached, private, kv, ps in _slot_cases():
        what = f"slots_to_free({cached}, {private}, {kv}, {ps})"
        got = call_reader(what, slots_to_free, cached, private, kv, ps)
        want = _slots_to_free(cached, private, kv, ps)
        expect(same_int(got, want), f"{what} returned {got!r}; expected {want}.")
    passed("13.2", f"{len(_slot_cases())} partial acceptances")


# --------------------------------------------------------------------------- 13.3


def _tokens_per_step(alpha: float, k: int) -> float:
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@checker("13.3", "Count the tokens of one step: how many drafts are kept with what "
                 "probability, and what is always added?")
def check_tokens_per_step(tokens_per_step: Callable[[float, int], float]) -> None:
    """Exercise 13.3: ``tokens_per_step(alpha, k) -> float``, the expected tokens one verify
    step appends when each of its ``k`` drafts agrees with probability ``alpha``,
    independently, and verification stops at the first that does not."""
    for alpha, k in [(0.0, 4), (0.5, 1), (0.5, 4), (0.8, 4), (0.8, 8), (1.0, 4), (0.3, 0),
                     (0.95, 16)]:
        what = f"tokens_per_step({alpha}, {k})"
        got = call_reader(what, tokens_per_step, alpha, k)
        want = _tokens_per_step(alpha, k)
        ok = (isinstance(got, (int, float)) and not isinstance(got, bool)
              and math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12))
        expect(ok, f"{what} returned {got!r}; expected {want:.6g}.")
    passed("13.3", "eight acceptance rates and draft lengths")


# --------------------------------------------------------------------------- 13.4

_VOCAB = 64


def _eagle_streams() -> list[tuple[list[list[int]], int]]:
    a = list(range(10, 42))
    streams = [([a, a + [7, 8, 9], a[:16] + [1] + a[17:]], 16),
               ([a + [7], a + [7, 8, 9]], 16),
               ([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5]], 2),
               ([[1, 2, 3, 4, 5], [1, 2, 3]], 2)]  # the token after a block: the last one
    rng = random.Random(134)
    stems = [[rng.randrange(_VOCAB) for _ in range(rng.randrange(4, 70))] for _ in range(3)]
    stream = []
    for _ in range(14):
        s = rng.choice(stems)
        stream.append(s[:rng.randrange(len(s) + 1)]
                      + [rng.randrange(_VOCAB) for _ in range(rng.randrange(1, 6))])
    streams += [(stream, 8), (stream, 4), (stream, 1)]
    return streams


@checker("13.4", "A request's lookup stops one token short of its end. Under the lookahead "
                 "key, which tokens must agree for a block to count?")
def check_eagle_hits(eagle_hits: Callable[[list[list[int]], int, str], list[int]]) -> None:
    """Exercise 13.4: ``eagle_hits(requests, block_size, rule) -> list[int]``, per request the
    tokens an unlimited whole-block cache serves it, the requests served in order (each
    one's tokens cached after its lookup), under ``rule`` "drop" (vLLM's EAGLE rule) or
    "lookahead" (a block counts only with its next token)."""
    for requests, block_size in _eagle_streams():
        for rule in ("drop", "lookahead"):
            shown = requests if len(requests) <= 3 else f"<{len(requests)} requests>"
            what = f"eagle_hits({shown}, {block_size}, {rule!r})"
            got = call_reader(what, eagle_hits, [list(r) for r in requests], block_size, rule)
            expect_per_request(what, got, replay_hits(requests, block_size, rule, _VOCAB),
                               requests, "hits")
    passed("13.4", "both rules on seven streams")
