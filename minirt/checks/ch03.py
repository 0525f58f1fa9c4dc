"""Checkers for chapter 03: the match walk, page alignment and offsets, hashed blocks, hit counts.

Each checker runs the reader's function on several inputs, compares with a reference
computed here (the first and last with ``RadixCache`` itself), and names the first input
that disagrees.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..cache import RadixCache, insert_fresh
from ..radix import RadixNode
from ..viz import tree_dict
from ._common import call_reader, expect, passed

__all__ = [
    "check_aligned_hits",
    "check_hash_reuse",
    "check_match_walk",
    "check_reuse_and_offset",
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
                   f"{what} returned (cached_len, slots) = {got}, expected {want}: descend while "
                   "whole nodes agree, stop inside a node at the agreement rounded down to whole "
                   "pages, and return the slots of exactly the matched tokens.")
            expect(tree_dict(mine) == shape and _node_count(mine.root) == count,
                   f"{what} changed the tree (a split?). This walk only looks: it must not "
                   "modify any node.")
            tried += 1
    passed("3.1", f"{tried} lookups right on trees with pages of 1, 2 and 4, tree untouched")


# --------------------------------------------------------------------------- 3.2

_OFFSET_CASES = [(20, 16), (16, 16), (15, 16), (40, 16), (5, 1), (33, 8), (0, 16), (31, 16),
                 (64, 32), (7, 4)]


def check_reuse_and_offset(reuse_and_offset: Callable[[int, int], tuple[int, int]]) -> None:
    """Exercise 3.2: ``reuse_and_offset(common_len, page_size) -> (reused, offset)``."""
    for common, page in _OFFSET_CASES:
        want = (common // page * page, common % page)
        got = call_reader(f"reuse_and_offset({common}, {page})", reuse_and_offset, common, page)
        expect(isinstance(got, tuple) and tuple(got) == want,
               f"reuse_and_offset({common}, {page}) returned {got!r}, expected {want}: only whole "
               "pages are reused (round the common prefix down to a multiple of the page "
               "size); the offset design's original branch starts at that boundary and skips "
               "the common tokens that spill into the next page.")
    passed("3.2", "20 common tokens with pages of 16: 16 reused, offset 4")


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


def check_hash_reuse(hash_reuse: Callable[[list[list[int]], list[int], int], int]) -> None:
    """Exercise 3.3: tokens of ``ids`` a chained-block-hash cache holding ``cached`` can reuse."""
    for label, cached, ids, block in _HASH_CASES:
        want = _ref_hash_reuse(cached, ids, block)
        what = f"hash_reuse(cached, ids, {block}) ({label}; ids = {ids[:6]}..., {len(ids)} tokens)"
        got = call_reader(what, hash_reuse, [list(c) for c in cached], list(ids), block)
        expect(got == want,
               f"{what} returned {got!r}, expected {want}: cut every sequence into full blocks "
               "from position 0, name each block by a hash of its tokens chained with the "
               "previous block's name, and count the leading blocks of ids whose names are "
               "known.")
    passed("3.3", "chained full-block hashes: blocks line up from position 0, so no offset")


# --------------------------------------------------------------------------- 3.4


def _replay_hits(requests: list[list[int]], page_size: int) -> int:
    return _build(page_size, requests).stats.hit_tokens


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
        expect(got == want,
               f"{what} returned {got!r}, expected {want} (what RadixCache reports): each "
               "request hits the longest prefix it shares with any EARLIER request, rounded "
               "down to whole pages request by request.")
    passed("3.4", f"{len(cases)} request streams predicted exactly")
