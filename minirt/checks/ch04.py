"""Checkers for chapter 04: lock/unlock bookkeeping, the finish step, page tables through the
R1/R2 story, and ``make_room`` (where evict and free meet).

Each checker builds its own scenarios, runs the reader's function next to minirt's own
(``RadixCache.lock``, ``Lifecycle.finish``, ``Lifecycle.make_room``) on an identical twin,
and names the first scenario where they disagree. Scenarios that need a model run a tiny
random one (``tiny_model``): only which slots go where matters here, not the tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from ..cache import CacheHandle, RadixCache, insert_fresh
from ..errors import MinirtError, OutOfMemoryError
from ..lifecycle import Lifecycle, Request, check_integrity, state_snapshot
from ..pool import KVPool
from ..radix import RadixNode
from ._common import as_int_list, expect, passed

__all__ = [
    "PAGE_TABLE_STEPS",
    "check_finish",
    "check_lock_path",
    "check_make_room",
    "check_page_tables",
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
    ("one request on the seed's S + [31, 32]", [_S, _S + [31, 32]],
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
            got = update_path(_node_at(mine, ids), delta)
            done.append(f"{op}({ids})")
            where = f"in scenario '{name}', after {' -> '.join(done)}"
            for x, y in zip(_nodes(mine), _nodes(ref), strict=True):
                expect(x.ref_count == y.ref_count,
                       f"{where}: node {_path_tokens(x) or 'root'} has ref_count "
                       f"{x.ref_count}, expected {y.ref_count}. {op} changes the count of "
                       "the node AND every ancestor up to the root, even ancestors that are "
                       "already locked.")
            expect(isinstance(got, int) and not isinstance(got, bool) and got == expected_moved,
                   f"{call} returned {got!r} {where}; expected "
                   f"{expected_moved}: the tokens of the nodes whose ref_count went "
                   f"{'0 -> 1' if op == 'lock' else '1 -> 0'} (a node already in use moves "
                   "nothing).")
            ops += 1
    passed("4.1", f"{ops} locks and unlocks in {len(LOCK_SCENARIOS)} trees: ref counts and "
                  "evictable/protected moves agree with RadixCache")


# --------------------------------------------------------------------------- 4.2

FinishFn = Callable[[KVPool, RadixCache, Request], None]


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


def _pool_and_tree(lc: Lifecycle) -> tuple:
    return state_snapshot(lc)[:4]


def check_finish(finish: FinishFn) -> None:
    """Exercise 4.2: ``finish(pool, cache, req)`` caches a finished request's tokens with K/V,
    frees its duplicates and the part it could not insert, and unlocks its handle: no slot
    leaked, none freed twice, no other request's K/V freed."""
    with _one_thread():
        for name, build in FINISH_SCENARIOS:
            mine_lc, mine = build()
            ref_lc, ref = build()
            ref_lc.finish(ref)
            others = [r for r in mine_lc.running if r is not mine]
            try:
                finish(mine_lc.pool, mine_lc.cache, mine)
            except MinirtError as exc:
                raise AssertionError(
                    f"In scenario '{name}', your finish raised {type(exc).__name__}: {exc}. "
                    "A PoolError from free usually means a double free: freeing slots that "
                    "are already free, or that the tree owns.") from None
            mine.state, mine.handle = "finished", None
            mine.private = torch.empty(0, dtype=torch.int64)
            try:
                check_integrity(mine_lc.pool, mine_lc.cache, others)
            except AssertionError as exc:
                msg = str(exc)
                hint = ""
                if "leaked" in msg:
                    hint = (" Some slots are neither free nor in the tree: a leak. Did you free "
                            "the duplicates (slots [cached_len:insert's cached_len]) and "
                            "everything past the inserted length?")
                elif "ref_count" in msg:
                    hint = " A lock is still held (or released twice): unlock req.handle once."
                elif "owned twice" in msg or "free slots" in msg:
                    hint = (" A slot is both free and still in use: did you free slots that "
                            "now belong to the tree (or to another request)?")
                raise AssertionError(f"In scenario '{name}', after your finish: {msg}.{hint}") \
                    from None
            got, want = _pool_and_tree(mine_lc), _pool_and_tree(ref_lc)
            expect(got[0] == want[0],
                   f"In scenario '{name}', the free pages after your finish are {list(got[0])}, "
                   f"expected {list(want[0])}.")
            expect(got[1:] == want[1:],
                   f"In scenario '{name}', the tree after your finish differs from minirt's: "
                   f"cached {got[2] + got[3]} tokens ({got[2]} evictable, {got[3]} protected), "
                   f"expected {want[2] + want[3]} ({want[2]} evictable, {want[3]} protected). "
                   "Insert the tokens that have K/V (req.tokens[:req.kv_len]) with the page "
                   "table's slots.")
    passed("4.2", f"{len(FINISH_SCENARIOS)} finishes: nothing leaked, nothing freed twice, "
                  "locks released, the tree as minirt's")


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


def check_page_tables(predicted: Mapping[str, Mapping[str, object]]) -> None:
    """Exercise 4.3: your predicted page tables and free list after each step of the story."""
    truth = page_table_story()
    expect(isinstance(predicted, Mapping),
           f"expected a dict from step name to {{'page_tables': ..., 'free': ...}}, got "
           f"{type(predicted).__name__}")
    for step in PAGE_TABLE_STEPS:
        expect(step in predicted, f"no prediction for step {step!r} (steps: {PAGE_TABLE_STEPS})")
        want, got = truth[step], predicted[step]
        free = as_int_list(got.get("free", ())) if isinstance(got, Mapping) else None
        expect(free is not None and free == want["free"],
               f"after '{step}' you predicted the free list {free!r}; it is {want['free']}. "
               "Allocation takes the lowest-numbered free slots; eviction returns a leaf's "
               "slots to the free list first.")
        tables = got.get("page_tables", {})
        expect(isinstance(tables, Mapping) and set(tables) == set(want["page_tables"]),
               f"after '{step}' you predicted page tables for {sorted(tables)}; the running "
               f"requests are {sorted(want['page_tables'])}.")
        for rid, slots in want["page_tables"].items():
            mine = as_int_list(tables[rid])
            expect(mine == slots,
                   f"after '{step}' you predicted {rid}'s page table {mine!r}; it is {slots}. "
                   "Cached positions point at the tree's slots; only the uncached gap and each "
                   "decoded token get new slots.")
    passed("4.3", f"page tables and free list right at all {len(PAGE_TABLE_STEPS)} steps")


# --------------------------------------------------------------------------- 4.4

MakeRoomFn = Callable[[KVPool, RadixCache, int], object]


def _room_scenario(lock: bool) -> tuple[KVPool, RadixCache]:
    """A 16-slot pool: A, B, C cached (8 slots), 3 slots held by a running request, 5 free.

    With ``lock``, C's path (3 tokens) is locked by a running request.
    """
    pool = KVPool(1, 1, 1, 16)
    cache = RadixCache()
    for ids in (_A, _B, _C):
        m = cache.match_prefix(ids)
        fresh = pool.alloc(len(ids) - m.cached_len)
        cache.insert_prefix(ids, torch.cat([m.indices, fresh]))
    pool.alloc(3)  # a running request's private slots
    cache.match_prefix(_A)  # A used recently: B's leaf is the least recently used
    if lock:
        cache.lock(cache.match_prefix(_C).handle)
    return pool, cache


def _reference_make_room(pool: KVPool, cache: RadixCache, n: int) -> None:
    lc = Lifecycle(None, pool, cache)
    lc.make_room(n)


def _room_state(pool: KVPool, cache: RadixCache) -> tuple:
    lc = Lifecycle(None, pool, cache)
    return state_snapshot(lc)[:4]


ROOM_CASES = [(False, n) for n in (0, 3, 5, 6, 7, 9, 13, 14)] + \
             [(True, n) for n in (4, 6, 9, 10, 11, 12)]


def check_make_room(make_room: MakeRoomFn) -> None:
    """Exercise 4.4: ``make_room(pool, cache, n)`` leaves at least ``n`` free slots by evicting
    only the shortfall and freeing what eviction returns; if free + evictable cannot cover
    ``n`` it raises OutOfMemoryError and changes nothing."""
    for lock, n in ROOM_CASES:
        pool, cache = _room_scenario(lock)
        ref_pool, ref_cache = _room_scenario(lock)
        call = (f"make_room(pool, cache, {n}) with {pool.num_free} free, "
                f"{cache.evictable_size} evictable{' (C locked)' if lock else ''}")
        before = _room_state(pool, cache)
        try:
            _reference_make_room(ref_pool, ref_cache, n)
            fits = True
        except OutOfMemoryError:
            fits = False
        try:
            make_room(pool, cache, n)
            raised = None
        except MinirtError as exc:
            raised = exc
        if not fits:
            expect(isinstance(raised, OutOfMemoryError),
                   f"{call}: free + evictable < {n}, so it must raise OutOfMemoryError; "
                   f"{'it returned normally' if raised is None else f'it raised {raised!r}'}.")
            expect(_room_state(pool, cache) == before,
                   f"{call} raised, but the pool or the tree changed: check that there is "
                   "enough room BEFORE evicting anything (evict nothing, free nothing).")
            continue
        expect(raised is None, f"{call} raised {raised!r}; there is room for {n}.")
        expect(pool.num_free >= n,
               f"{call}: afterwards only {pool.num_free} slots are free. Evicted slots are "
               "not free until you give them back with pool.free(...).")
        cache.check_integrity()
        tree_slots = set(cache.all_values().tolist())
        freed_in_tree = tree_slots & set(pool.free_slots().tolist())
        expect(not freed_in_tree,
               f"{call}: slots {sorted(freed_in_tree)} are free but still in the tree. Never "
               "free cached slots directly: evict them from the tree first.")
        expect(_room_state(pool, cache) == _room_state(ref_pool, ref_cache),
               f"{call}: the tree now caches {cache.total_size} tokens and {pool.num_free} "
               f"slots are free; minirt's make_room leaves {ref_cache.total_size} cached and "
               f"{ref_pool.num_free} free. Evict only the shortfall, n - pool.num_free, and "
               "nothing when the free list already has n.")
    passed("4.4", f"{len(ROOM_CASES)} requests for room: evictions minimal, evicted slots "
                  "freed, refusals change nothing")
