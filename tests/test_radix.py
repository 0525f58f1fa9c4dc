"""Unit tests of minirt.radix: key functions, get_match_len, split_at."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt.radix import (
    PageKey,
    RadixNode,
    as_tokens,
    common_prefix_len,
    page_key,
    token_key,
)


def t(xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_key_functions():
    assert token_key(t([7, 8, 9])) == 7
    assert page_key(1) is token_key
    pk = page_key(2)
    assert isinstance(pk, PageKey) and pk.page_size == 2
    assert pk(t([7, 8, 9, 10])) == (7, 8)
    with pytest.raises(ValueError):
        PageKey(0)


def test_root_and_leaf():
    root = RadixNode(token_key)
    assert root.is_root() and root.is_leaf() and root.length == 0
    node = RadixNode(token_key, t([1, 2]), t([5, 6]), tick=3)
    assert not node.is_root() and node.length == 2
    assert node.created == 3 and node.last_access == 3 and node.ref_count == 0
    later, latest = RadixNode(token_key), RadixNode(token_key)
    assert node.id < later.id < latest.id
    with pytest.raises(ValueError):
        RadixNode(token_key, t([1, 2]), t([5]))


@pytest.mark.parametrize(
    "key, ids, page_size, expected",
    [
        ([1, 2, 3], [1, 2, 3], 1, 3),
        ([1, 2, 3], [1, 2, 3, 4], 1, 3),
        ([1, 2, 3], [1, 2], 1, 2),
        ([1, 2, 3], [9], 1, 0),
        ([1, 2, 3], [], 1, 0),
        ([1, 2, 3, 4], [1, 2, 3, 9], 2, 2),
        ([1, 2, 3, 4], [1, 9, 3, 4], 2, 0),
        ([1, 2, 3, 4], [1, 2, 3, 4, 5], 2, 4),
        ([1, 2, 3, 4], [1, 2, 3], 2, 2),
    ],
)
def test_get_match_len(key, ids, page_size, expected):
    node = RadixNode(page_key(page_size), t(key), t(key))
    assert node.get_match_len(t(ids)) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_len_matches_python(a, b):
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_prefix_len(t(a), t(b)) == expected
    assert common_prefix_len(a, [9] + b, start=1) == expected  # lists, and an offset into b


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 300))
def test_common_prefix_len_gallops_to_any_mismatch(n, m, where):
    """Long runs: the first mismatch can lie anywhere, or nowhere."""
    a = list(range(n))
    b = list(range(m))
    if where < min(n, m):
        b[where] = -1
    expected = next((i for i in range(min(n, m)) if a[i] != b[i]), min(n, m))
    assert common_prefix_len(a, b) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=40), st.lists(st.integers(0, 2), max_size=40),
       st.integers(0, 45))
def test_common_prefix_len_same_on_every_kind_of_view(a, b, start):
    """The memcmp path (b views a whole bytes object) and the slice path (b a slice of a
    larger buffer, or numpy's memory) give the same answer, at any offset into b."""
    import numpy as np

    expected = 0
    while start + expected < len(b) and expected < len(a) and a[expected] == b[start + expected]:
        expected += 1
    whole = as_tokens(b)
    assert whole.obj is not None and whole.nbytes == len(whole.obj)  # the memcmp path
    padded = as_tokens([7] + b + [7])[1 : len(b) + 1]  # a slice: the view path
    in_numpy = memoryview(np.array(b, dtype=np.int64)).cast("B").cast("q")
    for view in (whole, padded, in_numpy):
        assert common_prefix_len(as_tokens(a), view, start) == expected


def test_split_at_shares_storage_and_moves_metadata():
    root = RadixNode(token_key)
    node = RadixNode(token_key, t([101, 11, 12, 21, 22]), t([0, 1, 2, 3, 4]), tick=5)
    node.parent = root
    root.children[101] = node
    node.ref_count, node.hit_count, node.priority = 2, 4, 7
    key_buf, val_buf = node.key.obj, node.value.obj

    upper = node.split_at(3)

    assert upper.key.tolist() == [101, 11, 12] and upper.value.tolist() == [0, 1, 2]
    assert node.key.tolist() == [21, 22] and node.value.tolist() == [3, 4]
    # no K/V, id or slot copied: both halves are views of the old buffers
    assert upper.key.obj is key_buf and node.key.obj is key_buf
    assert upper.value.obj is val_buf and node.value.obj is val_buf
    assert (upper.length, node.length) == (3, 2)
    # structure
    assert root.children == {101: upper} and upper.parent is root
    assert upper.children == {21: node} and node.parent is upper
    assert (upper.ref_count, upper.hit_count, upper.priority) == (2, 4, 7)
    assert upper.created == 5 and upper.id > node.id


def test_split_at_page_boundaries_only():
    node = RadixNode(page_key(2), t([1, 2, 3, 4, 5, 6]), t([0, 1, 2, 3, 4, 5]))
    for bad in (0, 1, 3, 6, 7, -2):
        with pytest.raises(ValueError):
            node.split_at(bad)
    assert node.key.tolist() == [1, 2, 3, 4, 5, 6]
    upper = node.split_at(4)
    assert upper.children == {(5, 6): node}


def test_abc_by_hand():
    """The seed's example with bare nodes: A, then B splits at 3, C splits at 2."""
    root = RadixNode(token_key)
    a = RadixNode(token_key, t([101, 11, 12, 21, 22]), t([0, 1, 2, 3, 4]))
    a.parent, root.children[101] = root, a
    ab = a.split_at(3)
    b = RadixNode(token_key, t([31, 32]), t([5, 6]))
    b.parent, ab.children[31] = ab, b
    abc = ab.split_at(2)
    c = RadixNode(token_key, t([99]), t([7]))
    c.parent, abc.children[99] = abc, c
    assert root.children[101] is abc and abc.key.tolist() == [101, 11]
    assert sorted(abc.children) == [12, 99] and abc.children[12] is ab
    assert ab.key.tolist() == [12] and sorted(ab.children) == [21, 31]
    assert a.key.tolist() == [21, 22] and a.value.tolist() == [3, 4]


def test_repr_is_short():
    node = RadixNode(token_key, torch.arange(100), torch.arange(100))
    assert "len=100" in repr(node) and len(repr(node)) < 120
