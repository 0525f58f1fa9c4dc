"""Checkers for chapter 02: merging and splitting nodes, counting nodes, a paged insert.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees (input, expected, got); a
repeated failure adds a hint toward the idea.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ..cache import RadixCache
from ..radix import RadixNode, page_key
from ..viz import tree_dict
from ..workloads import lookup_steps, prefix_node_counts
from ._common import (
    CheckFailure,
    as_int_list,
    call_reader,
    checker,
    expect,
    expect_value_error,
    passed,
    same_int,
)

__all__ = [
    "PAGED_REQUESTS",
    "check_insert_pages",
    "check_paged_prediction",
    "check_merge",
    "check_node_counts",
    "check_split_with_stats",
]


def _chain(page_size: int, *parts: list[int], ref: int = 0, times: list[int] | None = None):
    """root -> parts[0] -> parts[1] -> ...: slots 10, 11, ... in order; returns root, nodes.

    Node ``i`` was last accessed at ``times[i]`` (default ``5 + i``: deeper is more recent).
    """
    fn = page_key(page_size)
    root, parent, slot, nodes = RadixNode(fn), None, 10, []
    parent = root
    for i, part in enumerate(parts):
        node = RadixNode(fn, torch.tensor(part), torch.arange(slot, slot + len(part)), tick=i)
        slot += len(part)
        node.parent = parent
        parent.children[fn(node.key)] = node
        node.ref_count, node.last_access = ref, (5 + i if times is None else times[i])
        nodes.append(node)
        parent = node
    return root, nodes


def _snapshot(root: RadixNode) -> list[tuple]:
    """Every node's token path, slots, ref_count and child keys, in path order."""
    out, stack = [], [(root, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(node.key.tolist())
        out.append((path, tuple(node.value.tolist()), node.ref_count,
                    tuple(sorted(map(str, node.children)))))
        for key, child in node.children.items():
            expect(child.parent is node and node.key_fn(child.key) == key,
                   f"node {list(path)} lists a child under key {key!r} whose parent or key "
                   f"does not match (child.parent is {child.parent!r}).")
            stack.append((child, path))
    return sorted(out)


# --------------------------------------------------------------------------- 2.1

# (what it shows, page_size, node parts, ref_count, index of the node to merge)
_MERGE_CASES = [  # name, page size, keys root-down, index of the node to merge, last_access
    ("a node and its only child, a leaf", 1, [[1, 2, 3], [4, 5]], 0, None),
    ("the child has children of its own", 1, [[1, 2], [3], [4, 5, 6]], 0, None),
    ("under a parent that is not the root", 1, [[7], [8, 9], [10]], 1, None),
    ("locked path, pages of 2", 2, [[1, 2], [3, 4, 5, 6], [7, 8]], 0, None),
    # a match that ended at the upper node touched it after the child's last use
    ("the upper node was used more recently than its child", 1, [[1, 2], [3, 4]], 0, [9, 6]),
]


@checker("2.1", "A handle names the node where a match ends. After the merge, which of the "
                "two objects must still exist so that a handle taken before it still works? "
                "And who points at whom: parent, children dict, grandchildren?")
def check_merge(merge: Callable[[RadixNode], RadixNode]) -> None:
    """Exercise 2.1: ``merge(node)`` folds a node into its only child; the child survives."""
    tried = 0
    for name, page, parts, index, times in _MERGE_CASES:
        for ref in (0, 2):
            root, nodes = _chain(page, *parts, ref=ref, times=times)
            node, child = nodes[index], nodes[index + 1]
            grandkids = list(child.children.values())
            what = f"merge(node {parts[index]}) with its only child {parts[index + 1]} ({name})"
            key = parts[index] + parts[index + 1]
            slots = [*node.value, *child.value]
            latest = max(node.last_access, child.last_access)
            got = call_reader(what, merge, node)
            expect(got is child,
                   f"{what} returned {got!r}, expected the child object (id {child.id}), now "
                   f"holding {key}.")
            expect(child.key.tolist() == key and child.value.tolist() == slots,
                   f"{what}: the surviving node holds key {child.key.tolist()} and slots "
                   f"{child.value.tolist()}, expected {key} and {slots}.")
            expect(child.length == len(key),
                   f"{what}: the survivor's length is {child.length}, expected {len(key)} "
                   "(``length`` is a plain int kept in step with the key).")
            parent = root if index == 0 else nodes[index - 1]
            expect(child.parent is parent and parent.children == {child.key_fn(child.key): child},
                   f"{what}: the parent's children are {parent.children} and the survivor's "
                   f"parent is {child.parent!r}; expected the survivor alone under "
                   f"{parent.key.tolist() or 'the root'}.")
            expect(all(g.parent is child for g in grandkids)
                   and set(child.children.values()) == set(grandkids),
                   f"{what}: the survivor's children are {list(child.children.values())}, "
                   f"expected {grandkids}, each with the survivor as parent.")
            expect(child.ref_count == ref and child.last_access == latest,
                   f"{what}: the survivor has ref_count {child.ref_count} and last_access "
                   f"{child.last_access}, expected {ref} and {latest} (the later of the two).")
            expect(node.parent is None and not node.children,
                   f"{what}: the folded node still has parent {node.parent!r} and children "
                   f"{node.children}; expected it detached (parent None, no children).")
            _snapshot(root)
            tried += 1
    refusals = [("the root", lambda r, ns: r), ("a leaf", lambda r, ns: ns[-1])]
    for label, pick in refusals:
        root, nodes = _chain(1, [1, 2], [3])
        _refuses(merge, pick(root, nodes), root, f"merge({label})")
    root, nodes = _chain(1, [1, 2], [3])
    extra = RadixNode(nodes[0].key_fn, torch.tensor([9]), torch.tensor([99]))
    extra.parent = nodes[0]
    nodes[0].children[9] = extra
    _refuses(merge, nodes[0], root, "merge(a node with two children)")
    root, nodes = _chain(1, [1, 2], [3])
    nodes[1].ref_count = 1
    _refuses(merge, nodes[0], root, "merge(a node whose child has a different ref_count)")
    passed("2.1", f"{tried} merges undo a split exactly, the child survives (its handles stay "
                  "valid); 4 impossible merges refused with the tree unchanged")


def _refuses(merge, node, root, what: str) -> None:
    before = _snapshot(root)
    expect_value_error(what, merge, node)
    expect(_snapshot(root) == before, f"{what} raised ValueError but changed the tree first.",
           "Decide whether the merge is possible before you change anything.")


# --------------------------------------------------------------------------- 2.2

_STAT_CASES = [(1, 2), (1, 5), (2, 2), (2, 4)]


@checker("2.2", "split_at returns one object and modifies another: which one holds the "
                "first pos tokens afterwards? And what must still be true if split_at refuses?")
def check_split_with_stats(split_with_stats: Callable[[RadixNode, int, dict], RadixNode]) -> None:
    """Exercise 2.2: split a node and move its per-token statistic with the tokens."""
    hits_list = [5, 5, 4, 2, 2, 1]
    for page, pos in _STAT_CASES:
        root, (node, child) = _chain(page, [1, 2, 3, 4, 5, 6], [7, 8])
        stats = {node.id: torch.tensor(hits_list), child.id: torch.tensor([1, 0])}
        what = (f"split_with_stats(node [1, 2, 3, 4, 5, 6] with hits {hits_list}, {pos}) with "
                f"page_size {page}")
        upper = call_reader(what, split_with_stats, node, pos, stats)
        expect(isinstance(upper, RadixNode) and upper is not node and upper.parent is root
               and upper.key.tolist() == [1, 2, 3, 4, 5, 6][:pos],
               f"{what} returned {upper!r}; expected the new parent holding "
               f"{[1, 2, 3, 4, 5, 6][:pos]}.")
        want = {upper.id: hits_list[:pos], node.id: hits_list[pos:], child.id: [1, 0]}
        have = {k: as_int_list(v) for k, v in stats.items()}
        expect(have == want,
               f"{what}: the statistics are {have}, expected {want} (keyed by node id: "
               f"new parent {upper.id}, old node {node.id}, its child {child.id}).")
    for page, bad in ((1, 0), (1, 6), (1, 9), (2, 3)):
        root, (node, child) = _chain(page, [1, 2, 3, 4, 5, 6], [7, 8])
        stats = {node.id: torch.tensor(hits_list), child.id: torch.tensor([1, 0])}
        what = f"split_with_stats(node of length 6, {bad}) with page_size {page}"
        expect_value_error(what, split_with_stats, node, bad, stats)
        have = {k: as_int_list(v) for k, v in stats.items()}
        expect(have == {node.id: hits_list, child.id: [1, 0]},
               f"{what} raised ValueError but left the statistics as {have}, expected "
               f"{ {node.id: hits_list, child.id: [1, 0]} } (unchanged).")
    passed("2.2", "per-token statistics follow their tokens through a split; a refused split "
                  "changes nothing")


# --------------------------------------------------------------------------- 2.3

_COUNT_CASES: list[tuple[str, list[list[int]]]] = [
    ("the A, B, C requests", [[101, 11, 12, 21, 22], [101, 11, 12, 31, 32], [101, 11, 99]]),
    ("a request that is a prefix of another", [[1, 2, 3, 4], [1, 2]]),
    ("the same request twice", [[1, 2, 3], [1, 2, 3]]),
    ("no sharing", [[1, 2, 3], [4, 5], [6]]),
    ("a fork at the root", [[1, 2], [3, 4]]),
    ("a chat: each turn extends the last", [[9, 8, 1], [9, 8, 1, 2, 3], [9, 8, 1, 2, 3, 4]]),
    ("an empty request", [[], [1, 2]]),
]


def _ref_counts(requests) -> tuple[int, int, int, int]:
    return (*prefix_node_counts(requests), *lookup_steps(requests))


@checker("2.3", "Count on paper first: draw the trie and the radix tree for the failing "
                "input. Where exactly must a radix node end?")
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
            expect(g == e, f"count_nodes({reqs}) ({label}): {name} = {g}, expected {e}.")
    passed("2.3", f"{len(cases)} request sets counted right")


# --------------------------------------------------------------------------- 2.4

# (what it shows, page_size, requests inserted in order)
_PAGED_CASES: list[tuple[str, int, list[list[int]]]] = [
    ("A, B, C with pages of 1", 1, [[101, 11, 12, 21, 22], [101, 11, 12, 31, 32],
                                     [101, 11, 99]]),
    ("pages of 2: the second request diverges inside a page", 2,
     [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 5, 6]]),
    ("pages of 2: a request that ends inside a node", 2, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4]]),
    ("pages of 2: the same request twice", 2, [[1, 2, 3, 4], [1, 2, 3, 4]]),
    ("pages of 4: three requests on one prefix", 4,
     [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8], [0, 1, 2, 3, 9, 9, 9, 9]]),
    ("pages of 2: nothing shared", 2, [[1, 2], [3, 4, 5, 6]]),
]


def _own_slots(request_index: int, length: int, page: int) -> list[int]:
    """Request k's own slots: whole pages starting at page 10 * (k + 1)."""
    first = 10 * (request_index + 1) * page
    return list(range(first, first + length))


def _slot_paths(root: RadixNode) -> dict[tuple[int, ...], list[int]]:
    out, stack = {}, [(root, [], [])]
    while stack:
        node, keys, values = stack.pop()
        if node.parent is not None:
            out[tuple(keys)] = values
        for child in node.children.values():
            stack.append((child, keys + child.key.tolist(), values + child.value.tolist()))
    return out


def _has_node_with_key(root: RadixNode, ids: list[int]) -> bool:
    """True if one node under ``root`` holds exactly ``ids`` as its key."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        if node.key.tolist() == list(ids):
            return True
        stack.extend(node.children.values())
    return False


def _insert_nudge(got: list[int] | None, want: list[int], slots: list[int],
                  tree_pages: list[int], page: int) -> str:
    """A hint for the kind of mistake in the returned duplicate pages."""
    if got is not None and got and got == slots[: len(want) * page]:
        return f"Those are slot numbers; return page numbers: slot // {page}."
    if got is not None and got and got == tree_pages[: len(got)]:
        return ("Those are the tree's pages, which stay. Return the request's own copies of "
                "what the tree already held: they are the ones to free.")
    if got is not None and len(got) > len(want):
        return ("Only whole pages are shared: count the matched tokens in whole pages "
                "(get_match_len does), not token by token.")
    return ("The duplicates are the request's own pages for the positions the tree already "
            "held when it arrived, in position order.")


@checker("2.4", "The tree keeps the slots it already has; the request's copies of those are "
                "the duplicates. Which pages of the request hold them, and what is a page's "
                "number in a pool of pages?")
def check_insert_pages(insert_pages: Callable[[RadixNode, list[int], list[int]], list[int]]
                       ) -> None:
    """Exercise 2.4: a paged insert that returns the request's duplicate pages to free.

    Each kind of failure carries its own hint: a crash inside ``split_at``, wrong pages, a
    tree of the wrong shape, or wrong slots along a path.
    """
    for name, page, requests in _PAGED_CASES:
        root = RadixNode(page_key(page))
        ref = RadixCache(page_size=page)
        for k, ids in enumerate(requests):
            slots = _own_slots(k, len(ids), page)
            before = _slot_paths(ref.root)
            tree_pages = sorted({s // page for path in before.values() for s in path})
            want_dup = [s // page for s in slots[: ref.insert_prefix(ids, slots).cached_len:page]]
            what = (f"insert_pages(root, ids={ids}, slots={slots}) with page_size {page}, after "
                    f"inserting {requests[:k]} ({name})")
            try:
                got = as_int_list(call_reader(what, insert_pages, root, list(ids), list(slots)))
            except CheckFailure as exc:
                raise CheckFailure(str(exc), (
                    "split_at takes only positions on a page boundary. Measure a match with "
                    "get_match_len, which counts whole pages, before you split.")
                    if "ValueError" in str(exc) else None) from exc
            expect(got == want_dup,
                   f"{what} returned the duplicate pages {got}, expected {want_dup}.",
                   _insert_nudge(got, want_dup, slots, tree_pages, page))
            have, want = tree_dict(root), tree_dict(ref)
            whole = _has_node_with_key(root, ids) and not _has_node_with_key(ref.root, ids)
            expect(have == want, f"{what}: the tree is now {have}, expected {want}.",
                   "The tokens the tree already holds stay on its nodes: hang only the "
                   "uncached rest of the request as a new leaf, under the node where the "
                   "match ends." if whole else
                   "Split where the request leaves a node, even where it simply ends there.")
            have_slots, want_slots = _slot_paths(root), _slot_paths(ref.root)
            expect(have_slots == want_slots,
                   f"{what}: the slots along each path are {have_slots}, expected "
                   f"{want_slots}.",
                   "Cached positions keep the tree's slots; the new leaf takes the request's "
                   "own slots for the positions after the match.")
    passed("2.4", f"{len(_PAGED_CASES)} insert sequences: the tree as RadixCache builds it, and "
                  "exactly the duplicate pages returned")


# Exercise 2.4's prediction: three requests inserted in order with pages of 2, each
# computed into slots of its own (request k into slots 10 k, 10 k + 1, ...).
PAGED_REQUESTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 9, 9, 10], [5, 6, 7, 8, 1, 2]]


def _paged_truth(page: int = 2) -> dict[str, object]:
    """Each request's duplicate pages and the tree's node count, through ``RadixCache``."""
    cache, dups = RadixCache(page_size=page), []
    for k, ids in enumerate(PAGED_REQUESTS):
        slots = list(range(10 * k, 10 * k + len(ids)))
        cached = cache.insert_prefix(ids, slots).cached_len
        dups.append([s // page for s in slots[:cached:page]])
    nodes, stack = 0, [cache.root]
    while stack:
        node = stack.pop()
        nodes += not node.is_root()
        stack.extend(node.children.values())
    return {"duplicates": dups, "nodes": nodes}


_PAGED_NAMES = ("P", "Q", "R")


def _paged_nudge(k: int, got: list[int], want: list[int], page: int = 2) -> str:
    """A hint for the kind of mistake in request ``k``'s duplicate pages (never the answer)."""
    own = list(range(10 * k, 10 * k + len(PAGED_REQUESTS[k])))
    if got and all(g in own for g in got) and not set(got) & set(want):
        return ("Those look like slot numbers. The pool frees whole pages: a page's number is "
                f"slot // {page}.")
    if got and not set(got) <= {s // page for s in own}:
        return (f"Duplicates are {_PAGED_NAMES[k]}'s own copies, so they are among its own "
                f"pages (its slots are {own[0]}..{own[-1]}), not the tree's.")
    if len(got) > len(want):
        return ("A page is shared only when all its tokens match, and every page before it "
                "too: a page that matches only in part is computed again, not a duplicate.")
    return ("Walk the tree as it stands after the requests before this one, one whole page at "
            "a time, and stop at the first page that differs.")


@checker("2.4 prediction", "A page is shared only when it and every page before it match. "
                           "Where does each request leave the tree, in whole pages, and which "
                           "nodes does that split?")
def check_paged_prediction(predicted: dict) -> None:
    """Exercise 2.4, first part: duplicate pages and node count of ``PAGED_REQUESTS``.

    A wrong value is named but never corrected: the point is to predict first.
    """
    want = _paged_truth()
    form = ("a dict {'duplicates': [P's pages, Q's pages, R's pages], 'nodes': n}, each "
            "entry a list of page numbers and n an int, e.g. {'duplicates': [[], [0], [1, 2]], "
            "'nodes': 3}")
    expect(isinstance(predicted, dict) and set(predicted) == set(want),
           f"your prediction is {predicted!r}; write it as {form}.",
           "Copy the template in the cell and fill in the values.")
    raw = predicted["duplicates"]
    got = ([as_int_list(d) for d in raw] if isinstance(raw, (list, tuple)) and len(raw) == 3
           else None)
    expect(got is not None and None not in got,
           f"your 'duplicates' is {raw!r}; it must hold three lists of page numbers, one per "
           "request P, Q, R in insertion order.", "Copy the template in the cell.")
    for k, (g, w) in enumerate(zip(got, want["duplicates"], strict=True)):
        expect(g == w, f"your duplicate pages for {_PAGED_NAMES[k]} ({PAGED_REQUESTS[k]}) are "
                       f"{raw[k]!r}; that is not right.", _paged_nudge(k, g, w))
    expect(same_int(predicted["nodes"], want["nodes"]),
           f"your duplicate pages are right, but the tree does not have {predicted['nodes']!r} "
           "nodes besides the root.",
           "Draw the tree after each insert. A request that leaves a node part of the way "
           "along splits it, at a page boundary; and the pages it does not share hang as one "
           "new leaf.")
    passed("2.4", f"prediction right: duplicate pages {want['duplicates']}, "
                  f"{want['nodes']} nodes")
