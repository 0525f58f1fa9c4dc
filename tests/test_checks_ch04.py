"""Chapter 04 checkers accept the reference answers and reject plausible wrong ones."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from exercise_util import ROOT, accepts, rejects

from minirt.checks import _common, ch04

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
    (only_the_node, "has ref_count"),
    (stops_at_locked_ancestor, "has ref_count"),
    (counts_every_change, "tokens moved"),
    (skips_the_root, "root has ref_count"),
])
def test_lock_path_rejects_mutants(mutant, words):
    assert words in rejects(ch04.check_lock_path, mutant, "4.1")


# ----------------------------------------------------------------------------- 4.2


def slot_fates(req, tree_has, page_size, *, ignore_tree=False, no_rounding=False,
               tail_in_table_only=False):
    slots = req.page_table.slots.tolist()
    n = req.kv_len
    aligned = n if no_rounding else n - n % page_size
    start = req.cached_len if ignore_tree else tree_has
    tail = req.private.tolist()[aligned - req.cached_len:]
    if tail_in_table_only:
        tail = slots[aligned:n]
    return {"kept": slots[: req.cached_len], "duplicate": slots[req.cached_len:start],
            "cached": slots[start:aligned], "tail": tail}


def test_slot_fates_accepts_reference(capsys):
    accepts(ch04.check_slot_fates, slot_fates, "4.2", capsys)


@pytest.mark.parametrize("kwargs", [dict(ignore_tree=True), dict(no_rounding=True),
                                    dict(tail_in_table_only=True)])
def test_slot_fates_rejects_mutants(kwargs):
    rejects(ch04.check_slot_fates, lambda r, t, p: slot_fates(r, t, p, **kwargs), "4.2",
            contains="slot_fates(req")


@pytest.mark.parametrize("name, build", ch04.FINISH_SCENARIOS)
def test_slot_fates_reference_agrees_with_finish(name, build, one_thread):
    lc, req = build()
    fates = ch04.slot_fates_reference(req, ch04._tree_has(lc, req), lc.pool.page_size)
    lc.finish(req)
    free, cached = set(lc.pool.free_slots().tolist()), set(lc.cache.all_values().tolist())
    assert set(fates["duplicate"] + fates["tail"]) <= free
    assert set(fates["kept"] + fates["cached"]) <= cached
    assert not set(fates["duplicate"] + fates["tail"]) & cached


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
    assert words in rejects(ch04.check_page_tables, wrong, "4.3")


def test_a_wrong_lru_choice_gets_a_hint_about_the_lru_choice():
    wrong = _changed("admit R3", page_tables={"R3": [0, 1, 2, 3, 4, 5, 10]})
    rejects(ch04.check_page_tables, wrong, "4.3")
    for _ in range(2):
        with pytest.raises(AssertionError) as failure:
            ch04.check_page_tables(wrong)
    assert "least recently" in str(failure.value) and "output leaf" in str(failure.value)


# ----------------------------------------------------------------------------- 4.4


def recompute_cost(node, weights):
    start, up = 0, node.parent
    while up is not None:
        start += up.length
        up = up.parent
    return sum(weights + p + 1 for p in range(start, start + node.length))


def cost_length_only(node, weights):  # ignores where the node sits
    return node.length


def cost_ignores_depth(node, weights):
    return sum(weights + p + 1 for p in range(node.length))


def cost_off_by_one(node, weights):  # forgets the token attends to itself
    return recompute_cost(node, weights) - node.length


def test_recompute_cost_accepts_reference(capsys):
    accepts(ch04.check_recompute_cost, recompute_cost, "4.4", capsys)


@pytest.mark.parametrize("mutant", [cost_length_only, cost_ignores_depth, cost_off_by_one])
def test_recompute_cost_rejects_mutants(mutant):
    rejects(ch04.check_recompute_cost, mutant, "4.4", contains="recompute_cost(node")


# --------------------------------------------------------------------------- 4.2 prediction

TWIN_FATES = {"kept": [], "duplicate": [8, 9, 10, 11, 12, 13], "cached": [14, 15],
              "tail": [16, 17]}


def test_finish_prediction_accepts_the_right_one(capsys, one_thread):
    ch04.check_finish_prediction(TWIN_FATES)
    assert capsys.readouterr().out.startswith("Exercise 4.2 passed")
    assert _common.failures("4.2 prediction") == 0


# The cold run's wrong predictions, each with the words its hint must contain.
FINISH_WRONG = [
    ({**TWIN_FATES, "tail": [16]}, "unused slots"),                    # forgets slot 17
    ({**TWIN_FATES, "duplicate": [8, 9, 10, 11, 12, 13, 14], "cached": [15]},
     "whole pages only"),                                              # the tree holds all 7
    ({**TWIN_FATES, "kept": [0, 1, 2, 3, 4, 5], "duplicate": []}, "when it was admitted"),
    ({**TWIN_FATES, "cached": [14, 15, 16], "tail": [17]}, "whole pages of K/V"),
    ({**TWIN_FATES, "duplicate": [0, 1, 2, 3, 4, 5]}, "own copies"),
    ([8, 9, 10], "template"),
]


@pytest.mark.parametrize("wrong, hint", FINISH_WRONG)
def test_finish_prediction_rejects_wrong_ones(wrong, hint, one_thread):
    _common.reset_attempts("4.2 prediction")
    with pytest.raises(AssertionError) as first:
        ch04.check_finish_prediction(wrong)
    with pytest.raises(AssertionError) as second:
        ch04.check_finish_prediction(wrong)
    _common.reset_attempts("4.2 prediction")
    one, two = str(first.value), str(second.value)
    assert "your prediction" in one and "Hint" not in one, one
    assert hint in two.split("Hint (failed 2 times):")[1], two
    for message in (one, two):  # predict first: no failure gives the answer away
        rest = message.replace(repr(wrong), "")
        assert "expected" not in rest, message
        for fate, slots in TWIN_FATES.items():
            if slots:
                assert str(slots) not in rest, (fate, message)


@pytest.mark.parametrize("kwargs, hint", [(dict(tail_in_table_only=True), "unused slots"),
                                          (dict(no_rounding=True), "whole pages")])
def test_slot_fates_hint_answers_the_kind_of_mistake(kwargs, hint):
    _common.reset_attempts("4.2")
    for _ in range(2):
        with pytest.raises(AssertionError) as failure:
            ch04.check_slot_fates(lambda r, t, p: slot_fates(r, t, p, **kwargs))
    _common.reset_attempts("4.2")
    assert hint in str(failure.value).split("Hint (failed 2 times):")[1], str(failure.value)


def test_the_finish_prediction_form_is_stated_before_any_failure():
    """The exercise says what form ``predicted`` takes, and its cell holds a template."""
    cells = json.loads((ROOT / "exercises" / "04_lifecycle.ipynb").read_text())["cells"]
    text = "".join("".join(c["source"]) for c in cells)
    assert '# predicted = {"kept":' in text
