"""Checkers for chapter 03: the match walk, the offset design, hashed blocks, hit counts.

Each checker runs the reader's function on several inputs, compares with a reference
computed here (the first and last with ``RadixCache`` itself), and names the first input
that disagrees (input, expected, got); a repeated failure adds a hint toward the idea.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..cache import RadixCache, insert_fresh
from ..radix import RadixNode
from ..viz import tree_dict
from ._common import call_reader, checker, expect, passed

__all__ = [
    "check_aligned_hits",
    "check_hash_reuse",
    "check_match_walk",
    "check_offset_design",
]


def _as_list(x) -> list[int] | None:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    if isinstance(x, (list, tuple)) and all(isinstance(v, int) for v in x):
        return list(x)
    return None


def _node_count(root: RadixNode) -> int:
    count, stack = 0, [root]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


# --------------------------------------------------------------------------- 3.1

A, B, C = [101, 11, 12, 21, 22], [101, 11, 12, 31, 32], [101, 11, 99]
X = list(range(10, 58))
Y = X[:20] + list(range(500, 516))

# (page_size, requests to insert, queries)
_WALK_TREES: list[tuple[int, list[list[int]], list[list[int]]]] = [
    (1, [A, B, C], [A, B, C, [101, 11, 12, 21], [101, 11, 12, 31, 32, 7, 8], [101], [5, 6],
                    [101, 11, 98], []]),
    (4, [X, Y[:32]], [Y, X, X[:18], X[:16] + [0] * 8, X[:3], Y[:31] + [1, 2, 3, 4], [10]]),
    (2, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 8]], [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 3],
                                                     [7, 8, 9], [7]]),
]


def _build(page_size: int, requests: list[list[int]]) -> RadixCache:
    cache, slot = RadixCache(page_size=page_size), 100
    for ids in requests:
        _, slot = insert_fresh(cache, ids, slot)
    return cache


@checker("3.1", "Draw the tree for the failing input and walk it by hand. Where can a match "
                "stop, and what must stay untouched while you look?")
def check_match_walk(match_walk: Callable[[RadixNode, list[int], int], tuple]) -> None:
    """Exercise 3.1: ``match_walk(root, ids, page_size) -> (cached_len, slots)``, read-only."""
    tried = 0
    for page_size, inserts, queries in _WALK_TREES:
        mine, ref = _build(page_size, inserts), _build(page_size, inserts)
        shape, count = tree_dict(mine), _node_count(mine.root)
        for ids in queries:
            what = f"match_walk(root, {ids}, page_size={page_size}) on a tree holding {inserts}"
            got = call_reader(what, match_walk, mine.root, list(ids), page_size)
            expected = ref.match_prefix(ids)
            want = (expected.cached_len, expected.indices.tolist())
            ok_shape = isinstance(got, tuple) and len(got) == 2 and _as_list(got[1]) is not None
            expect(ok_shape, f"{what} returned {got!r}; return (cached_len, slots) with slots "
                             "a list or 1-D tensor of ints.")
            got = (got[0], _as_list(got[1]))
            expect(got == want,
                   f"{what} returned (cached_len, slots) = {got}, expected {want}.")
            expect(tree_dict(mine) == shape and _node_count(mine.root) == count,
                   f"{what} changed the tree (a split?). This walk only looks: it must not "
                   "modify any node.")
            tried += 1
    passed("3.1", f"{tried} lookups right on trees with pages of 1, 2 and 4, tree untouched")


# --------------------------------------------------------------------------- 3.2


def _blocks(first: int, start: int, stop: int, page: int) -> list[int]:
    """Block numbers ``first, first + 1, ...`` covering positions ``start..stop`` (a partial
    last block counts)."""
    return list(range(first, first + -(-(stop - start) // page)))


def _offset_design(x: list[int], y: list[int], page: int) -> dict:
    """What the offset design stores after caching x (blocks 100, ...) and then y (200, ...)."""
    common = 0
    while x[common] == y[common]:
        common += 1
    aligned = common // page * page
    x_blocks = _blocks(100, 0, len(x), page)
    return {
        "reused": aligned,
        "common": {"span": (0, aligned), "blocks": x_blocks[: aligned // page]},
        "original": {"span": (common, len(x)), "blocks": x_blocks[aligned // page:],
                     "offset": common - aligned, "key": x[common]},
        "new": {"span": (aligned, len(y)), "blocks": _blocks(200, aligned, len(y), page),
                "key": y[aligned]},  # the first token of y's branch, as the chapter's table
    }


_OFFSET_PAIRS: list[tuple[str, list[int], list[int], int]] = [
    ("X and Y of the chapter", X, Y, 16),
    ("a fork right on a page boundary", X, X[:16] + [7] * 20, 16),
    ("a fork inside the first page", X, X[:5] + [7] * 30, 16),
    ("small pages", list(range(1, 11)), [1, 2, 3, 4, 5, 99, 98], 4),
    ("Y shorter than the page it forks in", X, X[:35] + [1, 2], 16),
    ("pages of 8, X not a whole number of pages", X[:45], X[:27] + [0] * 10, 8),
]


def _normal(got) -> object:
    """The reader's dict with tuples/lists/tensors of ints made comparable."""
    if isinstance(got, dict):
        return {k: _normal(v) for k, v in got.items()}
    if isinstance(got, (list, tuple, torch.Tensor)):
        return _as_list(got)
    return got


@checker("3.2", "Look at the drawing of the offset design's tree: where does each of the "
                "three nodes start, and which blocks can X's branch keep without copying "
                "anything? Y can reuse only blocks that are entirely right for it.")
def check_offset_design(offset_design: Callable[[list[int], list[int], int], dict]) -> None:
    """Exercise 3.2: predict the offset design's tree and reuse for a pair of requests."""
    for name, x, y, page in _OFFSET_PAIRS:
        want = _normal(_offset_design(x, y, page))
        common = _offset_design(x, y, page)["original"]["span"][0]
        what = (f"offset_design(x, y, page_size={page}) ({name}; x = {len(x)} tokens, y = "
                f"{len(y)} tokens, the first {common} equal)")
        got = _normal(call_reader(what, offset_design, list(x), list(y), page))
        expect(isinstance(got, dict) and set(got) == set(want),
               f"{what} returned {got!r}; expected a dict with the keys {sorted(want)}, for "
               "example {'reused': 16, 'common': {'span': (0, 16), 'blocks': [100]}, ...}.")
        for part in ("reused", "common", "original", "new"):
            expect(got[part] == want[part],
                   f"{what}: {part!r} is {got[part]!r}, expected {want[part]!r}.")
    passed("3.2", "the offset design forks at the token and keeps an offset, yet reuses exactly "
                  "the whole pages, as RadixCache does")


# --------------------------------------------------------------------------- 3.3


def _ref_hash_reuse(cached: Sequence[Sequence[int]], ids: Sequence[int], block: int) -> int:
    """Chained block identities as nested tuples (exact, no collisions)."""
    def names(seq):
        out, parent = [], None
        for start in range(0, len(seq) - len(seq) % block, block):
            parent = (parent, tuple(seq[start:start + block]))
            out.append(parent)
        return out

    known = {n for seq in cached for n in names(seq)}
    reused = 0
    for name in names(ids):
        if name not in known:
            break
        reused += block
    return reused


_W = X[16:32] + X[:16]  # X's second block first: same contents, different positions
_HASH_CASES: list[tuple[str, list[list[int]], list[int], int]] = [
    ("X cached, Y shares 20 tokens", [X], Y, 16),
    ("the same 36 tokens again", [Y], Y, 16),
    ("Y after Y's own prefix of 20", [Y[:20]], Y, 16),
    ("X's blocks in another order", [X], _W, 16),
    ("a shared middle block after a different first block", [X], [0] * 16 + X[16:32], 16),
    ("two cached requests, the earlier one matches longer", [X, Y[:20]], X[:40], 16),
    ("block 0 as in one cached request, block 1 as in another", [X[:32], [7] * 16 + X[32:48]],
     X[:16] + X[32:48], 16),
    ("small blocks", [[1, 2, 3, 4, 5, 6, 7]], [1, 2, 3, 4, 5, 6, 9, 9], 2),
    ("nothing cached", [], X, 16),
    ("shorter than one block", [X], X[:15], 16),
]


@checker("3.3", "Two blocks are the same block only if they have the same name. What does a "
                "block's name depend on besides its own tokens?")
def check_hash_reuse(hash_reuse: Callable[[list[list[int]], list[int], int], int]) -> None:
    """Exercise 3.3: tokens of ``ids`` a chained-block-hash cache holding ``cached`` can reuse."""
    for label, cached, ids, block in _HASH_CASES:
        want = _ref_hash_reuse(cached, ids, block)
        what = f"hash_reuse(cached, ids, {block}) ({label}; ids = {ids[:6]}..., {len(ids)} tokens)"
        got = call_reader(what, hash_reuse, [list(c) for c in cached], list(ids), block)
        expect(got == want, f"{what} returned {got!r}, expected {want}.")
    passed("3.3", "chained full-block hashes: blocks line up from position 0, so no offset")


# --------------------------------------------------------------------------- 3.4


def _replay_hits(requests: list[list[int]], page_size: int) -> int:
    return _build(page_size, requests).stats.hit_tokens


@checker("3.4", "When request i arrives, which requests are in the tree, and what did "
                "inserting each of them keep? A match can only return whole pages of what is "
                "there.")
def check_aligned_hits(aligned_hits: Callable[[list[list[int]], int], int]) -> None:
    """Exercise 3.4: ``aligned_hits(requests, page_size)`` = hit tokens of an unbounded
    page-aligned RadixCache that matches, then inserts, each request in order."""
    rng = random.Random(4)
    cases: list[tuple[list[list[int]], int]] = [([A, B, C], 1), ([A, B, C], 2), ([X, Y], 16),
                                                ([X, Y, X], 16), ([Y, X[:40]], 8)]
    for _ in range(25):
        base = [rng.randrange(3) for _ in range(rng.randrange(4, 14))]
        reqs = [base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(4)]
                for _ in range(rng.randrange(2, 7))]
        cases.append((reqs, rng.choice([1, 2, 3, 4])))
    for reqs, page in cases:
        want = _replay_hits(reqs, page)
        what = f"aligned_hits({reqs if len(str(reqs)) < 160 else '[...]'}, page_size={page})"
        got = call_reader(what, aligned_hits, [list(r) for r in reqs], page)
        expect(got == want, f"{what} returned {got!r}, expected {want} (what RadixCache "
                            "reports).")
    passed("3.4", f"{len(cases)} request streams predicted exactly")
