"""Checkers for chapter 02: matching a node, splitting it, counting nodes, building A/B/C.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import torch

from ..radix import RadixNode, page_key
from ..viz import tree_dict
from ..workloads import lookup_steps, prefix_node_counts
from ._common import call_reader, expect, passed

__all__ = [
    "check_abc_tree",
    "check_get_match_len",
    "check_node_counts",
    "check_split_at",
]


# --------------------------------------------------------------------------- 2.1

_MATCH_CASES: list[tuple[list[int], list[int], int]] = [
    ([101, 11, 12, 21, 22], [101, 11, 12, 21, 22, 7], 1),  # the whole node, request longer
    ([101, 11, 12, 21, 22], [101, 11, 12, 31, 32], 1),  # diverges inside
    ([101, 11, 12, 21, 22], [101, 11], 1),  # request ends inside the node
    ([101, 11, 12], [5, 101, 11], 1),  # nothing in common
    ([101, 11, 12], [], 1),  # empty request
    ([5, 6, 7, 8], [5, 6, 7, 9], 2),  # 3 common -> 1 whole page of 2
    ([5, 6, 7, 8], [5, 6, 7, 8], 2),  # 2 whole pages
    ([5, 6, 7, 8], [5, 9], 2),  # 1 common -> no whole page
    (list(range(40)), list(range(20)) + [99] * 20, 16),  # 20 common -> 16
    (list(range(32)), list(range(32)), 16),  # exact pages
]


def _ref_match_len(key: Sequence[int], ids: Sequence[int], page_size: int) -> int:
    n = 0
    for a, b in zip(key, ids, strict=False):
        if a != b:
            break
        n += 1
    return n - n % page_size


def check_get_match_len(get_match_len: Callable[[torch.Tensor, torch.Tensor, int], int]) -> None:
    """Exercise 2.1: ``get_match_len(key, ids, page_size)`` for 1-D int64 tensors."""
    rng = random.Random(2)
    cases = list(_MATCH_CASES)
    for _ in range(40):
        page = rng.choice([1, 2, 4])
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        ids = key[: rng.randrange(len(key) + 1)] + [rng.randrange(3) for _ in range(3)]
        cases.append((key, ids, page))
    for key, ids, page in cases:
        expected = _ref_match_len(key, ids, page)
        got = call_reader(f"get_match_len(key={key}, ids={ids}, page_size={page})", get_match_len,
                    torch.tensor(key, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
                    page)
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"get_match_len(key={key}, ids={ids}, page_size={page}) returned {got!r} "
               f"of type {type(got).__name__}; return a Python int (use int(...)).")
        expect(got == expected,
               f"get_match_len(key={key}, ids={ids}, page_size={page}) returned {got}, expected "
               f"{expected}: count the leading positions where key and ids agree (stop at the "
               "first difference or the shorter end), then round down to whole pages.")
    passed("2.1", f"{len(cases)} cases right, e.g. a 20-token common prefix with pages of 16 "
                  "matches 16 tokens")


# --------------------------------------------------------------------------- 2.2


def _split_fixture(page_size: int):
    """root -> node [1..6] (slots 10..15, ref 2, with a child [7, 8]); returns both + originals."""
    fn = page_key(page_size)
    root = RadixNode(fn)
    node = RadixNode(fn, torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([10, 11, 12, 13, 14, 15]),
                     tick=3)
    node.parent = root
    root.children[fn(node.key)] = node
    node.ref_count, node.last_access, node.hit_count = 2, 7, 4
    child = RadixNode(fn, torch.tensor([7, 8]), torch.tensor([16, 17]), tick=4)
    child.parent = node
    node.children[fn(child.key)] = child
    return root, node, child


def _describe(root: RadixNode) -> str:
    return str(tree_dict(root))


def check_split_at(split_at: Callable[[RadixNode, int], RadixNode]) -> None:
    """Exercise 2.2: ``split_at(node, pos)`` -> the new parent holding ``key[:pos]``."""
    for page_size, pos in ((1, 2), (1, 5), (2, 2), (2, 4)):
        root, node, child = _split_fixture(page_size)
        key_buf, value_buf = node.key.obj, node.value.obj  # the buffers both halves must view
        what = f"split_at(node [1, 2, 3, 4, 5, 6], {pos}) with page_size {page_size}"
        upper = call_reader(what, split_at, node, pos)
        expect(isinstance(upper, RadixNode) and upper is not node,
               f"{what} returned {upper!r}; it must return a NEW RadixNode, the upper half. "
               "The old node object keeps the lower half, so handles to it stay valid.")
        expect(upper.key.tolist() == [1, 2, 3, 4, 5, 6][:pos]
               and upper.value.tolist() == [10, 11, 12, 13, 14, 15][:pos],
               f"{what}: the new parent holds key {upper.key.tolist()} / value "
               f"{upper.value.tolist()}, expected the first {pos} tokens and slots.")
        expect(node.key.tolist() == [1, 2, 3, 4, 5, 6][pos:]
               and node.value.tolist() == [10, 11, 12, 13, 14, 15][pos:],
               f"{what}: the old node now holds key {node.key.tolist()} / value "
               f"{node.value.tolist()}, expected the tokens and slots from position {pos} on.")
        fn = node.key_fn
        expect(upper.parent is root and root.children.get(fn(upper.key)) is upper
               and len(root.children) == 1,
               f"{what}: the root's children are {root.children}; the new parent must replace "
               "the old node there (same key, since both start with the same tokens), with "
               "upper.parent = root.")
        expect(node.parent is upper and upper.children == {fn(node.key): node},
               f"{what}: the old node must be the only child of the new parent, keyed by "
               f"key_fn(node.key) = {fn(node.key)!r}; got parent {node.parent!r}, children "
               f"{upper.children}.")
        expect(node.children == {fn(child.key): child} and child.parent is node,
               f"{what}: the old node's own children must stay with it (they continue its "
               "lower half).")
        views = all(isinstance(x, memoryview) and x.obj is buf for x, buf in (
            (upper.key, key_buf), (node.key, key_buf),
            (upper.value, value_buf), (node.value, value_buf)))
        expect(views, f"{what}: the halves must be views (slices) of the old key and value "
                      "memoryviews, sharing their buffers; something was copied (tolist, "
                      "bytes(...), a new tensor). A split moves metadata only.")
        expect(upper.length == pos and node.length == 6 - pos,
               f"{what}: lengths are upper {upper.length}, node {node.length}; expected "
               f"{pos} and {6 - pos}. ``length`` is a plain int: keep it in step with the key.")
        expect(upper.ref_count == 2,
               f"{what}: new parent has ref_count {upper.ref_count}, expected 2 (copied from "
               "the old node: every request using the old node also uses its upper half).")
        expect(upper.key_fn is node.key_fn,
               f"{what}: the new parent must use the same key_fn as the old node.")
    for bad in (0, 6, 9, -1):
        root, node, child = _split_fixture(1)
        before = _describe(root)
        try:
            split_at(node, bad)
        except ValueError:
            pass
        except Exception as exc:
            raise AssertionError(f"split_at(node of length 6, {bad}) raised "
                                 f"{type(exc).__name__}; expected ValueError") from exc
        else:
            raise AssertionError(f"split_at(node of length 6, {bad}) did not raise: a cut must "
                                 "lie strictly inside the node (0 < pos < length); raise "
                                 "ValueError.")
        expect(_describe(root) == before and node.parent is root,
               f"split_at(node, {bad}) raised but changed the tree first: check before you "
               "modify anything.")
    root, node, _ = _split_fixture(2)
    try:
        split_at(node, 3)
    except ValueError:
        pass
    else:
        raise AssertionError("split_at(node, 3) with page_size 2 did not raise: cuts must "
                             "fall on page boundaries (pos % node.page_size == 0).")
    passed("2.2", "the new parent holds the prefix, both halves are views of the old buffers, "
                  "ref_count inherited, bad positions refused")


# --------------------------------------------------------------------------- 2.3

_COUNT_CASES: list[tuple[str, list[list[int]]]] = [
    ("the seed's A, B, C", [[101, 11, 12, 21, 22], [101, 11, 12, 31, 32], [101, 11, 99]]),
    ("a request that is a prefix of another", [[1, 2, 3, 4], [1, 2]]),
    ("the same request twice", [[1, 2, 3], [1, 2, 3]]),
    ("no sharing", [[1, 2, 3], [4, 5], [6]]),
    ("a fork at the root", [[1, 2], [3, 4]]),
    ("a chat: each turn extends the last", [[9, 8, 1], [9, 8, 1, 2, 3], [9, 8, 1, 2, 3, 4]]),
    ("an empty request", [[], [1, 2]]),
]


def _ref_counts(requests) -> tuple[int, int, int, int]:
    return (*prefix_node_counts(requests), *lookup_steps(requests))


def check_node_counts(count_nodes: Callable[[list[list[int]]], tuple[int, int, int, int]]) -> None:
    """Exercise 2.3: ``count_nodes(requests)`` -> trie nodes, radix nodes, trie hops, radix hops."""
    rng = random.Random(3)
    cases = list(_COUNT_CASES)
    for i in range(30):
        reqs = [[rng.randrange(3) for _ in range(rng.randrange(8))]
                for _ in range(rng.randrange(6))]
        cases.append((f"random case {i}", reqs))
    names = ("trie_nodes", "radix_nodes", "trie_hops", "radix_hops")
    for label, reqs in cases:
        expected = _ref_counts(reqs)
        got = call_reader(f"count_nodes({reqs})", count_nodes, [list(r) for r in reqs])
        expect(isinstance(got, tuple) and len(got) == 4,
               f"count_nodes({reqs}) returned {got!r}; return a tuple "
               f"(trie_nodes, radix_nodes, trie_hops, radix_hops).")
        for name, g, e in zip(names, got, expected, strict=True):
            expect(g == e,
                   f"count_nodes({reqs}) ({label}): {name} = {g}, expected {e}. Nodes do not "
                   "count the root; a radix node ends where a request ends or where the path "
                   "forks or stops; hops count the nodes entered while looking up every request "
                   "in the finished tree.")
    passed("2.3", f"{len(cases)} request sets counted right")


# --------------------------------------------------------------------------- 2.4

A = [101, 11, 12, 21, 22]
B = [101, 11, 12, 31, 32]
C = [101, 11, 99]
ABC_TREE = {(101, 11): {(12,): {(21, 22): {}, (31, 32): {}}, (99,): {}}}


def _paths(root: RadixNode) -> dict[tuple[int, ...], list[int]]:
    """Every node's full token sequence -> its full slot list."""
    out: dict[tuple[int, ...], list[int]] = {}
    stack: list[tuple[RadixNode, list[int], list[int]]] = [(root, [], [])]
    while stack:
        node, keys, values = stack.pop()
        if not node.is_root():
            out[tuple(keys)] = values
        for child in node.children.values():
            stack.append((child, keys + child.key.tolist(), values + child.value.tolist()))
    return out


def check_abc_tree(build_tree: Callable[[list[list[int]]], RadixNode]) -> None:
    """Exercise 2.4: ``build_tree(requests)`` inserts them in order, fresh slots 0, 1, 2, ...
    for uncached tokens only, and returns the root."""
    root = call_reader("build_tree([A, B, C])", build_tree, [A, B, C])
    expect(isinstance(root, RadixNode) and root.is_root(),
           f"build_tree([A, B, C]) returned {root!r}; return the (empty) root RadixNode.")
    got = tree_dict(root)
    expect(got == ABC_TREE, f"build_tree([A, B, C]) built {got}, expected the seed's tree "
                            f"{ABC_TREE}: B splits A's node at 3, C splits [101, 11, 12] at 2.")
    paths = _paths(root)
    want = {tuple(A): [0, 1, 2, 3, 4], tuple(B): [0, 1, 2, 5, 6], tuple(C): [0, 1, 7]}
    for seq, slots in want.items():
        expect(paths.get(seq) == slots,
               f"build_tree([A, B, C]): request {list(seq)} has slots {paths.get(seq)}, "
               f"expected {slots}: A takes 0..4; B reuses 0..2 and only its new tokens [31, 32] "
               "get fresh slots 5, 6; C reuses 0, 1 and gets 7.")
    top = root.children[101]
    leaf_a = top.children[12].children[21]
    expect(top.value.obj is leaf_a.value.obj,
           "build_tree([A, B, C]): [101, 11] and [21, 22] should be views of A's original slot "
           "buffer (split_at copies nothing); they no longer share it.")
    for reqs, shape, label in (
        ([[1, 2, 3], [1, 2]], {(1, 2): {(3,): {}}}, "a request that ends inside a node splits it"),
        ([[1, 2, 3], [1, 2, 3]], {(1, 2, 3): {}}, "a repeated request adds nothing"),
        ([[1, 2], [1, 2, 3, 4]], {(1, 2): {(3, 4): {}}}, "an extension hangs below"),
        ([[1, 2], [3]], {(1, 2): {}, (3,): {}}, "a request sharing nothing hangs at the root"),
    ):
        root = call_reader(f"build_tree({reqs})", build_tree, reqs)
        expect(tree_dict(root) == shape,
               f"build_tree({reqs}) built {tree_dict(root)}, expected {shape} ({label}).")
        used = sorted(itertools.chain.from_iterable(_paths(root)[tuple(r)] for r in reqs))
        fresh = len({tuple(r[:i]) for r in reqs for i in range(1, len(r) + 1)})
        expect(len(set(used)) == fresh and max(used) == fresh - 1,
               f"build_tree({reqs}) used slots {sorted(set(used))}; expected exactly 0..{fresh - 1}"
               " (one fresh slot per token not yet cached).")
    passed("2.4", "A, B, C give [101, 11] -> {[12] -> {[21, 22], [31, 32]}, [99]} with 8 slots "
                  "for 13 tokens")
