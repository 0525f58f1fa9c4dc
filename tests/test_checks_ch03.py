"""Chapter 03 checkers accept the reference solutions and reject plausible wrong ones."""

from __future__ import annotations

import hashlib

import pytest
import torch
from brute_force import lcp
from exercise_util import rejects

from minirt.checks import ch03
from minirt.radix import RadixNode

# --------------------------------------------------------------------------- references
# (the same code as solutions/03_match_and_insert.ipynb)


def match_walk(root: RadixNode, ids: list[int], page_size: int):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    node, pos, slots = root, 0, []
    while len(ids) - pos >= page_size:
        child = node.children.get(node.key_fn(ids_t[pos:]))
        if child is None:
            break
        m = child.get_match_len(ids_t[pos:])
        slots += child.value[:m].tolist()
        pos += m
        if m < child.length:
            break
        node = child
    return pos, slots


def offset_design(x, y, page_size, *, offset_from_aligned=False, new_from_fork=False,
                  reuse_common=False, original_from_aligned=False, new_key_at_fork=False):
    common = 0
    while x[common] == y[common]:
        common += 1
    aligned = common // page_size * page_size

    def blocks(first, start, stop):
        return list(range(first, first + -(-(stop - start) // page_size)))

    x_blocks = blocks(100, 0, len(x))
    new_start = common if new_from_fork else aligned
    return {
        "reused": common if reuse_common else aligned,
        "common": {"span": (0, aligned), "blocks": x_blocks[: aligned // page_size]},
        "original": {"span": (aligned if original_from_aligned else common, len(x)),
                     "blocks": x_blocks[aligned // page_size:],
                     "offset": aligned if offset_from_aligned else common - aligned,
                     "key": x[common]},
        "new": {"span": (new_start, len(y)), "blocks": blocks(200, new_start, len(y)),
                "key": y[common] if new_key_at_fork else y[new_start]},
    }


def block_names(ids, block):
    names, parent = [], ""
    for start in range(0, len(ids) - len(ids) % block, block):
        parent = hashlib.sha256(f"{parent}|{ids[start:start + block]}".encode()).hexdigest()
        names.append(parent)
    return names


def hash_reuse(cached, ids, block):
    known = {n for seq in cached for n in block_names(seq, block)}
    reused = 0
    for name in block_names(ids, block):
        if name not in known:
            break
        reused += block
    return reused


def aligned_hits(requests, page_size):
    total = 0
    for i, r in enumerate(requests):
        best = max((lcp(r, q) for q in requests[:i]), default=0)
        total += best - best % page_size
    return total


def test_references_pass(capsys):
    ch03.check_match_walk(match_walk)
    ch03.check_offset_design(offset_design)
    ch03.check_hash_reuse(hash_reuse)
    ch03.check_aligned_hits(aligned_hits)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" passed")[0] for line in out] == [
        "Exercise 3.1", "Exercise 3.2", "Exercise 3.3", "Exercise 3.4"]


# --------------------------------------------------------------------------- mutants


def walk_no_rounding(root, ids, page_size):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    node, pos, slots = root, 0, []
    while len(ids) - pos >= page_size:
        child = node.children.get(node.key_fn(ids_t[pos:]))
        if child is None:
            break
        n = min(child.length, len(ids) - pos)
        eq = (child.key[:n] == ids_t[pos:pos + n]).tolist() + [False]
        m = eq.index(False)
        slots += child.value[:m].tolist()
        pos += m
        if m < child.length:
            break
        node = child
    return pos, slots


def walk_one_level(root, ids, page_size):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    if len(ids) < page_size:
        return 0, []
    child = root.children.get(root.key_fn(ids_t))
    if child is None:
        return 0, []
    m = child.get_match_len(ids_t)
    return m, child.value[:m].tolist()


def walk_whole_node_slots(root, ids, page_size):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    node, pos, slots = root, 0, []
    while len(ids) - pos >= page_size:
        child = node.children.get(node.key_fn(ids_t[pos:]))
        if child is None:
            break
        m = child.get_match_len(ids_t[pos:])
        slots += child.value.tolist()
        pos += m
        if m < child.length:
            break
        node = child
    return pos, slots


def walk_first_token_keys(root, ids, page_size):  # ignores that pages key children by page
    ids_t = torch.tensor(ids, dtype=torch.int64)
    node, pos, slots = root, 0, []
    while pos < len(ids):
        child = node.children.get(int(ids_t[pos]))
        if child is None:
            break
        m = child.get_match_len(ids_t[pos:])
        slots += child.value[:m].tolist()
        pos += m
        if m < child.length:
            break
        node = child
    return pos, slots


def walk_that_splits(root, ids, page_size):  # matches like match_prefix: splits mid-node
    ids_t = torch.tensor(ids, dtype=torch.int64)
    node, pos, slots = root, 0, []
    while len(ids) - pos >= page_size:
        child = node.children.get(node.key_fn(ids_t[pos:]))
        if child is None:
            break
        m = child.get_match_len(ids_t[pos:])
        if 0 < m < child.length:
            child = child.split_at(m)
        slots += child.value[:m].tolist()
        pos += m
        node = child
        if m < child.length or m == 0:
            break
    return pos, slots


@pytest.mark.parametrize("wrong", [walk_no_rounding, walk_one_level, walk_whole_node_slots,
                                   walk_first_token_keys, walk_that_splits])
def test_match_walk_mutants_rejected(wrong):
    rejects(ch03.check_match_walk, wrong, "3.1", contains="match_walk(")


@pytest.mark.parametrize("kwargs", [dict(offset_from_aligned=True), dict(new_from_fork=True),
                                    dict(reuse_common=True), dict(original_from_aligned=True),
                                    dict(new_key_at_fork=True)])
def test_offset_design_mutants_rejected(kwargs):
    rejects(ch03.check_offset_design, lambda x, y, p: offset_design(x, y, p, **kwargs), "3.2",
            contains="offset_design(")


def hash_unchained(cached, ids, block):  # a block named by its own tokens only
    def names(seq):
        return [tuple(seq[s:s + block]) for s in range(0, len(seq) - len(seq) % block, block)]
    known = {n for seq in cached for n in names(seq)}
    reused = 0
    for name in names(ids):
        if name not in known:
            break
        reused += block
    return reused


def hash_position_not_chain(cached, ids, block):  # a block named by its index and tokens
    def names(seq):
        return [(s, tuple(seq[s:s + block])) for s in range(0, len(seq) - len(seq) % block, block)]
    known = {n for seq in cached for n in names(seq)}
    reused = 0
    for name in names(ids):
        if name not in known:
            break
        reused += block
    return reused


def hash_with_partial_block(cached, ids, block):  # also hashes the last, partial block
    def names(seq):
        out, parent = [], ""
        for start in range(0, len(seq), block):
            parent = hashlib.sha256(f"{parent}|{seq[start:start + block]}".encode()).hexdigest()
            out.append((parent, len(seq[start:start + block])))
        return out
    known = {n for seq in cached for n in names(seq)}
    reused = 0
    for name, size in names(ids):
        if (name, size) not in known:
            break
        reused += size
    return reused


def hash_last_cached_only(cached, ids, block):
    return hash_reuse(cached[-1:], ids, block)


@pytest.mark.parametrize("wrong", [hash_unchained, hash_position_not_chain,
                                   hash_with_partial_block, hash_last_cached_only])
def test_hash_reuse_mutants_rejected(wrong):
    rejects(ch03.check_hash_reuse, wrong, "3.3", contains="hash_reuse(")


def hits_previous_request_only(requests, page_size):
    total = 0
    for i, r in enumerate(requests):
        best = lcp(r, requests[i - 1]) if i else 0
        total += best - best % page_size
    return total


def hits_no_rounding(requests, page_size):
    return aligned_hits(requests, 1)


def hits_round_the_total(requests, page_size):
    total = aligned_hits(requests, 1)
    return total - total % page_size


def hits_include_itself(requests, page_size):
    total = 0
    for i, r in enumerate(requests):
        best = max(lcp(r, q) for q in requests[: i + 1])
        total += best - best % page_size
    return total


@pytest.mark.parametrize("wrong", [hits_previous_request_only, hits_no_rounding,
                                   hits_round_the_total, hits_include_itself])
def test_aligned_hits_mutants_rejected(wrong):
    rejects(ch03.check_aligned_hits, wrong, "3.4", contains="aligned_hits(")


def test_a_crash_names_the_input():
    def crashes(root, ids, page_size):
        return root.no_such_attribute

    with pytest.raises(AssertionError, match=r"match_walk\(root, .*raised AttributeError"):
        ch03.check_match_walk(crashes)
