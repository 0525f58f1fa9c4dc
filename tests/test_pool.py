"""KVPool: pages and the free list, misuse errors, and the transformers adapter on tiny_model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt.errors import InvalidIdsError, OutOfMemoryError, PoolError
from minirt.forward import PrefillPlan, forward_paged
from minirt.model import tiny_model
from minirt.pool import KVPool, PageTable


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def small_pool(capacity=16, page_size=1):
    return KVPool(num_layers=2, kv_heads=2, head_dim=4, capacity=capacity, page_size=page_size)


def test_shape_and_bytes_per_token(model):
    pool = KVPool.for_model(model, 32)
    assert pool.k.shape == (2, 32, 2, 16) and pool.v.shape == pool.k.shape
    assert pool.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert pool.nbytes == 32 * pool.bytes_per_token
    assert pool.dtype == torch.float32 and pool.device == next(model.parameters()).device
    half = KVPool(2, 2, 16, 8, dtype=torch.float16)
    assert half.bytes_per_token == pool.bytes_per_token // 2


def test_alloc_lowest_pages_first_and_free_roundtrip():
    pool = small_pool(12, page_size=4)
    a = pool.alloc(8)
    assert a.tolist() == list(range(8)) and a.dtype == torch.int64
    assert pool.num_free == 4
    pool.free(a[:4])
    assert pool.free_slots().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    b = pool.alloc(4)
    assert b.tolist() == [0, 1, 2, 3]
    pool.free(torch.cat([b, a[4:]]))
    assert pool.num_free == 12 and pool.alloc(0).numel() == 0


@pytest.mark.parametrize(
    "action, error, words",
    [
        (lambda p, a: p.free(a[:2]), PoolError, "already free"),       # double free
        (lambda p, a: p.free([8, 9, 10, 11]), PoolError, "never allocated"),
        (lambda p, a: p.free([4, 5]), PoolError, "only in part"),      # partial page
        (lambda p, a: p.free([4, 5, 6, 7, 4]), PoolError, "more than once"),
        (lambda p, a: p.free([99]), PoolError, "outside the pool"),
        (lambda p, a: p.free([-1]), PoolError, "outside the pool"),
        (lambda p, a: p.free([4.5]), InvalidIdsError, "integers"),
        (lambda p, a: p.alloc(16), OutOfMemoryError, "only 12 of 16"),
        (lambda p, a: p.alloc(3), PoolError, "whole pages"),
        (lambda p, a: p.alloc(-4), PoolError, "non-negative"),
    ],
)
def test_misuse_raises_and_leaves_pool_unchanged(action, error, words):
    pool = small_pool(16, page_size=4)
    a = pool.alloc(4)
    pool.alloc(4)
    pool.free(a)
    before = pool.snapshot(), pool.num_free
    with pytest.raises(error, match=words):
        action(pool, a)
    assert (pool.snapshot(), pool.num_free) == before


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=30),
       st.sampled_from([1, 2, 4]))
def test_free_list_accounting(ops, page_size):
    """Random alloc/free: held + free always partition the pool, against a set model."""
    pool = small_pool(24, page_size=page_size)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc:
            want = n * page_size
            if want > pool.num_free:
                with pytest.raises(OutOfMemoryError):
                    pool.alloc(want)
            else:
                held.append(pool.alloc(want))
        elif held:
            pool.free(held.pop(n % len(held)))
        owned = torch.cat(held + [pool.free_slots()]) if held else pool.free_slots()
        assert sorted(owned.tolist()) == list(range(24))
        assert pool.num_free == pool.free_slots().numel()  # the count kept = the list's


def test_page_table_repoint():
    t = PageTable([5, 6, 7])
    t.append(torch.tensor([9]))
    t.repoint([0, 1])
    assert t.tolist() == [0, 1, 7, 9] and len(t) == 4 and int(t[3]) == 9
    with pytest.raises(PoolError):
        t.repoint([0, 1, 2, 3, 4])


def test_prefill_through_pool_equals_plain(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (12,))
    ref = model(ids[None]).logits[0]
    pool = KVPool.for_model(model, 32)
    table = PageTable(pool.alloc(12))
    got = forward_paged(model, pool, [table], [ids], last_only=False)[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # The pool now holds the K/V: a second request reuses the first 7 positions' slots.
    t2 = PageTable(table.slots[:7])
    t2.append(pool.alloc(5))
    got2 = forward_paged(model, pool, [t2], [ids[7:]], last_only=False)[0]
    torch.testing.assert_close(got2, ref[7:], atol=1e-5, rtol=1e-5)
    # Wrong K/V in a reused slot changes the logits: the pool really is what attention reads.
    pool.k[:, int(table.slots[2])] += 1.0
    t3 = PageTable(table.slots[:7])
    t3.append(pool.alloc(5))
    got3 = forward_paged(model, pool, [t3], [ids[7:]], last_only=False)[0]
    assert not torch.allclose(got3, ref[7:], atol=1e-3)


def test_greedy_decode_through_pool_equals_plain(model):
    torch.manual_seed(2)
    prompt = torch.randint(0, 128, (6,))
    seq = prompt.clone()
    for _ in range(5):  # plain greedy without any cache
        seq = torch.cat([seq, model(seq[None]).logits[0, -1].argmax()[None]])
    pool = KVPool.for_model(model, 16)
    table = PageTable(pool.alloc(6))
    tok = forward_paged(model, pool, [table], [prompt])[0].argmax()
    out = [int(tok)]
    for _ in range(4):
        table.append(pool.alloc(1))
        tok = forward_paged(model, pool, [table], [tok[None]])[0].argmax()
        out.append(int(tok))
    assert out == seq[6:].tolist()


def test_batched_decode_and_prefill_of_different_lengths(model):
    torch.manual_seed(3)
    pool = KVPool.for_model(model, 64)
    seqs = [torch.randint(0, 128, (n,)) for n in (3, 8, 5)]
    tables = []
    for s in seqs:
        tables.append(PageTable(pool.alloc(len(s))))
        forward_paged(model, pool, [tables[-1]], [s])
    nxt = [torch.tensor([t]) for t in (4, 40, 90)]
    for t in tables:
        t.append(pool.alloc(1))
    outs = forward_paged(model, pool, tables, nxt)
    for s, n, o in zip(seqs, nxt, outs, strict=True):
        torch.testing.assert_close(o, model(torch.cat([s, n])[None]).logits[0, -1],
                                   atol=1e-5, rtol=1e-5)
    # Batched prefill: one request with 5 cached tokens and 4 new, one fresh with 6.
    a, b = torch.randint(0, 128, (9,)), torch.randint(0, 128, (6,))
    ta = PageTable(pool.alloc(5))
    forward_paged(model, pool, [ta], [a[:5]])
    ta.append(pool.alloc(4))
    tb = PageTable(pool.alloc(6))
    got_a, got_b = forward_paged(model, pool, [ta, tb], [a[5:], b], last_only=False)
    torch.testing.assert_close(got_a, model(a[None]).logits[0, 5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_b, model(b[None]).logits[0], atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 9), st.integers(0, 6),
       st.lists(st.tuples(st.sampled_from(["shared", "more", "cold"]), st.integers(1, 7)),
                min_size=1, max_size=5),
       st.booleans(), st.integers(0, 10_000))
def test_batched_prefill_matches_the_model_for_any_ragged_batch(model, prefix_len, run_len,
                                                                requests, twins, seed):
    """The last-position prefill of a Llama (``_prefill_llama``): requests behind one shared
    cached prefix, with more cached of their own, or cold, several starting with the same
    new tokens (computed once), each with its own tail. Every request's logits equal the
    model's on its whole prompt, and the pool then holds every new position's K/V: one
    more token through the gathering path (transformers' forward) agrees too. ``twins``:
    every request has the same tail (identical prompts: all but the last token shared)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool.for_model(model, 256)
    prefix = torch.randint(0, 128, (prefix_len,), generator=gen)
    run = torch.randint(0, 128, (run_len,), generator=gen)
    shared = PageTable(pool.alloc(prefix_len))
    if prefix_len:
        forward_paged(model, pool, [shared], [prefix])
    tables, news, prompts = [], [], []
    same = torch.randint(0, 128, (requests[0][1],), generator=gen)
    for kind, own in requests:
        tail = same if twins else torch.randint(0, 128, (own,), generator=gen)
        if kind == "cold" or not prefix_len:
            prompt, table, cached = torch.cat([run, tail]), PageTable(), 0
        else:
            table, cached = PageTable(shared.slots), prefix_len
            prompt = torch.cat([prefix, run, tail])
            if kind == "more":  # a further cached stretch in slots of its own
                extra = torch.randint(0, 128, (3,), generator=gen)
                prompt = torch.cat([prefix, extra, run, tail])
                table.append(pool.alloc(3))
                forward_paged(model, pool, [table], [extra])
                cached += 3
        table.append(pool.alloc(prompt.numel() - cached))
        tables.append(table)
        news.append(prompt[cached:])
        prompts.append(prompt)
    with torch.inference_mode():
        got = forward_paged(model, pool, tables, news)
        for prompt, logits in zip(prompts, got, strict=True):
            torch.testing.assert_close(logits, model(prompt[None]).logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
        nxt = [torch.tensor([int(g.argmax())]) for g in got]
        for t in tables:
            t.append(pool.alloc(1))
        again = forward_paged(model, pool, tables, nxt, last_only=False)
        for prompt, n, logits in zip(prompts, nxt, again, strict=True):
            want = model(torch.cat([prompt, n])[None]).logits[0, -1]
            torch.testing.assert_close(logits[-1], want, atol=1e-4, rtol=1e-4)


def test_prefill_plan_reads_the_prefix_once_and_computes_a_common_run_once():
    """Three requests behind 8 shared cached slots begin their new tokens with the same 5:
    those are one run, computed once; a fourth with 4 more cached positions of its own
    computes all its new tokens; rows = run + every request's own tokens, unpadded, in
    parts of equal length (one attention call each)."""
    prefix = list(range(8))
    run, tails = [7, 7, 7, 7, 7], [[1, 2], [3, 4], [5, 6]]
    tables = [PageTable(prefix + list(range(100 + 10 * r, 107 + 10 * r))) for r in range(3)]
    tables.append(PageTable(prefix + list(range(200, 208))))
    ids = [torch.tensor(run + t) for t in tails] + [torch.tensor([9, 9, 9, 9])]
    plan = PrefillPlan.build(tables, ids)
    assert (plan.shared, plan.common, plan.group, plan.own) == (8, 5, [0, 1, 2], [2, 2, 2, 4])
    assert plan.rows == 5 + 2 + 2 + 2 + 4 and plan.prefix.tolist() == prefix
    assert plan.input_ids.tolist() == run + [1, 2, 3, 4, 5, 6, 9, 9, 9, 9]
    assert plan.positions.tolist() == [8, 9, 10, 11, 12] + [13, 14] * 3 + [12, 13, 14, 15]
    # The run's K/V goes to each group request's slots at positions 8..12, from rows 0..4.
    assert plan.new_slots[:15].tolist() == [s for r in range(3) for s in range(100 + 10 * r,
                                                                               105 + 10 * r)]
    assert plan.source.tolist() == list(range(5)) * 3 + list(range(5, 15))
    assert plan.last.tolist() == [6, 8, 10, 14]
    (pair, lone) = plan.parts  # both read keys from the pool: the run's, and 4 cached
    assert (pair.requests, pair.start, pair.length) == ([0, 1, 2], 5, 2)
    assert (lone.requests, lone.start, lone.length) == ([3], 11, 4)
    assert pair.mask is not None and pair.own_slots.shape == (3, 7)
    assert lone.own_slots.tolist() == [list(range(200, 208))]
    apart = PrefillPlan.build(tables, ids, share_runs=False)  # an engine without a cache
    assert (apart.common, apart.own, apart.rows) == (0, [7, 7, 7, 4], 3 * 7 + 4)
    assert [p.requests for p in apart.parts] == [[0, 1, 2], [3]]
    assert apart.parts[0].own_slots is None  # nothing past the prefix but their new tokens
    alone = PrefillPlan.build(tables[:1], ids[:1])  # one request: no run, its keys causal
    assert (alone.common, alone.own, alone.parts[0].own_slots, alone.parts[0].mask) == \
        (0, [7], None, None)


def test_forward_paged_rejects_missing_slots(model):
    pool = KVPool.for_model(model, 8)
    with pytest.raises(PoolError, match="allocate slots"):
        forward_paged(model, pool, [PageTable([0, 1])], [torch.tensor([1, 2, 3])])


def test_pool_for_model_follows_model_dtype():
    m = tiny_model(0).to(torch.float64)
    pool = KVPool.for_model(m, 8)
    assert pool.dtype == torch.float64 and pool.bytes_per_token == 2 * 2 * 2 * 16 * 8
    ids = torch.tensor([3, 1, 4, 1, 5])
    got = forward_paged(m, pool, [PageTable(pool.alloc(5))], [ids])[0]
    torch.testing.assert_close(got, m(ids[None]).logits[0, -1])


@pytest.mark.parametrize("fresh", ["as allocated", "NaN"])
def test_working_kv_decode_equals_gathering_from_the_pool(model, monkeypatch, fresh):
    """Decode steps through WorkingKV give the gathering path's logits while requests of
    different lengths join and leave, its rows always equal the pool at their slots, and a
    table re-pointed under it (or with a bad K/V slot) is read again from the pool. Memory
    it grows into is not cleared as a whole: filled with NaN, nothing changes, since no
    position attention reads is left unwritten. Cleared when idle, it keeps its buffers,
    and requests after that read none of what they held."""
    from minirt.working_set import WorkingKV

    if fresh == "NaN":
        empty = torch.Tensor.new_empty
        monkeypatch.setattr(torch.Tensor, "new_empty",
                            lambda self, *size, **kw: empty(self, *size, **kw).fill_(float("nan")))
    torch.manual_seed(4)
    pool = KVPool.for_model(model, 256)
    working = WorkingKV(pool, grow=4)
    seqs = [torch.randint(0, 128, (n,)) for n in (3, 9, 5, 6)]
    tables, last = [], []
    for s in seqs:
        tables.append(PageTable(pool.alloc(len(s))))
        last.append(forward_paged(model, pool, [tables[-1]], [s])[0].argmax().reshape(1))
    batches = [[0, 1], [0, 1], [0, 1, 2], [2, 1, 0], [1, 3, 0], [3, 1, 2]]
    for step, rows in enumerate(batches):
        for r in rows:
            tables[r].append(pool.alloc(1))
        got = forward_paged(model, pool, [tables[r] for r in rows], [last[r] for r in rows],
                            working=working)
        for r, lg in zip(rows, got, strict=True):
            seq = torch.cat([seqs[r], last[r]])
            ref = model(seq[None]).logits[0, -1]
            if step == 4 and r == 0:  # read from the pool (bad slot), not the old row
                assert not torch.allclose(lg, ref, atol=1e-3)
                continue
            torch.testing.assert_close(lg, ref, atol=1e-5, rtol=1e-5)
            seqs[r], last[r] = seq, lg.argmax().reshape(1)
        working.check([tables[r] for r in rows])
        assert sorted(map(id, working.tables)) == sorted(id(tables[r]) for r in rows)
        if step == 3:  # re-point request 0 at a copy of its K/V, one slot of it wrong
            copy = pool.alloc(len(tables[0]))
            for layer in range(pool.num_layers):
                k, v = pool.gather(layer, tables[0].slots)
                pool.write(layer, copy, k, v)
            tables[0].repoint(copy)
            pool.k[:, int(copy[0])] += 1.0
    nbytes, k = working.nbytes, working.k
    working.clear()  # idle: the rows go, the buffers stay for the next requests
    assert working.tables == [] and working.prefixes == [] and working.nbytes == nbytes > 0
    with torch.inference_mode():  # whatever the rows held before: never read again
        working.k.fill_(float("nan"))
        working.v.fill_(float("nan"))
    rows = [3, 1]
    for r in rows:
        tables[r].append(pool.alloc(1))
    got = forward_paged(model, pool, [tables[r] for r in rows], [last[r] for r in rows],
                        working=working)
    for r, lg in zip(rows, got, strict=True):
        ref = model(torch.cat([seqs[r], last[r]])[None]).logits[0, -1]
        torch.testing.assert_close(lg, ref, atol=1e-5, rtol=1e-5)
    assert working.k is k  # no new buffer: the rows were taken again


def test_working_kv_check_catches_a_row_that_drifted(model):
    from minirt.working_set import WorkingKV

    pool = KVPool.for_model(model, 32)
    working = WorkingKV(pool)
    table = PageTable(pool.alloc(4))
    tok = forward_paged(model, pool, [table], [torch.tensor([5, 6, 7, 8])])[0].argmax()
    table.append(pool.alloc(1))
    forward_paged(model, pool, [table], [tok.reshape(1)], working=working)
    working.check([table])
    pool.v[1, int(table.slots[2])] += 1.0
    with pytest.raises(PoolError, match="source of truth"):
        working.check([table])


def test_working_kv_holds_each_groups_prefix_once(model):
    """Requests whose tables share leading slots (as after tree hits) decode through one copy
    of each group's prefix: behind two prefixes, two groups; a request sharing less than a
    group's prefix has its own row only; one sharing more with a member than the group does
    forms a group with it. Logits equal the plain model's throughout."""
    from minirt.working_set import WorkingKV

    torch.manual_seed(5)
    pool = KVPool.for_model(model, 512)
    working = WorkingKV(pool)
    heads = {}
    for name, n in (("x", 7), ("y", 6)):
        ids = torch.randint(0, 128, (n,))
        heads[name] = (ids, pool.alloc(n))
        forward_paged(model, pool, [PageTable(heads[name][1])], [ids])
    seqs, tables, last = [], [], []

    def request(ids: torch.Tensor, slots: torch.Tensor, own: int) -> None:
        seq = torch.cat([ids, torch.randint(0, 128, (own,))])
        table = PageTable(slots)
        table.append(pool.alloc(own))
        last.append(forward_paged(model, pool, [table], [seq[len(ids):]])[0].argmax().reshape(1))
        seqs.append(seq)
        tables.append(table)

    (x, xs), (y, ys) = heads["x"], heads["y"]
    for ids, slots, own in ((x, xs, 2), (x, xs, 4), (x[:3], xs[:3], 5), (y, ys, 3), (y, ys, 2)):
        request(ids, slots, own)
    request(seqs[1][:9], tables[1].slots[:9], 3)  # request 5: x and request 1's first 2 own
    steps = (([0, 1], [(7, [0, 1])]),
             ([0, 1, 3], [(7, [0, 1])]),                      # 3 shares nothing yet: a row
             ([3, 0, 1, 4], [(6, [3, 4]), (7, [0, 1])]),
             ([3, 2, 4, 0], [(6, [3, 4]), (7, [0])]),         # 2 shares 3 of the 7: a row
             ([0, 5, 1, 2], [(7, [0]), (9, [1, 5])]))         # 1 shares 9 with 5: a group
    for rows, groups in steps:
        for r in rows:
            tables[r].append(pool.alloc(1))
        got = forward_paged(model, pool, [tables[r] for r in rows], [last[r] for r in rows],
                            working=working)
        which = {id(t): r for r, t in enumerate(tables)}
        held = [(len(h), sorted(which[id(t)] for t, g in zip(working.tables, working.held,
                                                              strict=True) if g is h))
                for h in working.prefixes]
        assert sorted(held) == groups
        working.check([tables[r] for r in rows])
        for r, lg in zip(rows, got, strict=True):
            seqs[r] = torch.cat([seqs[r], last[r]])
            torch.testing.assert_close(lg, model(seqs[r][None]).logits[0, -1],
                                       atol=1e-5, rtol=1e-5)
            last[r] = lg.argmax().reshape(1)
    saved = pool.k[0, int(xs[1])].clone()
    pool.k[0, int(xs[1])] += 1.0
    with pytest.raises(PoolError, match="prefix differs from the pool"):
        working.check([tables[0]])
    row = [id(t) for t in working.tables].index(id(tables[2]))
    with pytest.raises(PoolError, match=f"row {row} differs from the pool"):
        working.check([tables[2]])  # it holds that slot in its own row
    pool.k[0, int(xs[1])] = saved
    # Idle, then the two groups again: the buffers are taken again, and whatever they held
    # (NaN here) is never read, past the shorter prefix's end included.
    pk = working.pk
    working.clear()
    with torch.inference_mode():
        for buf in (working.k, working.v, working.pk, working.pv):
            buf.fill_(float("nan"))
    rows = [3, 4, 0, 1]
    for r in rows:
        tables[r].append(pool.alloc(1))
    got = forward_paged(model, pool, [tables[r] for r in rows], [last[r] for r in rows],
                        working=working)
    assert sorted(len(h) for h in working.prefixes) == [6, 7] and working.pk is pk
    for r, lg in zip(rows, got, strict=True):
        seqs[r] = torch.cat([seqs[r], last[r]])
        torch.testing.assert_close(lg, model(seqs[r][None]).logits[0, -1], atol=1e-5, rtol=1e-5)


def test_working_kv_min_prefix(model):
    """``min_prefix``: requests sharing fewer positions keep all of theirs in their rows."""
    from minirt.working_set import WorkingKV

    torch.manual_seed(6)
    pool = KVPool.for_model(model, 64)
    ids, slots = torch.randint(0, 128, (5,)), pool.alloc(5)
    forward_paged(model, pool, [PageTable(slots)], [ids])
    tables, nxt = [], []
    for _ in range(2):
        t = PageTable(slots)
        t.append(pool.alloc(2))
        nxt.append(forward_paged(model, pool, [t], [torch.tensor([1, 2])])[0].argmax().reshape(1))
        t.append(pool.alloc(1))
        tables.append(t)
    for least, held in ((5, [5]), (6, [])):
        working = WorkingKV(pool, min_prefix=least)
        forward_paged(model, pool, tables, nxt, working=working)
        assert [len(h) for h in working.prefixes] == held
