"""Checkers for chapter 05: which nodes eviction may take, what evicting an internal node
would break, block reference counts when the tree holds a reference, and Belady's optimum
at token granularity.

Every checker builds its own inputs, runs the reader's function, compares with a
reference (the real ``RadixCache.evict``, or ``belady_hit_rate``) and names the first
input that disagrees (input, expected, got); a repeated failure adds a hint toward the idea.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence

from ..cache import RadixCache, insert_fresh
from ..radix import RadixNode
from ..simulate import belady_hit_rate
from ._common import as_int_list, call_reader, checker, expect, passed

__all__ = ["check_belady_hits", "check_eviction_order", "check_orphaned_slots", "check_refcounts"]

# A tree is built from a script of steps, each ("insert" | "match" | "lock", token ids).
# "insert" caches the ids (fresh slots for the uncached part); "match" touches the cached
# prefix (a hit, one clock tick); "lock" matches and locks the result, as a running request.
Script = Sequence[tuple[str, Sequence[int]]]

_A, _B, _C = [101, 11, 12, 21, 22], [101, 11, 12, 31, 32], [101, 11, 99]

# (what it shows, script, token counts to ask for)
EVICTION_TREES: list[tuple[str, list[tuple[str, list[int]]], list[int]]] = [
    ("the A/B/C tree, nothing locked",
     [("insert", _A), ("insert", _B), ("insert", _C)], [1, 2, 3, 4, 5, 8]),
    ("A/B/C with C running (locked)",
     [("insert", _A), ("insert", _B), ("insert", _C), ("lock", _C)], [1, 2, 3, 5]),
    ("A/B/C, then A matched again: B's leaf is now the oldest",
     [("insert", _A), ("insert", _B), ("insert", _C), ("match", _A)], [1, 2, 3, 5, 8]),
    ("a node and its extension touched at the same tick (ties go to the older id)",
     [("insert", [1, 2]), ("insert", [1, 2, 3]), ("insert", [7, 8, 9])], [1, 2, 3, 6]),
    ("a locked inner node whose children are free, with a younger branch beside it",
     [("insert", _A), ("insert", _B), ("insert", _C), ("lock", [101, 11]),
      ("insert", [50, 51])], [2, 4, 5, 6, 7]),
    ("a long old leaf: one victim frees more than asked",
     [("insert", [5] + list(range(20, 40))), ("insert", [5, 6, 7]), ("insert", [9, 9])],
     [1, 2, 3, 20, 21, 22, 24]),
]


def build_cache(script: Script, policy: str = "lru") -> RadixCache:
    """A ``RadixCache`` built by ``script``; slots are handed out 0, 1, 2, ... as needed.

    Two builds from one script give the same tree, slots and eviction order.
    """
    cache = RadixCache(policy=policy)
    next_slot = 0
    for step, ids in script:
        ids = list(ids)
        if step == "insert":
            _, next_slot = insert_fresh(cache, ids, next_slot)
        elif step == "match":
            cache.match_prefix(ids)
        elif step == "lock":
            cache.lock(cache.match_prefix(ids).handle)
        else:
            raise ValueError(f"unknown script step {step!r}")
    return cache


def path_tokens(node: RadixNode) -> list[int]:
    """The token ids a node stands for: the keys from the root down to it."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key.tolist())
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def _state(cache: RadixCache) -> tuple:
    """Everything eviction could change: the shape, slots, locks and clocks of every node."""
    def walk(node: RadixNode) -> tuple:
        kids = tuple(walk(node.children[k]) for k in sorted(node.children))
        return (tuple(node.key.tolist()), tuple(node.value.tolist()), node.ref_count,
                node.last_access, kids)

    return walk(cache.root), cache.size_info, cache.num_nodes


def _describe(nodes: Sequence[RadixNode]) -> list[list[int]]:
    return [path_tokens(n) for n in nodes]


@checker("5.1", "Replay evict by hand on the failing tree, one victim at a time: after each "
                "removal, which nodes have just become candidates, and which never were?")
def check_eviction_order(eviction_order: Callable[[RadixCache, int], Sequence[RadixNode]]) -> None:
    """Exercise 5.1: the nodes ``cache.evict(num_tokens)`` would remove, in order, without
    removing them (LRU: smallest ``(last_access, id)`` first among unlocked leaves)."""
    for name, script, amounts in EVICTION_TREES:
        for num_tokens in amounts:
            mine, theirs = build_cache(script), build_cache(script)
            expect(num_tokens <= mine.evictable_size, "checker bug: asks for too much")
            before = _state(mine)
            call = f"eviction_order(<{name}>, {num_tokens})"
            got = call_reader(call, eviction_order, mine, num_tokens)
            expected_slots = theirs.evict(num_tokens).tolist()
            expect(_state(mine) == before,
                   f"{call} changed the tree: it must only say what evict would remove "
                   "(work on your own bookkeeping, not on the nodes).")
            got = list(got) if got is not None else None
            expect(got is not None and all(isinstance(n, RadixNode) for n in got),
                   f"{call} returned {got!r}: expected a list of RadixNode objects")
            got_slots = [s for n in got for s in n.value.tolist()]
            if got_slots != expected_slots:
                victims = []
                for s in expected_slots:  # the reference victims, as nodes of the reader's tree
                    node = next(n for n in mine.nodes() if s in n.value.tolist())
                    if not victims or victims[-1] is not node:
                        victims.append(node)
                expect(False,
                       f"{call} returned nodes {_describe(got)} (paths from the root), expected "
                       f"{_describe(victims)}.")
    passed("5.1", f"{sum(len(a) for _, _, a in EVICTION_TREES)} eviction orders on "
                  f"{len(EVICTION_TREES)} trees match RadixCache.evict")


def _orphaned(node: RadixNode) -> list[int]:
    slots: list[int] = []
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        slots.extend(n.value.tolist())
        stack.extend(n.children.values())
    return sorted(slots)


_ORPHAN_TREE = [("insert", _A), ("insert", _B), ("insert", _C), ("insert", [101, 11, 12, 21, 40]),
                ("insert", [7, 8])]


@checker("5.2", "Matching walks down from the root. Once a node is cut out, which nodes can "
                "no walk reach any more, and which of them still hold slots?")
def check_orphaned_slots(orphaned_slots: Callable[[RadixNode], Sequence[int]]) -> None:
    """Exercise 5.2: the pool slots that would become unreachable (and never be freed) if
    ``node`` were cut out of the tree: the slots of every node below it."""
    cache = build_cache(_ORPHAN_TREE)
    nodes = sorted(cache.nodes(), key=path_tokens)
    inner = 0
    for node in nodes:
        expected = _orphaned(node)
        inner += bool(expected)
        call = (f"orphaned_slots(node {path_tokens(node)} with key {node.key.tolist()}, slots "
                f"{node.value.tolist()})")
        got = as_int_list(call_reader(call, orphaned_slots, node))
        expect(got is not None and sorted(got) == expected and len(got) == len(expected),
               f"{call} returned {got!r}, expected {expected} (each slot once).")
    passed("5.2", f"{len(nodes)} nodes checked; cutting out any of the {inner} inner nodes "
                  "would strand K/V that no request can reach and the pool never gets back")


# Reference counts per block in the design where the tree holds a reference: the cache and
# every running request hold references; a block goes back to the free list only when its
# count reaches zero. (vLLM v1 does not work this way: its ref_cnt counts requests only.)
Event = tuple[str, Sequence[int]]
REFCOUNT_SCENARIOS: list[tuple[str, list[Event]]] = [
    ("evict a leaf a running request still uses",
     [("alloc", [0, 1]), ("insert", [0, 1]), ("finish", [0, 1]),
      ("hit", [0, 1]), ("alloc", [2, 3]), ("insert", [2, 3]), ("evict", [2, 3]),
      ("finish", [0, 1, 2, 3]), ("evict", [0, 1])]),
    ("a request that finishes before anything is cached",
     [("alloc", [4, 5, 6]), ("finish", [4, 5, 6])]),
    ("two requests share a cached prefix; the cache drops it while both run",
     [("alloc", [0, 1, 2]), ("insert", [0, 1, 2]), ("finish", [0, 1, 2]),
      ("hit", [0, 1]), ("hit", [0, 1]), ("evict", [2]), ("evict", [0, 1]),
      ("finish", [0, 1]), ("finish", [0, 1])]),
    ("the tail that is not cached goes back at finish; the cached part waits for evict",
     [("alloc", [8, 9, 10]), ("insert", [8, 9]), ("finish", [8, 9, 10]), ("evict", [8, 9])]),
]
_KINDS = {"alloc": 1, "hit": 1, "insert": 1, "finish": -1, "evict": -1}


def _replay_refs(events: Sequence[Event]) -> list[list[int]]:
    refs: dict[int, int] = {}
    freed_per_event = []
    for kind, blocks in events:
        delta = _KINDS[kind]
        freed = []
        for b in blocks:
            if kind == "alloc":
                assert refs.get(b, 0) == 0, f"block {b} allocated while in use"
            refs[b] = refs.get(b, 0) + delta
            assert refs[b] >= 0, f"block {b} released more often than held"
            if refs[b] == 0:
                freed.append(b)
        freed_per_event.append(sorted(freed))
    return freed_per_event


@checker("5.3", "Count the holders of one block at a time, event by event. Who still holds "
                "it after the event, and what does a count of zero mean?")
def check_refcounts(replay_refs: Callable[[list[Event]], Sequence[Sequence[int]]]) -> None:
    """Exercise 5.3: which blocks each event physically frees, when the tree holds a
    reference to every cached block."""
    for name, events in REFCOUNT_SCENARIOS:
        expected = _replay_refs(events)
        got = call_reader(f"replay_refs(<{name}>)", replay_refs,
                          [(kind, list(blocks)) for kind, blocks in events])
        try:
            lists = [as_int_list(g) for g in got]
        except TypeError:
            lists = None
        got_lists = None if lists is None or None in lists else [sorted(g) for g in lists]
        expect(got_lists is not None and len(got_lists) == len(events),
               f"replay_refs(<{name}>) returned {got!r}: expected one list of freed blocks per "
               f"event ({len(events)} events)")
        for i, (event, want, have) in enumerate(zip(events, expected, got_lists, strict=True)):
            expect(have == want,
                   f"replay_refs(<{name}>): event {i} {event} freed {have}, expected {want}. "
                   f"Events so far: {events[:i + 1]}.")
    passed("5.3", f"{len(REFCOUNT_SCENARIOS)} scenarios; evicting a leaf a running request "
                  "uses frees nothing until the request finishes")


def _belady_hits(trace: Sequence[Sequence[int]], capacity: int) -> int:
    total = sum(len(r) for r in trace)
    return round(belady_hit_rate(trace, capacity) * total)


def _random_trace(seed: int) -> tuple[list[list[int]], int]:
    """Requests that extend a few shared stems (a system prompt, documents), some one-offs."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 6) for _ in range(rng.randint(2, 5))] for _ in range(3)]
    trace = []
    for _ in range(rng.randint(6, 12)):
        if rng.random() < 0.75:
            stem = rng.choice(stems)
            trace.append(stem + [rng.randrange(1, 4) for _ in range(rng.randint(0, 3))])
        else:
            trace.append([rng.randrange(10, 20) for _ in range(rng.randint(1, 5))])
    longest = max(len(r) for r in trace)
    return trace, longest + rng.randint(0, 6)


BELADY_TRACES: list[tuple[str, list[list[int]], int]] = [
    ("the chapter's hot prefix", [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [20, 21, 22, 23],
                                  [30, 31, 32, 33], [1, 2, 3, 4, 7]], 10),
    ("keep the shallow end of a chain", [[1, 2, 3, 4], [7, 8], [7, 8], [1, 2, 3, 4]], 4),
    ("one request repeated, room for all", [[5, 6, 7]] * 3, 3),
    ("a cyclic scan", [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]], 4),
    ("nothing shared", [[1], [2], [3]], 1),
] + [(f"random trace {s}", *_random_trace(s)) for s in range(8)]


@checker("5.4", "Run the rule by hand on the failing trace with a cache of a few tokens. "
                "When is a prefix used next, and which of two equally distant ones can go "
                "without stranding the other?")
def check_belady_hits(belady_hits: Callable[[list[list[int]], int], int]) -> None:
    """Exercise 5.4: the most tokens any cache of ``capacity`` tokens could reuse on a trace
    (token-level Belady: evict the token used again furthest in the future, deeper first)."""
    for name, trace, capacity in BELADY_TRACES:
        expected = _belady_hits(trace, capacity)
        got = call_reader(f"belady_hits({trace}, capacity={capacity})", belady_hits,
                          [list(r) for r in trace], capacity)
        ok = not isinstance(got, bool)
        try:
            ok = ok and operator.index(got) == expected
        except TypeError:
            ok = False
        expect(ok, f"belady_hits({trace}, capacity={capacity}) ({name}) returned {got!r}, "
                   f"expected {expected} reused tokens.")
    hot = BELADY_TRACES[0]
    passed("5.4", f"{len(BELADY_TRACES)} traces; on the chapter's hot-prefix trace the optimum "
                  f"reuses {_belady_hits(hot[1], hot[2])} tokens")
