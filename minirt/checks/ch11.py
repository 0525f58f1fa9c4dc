"""Checkers for chapter 11: the usable prefix under tombstones, the window K/V a request
frees, a checkpoint interval's hits on a trace, vLLM's sliding-window hit search.

Each checker runs the reader's function on several inputs, compares with a reference
computed here (from ``minirt.hybrid`` and ``minirt.state`` where one exists) and names
the first input that disagrees; a repeated failure adds a nudge.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ..hybrid import NO_SLOT, WindowRadixCache
from ..state import StateCache
from ._common import as_int_list, call_reader, checker, expect, passed, same_int

__all__ = ["check_freed_window", "check_state_hits", "check_usable_prefix",
           "check_window_block_hit", "freed_window", "usable_prefix", "usable_prefix_by_tree",
           "window_block_hit"]


# ---------------------------------------------------------------- 11.1 the usable prefix

def usable_prefix(path: Sequence[tuple[int, bool]], matched: int, window: int,
                  page_size: int = 1) -> int:
    """Reference for 11.1: the longest prefix of the first ``matched`` tokens of ``path``
    (nodes as (length, tombstone?)) that is a whole number of pages and whose tail window,
    its last ``min(d, window - 1)`` positions, lies in live nodes."""
    live = [not tomb for length, tomb in path for _ in range(length)][:matched]
    need = window - 1
    for d in range(matched - matched % page_size, 0, -page_size):
        if all(live[d - min(d, need):d]):
            return d
    return 0


def usable_prefix_by_tree(path: Sequence[tuple[int, bool]], matched: int, window: int) -> int:
    """``usable_prefix`` at page size 1 through ``WindowRadixCache`` itself (the tests check
    that the two agree): a tree holding one path of nodes and a query of ``matched`` tokens."""
    cache = WindowRadixCache(window)
    ids, full, win, slot = [], [], [], 0
    for length, tomb in path:
        for _ in range(length):
            ids.append(len(ids) % 50 + 1)
            full.append(slot)
            win.append(NO_SLOT if tomb else 1000 + slot)
            slot += 1
    _insert_path(cache, path, ids, full, win)
    return cache.usable_length(ids[:matched] + [0])[0]


def _insert_path(cache, path, ids, full, win) -> None:
    """Insert node by node so the tree's nodes are exactly ``path``'s."""
    end = 0
    for length, _ in path:
        end += length
        cache.insert_prefix(ids[:end], full[:end], win[:end])


USABLE_CASES = [
    # (path as (length, tombstone), matched tokens, window W, page size)
    ([(10, False)], 10, 4, 4),            # 8: the last whole page
    ([(10, True), (5, False)], 15, 4, 1),  # the live run of 5 covers the 3 needed
    ([(10, True), (5, False)], 15, 4, 4),  # 12 reads 9-11, and 9 is a tombstone: 0
    ([(10, True), (6, False)], 16, 4, 4),  # 16 reads 13-15, all live
    ([(10, True), (2, False)], 12, 4, 1),  # a run of 2 < 3: nothing usable
    ([(3, False), (10, True), (4, False)], 17, 4, 2),  # 16 reads 13-15 live
    ([(3, False), (10, True), (4, False)], 8, 4, 2),   # ends in the tombstone: back to 2
    ([(6, False), (4, True), (6, False)], 16, 4, 4),  # 16 live; 12 reads 9 (tombstone)
    ([(6, False), (2, True), (8, False)], 15, 4, 4),  # 12 reads 9-11, live: inside a node
    ([(2, False)], 2, 8, 1),              # shorter than the window: whole path live is enough
    ([(2, True), (2, False)], 4, 8, 2),   # ... but not with a tombstone before it
    ([(5, True), (5, False), (5, True), (5, False)], 20, 5, 2),
    ([(4, True)], 4, 1, 2),               # W = 1 reads nothing cached: tombstones are fine
    ([(4, True), (3, False)], 7, 1, 2),   # ... any whole page up to matched
]

_NUDGE_111 = ("A depth d can be continued when d is a whole number of pages and every "
              "position a window layer reads to continue there holds window K/V. Which "
              "positions are those, for a window of W that counts the query itself? "
              "The end of a live node is not always a page boundary, and a page boundary "
              "inside a live node can be the answer.")
_ROUNDED_111 = ("Rounding the page-size-1 answer down to a page moves the end to a depth "
                "whose own window reaches further back, perhaps into a tombstone. Check each "
                "candidate end's window anew.")


def _rounded_wrong(path, matched, window, page_size) -> int | None:
    """What "the page-size-1 answer rounded down to a page" gives, if it differs."""
    d = usable_prefix(path, matched, window, 1)
    rounded = d - d % page_size
    return rounded if rounded != usable_prefix(path, matched, window, page_size) else None


@checker("11.1", _NUDGE_111)
def check_usable_prefix(fn: Callable) -> None:
    """Exercise 11.1: ``fn(path, matched, window, page_size)`` -> the longest usable prefix
    that is a whole number of pages."""
    rng = random.Random(111)
    cases = list(USABLE_CASES)
    for _ in range(60):
        path = [(rng.randint(1, 7), rng.random() < 0.4) for _ in range(rng.randint(1, 5))]
        total = sum(n for n, _ in path)
        cases.append((path, rng.randint(0, total), rng.randint(1, 7), rng.choice([1, 2, 3, 4])))
    for path, matched, window, page in cases:
        want = usable_prefix(path, matched, window, page)
        got = call_reader(f"usable_prefix({path}, {matched}, {window}, {page})", fn,
                          list(path), matched, window, page)
        rounded = _rounded_wrong(path, matched, window, page)
        expect(same_int(got, want), f"usable_prefix(path={path}, matched={matched}, "
                                    f"window={window}, page_size={page}) returned {got!r}; "
                                    f"expected {want}.",
               nudge=_ROUNDED_111 if rounded is not None and same_int(got, rounded) else None)
    passed("11.1", f"{len(cases)} paths with tombstones and pages")


# ---------------------------------------------------------------- 11.2 what a request frees

def freed_window(computed: int, cached: int, window: int, branch: int | None) -> list[int]:
    """Reference for 11.2: the positions whose window K/V a finished request frees.

    It computed positions ``cached .. computed - 1`` (the rest came from the tree); it keeps
    the last ``window - 1`` (a continuation reads them) and, if ``branch`` is given, the
    ``window - 1`` before ``branch`` (where a later request may branch off).
    """
    need = window - 1
    keep = set(range(computed - need, computed))
    if branch is not None:
        keep |= set(range(branch - need, branch))
    return [p for p in range(cached, computed) if p not in keep]


FREED_CASES = [
    # (computed, cached, window, branch)
    (10, 0, 4, None),
    (10, 6, 4, None),
    (10, 9, 4, None),
    (3, 0, 8, None),
    (20, 0, 4, 12),
    (20, 10, 4, 12),
    (20, 0, 1, None),
    (20, 5, 6, 20),
]

_NUDGE_112 = ("Three kinds of position are never freed by the request: those it did not "
              "compute, the ones the next token still attends to, and the ones just before "
              "the point a later request may continue from. How many does a window of W "
              "need, counting the query itself as one of the W?")


@checker("11.2", _NUDGE_112)
def check_freed_window(fn: Callable) -> None:
    """Exercise 11.2: ``fn(computed, cached, window, branch)`` -> sorted positions freed."""
    for args in FREED_CASES:
        want = freed_window(*args)
        got = call_reader(f"freed_window{args}", fn, *args)
        got_list = as_int_list(got)
        expect(got_list is not None and sorted(got_list) == want,
               f"freed_window(computed={args[0]}, cached={args[1]}, window={args[2]}, "
               f"branch={args[3]}) returned {got!r}; expected {want}.")
    passed("11.2", f"{len(FREED_CASES)} finished requests")


# ---------------------------------------------------------------- 11.3 checkpoint hits

def _trace(rng: random.Random) -> list[list[int]]:
    """Requests that share stems and extend earlier ones (multi-turn style)."""
    stems = [[rng.randrange(20) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    out: list[list[int]] = []
    for _ in range(rng.randint(3, 9)):
        if out and rng.random() < 0.4:
            base = rng.choice(out)
        else:
            base = rng.choice(stems)
        out.append(base + [rng.randrange(20) for _ in range(rng.randint(1, 9))])
    return out


STATE_CASES = [
    ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], 4, False),
    ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], 4, True),
    ([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 9]], 4, True),
    ([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 9]], 4, False),  # one state: 8 only
    ([[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]], 2, True),
    ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]], None, True),
    ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]], None, False),
    ([[1, 2, 3, 4], [1, 2, 3, 4]], None, True),  # a repeat: its last token is computed again
    ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]], 2, False),
    # the second request starts from a request-end state at 5, off the grid; its grid
    # state is at 8 (a multiple of 4), not at 5 + 4 = 9, which the third request shows
    ([[1, 2, 3, 4, 5], list(range(1, 11)), list(range(1, 10)) + [99, 100]], 4, True),
    ([[1, 2, 3, 4], list(range(1, 12)), list(range(1, 10)) + [99, 100]], 3, True),
]

_NUDGE_113 = ("A request can continue from the cache only at a position where some earlier "
              "request saved a state and whose K/V are cached. Which positions does one "
              "prefill save: how many grid states, and where is the grid? And the last "
              "token of a request is never a hit: its logits are needed.")
_RELATIVE_113 = ("The grid is absolute: its states sit at multiples of interval counted from "
                 "position 0 (interval, 2 * interval, ...), wherever the prefill starts. "
                 "Here a prefill starts off the grid, at an earlier request's end.")


def _relative_wrong(requests, interval, ends) -> int:
    """The hits if grid states are counted from where each prefill starts (usable + k *
    interval): the mistake 11.3's statement warns about."""
    saved, hits = set(), 0
    kv: set[tuple[int, ...]] = set()
    for ids in requests:
        query = ids[:-1]
        kv_len = 0
        while kv_len < len(query) and tuple(query[:kv_len + 1]) in kv:
            kv_len += 1
        usable = max((p for p in range(kv_len + 1) if tuple(query[:p]) in saved), default=0)
        hits += usable
        if interval and len(ids) - usable >= interval:
            saved.add(tuple(ids[:usable + (len(ids) - usable) // interval * interval]))
        if ends:
            saved.add(tuple(ids))
        kv |= {tuple(ids[:p]) for p in range(1, len(ids) + 1)}
    return hits


@checker("11.3", _NUDGE_113)
def check_state_hits(fn: Callable) -> None:
    """Exercise 11.3: ``fn(requests, interval, save_ends)`` -> total hit tokens."""
    rng = random.Random(113)
    cases = list(STATE_CASES) + [(_trace(rng), rng.choice([None, 2, 3, 5]), rng.random() < 0.5)
                                 for _ in range(40)]
    for requests, interval, ends in cases:
        want = StateCache(interval, ends).serve(requests).hit_tokens
        got = call_reader("state_hits(...)", fn, [list(r) for r in requests], interval, ends)
        relative = interval is not None and same_int(got, _relative_wrong(requests, interval, ends))
        expect(same_int(got, want), f"state_hits(requests={requests}, interval={interval}, "
                                    f"save_ends={ends}) returned {got!r}; expected {want}.",
               nudge=_RELATIVE_113 if relative else None)
    passed("11.3", f"{len(cases)} traces")


# ---------------------------------------------------------------- 11.4 vLLM's hit search

def window_block_hit(cached: Sequence[bool], block_size: int, window: int) -> int:
    """Reference for 11.4: vLLM's ``SlidingWindowManager.find_longest_cache_hit`` on one
    group, no EAGLE, alignment = block size. ``cached[i]``: block i's hash is in the pool.
    Returns the hit length in tokens."""
    need = -(-(window - 1) // block_size)
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        if cached[i]:
            run += 1
            if run >= need:
                return (i + run) * block_size
        else:
            run = 0
    return run * block_size  # a run that reaches block 0 is a hit even if shorter


BLOCK_CASES = [
    ([True, True, True, True], 4, 9),
    ([True, False, True, True], 4, 9),
    ([True, False, True, True], 4, 10),   # needs ceil(9 / 4) = 3 blocks
    ([False, True, True, True, False, True], 4, 9),
    ([True, True, False, False], 4, 17),  # no run long enough: the leading run counts
    ([False, True, True, True], 4, 17),
    ([True, True, True, False, True, True], 2, 5),
    ([], 4, 8),
    ([True] * 8, 16, 1),                  # W = 1 needs no block: the last one is the hit
    ([True, True, False], 4, 1),          # ... the last *cached* one, not the whole length
    ([False, False], 4, 1),
]

_NUDGE_114 = ("Scan the blocks from the right. How many contiguous cached blocks does a "
              "window of W tokens need before the hit's end (it reads W - 1 earlier tokens)? "
              "And what if the run of cached blocks reaches the very first block?")


@checker("11.4", _NUDGE_114)
def check_window_block_hit(fn: Callable) -> None:
    """Exercise 11.4: ``fn(cached, block_size, window)`` -> hit length in tokens."""
    rng = random.Random(114)
    cases = list(BLOCK_CASES) + [([rng.random() < 0.7 for _ in range(rng.randint(0, 12))],
                                  rng.choice([2, 4, 16]), rng.randint(1, 40)) for _ in range(40)]
    for cached, bs, w in cases:
        want = window_block_hit(cached, bs, w)
        got = call_reader(f"window_block_hit({cached}, {bs}, {w})", fn, list(cached), bs, w)
        expect(same_int(got, want), f"window_block_hit(cached={cached}, block_size={bs}, "
                                    f"window={w}) returned {got!r}; expected {want}.")
    passed("11.4", f"{len(cases)} block lookups")
