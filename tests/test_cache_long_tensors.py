"""RadixCache on long int64 tensors (an engine's ids and slots), which it checks where they
lie instead of copying first: same answers as lists, same errors, and the tree never keeps
the caller's memory."""

from __future__ import annotations

import pytest
import torch
from cache_model import assert_invariants, snapshot

from minirt.cache import _IN_PLACE, RadixCache
from minirt.errors import InvalidIdsError
from minirt.token_ids import TokenIds

N = _IN_PLACE + 100  # long enough to be checked in place


@pytest.mark.parametrize("page", [1, 16])
def test_long_tensors_answer_as_lists_do(page):
    a = torch.arange(N, dtype=torch.int64)
    b = torch.cat([a[: N // 2], torch.arange(10**6, 10**6 + N // 2)])
    caches = [RadixCache(page_size=page) for _ in range(3)]
    forms = [lambda t: t.tolist(), lambda t: t, lambda t: TokenIds(t)]
    answers = []
    for cache, form in zip(caches, forms, strict=True):
        out = []
        for ids, first in ((a, 0), (b, 5 * N), (a, 9 * N)):
            m = cache.match_prefix(form(ids))
            slots = torch.cat([m.indices, torch.arange(first, first + len(ids) - m.cached_len)])
            r = cache.insert_prefix(form(ids), form(slots))
            out.append((m.cached_len, m.indices.tolist(), r.cached_len, r.indices.tolist()))
        assert_invariants(cache)
        answers.append(out)
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][1][0] == N // 2 // page * page and answers[0][2][0] == N // page * page


def test_the_tree_keeps_copies_not_the_callers_tensors():
    for cached in (0, 100):
        cache = RadixCache()
        if cached:
            cache.insert_prefix(list(range(cached)), list(range(cached)))
        ids, slots = torch.arange(N, dtype=torch.int64), torch.arange(N, dtype=torch.int64)
        cache.insert_prefix(ids, slots)
        before = snapshot(cache)
        ids += 7  # the caller reuses its buffers
        slots.fill_(3)
        assert snapshot(cache) == before
        assert cache.match_prefix(torch.arange(N, dtype=torch.int64)).cached_len == N
        for node in cache.nodes():
            assert isinstance(node.key.obj, bytes) and isinstance(node.value.obj, bytes)


@pytest.mark.parametrize("where", ["ids", "indices"])
def test_a_negative_entry_in_a_long_tensor_is_refused_and_changes_nothing(where):
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    before = snapshot(cache)
    good = torch.arange(N, dtype=torch.int64)
    bad = good.clone()
    bad[N - 3] = -4
    with pytest.raises(InvalidIdsError, match=f"{where} must be non-negative, got -4 at "
                                              f"position {N - 3}"):
        if where == "ids":
            cache.insert_prefix(bad, good)
        else:
            cache.insert_prefix(good, bad)
    if where == "ids":
        with pytest.raises(InvalidIdsError, match=f"got -4 at position {N - 3}"):
            cache.match_prefix(bad)
    assert snapshot(cache) == before


def test_other_long_tensors_take_the_copying_path():
    cache = RadixCache()
    strided = torch.arange(2 * N, dtype=torch.int64)[::2]  # not contiguous
    small = torch.arange(N, dtype=torch.int32)
    cache.insert_prefix(strided, torch.arange(N))
    assert cache.match_prefix(strided.clone()).cached_len == N
    assert cache.match_prefix(small).cached_len == 1  # 0 is the one id they share
    assert_invariants(cache)


@pytest.mark.parametrize("where", [0, 4095, 4096, 9999])
@pytest.mark.parametrize("form", ["list", "array", "tensor"])
def test_a_negative_id_anywhere_in_a_long_request_is_named(where, form):
    """Long ids are checked by numpy's minimum, short ones by their sign bytes: a negative
    id is refused, with its position, on both sides of the switch and in every form."""
    from array import array

    ids = list(range(10_000))
    ids[where] = -7
    x = {"list": ids, "array": array("q", ids), "tensor": torch.tensor(ids)}[form]
    cache = RadixCache()
    with pytest.raises(InvalidIdsError, match=f"got -7 at position {where}"):
        TokenIds(x)
    with pytest.raises(InvalidIdsError, match=f"got -7 at position {where}"):
        cache.match_prefix(x)
    assert cache.total_size == 0
