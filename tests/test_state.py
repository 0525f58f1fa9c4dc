"""minirt.state: the toy state layer's two forms, and StateCache's checkpoint rules."""

from __future__ import annotations

import random

import pytest
import torch

from minirt.state import LinearRecurrence, StateCache


def _seqs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=g).tolist() for _ in range(n)]


def test_run_resumes_bitwise():
    layer = LinearRecurrence()
    for seq in _seqs(10, 30):
        for cut in (1, 7, 29):
            assert torch.equal(layer.run(seq[cut:], layer.run(seq[:cut])), layer.run(seq))


def test_scan_equals_run_in_real_arithmetic():
    layer = LinearRecurrence()
    for seq in _seqs(10, 40):
        for chunk in (1, 5, 8, 64):
            assert torch.allclose(layer.scan(seq, chunk=chunk).double(), layer.run(seq),
                                  rtol=1e-5, atol=1e-5)


def test_scan_resumes_bitwise_on_its_chunk_grid():
    """A state saved at a multiple of the chunk, continued with the same chunking, repeats
    the uncached run's operations: the same bits."""
    layer = LinearRecurrence()
    for seq in _seqs(20, 40, seed=1):
        full = layer.scan(seq, chunk=8)
        for cut in (8, 16, 24, 32, 40):
            saved = layer.scan(seq[:cut], chunk=8)
            assert torch.equal(layer.scan(seq[cut:], saved, chunk=8), full)


def test_scan_off_the_grid_regroups_the_sums():
    """Off the grid the chunks regroup the sums: equal within rounding, not in bits (on
    this CPU every one of these cases differs; one is enough for the claim)."""
    layer = LinearRecurrence()
    differ = 0
    for seq in _seqs(20, 40, seed=2):
        full = layer.scan(seq, chunk=8)
        for cut in (3, 13, 21, 30):
            resumed = layer.scan(seq[cut:], layer.scan(seq[:cut], chunk=8), chunk=8)
            assert torch.allclose(resumed, full, rtol=1e-5, atol=1e-5)
            differ += not torch.equal(resumed, full)
    assert differ > 0


def test_scan_rejects_a_bad_chunk():
    with pytest.raises(ValueError, match="chunk"):
        LinearRecurrence().scan([1, 2], chunk=0)


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"interval": 2.0}, {"interval": True},
                                    {"interval": 4, "chunk": 0}])
def test_state_cache_rejects_bad_rules(kwargs):
    interval = kwargs.pop("interval")
    with pytest.raises(ValueError):
        StateCache(interval, **kwargs)


def test_checkpoints_one_state_per_prefill_step():
    # one step from 5 to 23: one grid state, at the last multiple of 4 it reaches
    assert StateCache(4, False).checkpoints(23, 5, 5) == [20]
    # no multiple reached: nothing
    assert StateCache(4, False).checkpoints(7, 5, 5) == []
    # the request's end as well
    assert StateCache(4, True).checkpoints(23, 5, 5) == [20, 23]
    # steps of 6 from 5: 5-11, 11-17, 17-23; one grid state per step, absolute
    assert StateCache(4, False, chunk=6).checkpoints(23, 5, 5) == [8, 16, 20]
    # no buffer: the end of every step
    assert StateCache(None, True, chunk=6).checkpoints(23, 5, 5) == [11, 17, 23]
    assert StateCache(None, True).checkpoints(23, 5, 5) == [23]


def test_checkpoints_branching_point():
    # K/V matched 14 tokens past a usable prefix of 5: the state at 12 (grid 4) is saved
    assert StateCache(4, False, branch=True).checkpoints(23, 5, 14) == [12, 20]
    assert StateCache(None, True, branch=True).checkpoints(23, 5, 14) == [14, 23]
    # a branching point that rounds down to the usable prefix adds nothing
    assert StateCache(4, False, branch=True).checkpoints(23, 5, 7) == [20]
    assert StateCache(4, False).checkpoints(23, 5, 14) == [20]


def _every_multiple_hits(requests, interval, ends):
    """A brute-force trace player with a state at every multiple of ``interval`` passed."""
    saved, kv, hits = set(), set(), 0
    for ids in requests:
        q = ids[:-1]
        n = 0
        while n < len(q) and tuple(q[:n + 1]) in kv:
            n += 1
        usable = max((p for p in range(n + 1) if tuple(q[:p]) in saved), default=0)
        hits += usable
        saved |= {tuple(ids[:p]) for p in range(interval, len(ids) + 1, interval) if p > usable}
        if ends:
            saved.add(tuple(ids))
        kv |= {tuple(ids[:p]) for p in range(1, len(ids) + 1)}
    return hits


def test_chunk_equal_to_interval_saves_every_multiple():
    rng = random.Random(5)
    for _ in range(30):
        stems = [[rng.randrange(6) for _ in range(rng.randint(2, 10))] for _ in range(3)]
        trace: list[list[int]] = []
        for _ in range(rng.randint(2, 8)):
            base = rng.choice(trace) if trace and rng.random() < 0.5 else rng.choice(stems)
            trace.append(base + [rng.randrange(6) for _ in range(rng.randint(1, 9))])
        interval, ends = rng.choice([2, 3, 4]), rng.random() < 0.5
        assert StateCache(interval, ends, chunk=interval).serve(trace).hit_tokens == \
            _every_multiple_hits(trace, interval, ends)


def test_serve_worked_example():
    # request 1 saves 4 (grid) and 5 (end); request 2 continues from 5, saves 8 and 10;
    # request 3 shares 9 tokens of K/V and continues from the state at 8
    trace = [[1, 2, 3, 4, 5], list(range(1, 11)), list(range(1, 10)) + [99, 100]]
    t = StateCache(4, True).serve(trace)
    assert (t.hit_tokens, t.kv_hit_tokens, t.states, t.kv_tokens) == (13, 14, 5, 12)
    # without the request ends: request 2 continues from the grid state at 4
    t = StateCache(4, False).serve(trace)
    assert t.hit_tokens == 4 + 8 and t.states == 2
    # branching: request 3 matched 9 of K/V beyond its usable 8: no new grid point (8)
    assert StateCache(4, False, branch=True).serve(trace).hit_tokens == 12


def test_branching_point_wins_hits_for_later_requests():
    stem = list(range(1, 21))
    trace = [stem + [50, 51], stem + [60, 61], stem + [70, 71]]
    plain = StateCache(8, False).serve(trace)
    branched = StateCache(8, False, branch=True).serve(trace)
    # the first request saves only 16; the second matches 20 of K/V and continues from 16;
    # its branching point, 20 rounded down to the grid of 8, is 16 again: nothing new
    assert plain.hit_tokens == branched.hit_tokens == 32
    # with no grid, the branching point is the K/V match itself
    ends = StateCache(None, True).serve(trace)
    ends_branch = StateCache(None, True, branch=True).serve(trace)
    assert ends.hit_tokens == 0 and ends_branch.hit_tokens == 20
