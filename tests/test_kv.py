"""minirt.kv on tiny_model: prefix reuse is exact, reuse beyond it is not, bad input fails."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt import kv
from minirt.errors import InvalidIdsError, KVMismatchError, MinirtError, RequestError
from minirt.model import tiny_model

TOL = 1e-5
MODEL = tiny_model(0)
VOCAB = MODEL.config.vocab_size


def ids_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_shapes_and_bytes():
    ids = ids_of(9)
    logits, cache = kv.prefill(MODEL, ids)
    layers, heads, dim = kv.kv_geometry(MODEL)
    assert (layers, heads, dim) == (2, 2, 16)
    assert logits.shape == (9, VOCAB)
    assert len(cache) == 9 and cache.num_layers == layers
    assert all(k.shape == (heads, 9, dim) for k in cache.keys + cache.values)
    assert kv.bytes_per_token(MODEL) == 2 * layers * heads * dim * 4
    assert cache.nbytes == 9 * kv.bytes_per_token(MODEL)
    assert len(cache[2:5]) == 3 and len(cache.slice(4)) == 5


def test_accepts_list_1d_and_batch_of_one():
    ids = ids_of(6)
    a, _ = kv.prefill(MODEL, ids)
    b, _ = kv.prefill(MODEL, torch.tensor(ids))
    c, _ = kv.prefill(MODEL, torch.tensor([ids], dtype=torch.int32))
    assert torch.equal(a, b) and torch.equal(a, c)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 24), data=st.data())
def test_prefix_plus_extend_equals_full_prefill(n, data):
    ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    cut = data.draw(st.integers(1, n - 1))
    full_logits, full = kv.prefill(MODEL, ids)
    _, prefix = kv.prefill(MODEL, ids[:cut])
    tail_logits, extended = kv.extend(MODEL, prefix, ids[cut:])
    assert len(extended) == n
    assert kv.compare(extended, full).max <= TOL
    assert float((tail_logits - full_logits[cut:]).abs().max()) <= TOL
    # the prefix's K/V equal the full run's first positions: exact sharing
    assert kv.compare(prefix, full[:cut]).max <= TOL


def test_extend_leaves_the_prefix_untouched():
    _, prefix = kv.prefill(MODEL, ids_of(5))
    before = [t.clone() for t in prefix.keys + prefix.values]
    kv.extend(MODEL, prefix, ids_of(4, seed=1))
    assert len(prefix) == 5
    assert all(torch.equal(a, b) for a, b in zip(before, prefix.keys + prefix.values,
                                                   strict=True))


def test_extend_of_empty_kv_is_prefill():
    ids = ids_of(7)
    logits, full = kv.prefill(MODEL, ids)
    _, some = kv.prefill(MODEL, ids)
    logits2, again = kv.extend(MODEL, some[:0], ids)
    assert kv.compare(full, again).max == 0.0 and torch.equal(logits, logits2)


def test_decode_token_by_token_equals_prefill():
    ids = ids_of(16, seed=3)
    full_logits, full = kv.prefill(MODEL, ids)
    logits, grown = kv.prefill(MODEL, ids[:4])
    for i, token in enumerate(ids[4:], start=4):
        step_logits, grown = kv.decode_step(MODEL, grown, token)
        assert float((step_logits - full_logits[i]).abs().max()) <= TOL
    assert len(grown) == 16 and kv.compare(grown, full).max <= TOL
    # a tensor token works as well as an int
    t_logits, _ = kv.decode_step(MODEL, grown[:15], torch.tensor([ids[15]]))
    assert float((t_logits - full_logits[15]).abs().max()) <= TOL


def test_greedy_with_cached_prefix_equals_plain_greedy():
    ids = ids_of(12, seed=4)
    _, prefix = kv.prefill(MODEL, ids[:7])
    plain = kv.greedy(MODEL, ids, 10)
    assert len(plain) == 10 and all(0 <= t < VOCAB for t in plain)
    assert kv.greedy(MODEL, ids, 10, kv=prefix) == plain
    assert kv.greedy(MODEL, ids, 0) == []
    # greedy's first token is the argmax of the prefill's last logits
    logits, _ = kv.prefill(MODEL, ids)
    assert plain[0] == int(logits[-1].argmax())


def test_same_suffix_after_different_prefix_agrees_only_at_layer_0():
    suffix = ids_of(6, seed=5)
    a, b = [1, 2] + suffix, [3, 4] + suffix
    _, ka = kv.prefill(MODEL, a)
    _, kb = kv.prefill(MODEL, b)
    d = kv.compare(ka[2:], kb[2:])
    assert max(d.keys[0], d.values[0]) <= TOL
    assert d.first_layer_over(TOL) == 1
    assert min(d.keys[1], d.values[1]) > 1e-3


def test_splicing_another_runs_suffix_gives_wrong_logits():
    suffix = ids_of(8, seed=6)
    x, y = [7, 8, 9] + suffix, [10, 11, 12] + suffix
    _, kx = kv.prefill(MODEL, x)
    y_logits, ky = kv.prefill(MODEL, y)
    spliced = kv.splice(ky[:3], kx[3:-1])
    good = kv.splice(ky[:3], ky[3:-1])
    assert len(spliced) == len(y) - 1
    bad_logits, _ = kv.extend(MODEL, spliced, y[-1:])
    good_logits, _ = kv.extend(MODEL, good, y[-1:])
    assert float((good_logits[-1] - y_logits[-1]).abs().max()) <= TOL
    assert float((bad_logits[-1] - y_logits[-1]).abs().max()) > 1e-3
    assert kv.compare(spliced, good).first_layer_over(TOL) == 1


def test_shifted_positions_change_keys_not_values():
    ids = ids_of(8, seed=7)
    _, base = kv.prefill(MODEL, ids)
    _, shifted = kv.prefill(MODEL, ids, start=1)
    d = kv.compare(base, shifted)
    assert min(d.keys) > 1e-3  # RoPE rotates every layer's keys
    assert max(d.values) <= 1e-4  # RoPE is relative: attention, hence values, unchanged


def test_compare_and_first_layer_over():
    _, a = kv.prefill(MODEL, ids_of(5))
    assert kv.compare(a, a).max == 0.0 and kv.compare(a, a).first_layer_over(0.0) is None
    bumped = kv.KV(list(a.keys), [a.values[0], a.values[1] + 0.5])
    d = kv.compare(a, bumped)
    assert d.keys == [0.0, 0.0] and d.values[0] == 0.0
    assert d.values[1] == pytest.approx(0.5) and d.first_layer_over(0.1) == 1
    assert kv.compare(a[:0], a[:0]).max == 0.0


# ---- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("ids, words", [
    ([], "empty"),
    (torch.tensor([], dtype=torch.long), "empty"),
    (torch.zeros(2, 3, dtype=torch.long), "batch dimension 2"),
    (torch.zeros(1, 2, 3, dtype=torch.long), "1-D"),
    (torch.tensor([1.0, 2.0]), "integers"),
    (torch.tensor([True, False]), "integers"),
    ([1, -1], "-1"),
    ([1, VOCAB], str(VOCAB)),
    ([1, 2.5], "ints"),
    ([True, 1], "ints"),
    (5, "sequence"),
])
def test_bad_ids_raise_invalid_ids(ids, words):
    with pytest.raises(InvalidIdsError, match=words):
        kv.prefill(MODEL, ids)
    assert issubclass(InvalidIdsError, ValueError)


def test_bad_ids_in_extend_decode_and_greedy():
    _, prefix = kv.prefill(MODEL, ids_of(4))
    with pytest.raises(InvalidIdsError, match="empty"):
        kv.extend(MODEL, prefix, [])
    with pytest.raises(InvalidIdsError, match="one token"):
        kv.decode_step(MODEL, prefix, torch.tensor([1, 2]))
    with pytest.raises(InvalidIdsError, match="outside"):
        kv.decode_step(MODEL, prefix, VOCAB + 3)
    with pytest.raises(InvalidIdsError, match="at least one token"):
        kv.greedy(MODEL, ids_of(4), 3, kv=prefix)
    with pytest.raises(RequestError):
        kv.greedy(MODEL, ids_of(4), -1)
    with pytest.raises(InvalidIdsError, match="start"):
        kv.prefill(MODEL, ids_of(4), start=-1)


def test_kv_that_does_not_fit_the_model():
    _, three_layers = kv.prefill(tiny_model(0, num_layers=3), ids_of(4))
    with pytest.raises(KVMismatchError, match=r"\(3, 2, 16\).*\(2, 2, 16\)"):
        kv.extend(MODEL, three_layers, [1])
    _, ok = kv.prefill(MODEL, ids_of(4))
    one_head = kv.KV([k[:1] for k in ok.keys], [v[:1] for v in ok.values])
    with pytest.raises(KVMismatchError, match="kv_heads"):
        kv.decode_step(MODEL, one_head, 1)
    short_dim = kv.KV([k[..., :8] for k in ok.keys], [v[..., :8] for v in ok.values])
    with pytest.raises(KVMismatchError):
        kv.greedy(MODEL, ids_of(6), 2, kv=short_dim)
    half = kv.KV([k.half() for k in ok.keys], [v.half() for v in ok.values])
    with pytest.raises(KVMismatchError, match="float16"):
        kv.extend(MODEL, half, [1])
    with pytest.raises(KVMismatchError):
        kv.extend(MODEL, one_head[:0], [1])  # an empty KV must still fit


def test_inconsistent_kv_containers():
    _, ok = kv.prefill(MODEL, ids_of(4))
    with pytest.raises(KVMismatchError, match="same, non-zero number"):
        kv.KV(ok.keys, ok.values[:1])
    with pytest.raises(KVMismatchError, match="no batch dimension"):
        kv.KV([k.unsqueeze(0) for k in ok.keys], [v.unsqueeze(0) for v in ok.values])
    with pytest.raises(KVMismatchError, match="shape"):
        kv.KV([ok.keys[0], ok.keys[1][:, :3]], ok.values)
    with pytest.raises(KVMismatchError, match="float64"):
        kv.KV([ok.keys[0], ok.keys[1].double()], ok.values)
    with pytest.raises(KVMismatchError, match="equal shapes"):
        kv.compare(ok, ok[:3])
    with pytest.raises(KVMismatchError, match="part 1"):
        kv.splice(ok, kv.KV([k[:1] for k in ok.keys], [v[:1] for v in ok.values]))
    with pytest.raises(KVMismatchError):
        kv.splice()
    with pytest.raises(TypeError):
        ok[::2]
    assert issubclass(KVMismatchError, MinirtError) and issubclass(KVMismatchError, ValueError)
