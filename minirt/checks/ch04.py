"""Checkers for chapter 04: lock/unlock bookkeeping, where every slot goes at finish, page
tables through the R1/R2 story, and an eviction policy that prefers cheap recomputation.

Each checker builds its own scenarios, runs the reader's function next to minirt's own
(``RadixCache.lock``, ``Lifecycle.finish``, ``Lifecycle.make_room``) on an identical twin,
and names the first scenario where they disagree (input, expected, got); a repeated
failure adds a hint toward the idea. Scenarios that need a model run a tiny random one
(``tiny_model``): only which slots go where matters here, not the tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from ..cache import CacheHandle, RadixCache, insert_fresh
from ..eviction import EvictionPolicy
from ..lifecycle import Lifecycle, Request
from ..pool import KVPool
from ..radix import RadixNode
from ._common import as_int_list, call_reader, checker, expect, passed

__all__ = [
    "PAGE_TABLE_STEPS",
    "CostPolicy",
    "check_lock_path",
    "check_page_tables",
    "check_recompute_cost",
    "check_finish_prediction",
    "check_slot_fates",
    "page_table_story",
]

_S = [900, 10, 11, 12]
_A, _B, _C = [101, 11, 12, 21, 22], [101, 11, 12, 31, 32], [101, 11, 99]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread than on two fighting over a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_TINY = None


def _tiny():
    global _TINY
    if _TINY is None:
        from ..model import tiny_model

        _TINY = tiny_model(0, vocab_size=1024).to(torch.float64)
    return _TINY


def _path_tokens(node: RadixNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.key.tolist())
        node = node.parent
    return [t for p in reversed(parts) for t in p]


def _nodes(cache: RadixCache) -> list[RadixNode]:
    """Root and every node, in a canonical order (by the token path they spell)."""
    out, stack = [], [cache.root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return sorted(out, key=_path_tokens)


# --------------------------------------------------------------------------- 4.1


def _tree(inserts: Sequence[Sequence[int]]) -> RadixCache:
    """A cache holding ``inserts`` (fresh slots 0, 1, 2, ... for each uncached part)."""
    cache, nxt = RadixCache(), 0
    for ids in inserts:
        _, nxt = insert_fresh(cache, ids, nxt)
    return cache


# (what it shows, cached sequences, operations: ("lock" | "unlock", prefix naming the node))
LOCK_SCENARIOS: list[tuple[str, list[list[int]], list[tuple[str, list[int]]]]] = [
    ("one request on S + [31, 32]", [_S, _S + [31, 32]],
     [("lock", _S + [31, 32]), ("unlock", _S + [31, 32])]),
    ("two requests share S: the second lock moves nothing", [_S, _S + [31, 32]],
     [("lock", _S), ("lock", _S + [31, 32]), ("unlock", _S), ("unlock", _S + [31, 32])]),
    ("A/B/C: a deep lock under an already locked ancestor", [_A, _B, _C],
     [("lock", [101, 11]), ("lock", _B), ("lock", _C), ("unlock", [101, 11]), ("lock", _A),
      ("unlock", _B), ("unlock", _C), ("unlock", _A)]),
    ("the same node locked three times", [_A, _C],
     [("lock", _C), ("lock", _C), ("lock", _C), ("unlock", _C), ("unlock", _C),
      ("unlock", _C)]),
]


def _node_at(cache: RadixCache, ids: Sequence[int]) -> RadixNode:
    node = cache.root
    pos = 0
    while pos < len(ids):
        node = node.children[cache.key_fn(torch.tensor(ids[pos:]))]
        pos += node.length
    if pos != len(ids):  # pragma: no cover - scenarios name whole nodes
        raise ValueError(f"{ids} does not end at a node")
    return node


@checker("4.1", "Follow the node's parent pointers on the drawn tree. Which nodes does one "
                "request hold, and when does a count change what is evictable?")
def check_lock_path(update_path: Callable[[RadixNode, int], int]) -> None:
    """Exercise 4.1: ``update_path(node, +1)`` (lock) / ``update_path(node, -1)`` (unlock)
    change ``ref_count`` on the node and every ancestor up to and including the root, and
    return how many tokens moved from evictable to protected (lock) or back (unlock)."""
    ops = 0
    for name, inserts, script in LOCK_SCENARIOS:
        mine, ref = _tree(inserts), _tree(inserts)
        done: list[str] = []
        for op, ids in script:
            before = ref.protected_size
            ref_node = _node_at(ref, ids)
            handle = CacheHandle(ref_node, len(_path_tokens(ref_node)))
            (ref.lock if op == "lock" else ref.unlock)(handle)
            expected_moved = abs(ref.protected_size - before)
            delta = 1 if op == "lock" else -1
            call = f"update_path(node {ids}, {delta:+d})"
            got = call_reader(call, update_path, _node_at(mine, ids), delta)
            done.append(f"{op}({ids})")
            where = f"in scenario '{name}', after {' -> '.join(done)}"
            for x, y in zip(_nodes(mine), _nodes(ref), strict=True):
                expect(x.ref_count == y.ref_count,
                       f"{where}: node {_path_tokens(x) or 'root'} has ref_count "
                       f"{x.ref_count}, expected {y.ref_count}.")
            expect(isinstance(got, int) and not isinstance(got, bool) and got == expected_moved,
                   f"{call} returned {got!r} {where}; expected {expected_moved} tokens moved.")
            ops += 1
    passed("4.1", f"{ops} locks and unlocks in {len(LOCK_SCENARIOS)} trees: ref counts and "
                  "evictable/protected moves agree with RadixCache")


# --------------------------------------------------------------------------- 4.2

FatesFn = Callable[[Request, int, int], Mapping[str, Sequence[int]]]
FATES = ("kept", "duplicate", "cached", "tail")


def _lifecycle(capacity: int, page_size: int = 1) -> Lifecycle:
    model = _tiny()
    pool = KVPool.for_model(model, capacity, page_size=page_size)
    return Lifecycle(model, pool, RadixCache(page_size=page_size))


def _until_done(lc: Lifecycle, req: Request) -> None:
    while not req.done:
        lc.decode([req])


def _scenario_plain() -> tuple[Lifecycle, Request]:
    lc = _lifecycle(12)
    lc.run(lc.new_request(_S, 1))
    r = lc.new_request(_S + [31, 32], 3, rid="R")
    lc.admit(r)
    lc.prefill(r)
    _until_done(lc, r)
    return lc, r


def _scenario_inserted_while_running() -> tuple[Lifecycle, Request]:
    lc = _lifecycle(12)
    lc.run(lc.new_request(_S, 1))
    r = lc.new_request(_S + [31, 32], 3, rid="R")
    lc.admit(r)
    lc.prefill(r)
    lc.insert_running(r)
    _until_done(lc, r)
    return lc, r


def _scenario_twins(page_size: int) -> tuple[Lifecycle, Request]:
    lc = _lifecycle(24, page_size)
    a = lc.new_request([3, 1, 4, 1, 5, 9, 2], 2, rid="A")
    b = lc.new_request([3, 1, 4, 1, 5, 9, 2], 3, rid="B")
    for r in (a, b):
        lc.admit(r)
        lc.prefill(r)
    lc.insert_running(a)       # A cached the prompt first and keeps running
    _until_done(lc, b)
    return lc, b


def _scenario_tail() -> tuple[Lifecycle, Request]:
    lc = _lifecycle(16, 4)
    lc.run(lc.new_request([7, 7, 7, 7, 8], 1))
    r = lc.new_request([7, 7, 7, 7, 8, 9, 10], 2, rid="R")
    lc.admit(r)
    lc.prefill(r)
    _until_done(lc, r)
    return lc, r


FINISH_SCENARIOS: list[tuple[str, Callable[[], tuple[Lifecycle, Request]]]] = [
    ("R = S + [31, 32] after S was cached; 3 tokens generated", _scenario_plain),
    ("the same, but R's prompt was inserted while it ran", _scenario_inserted_while_running),
    ("twins: A cached the same prompt first and is still running", lambda: _scenario_twins(1)),
    ("twins with pages of 2", lambda: _scenario_twins(2)),
    ("pages of 4: the last page is only partly used", _scenario_tail),
]


def _tree_has(lc: Lifecycle, req: Request) -> int:
    """Leading tokens (with K/V) of ``req`` the tree holds now, in whole pages, read-only."""
    ids = req.tokens[: req.kv_len].tolist()
    node, pos, page = lc.cache.root, 0, lc.cache.page_size
    while len(ids) - pos >= page:
        child = node.children.get(lc.cache.key_fn(torch.tensor(ids[pos:])))
        if child is None:
            break
        m = child.get_match_len(torch.tensor(ids[pos:]))
        pos += m
        if m < child.length:
            break
        node = child
    return pos


def slot_fates_reference(req: Request, tree_has: int, page_size: int) -> dict[str, list[int]]:
    """Where each of ``req``'s slots goes when ``Lifecycle.finish`` runs."""
    slots = req.page_table.slots.tolist()
    aligned = req.kv_len - req.kv_len % page_size
    private = req.private.tolist()
    return {"kept": slots[: req.cached_len], "duplicate": slots[req.cached_len:tree_has],
            "cached": slots[tree_has:aligned], "tail": private[aligned - req.cached_len:]}


def _fates_nudge(fate: str, got: list[int] | None, want: dict[str, list[int]],
                 private: list[int]) -> str | None:
    """A hint for the kind of mistake made in one fate (None: the checker's general hint)."""
    have, right = set(got or []), set(want[fate])
    extra, missing = have - right, right - have
    if fate == "kept" and extra:
        return ("Kept lists only the tree slots the request shared when it was admitted (its "
                "first cached_len positions), not what the tree holds now.")
    if fate == "duplicate" and extra - set(private):
        return ("Duplicates are the request's own copies (private slots) of tokens the tree "
                "already holds; the tree's own slots stay where they are.")
    if fate == "duplicate" and extra:
        return ("The other request inserted its prompt in whole pages only: how many of its "
                "tokens is that?")
    if fate == "tail" and missing and not extra:
        return ("The tail is freed page by page: it holds every private slot after the last "
                "whole page the tree takes, the unused slots of the request's last page too.")
    if fate in ("cached", "tail") and (extra & set(want["cached"] + want["tail"])):
        return ("The tree takes whole pages of K/V only: positions after the last whole page "
                "are not inserted, and the last output token has no K/V yet.")
    return None


@checker("4.2", "Finish inserts only what has K/V, in whole pages, and the tree keeps the "
                "slots it already had. For each position of the request, ask: did the tree "
                "own it before, does it own it after, and whose copy survives?")
def check_slot_fates(slot_fates: FatesFn) -> None:
    """Exercise 4.2: predict, before ``finish``, where every slot of a request ends up."""
    with _one_thread():
        for name, build in FINISH_SCENARIOS:
            lc, req = build()
            tree_has, page = _tree_has(lc, req), lc.pool.page_size
            want = slot_fates_reference(req, tree_has, page)
            what = (f"slot_fates(req, tree_has={tree_has}, page_size={page}) in scenario "
                    f"'{name}' (page table {req.page_table.tolist()}, cached_len "
                    f"{req.cached_len}, kv_len {req.kv_len}, private {req.private.tolist()})")
            got = call_reader(what, slot_fates, req, tree_has, page)
            expect(isinstance(got, Mapping) and set(got) == set(FATES),
                   f"{what} returned {got!r}; expected a dict with the keys {list(FATES)}, "
                   "each a list of slots, e.g. {'kept': [0, 1], 'duplicate': [], 'cached': "
                   "[4, 5], 'tail': [6]}.")
            for fate in FATES:
                have = as_int_list(got[fate])
                expect(have is not None and sorted(have) == sorted(want[fate]),
                       f"{what}: {fate!r} is {got[fate]!r}, expected {want[fate]}.",
                       _fates_nudge(fate, have, want, req.private.tolist()))
    passed("4.2", f"{len(FINISH_SCENARIOS)} finishes predicted slot by slot: kept, duplicate "
                  "(freed), newly cached, tail (freed)")


@checker("4.2 prediction", "Go position by position through B's page table: which positions "
                           "does the tree already hold (A inserted its prompt in whole pages), "
                           "which whole pages does B add, and which slots of B's last page hold "
                           "no cached token?")
def check_finish_prediction(predicted: Mapping[str, Sequence[int]]) -> None:
    """Exercise 4.2, first part: twin B's slots at finish, predicted by hand (pages of 2).

    A wrong list is named but never corrected: the point is to predict first.
    """
    with _one_thread():
        lc, req = _scenario_twins(2)
        want = slot_fates_reference(req, _tree_has(lc, req), lc.pool.page_size)
        private = req.private.tolist()
    what = "your prediction for B's finish"
    expect(isinstance(predicted, Mapping) and set(predicted) == set(FATES),
           f"{what} is {predicted!r}; write it as a dict with the keys {list(FATES)}, each a "
           "list of slot numbers (in any order).", "Copy the template in the cell.")
    for fate in FATES:
        have = as_int_list(predicted[fate])
        expect(have is not None and sorted(have) == sorted(want[fate]),
               f"{what}: {fate!r} is {predicted[fate]!r}; that is not right.",
               _fates_nudge(fate, have, want, private))
    passed("4.2", "prediction right: " + ", ".join(f"{k} {v}" for k, v in want.items()))


# --------------------------------------------------------------------------- 4.3

# The story of exercise 4.3: a pool of 11 slots, S cached in p0..p3.
PAGE_TABLE_STEPS = ["admit R1", "admit R2", "decode R1 and R2", "finish R1 and R2", "admit R3"]


def page_table_story() -> dict[str, dict[str, object]]:
    """Run exercise 4.3's story; for each step, the running page tables and the free list."""
    with _one_thread():
        lc = _lifecycle(11)
        lc.run(lc.new_request(_S, 1, rid="S"))
        r1 = lc.new_request(_S + [31, 32], 2, rid="R1")
        r2 = lc.new_request(_S + [41, 42, 43], 2, rid="R2")
        r3 = lc.new_request(_S + [31, 32, 50], 1, rid="R3")
        out: dict[str, dict[str, object]] = {}

        def snap(step: str) -> None:
            out[step] = {"page_tables": {r.rid: r.page_table.tolist() for r in lc.running},
                         "free": lc.pool.free_slots().tolist()}

        lc.admit(r1)
        snap("admit R1")
        lc.admit(r2)
        snap("admit R2")
        for r in (r1, r2):
            lc.prefill(r)
            lc.insert_running(r)
        lc.decode([r1, r2])
        snap("decode R1 and R2")
        lc.finish(r1)
        lc.finish(r2)
        snap("finish R1 and R2")
        lc.admit(r3)
        snap("admit R3")
        return out


_STEP_NUDGES = {
    "admit R1": "R1's match stops before its last prompt token; only the gap gets slots.",
    "admit R2": "R2 shares S with R1 but nothing after it: which positions come from the tree?",
    "decode R1 and R2": "Each request feeds its last output token, which needs a slot first; "
                        "R1 is served first.",
    "finish R1 and R2": "After finishing, what does the tree own, and is any slot left on the "
                        "free list? A finished request has no page table.",
    "admit R3": "R3 needs one slot and none is free, so something is evicted. Of the unlocked "
                "leaves, which was used least recently: which request's output leaf went into "
                "the tree first, and did R3's match touch either?",
}


@checker("4.3", "Replay the story one step at a time on paper, with the pool as a row of 11 "
                "boxes.")
def check_page_tables(predicted: Mapping[str, Mapping[str, object]]) -> None:
    """Exercise 4.3: your predicted page tables and free list after each step of the story."""
    truth = page_table_story()
    example = "{'admit R1': {'page_tables': {'R1': [0, 1, ...]}, 'free': [6, ...]}, ...}"
    expect(isinstance(predicted, Mapping),
           f"predicted is a {type(predicted).__name__}; expected a dict from step name to "
           f"{{'page_tables': ..., 'free': ...}}, e.g. {example}")
    for step in PAGE_TABLE_STEPS:
        expect(step in predicted,
               f"no prediction for step {step!r}; expected one key per step: {PAGE_TABLE_STEPS}")
        want, got = truth[step], predicted[step]
        nudge = _STEP_NUDGES[step]
        free = as_int_list(got.get("free", ())) if isinstance(got, Mapping) else None
        expect(free is not None and free == want["free"],
               f"after '{step}' you predicted the free list {free!r}; it is {want['free']}.",
               nudge)
        tables = got.get("page_tables", {})
        expect(isinstance(tables, Mapping) and set(tables) == set(want["page_tables"]),
               f"after '{step}' you predicted page tables for {sorted(tables)}; the running "
               f"requests are {sorted(want['page_tables'])}.", nudge)
        for rid, slots in want["page_tables"].items():
            mine = as_int_list(tables[rid])
            expect(mine == slots,
                   f"after '{step}' you predicted {rid}'s page table {mine!r}; it is {slots}.",
                   nudge)
    passed("4.3", f"page tables and free list right at all {len(PAGE_TABLE_STEPS)} steps")


# --------------------------------------------------------------------------- 4.4

CostFn = Callable[[RadixNode, int], int]


def recompute_cost_reference(node: RadixNode, weights: int) -> int:
    """Units to prefill a node's tokens again: ``weights + p + 1`` for the token at position p."""
    start, up = 0, node.parent
    while up is not None:
        start += up.length
        up = up.parent
    return sum(weights + p + 1 for p in range(start, start + node.length))


class CostPolicy(EvictionPolicy):
    """Evict the leaf that is cheapest to recompute first (ties: the older node id)."""

    name = "cheapest"

    def __init__(self, cost: CostFn, weights: int = 16) -> None:
        self.cost, self.weights = cost, weights

    def key(self, node: RadixNode) -> tuple[int, ...]:
        return (int(self.cost(node, self.weights)), node.id)


# Built so that no insert splits an existing leaf (the shared prefix goes in first).
_LONG = list(range(40, 52))
_COST_TREE = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11],
              [20, 21, 22], _LONG, [1, 2, 3, 4, 5, 6, 7, 8, 30], [60]]


def _cost_scenario(cost: CostFn, weights: int, lock_long: bool):
    pool = KVPool(1, 1, 1, 40)
    cache = RadixCache(policy=CostPolicy(cost, weights))
    for ids in _COST_TREE:
        m = cache.match_prefix(ids)
        cache.insert_prefix(ids, torch.cat([m.indices, pool.alloc(len(ids) - m.cached_len)]))
    if lock_long:
        cache.lock(cache.match_prefix(_LONG).handle)
    pool.alloc(pool.num_free - 2)  # two slots stay free
    return pool, cache


def _cached_paths(cache: RadixCache) -> list[list[int]]:
    out, stack = [], [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        path = path + node.key.tolist()
        if node.parent is not None:
            out.append(path)
        stack.extend((c, path) for c in node.children.values())
    return sorted(out)


@checker("4.4", "Recomputing a token means running it through the model again after "
                "everything before it. What does that cost depend on besides the node's own "
                "length?")
def check_recompute_cost(recompute_cost: CostFn) -> None:
    """Exercise 4.4: a leaf's recompute cost, used as an eviction key by ``make_room``."""
    for weights in (16, 0, 3):
        _, cache = _cost_scenario(recompute_cost_reference, weights, False)
        for node in sorted(cache.nodes(), key=_path_tokens):
            want = recompute_cost_reference(node, weights)
            what = (f"recompute_cost(node {node.key.tolist()} under "
                    f"{_path_tokens(node)[: -node.length] or 'the root'}, weights={weights})")
            got = call_reader(what, recompute_cost, node, weights)
            expect(isinstance(got, int) and not isinstance(got, bool) and got == want,
                   f"{what} returned {got!r}, expected {want}.")
    for lock_long in (False, True):
        for n in (3, 5, 9, 14):
            pool, cache = _cost_scenario(recompute_cost, 16, lock_long)
            ref_pool, ref_cache = _cost_scenario(recompute_cost_reference, 16, lock_long)
            Lifecycle(None, ref_pool, ref_cache).make_room(n)
            what = (f"make_room({n}) with 2 slots free, evicting by your cost"
                    f"{' (the 12-token leaf locked)' if lock_long else ''}")
            call_reader(what, Lifecycle(None, pool, cache).make_room, n)
            expect(_cached_paths(cache) == _cached_paths(ref_cache),
                   f"{what}: the tree keeps {_cached_paths(cache)}, expected "
                   f"{_cached_paths(ref_cache)}.")
    passed("4.4", "recompute costs right on every node; make_room evicts the cheapest leaves "
                  "to recompute first")
