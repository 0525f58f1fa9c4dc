"""Chapter 02 checkers accept the reference solutions and reject plausible wrong ones."""

from __future__ import annotations

import json

import pytest
import torch
from exercise_util import ROOT, accepts, rejects

from minirt.checks import _common, ch02
from minirt.radix import RadixNode, as_tokens

# --------------------------------------------------------------------------- references
# (the same code as solutions/02_radix_tree.ipynb)


def merge(node):
    if node.parent is None or len(node.children) != 1:
        raise ValueError("merge needs a non-root node with exactly one child")
    (child,) = node.children.values()
    if child.ref_count != node.ref_count:
        raise ValueError("different ref counts")
    parent = node.parent
    child.key = as_tokens([*node.key, *child.key])
    child.value = as_tokens([*node.value, *child.value])
    child.length = len(child.key)
    child.last_access = max(child.last_access, node.last_access)
    parent.children[node.key_fn(child.key)] = child
    child.parent = parent
    node.parent, node.children = None, {}
    return child


def split_with_stats(node, pos, stats):
    upper = node.split_at(pos)
    hits = stats[node.id]
    stats[upper.id], stats[node.id] = hits[:pos], hits[pos:]
    return upper


def _trie(requests):
    children, ends = [{}], [False]
    for r in requests:
        n = 0
        for t in r:
            if t not in children[n]:
                children[n][t] = len(children)
                children.append({})
                ends.append(False)
            n = children[n][t]
        ends[n] = True
    return children, ends


def count_nodes(requests):
    children, ends = _trie(requests)
    boundary = [i > 0 and (ends[i] or len(children[i]) != 1) for i in range(len(children))]
    trie_hops = radix_hops = 0
    for r in requests:
        n = 0
        for t in r:
            n = children[n][t]
            trie_hops += 1
            radix_hops += boundary[n]
    return len(children) - 1, sum(boundary), trie_hops, radix_hops


def insert_pages(root, ids, slots, *, split_at_end=True, return_slots=False,
                 return_new=False, token_level=False, whole_leaf=False, tree_pages=False):
    page = root.page_size
    ids_t, slots_t = torch.tensor(ids), torch.tensor(slots)
    node, pos = root, 0
    while pos < len(ids):
        child = node.children.get(root.key_fn(ids_t[pos:]))
        if child is None:
            break
        m = child.get_match_len(ids_t[pos:])
        if token_level:  # matches token by token, not in whole pages
            m = 0
            while m < min(child.length, len(ids) - pos) and int(child.key[m]) == ids[pos + m]:
                m += 1
        if m < child.length:
            if pos + m == len(ids) and not split_at_end:
                pos += m
                break
            child = child.split_at(m)
        node, pos = child, pos + m
    if pos < len(ids):
        if whole_leaf:  # the new leaf holds the whole request, not only the uncached rest
            leaf = RadixNode(root.key_fn, ids_t, slots_t)
        else:
            leaf = RadixNode(root.key_fn, ids_t[pos:], slots_t[pos:])
        leaf.parent = node
        node.children[root.key_fn(leaf.key)] = leaf
    if tree_pages:  # the tree's pages for the matched part, not the request's copies
        out, n, walk = [], root, 0
        while walk < pos:
            n = n.children[root.key_fn(ids_t[walk:])]
            out += [int(v) // page for v in n.value[: pos - walk: page]]
            walk += n.length
        return out
    if return_slots:
        return slots[:pos]
    if return_new:
        return [s // page for s in slots[pos::page]]
    return [s // page for s in slots[:pos:page]]


def test_references_pass(capsys):
    accepts(ch02.check_merge, merge, "2.1", capsys)
    accepts(ch02.check_split_with_stats, split_with_stats, "2.2", capsys)
    accepts(ch02.check_node_counts, count_nodes, "2.3", capsys)
    accepts(ch02.check_insert_pages, insert_pages, "2.4", capsys)


def test_a_pass_after_failures_resets_the_hint(capsys):
    for _ in range(2):
        with pytest.raises(AssertionError):
            ch02.check_merge(lambda node: node)
    accepts(ch02.check_merge, merge, "2.1", capsys)
    with pytest.raises(AssertionError) as again:
        ch02.check_merge(lambda node: node)
    assert "Hint" not in str(again.value)


# --------------------------------------------------------------------------- mutants


def merge_upper_survives(node):  # the upper object survives: handles to the child go stale
    (child,) = node.children.values()
    node.key = as_tokens([*node.key, *child.key])
    node.value = as_tokens([*node.value, *child.value])
    node.length = len(node.key)
    node.children = dict(child.children)
    for g in node.children.values():
        g.parent = node
    child.parent, child.children = None, {}
    return node


def merge_forgets_grandchildren(node):
    (child,) = node.children.values()
    child.key = as_tokens([*node.key, *child.key])
    child.value = as_tokens([*node.value, *child.value])
    child.length = len(child.key)
    node.parent.children[node.key_fn(child.key)] = child
    child.parent, child.children = node.parent, {}
    node.parent, node.children = None, {}
    return child


def merge_never_refuses(node):
    if node.parent is None:
        return node
    (child, *_) = node.children.values()
    child.key = as_tokens([*node.key, *child.key])
    child.value = as_tokens([*node.value, *child.value])
    child.length = len(child.key)
    node.parent.children[node.key_fn(child.key)] = child
    child.parent = node.parent
    node.parent, node.children = None, {}
    return child


def merge_keeps_node_attached(node):
    (child,) = node.children.values()
    if child.ref_count != node.ref_count:
        raise ValueError
    child.key = as_tokens([*node.key, *child.key])
    child.value = as_tokens([*node.value, *child.value])
    child.length = len(child.key)
    node.parent.children[node.key_fn(child.key)] = child
    child.parent = node.parent
    return child


def merge_keeps_child_time(node):
    """The reference merge, except that the child keeps its own last_access."""
    own = [c.last_access for c in node.children.values()]
    merged = merge(node)
    merged.last_access = own[0]
    return merged


@pytest.mark.parametrize("wrong", [merge_upper_survives, merge_forgets_grandchildren,
                                   merge_never_refuses, merge_keeps_node_attached,
                                   merge_keeps_child_time])
def test_merge_mutants_rejected(wrong):
    rejects(ch02.check_merge, wrong, "2.1", contains="merge(")


def stats_swapped(node, pos, stats):  # the old node object keeps the upper half's numbers
    upper = node.split_at(pos)
    hits = stats[node.id]
    stats[upper.id], stats[node.id] = hits[pos:], hits[:pos]
    return upper


def stats_not_moved(node, pos, stats):
    return node.split_at(pos)


def stats_moved_before_checking(node, pos, stats):  # a refused split leaves the stats changed
    hits = stats.pop(node.id)
    stats[node.id] = hits[pos:]
    upper = node.split_at(pos)
    stats[upper.id] = hits[:pos]
    return upper


@pytest.mark.parametrize("wrong", [stats_swapped, stats_not_moved, stats_moved_before_checking])
def test_split_with_stats_mutants_rejected(wrong):
    rejects(ch02.check_split_with_stats, wrong, "2.2", contains="split_with_stats(")


def counts_radix_forks_only(requests):  # forgets that a request's end ends a node
    children, ends = _trie(requests)
    t, _, th, _ = count_nodes(requests)
    boundary = [i > 0 and len(children[i]) != 1 for i in range(len(children))]
    rh = 0
    for r in requests:
        n = 0
        for tok in r:
            n = children[n][tok]
            rh += boundary[n]
    return t, sum(boundary), th, rh


def counts_root_too(requests):
    t, r, th, rh = count_nodes(requests)
    return t + 1, r + 1, th, rh


def counts_leaves_only(requests):
    children, _ = _trie(requests)
    t, _, th, rh = count_nodes(requests)
    return t, sum(1 for i in range(1, len(children)) if not children[i]), th, rh


def counts_total_tokens_as_trie_nodes(requests):
    t, r, th, rh = count_nodes(requests)
    return th, r, th, rh


@pytest.mark.parametrize("wrong", [counts_radix_forks_only, counts_root_too, counts_leaves_only,
                                   counts_total_tokens_as_trie_nodes])
def test_node_count_mutants_rejected(wrong):
    rejects(ch02.check_node_counts, wrong, "2.3", contains="count_nodes(")


@pytest.mark.parametrize("wrong", [
    lambda root, ids, slots: insert_pages(root, ids, slots, split_at_end=False),
    lambda root, ids, slots: insert_pages(root, ids, slots, return_slots=True),
    lambda root, ids, slots: insert_pages(root, ids, slots, return_new=True),
])
def test_insert_pages_mutants_rejected(wrong):
    rejects(ch02.check_insert_pages, wrong, "2.4", contains="insert_pages(")


@pytest.mark.parametrize("kwargs, hint", [
    (dict(token_level=True), "page boundary"),     # the cold run's token-level match
    (dict(whole_leaf=True), "uncached rest"),      # the cold run's leaf holding everything
    (dict(tree_pages=True), "tree's pages"),
    (dict(return_slots=True), "slot // "),
    (dict(split_at_end=False), "simply ends there"),
])
def test_insert_pages_hint_answers_the_kind_of_mistake(kwargs, hint):
    """The hint on a repeated failure speaks to the mistake made, not to the failure count."""
    rejects(ch02.check_insert_pages,
            lambda root, ids, slots: insert_pages(root, ids, slots, **kwargs), "2.4")
    _common.reset_attempts("2.4")
    with pytest.raises(AssertionError):
        ch02.check_insert_pages(lambda root, ids, slots: insert_pages(root, ids, slots, **kwargs))
    with pytest.raises(AssertionError) as second:
        ch02.check_insert_pages(lambda root, ids, slots: insert_pages(root, ids, slots, **kwargs))
    _common.reset_attempts("2.4")
    assert hint in str(second.value).split("Hint (failed 2 times):")[1], str(second.value)


def test_crashes_become_assertions_naming_the_input():
    def crashes(root, ids, slots):
        raise IndexError("oops")

    with pytest.raises(AssertionError, match=r"insert_pages\(root, ids=.*raised IndexError"):
        ch02.check_insert_pages(crashes)


# --------------------------------------------------------------------------- 2.4 prediction


def test_paged_prediction_accepts_the_right_one(capsys):
    ch02.check_paged_prediction({"duplicates": [[], [5], [10, 11]], "nodes": 5})
    assert capsys.readouterr().out.startswith("Exercise 2.4 passed")
    assert _common.failures("2.4 prediction") == 0


PAGED_WRONG = [
    ({"duplicates": [[], [5], [10, 11, 12]], "nodes": 5}, "only when all its tokens match"),
    ({"duplicates": [[], [5], [10]], "nodes": 5}, "one whole page at a time"),
    ({"duplicates": [[], [5], [10, 11]], "nodes": 4}, "splits it"),
    ({"duplicates": [[], [10], [20, 21]], "nodes": 5}, "slot numbers"),   # the cold run's
    ({"duplicates": [[], [0], [0, 1]], "nodes": 5}, "not the tree's"),   # the tree's pages
    ({"dups": [[], [5], [10, 11]], "n": 5}, "template"),                 # the cold run's keys
    ({"duplicates": [5, 10, 11], "nodes": 5}, "template"),
]


def _two_failures(check, answer, label: str) -> tuple[str, str]:
    """Run a prediction checker twice on a wrong answer; the first and second message."""
    _common.reset_attempts(label)
    with pytest.raises(AssertionError) as first:
        check(answer)
    with pytest.raises(AssertionError) as second:
        check(answer)
    _common.reset_attempts(label)
    return str(first.value), str(second.value)


@pytest.mark.parametrize("wrong, hint", PAGED_WRONG)
def test_paged_prediction_rejects_wrong_ones(wrong, hint):
    one, two = _two_failures(ch02.check_paged_prediction, wrong, "2.4 prediction")
    assert "your" in one and "Hint" not in one, one
    assert hint in two.split("Hint (failed 2 times):")[1], two
    # predict first: no failure gives the answer away
    for message in (one, two):
        rest = message.replace(repr(wrong), "")
        assert "[10, 11]]" not in rest and "[[], [5]" not in rest, message
        assert "5 nodes" not in rest and "expected" not in rest, message


def test_the_paged_prediction_form_is_stated_before_any_failure():
    """The exercise says what form ``predicted`` takes, and its cell holds a template."""
    cells = json.loads((ROOT / "exercises" / "02_radix_tree.ipynb").read_text())["cells"]
    text = "".join("".join(c["source"]) for c in cells)
    assert '"duplicates":' in text and '"nodes":' in text
