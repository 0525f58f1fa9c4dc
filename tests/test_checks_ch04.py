"""Chapter 04 checkers accept the reference answers and reject plausible wrong ones."""

from __future__ import annotations

import copy

import pytest
import torch

from minirt.checks import ch04
from minirt.errors import OutOfMemoryError

# ----------------------------------------------------------------------------- 4.1


def update_path(node, delta):
    moved = 0
    while node is not None:
        before = node.ref_count
        node.ref_count += delta
        if (before, node.ref_count) in ((0, 1), (1, 0)):
            moved += node.length
        node = node.parent
    return moved


def only_the_node(node, delta):
    node.ref_count += delta
    return node.length if (node.ref_count == 1 and delta > 0) or node.ref_count == 0 else 0


def stops_at_locked_ancestor(node, delta):
    """'The rest of the path is locked already': forgets that counts must still go up."""
    moved = 0
    while node is not None:
        before = node.ref_count
        node.ref_count += delta
        if (before, node.ref_count) in ((0, 1), (1, 0)):
            moved += node.length
        elif delta > 0:
            break
        node = node.parent
    return moved


def counts_every_change(node, delta):
    moved = 0
    while node is not None:
        node.ref_count += delta
        moved += node.length
        node = node.parent
    return moved


def skips_the_root(node, delta):
    moved = 0
    while node.parent is not None:
        before = node.ref_count
        node.ref_count += delta
        if (before, node.ref_count) in ((0, 1), (1, 0)):
            moved += node.length
        node = node.parent
    return moved


def test_lock_path_accepts_reference(capsys):
    ch04.check_lock_path(update_path)
    assert "Exercise 4.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("mutant, words", [
    (only_the_node, "every ancestor"),
    (stops_at_locked_ancestor, "already locked"),
    (counts_every_change, "moves nothing"),
    (skips_the_root, "root has ref_count"),
])
def test_lock_path_rejects_mutants(mutant, words):
    with pytest.raises(AssertionError, match=words):
        ch04.check_lock_path(mutant)


# ----------------------------------------------------------------------------- 4.2


def finish(pool, cache, req):
    n = req.kv_len
    slots = req.page_table.slots[:n]
    res = cache.insert_prefix(req.tokens[:n], slots)
    aligned = res.indices.numel()
    req.page_table.repoint(res.indices)
    pool.free(slots[req.cached_len:res.cached_len])
    cache.unlock(req.handle)
    pool.free(req.private[aligned - req.cached_len:])


def finish_forgets_duplicates(pool, cache, req):
    n = req.kv_len
    res = cache.insert_prefix(req.tokens[:n], req.page_table.slots[:n])
    cache.unlock(req.handle)
    pool.free(req.private[res.indices.numel() - req.cached_len:])


def finish_frees_the_trees_copy(pool, cache, req):
    n = req.kv_len
    res = cache.insert_prefix(req.tokens[:n], req.page_table.slots[:n])
    pool.free(res.indices[req.cached_len:res.cached_len])  # the tree's slots, not its own
    cache.unlock(req.handle)
    pool.free(req.private[res.indices.numel() - req.cached_len:])


def finish_forgets_the_tail(pool, cache, req):
    n = req.kv_len
    slots = req.page_table.slots[:n]
    res = cache.insert_prefix(req.tokens[:n], slots)
    pool.free(slots[req.cached_len:res.cached_len])
    cache.unlock(req.handle)


def finish_forgets_unlock(pool, cache, req):
    n = req.kv_len
    slots = req.page_table.slots[:n]
    res = cache.insert_prefix(req.tokens[:n], slots)
    pool.free(slots[req.cached_len:res.cached_len])
    pool.free(req.private[res.indices.numel() - req.cached_len:])


def finish_frees_everything_private(pool, cache, req):
    """Frees all its own slots after inserting them: the tree now owns freed slots."""
    n = req.kv_len
    cache.insert_prefix(req.tokens[:n], req.page_table.slots[:n])
    cache.unlock(req.handle)
    pool.free(req.private)


def finish_inserts_the_prompt_only(pool, cache, req):
    n = req.prompt.numel()
    slots = req.page_table.slots[:n]
    res = cache.insert_prefix(req.prompt, slots)
    pool.free(slots[req.cached_len:res.cached_len])
    cache.unlock(req.handle)
    pool.free(req.private[res.indices.numel() - req.cached_len:])


def test_finish_accepts_reference(capsys):
    ch04.check_finish(finish)
    assert "Exercise 4.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("mutant, words", [
    (finish_forgets_duplicates, "leak"),
    (finish_frees_the_trees_copy, "twice|free and still in use|double free"),
    (finish_forgets_the_tail, "leak"),
    (finish_forgets_unlock, "lock"),
    (finish_frees_everything_private, "double free|free and still in use|twice"),
    (finish_inserts_the_prompt_only, "tree after your finish|free pages"),
])
def test_finish_rejects_mutants(mutant, words):
    with pytest.raises(AssertionError, match=words):
        ch04.check_finish(mutant)


# ----------------------------------------------------------------------------- 4.3

ANSWER = {
    "admit R1": {"page_tables": {"R1": [0, 1, 2, 3, 4, 5]}, "free": [6, 7, 8, 9, 10]},
    "admit R2": {"page_tables": {"R1": [0, 1, 2, 3, 4, 5], "R2": [0, 1, 2, 3, 6, 7, 8]},
                 "free": [9, 10]},
    "decode R1 and R2": {"page_tables": {"R1": [0, 1, 2, 3, 4, 5, 9],
                                         "R2": [0, 1, 2, 3, 6, 7, 8, 10]}, "free": []},
    "finish R1 and R2": {"page_tables": {}, "free": []},
    "admit R3": {"page_tables": {"R3": [0, 1, 2, 3, 4, 5, 9]}, "free": []},
}


def test_page_tables_match_the_written_answer(capsys):
    ch04.check_page_tables(ANSWER)
    assert "Exercise 4.3 passed" in capsys.readouterr().out
    ch04.check_page_tables({k: {"page_tables": {r: torch.tensor(v) for r, v in
                                                a["page_tables"].items()},
                                "free": torch.tensor(a["free"], dtype=torch.int64)}
                            for k, a in ANSWER.items()})


def _changed(step, **what):
    wrong = copy.deepcopy(ANSWER)
    wrong[step].update(what)
    return wrong


@pytest.mark.parametrize("wrong, words", [
    # R1 allocates its whole prompt instead of the uncached gap
    (_changed("admit R1", page_tables={"R1": [4, 5, 6, 7, 8, 9]}, free=[10]), "free list"),
    # R2's table reuses nothing
    (_changed("admit R2", page_tables={"R1": [0, 1, 2, 3, 4, 5], "R2": [6, 7, 8, 9, 10, 0, 1]}),
     "R2's page table"),
    # finishing frees the requests' slots
    (_changed("finish R1 and R2", free=[4, 5, 6, 7, 8, 9, 10]), "free list"),
    # R3 evicts R2's leaf instead of R1's older one
    (_changed("admit R3", page_tables={"R3": [0, 1, 2, 3, 4, 5, 10]}), "R3's page table"),
    # forgetting that decode takes slots
    (_changed("decode R1 and R2", page_tables={"R1": [0, 1, 2, 3, 4, 5],
                                               "R2": [0, 1, 2, 3, 6, 7, 8]}, free=[9, 10]),
     "free list"),
    ({k: v for k, v in ANSWER.items() if k != "admit R3"}, "no prediction"),
])
def test_page_tables_reject_wrong_answers(wrong, words):
    with pytest.raises(AssertionError, match=words):
        ch04.check_page_tables(wrong)


# ----------------------------------------------------------------------------- 4.4


def make_room(pool, cache, n):
    short = n - pool.num_free
    if short <= 0:
        return
    if short > cache.evictable_size:
        raise OutOfMemoryError(f"need {short} more slots, only {cache.evictable_size} evictable")
    pool.free(cache.evict(short))


def make_room_evicts_n(pool, cache, n):
    if n > pool.num_free:
        pool.free(cache.evict(min(n, cache.evictable_size)))


def make_room_forgets_free(pool, cache, n):
    short = n - pool.num_free
    if short > 0:
        cache.evict(short)


def make_room_evicts_what_it_can(pool, cache, n):
    short = n - pool.num_free
    if short <= 0:
        return
    got = min(short, cache.evictable_size)
    pool.free(cache.evict(got))
    if got < short:
        raise OutOfMemoryError("not enough room")


def make_room_frees_cached_slots(pool, cache, n):
    """Skips the tree: frees cached slots straight to the pool."""
    short = n - pool.num_free
    if short > 0:
        pool.free(cache.all_values()[:short])


def test_make_room_accepts_reference(capsys):
    ch04.check_make_room(make_room)
    assert "Exercise 4.4 passed" in capsys.readouterr().out


@pytest.mark.parametrize("mutant, words", [
    (make_room_evicts_n, "shortfall"),
    (make_room_forgets_free, "not free until"),
    (make_room_evicts_what_it_can, "changed"),
    (make_room_frees_cached_slots, "still in the tree"),
])
def test_make_room_rejects_mutants(mutant, words):
    with pytest.raises(AssertionError, match=words):
        ch04.check_make_room(mutant)
