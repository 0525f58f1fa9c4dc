"""Chapter 02 checkers accept the reference solutions and reject plausible wrong ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from minirt.checks import ch02
from minirt.radix import RadixNode, as_tokens, token_key

# --------------------------------------------------------------------------- references
# (the same code as solutions/02_radix_tree.ipynb)


def get_match_len(key: torch.Tensor, ids: torch.Tensor, page_size: int) -> int:
    n = min(len(key), len(ids))
    differ = (key[:n] != ids[:n]).nonzero()
    common = n if len(differ) == 0 else int(differ[0, 0])
    return common - common % page_size


def split_at(node: RadixNode, pos: int) -> RadixNode:
    if not 0 < pos < node.length or pos % node.page_size:
        raise ValueError(f"cannot split a node of length {node.length} at {pos}")
    upper = RadixNode(node.key_fn, node.key[:pos], node.value[:pos], node.created)
    upper.ref_count = node.ref_count
    upper.last_access = node.last_access
    parent = node.parent
    parent.children[node.key_fn(node.key)] = upper
    upper.parent = parent
    node.key, node.value, node.length = node.key[pos:], node.value[pos:], node.length - pos
    upper.children[node.key_fn(node.key)] = node
    node.parent = upper
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


def build_tree(requests):
    root, slots = RadixNode(token_key), itertools.count()
    for r in requests:
        ids = torch.tensor(r)
        node, pos = root, 0
        while pos < len(ids):
            child = node.children.get(token_key(ids[pos:]))
            if child is None:
                break
            m = child.get_match_len(ids[pos:])
            if m < child.length:
                child = child.split_at(m)
            node, pos = child, pos + m
        if pos < len(ids):
            leaf = RadixNode(token_key, ids[pos:],
                             torch.tensor([next(slots) for _ in range(len(ids) - pos)]))
            leaf.parent = node
            node.children[token_key(leaf.key)] = leaf
    return root


def test_references_pass(capsys):
    ch02.check_get_match_len(get_match_len)
    ch02.check_split_at(split_at)
    ch02.check_node_counts(count_nodes)
    ch02.check_abc_tree(build_tree)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" passed")[0] for line in out] == [
        "Exercise 2.1", "Exercise 2.2", "Exercise 2.3", "Exercise 2.4"]


def test_the_library_passes_too():
    ch02.check_get_match_len(lambda k, i, p: RadixNode(
        token_key if p == 1 else __import__("minirt.radix").radix.page_key(p), k,
        torch.zeros_like(k)).get_match_len(i))
    ch02.check_split_at(lambda node, pos: node.split_at(pos))


# --------------------------------------------------------------------------- mutants


def match_no_rounding(key, ids, page_size):
    return get_match_len(key, ids, 1)


def match_round_up(key, ids, page_size):
    n = get_match_len(key, ids, 1)
    return -(-n // page_size) * page_size


def match_counts_all_equal(key, ids, page_size):  # counts equal positions, not the prefix
    n = min(len(key), len(ids))
    return int((key[:n] == ids[:n]).sum()) // page_size * page_size


def match_assumes_ids_longer(key, ids, page_size):
    differ = (key != ids[: len(key)]).nonzero()
    n = len(key) if len(differ) == 0 else int(differ[0, 0])
    return n - n % page_size


@pytest.mark.parametrize("wrong", [match_no_rounding, match_round_up, match_counts_all_equal,
                                   match_assumes_ids_longer])
def test_get_match_len_mutants_rejected(wrong):
    with pytest.raises(AssertionError, match="get_match_len"):
        ch02.check_get_match_len(wrong)


def split_returns_lower(node, pos):  # roles swapped: the old object keeps the prefix
    lower = RadixNode(node.key_fn, node.key[pos:], node.value[pos:])
    lower.children, node.children = node.children, {}
    for c in lower.children.values():
        c.parent = lower
    node.key, node.value = node.key[:pos], node.value[:pos]
    node.children[node.key_fn(lower.key)] = lower
    lower.parent = node
    return lower


def split_copies(node, pos):
    upper = split_at(node, pos)
    upper.key, upper.value = as_tokens(upper.key.tolist()), as_tokens(upper.value.tolist())
    return upper


def split_forgets_length(node, pos):  # slices the key but leaves ``length`` as it was
    upper = split_at(node, pos)
    node.length += pos
    return upper


def split_forgets_parent(node, pos):
    if not 0 < pos < node.length:
        raise ValueError("bad pos")
    upper = RadixNode(node.key_fn, node.key[:pos], node.value[:pos])
    upper.ref_count = node.ref_count
    upper.parent = node.parent
    node.key, node.value = node.key[pos:], node.value[pos:]
    upper.children[node.key_fn(node.key)] = node
    node.parent = upper
    return upper


def split_drops_ref_count(node, pos):
    upper = split_at(node, pos)
    upper.ref_count = 0
    return upper


def split_no_validation(node, pos):
    pos = max(1, min(pos, node.length - 1))
    return split_at(node, pos - pos % node.page_size or node.page_size)


@pytest.mark.parametrize("wrong", [split_returns_lower, split_copies, split_forgets_parent,
                                   split_drops_ref_count, split_no_validation,
                                   split_forgets_length])
def test_split_at_mutants_rejected(wrong):
    with pytest.raises(AssertionError, match="split_at"):
        ch02.check_split_at(wrong)


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
    with pytest.raises(AssertionError, match="count_nodes"):
        ch02.check_node_counts(wrong)


def build_no_split_at_end(requests):  # a request ending inside a node is ignored
    root, slots = RadixNode(token_key), itertools.count()
    for r in requests:
        ids = torch.tensor(r)
        node, pos = root, 0
        while pos < len(ids):
            child = node.children.get(token_key(ids[pos:]))
            if child is None:
                break
            m = child.get_match_len(ids[pos:])
            if m == len(ids) - pos and m < child.length:
                pos = len(ids)
                break
            if m < child.length:
                child = child.split_at(m)
            node, pos = child, pos + m
        if pos < len(ids):
            leaf = RadixNode(token_key, ids[pos:],
                             torch.tensor([next(slots) for _ in range(len(ids) - pos)]))
            leaf.parent = node
            node.children[token_key(leaf.key)] = leaf
    return root


def build_allocates_whole_request(requests):  # slots for every token, uses only the tail
    root, slots = RadixNode(token_key), itertools.count()
    for r in requests:
        ids = torch.tensor(r)
        fresh = torch.tensor([next(slots) for _ in range(len(ids))])
        node, pos = root, 0
        while pos < len(ids):
            child = node.children.get(token_key(ids[pos:]))
            if child is None:
                break
            m = child.get_match_len(ids[pos:])
            if m < child.length:
                child = child.split_at(m)
            node, pos = child, pos + m
        if pos < len(ids):
            leaf = RadixNode(token_key, ids[pos:], fresh[pos:])
            leaf.parent = node
            node.children[token_key(leaf.key)] = leaf
    return root


def build_new_leaf_at_root_level(requests):  # splits, but hangs the rest under the wrong node
    root, slots = RadixNode(token_key), itertools.count()
    for r in requests:
        ids = torch.tensor(r)
        node, pos, parent = root, 0, root
        while pos < len(ids):
            child = node.children.get(token_key(ids[pos:]))
            if child is None:
                break
            m = child.get_match_len(ids[pos:])
            if m < child.length:
                child = child.split_at(m)
            parent, node, pos = node, child, pos + m
        if pos < len(ids):
            leaf = RadixNode(token_key, ids[pos:],
                             torch.tensor([next(slots) for _ in range(len(ids) - pos)]))
            leaf.parent = parent
            parent.children[token_key(leaf.key)] = leaf
    return root


@pytest.mark.parametrize("wrong", [build_no_split_at_end, build_allocates_whole_request,
                                   build_new_leaf_at_root_level])
def test_build_tree_mutants_rejected(wrong):
    with pytest.raises(AssertionError, match="build_tree"):
        ch02.check_abc_tree(wrong)


def test_crashes_become_assertions_naming_the_input():
    def crashes(key, ids, page_size):
        raise IndexError("oops")

    with pytest.raises(AssertionError, match=r"get_match_len\(key=.*raised IndexError"):
        ch02.check_get_match_len(crashes)
