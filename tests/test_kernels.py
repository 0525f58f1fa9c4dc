"""minirt's CPU attention kernel (``minirt.kernels``): the values of attention in float64,
what it leaves to torch, and how it is built, cached and switched off."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt import kernels
from minirt.attention import PrefixGroups, attention_lse

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                    reason="no C compiler: minirt uses torch's kernel")


def reference(q, k, v, mask, scale, causal):
    """Attention and its log-sum-exp in float64, the K/V heads repeated per query head."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1),
                                    float("-inf"))
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def case(seed, b, kv_heads, group, m, n, d, causal, masked):
    """Random q, k, v laid out as the forward pass lays them (positions outermost, heads
    transposed in: strided views), and a mask that hides about a third of the keys
    (the first always seen, so no row is empty)."""
    gen = torch.Generator().manual_seed(seed)
    n = m if causal else n
    q = (torch.randn(b, m, kv_heads * group, d, generator=gen) * 2).transpose(1, 2)
    k, v = (torch.randn(b, n, kv_heads, d, generator=gen).transpose(1, 2) for _ in range(2))
    mask = None
    if masked:
        mask = torch.zeros(b, 1, m, n).masked_fill_(torch.rand(b, 1, m, n, generator=gen) < 0.3,
                                                    float("-inf"))
        mask[..., 0] = 0.0
    return q, k, v, mask


@needs_compiler
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 4, 8]), m=st.integers(1, 140), n=st.integers(1, 200),
       d=st.sampled_from([8, 16, 64, 128]), causal=st.booleans(), masked=st.booleans())
def test_the_kernel_is_attention(seed, b, kv_heads, group, m, n, d, causal, masked):
    """Every shape the kernel takes gives float64 attention's output and log-sum-exp to
    1e-4, whatever the tiles' boundaries, the group size and the strides; a shape it
    leaves to torch is a decode step's (16 query rows or fewer per K/V head)."""
    q, k, v, mask = case(seed, b, kv_heads, group, m, n, d, causal, masked)
    got = kernels.attention(q, k, v, mask, d ** -0.5, causal)
    if got is None:
        assert group * min(m, 32) <= 16, "the kernel refused a shape it takes"
        return
    want = reference(q, k, v, mask, d ** -0.5, causal)
    assert got[0].shape == q.shape and got[1].shape == q.shape[:3]
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1].double(), want[1], rtol=0, atol=1e-4)


@needs_compiler
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 3, 8]), m=st.integers(6, 80), n=st.integers(1, 90),
       prefix=st.integers(0, 150), each=st.booleans(), causal=st.booleans(),
       masked=st.booleans())
def test_the_kernel_reads_a_prefix_in_the_pool(seed, b, kv_heads, group, m, n, prefix, each,
                                              causal, masked):
    """With ``prefix``, each sequence's rows first see its cached keys where they lie in a
    pool (at scattered slots; one prefix for all, or ``each`` sequence its own of its own
    length; the mask and causality apply to the new keys only): float64 attention over
    those keys gathered and put in front, to 1e-4."""
    d = 16
    q, k, v, mask = case(seed, b, kv_heads, group, m, n, d, causal, masked)
    gen = torch.Generator().manual_seed(seed + 1)
    pool_k, pool_v = (torch.randn(300, kv_heads, d, generator=gen) for _ in range(2))
    if each:
        slots = torch.stack([torch.randperm(300, generator=gen)[:prefix] for _ in range(b)])
        lengths = torch.randint(0, prefix + 1, (b,), generator=gen)
        spec = (pool_k, pool_v, slots, lengths)
        rows = [s[:n] for s, n in zip(slots, lengths, strict=True)]
    else:
        slots = torch.randperm(300, generator=gen)[:prefix]
        spec, rows = (pool_k, pool_v, slots), [slots] * b
    got = kernels.attention(q, k, v, mask, d ** -0.5, causal, spec)
    if got is None:
        assert group * min(m, 32) <= 16, "the kernel refused a shape it takes"
        return
    own = k.shape[2]
    for i, cached in enumerate(rows):
        p = cached.numel()
        whole_k, whole_v = (torch.cat([x.index_select(0, cached).transpose(0, 1), y[i]], 1)[None]
                            for x, y in ((pool_k, k), (pool_v, v)))
        seen = torch.zeros(1, 1, m, p + own)
        if causal:
            seen[..., p:] = torch.full((m, own), float("-inf")).triu(1)
        if mask is not None:
            seen[..., p:] += mask[i:i + 1]
        want = reference(q[i:i + 1], whole_k, whole_v, seen, d ** -0.5, False)
        torch.testing.assert_close(got[0][i:i + 1].double(), want[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(got[1][i:i + 1].double(), want[1], rtol=0, atol=1e-4)


@needs_compiler
def test_a_prefix_outside_the_pool_is_left_to_torch():
    """A slot outside the pool, or a length past its row of slots, is refused (None:
    torch's path then names it), not read."""
    q, k, v, _ = case(2, 1, 3, 3, 40, 40, 16, True, False)
    pool = torch.randn(50, 3, 16)
    for bad in ([3, 50], [-1, 4]):
        assert kernels.attention(q, k, v, None, 0.25, True,
                                 (pool, pool, torch.tensor(bad))) is None
    assert kernels.attention(q, k, v, None, 0.25, True, (pool, pool, torch.tensor([3, 49])))
    rows = torch.tensor([[3, 49, 0]])  # a length past its row is refused too
    assert kernels.attention(q, k, v, None, 0.25, True,
                             (pool, pool, rows, torch.tensor([4]))) is None
    assert kernels.attention(q, k, v, None, 0.25, True, (pool, pool, rows, torch.tensor([3])))


@needs_compiler
def test_the_kernel_is_built_and_used_by_attention_lse(monkeypatch):
    """With a compiler, the kernel builds, and ``attention_lse`` runs a prefill's shape
    through it (nothing reaches torch's flash kernel), the same values as torch's."""
    assert kernels.library() is not None
    q, k, v, _ = case(1, 1, 3, 3, 96, 96, 64, True, False)
    ran = []
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                        lambda *a, **kw: ran.append(1))
    out, lse = attention_lse(q, k, v, None, 0.125, causal=True)
    assert not ran
    monkeypatch.undo()
    torch_out, torch_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True, scale=0.125)[:2]
    torch.testing.assert_close(out, torch_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, torch_lse, rtol=0, atol=1e-5)


@needs_compiler
def test_the_threads_do_not_change_a_bit():
    """Each task's rows are computed alone, in a fixed order: one thread or two, the same
    bits."""
    q, k, v, mask = case(2, 2, 3, 3, 200, 200, 64, False, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.attention(q, k, v, mask, 0.125, False)
        torch.set_num_threads(2)
        two = kernels.attention(q, k, v, mask, 0.125, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_what_the_kernel_leaves_to_torch():
    """bf16, a decode step's few rows, a mask that differs between heads, a causal
    attention that is not square and shapes that do not fit together are torch's;
    ``attention_lse`` still gives attention."""
    q, k, v, mask = case(3, 1, 3, 3, 40, 40, 64, False, True)
    per_head = mask.expand(1, 9, 40, 40).clone()
    refused = [(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, False),
               (q[:, :, :5], k, v, None, False),  # 3 heads x 5 positions: 15 rows
               (q, k, v, per_head, False),
               (q[:, :, :20], k, v, None, True),
               (q, k, v[:, :, :-1], None, False)]  # K and V of different lengths
    for args in refused:
        assert kernels.attention(*args[:4], 0.125, args[4]) is None
    got = attention_lse(q, k, v, per_head, 0.125)
    want = reference(q, k, v, per_head, 0.125, False)
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-4)


def test_switched_off_or_unbuildable_it_falls_back(monkeypatch, tmp_path, caplog):
    """``MINIRT_KERNELS=0``, or a compiler that fails (which is logged): no library,
    nothing left in the cache, and ``attention_lse`` on torch's kernel gives the same
    attention."""
    q, k, v, _ = case(4, 1, 3, 3, 64, 64, 64, True, False)
    want = reference(q, k, v, None, 0.125, True)
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path))
    caplog.set_level("INFO", logger="minirt.kernels")
    for env, value in [("MINIRT_KERNELS", "0"), ("CC", "false")]:
        with monkeypatch.context() as m:
            m.setenv(env, value)
            kernels.library.cache_clear()
            assert kernels.library() is None
            assert ("were not built" in caplog.text) == (env == "CC")
            assert kernels.attention(q, k, v, None, 0.125, True) is None
            got = attention_lse(q, k, v, None, 0.125, causal=True)
            torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-4)
    kernels.library.cache_clear()
    assert not list(tmp_path.rglob("*.so"))


@needs_compiler
def test_it_is_built_once_per_source_and_cpu(monkeypatch, tmp_path):
    """The first use compiles into the cache; later ones (a new process) load that file."""
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path))
    kernels.library.cache_clear()
    try:
        assert kernels.library() is not None
        built = list((tmp_path / "kernels").glob("kernels-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        kernels.library.cache_clear()
        assert kernels.library() is not None
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [stamp]
    finally:
        kernels.library.cache_clear()


def decode_case(seed, b, kv_heads, group, d, grouped, spare):
    """A decode step's inputs as ``WorkingKV`` lays them: q ``[b, heads, d]``, the rows'
    own K/V a view of a longer buffer (``spare`` positions past the widest), ragged own
    lengths (at least 1), and prefixes of different lengths side by side, held by the
    groups ``grouped`` says (a list of row lists; the other rows are in no group)."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 + int(torch.randint(0, 90, (1,), generator=gen))
    q = torch.randn(b, kv_heads * group, d, generator=gen) * 2
    k, v = (torch.randn(b + 1, kv_heads, n + spare, d, generator=gen)[:b, :, :n]
            for _ in range(2))
    own = torch.randint(1, n + 1, (b,), generator=gen)
    lengths = [int(x) for x in torch.randint(0, 150, (len(grouped),), generator=gen)]
    p = max(lengths, default=0)
    pk, pv = (torch.randn(len(grouped), kv_heads, p + spare, d, generator=gen)
              for _ in range(2))
    return q, k, v, own, pk, pv, lengths


def decode_reference(q, k, v, own, pk, pv, grouped, lengths, scale):
    """Each row's attention over its prefix then its own keys, in float64."""
    out = []
    for r in range(q.shape[0]):
        g = [i for i, rows in enumerate(grouped) if r in rows]
        keys, values = k[r, :, :own[r]], v[r, :, :own[r]]
        if g:
            keys = torch.cat([pk[g[0], :, :lengths[g[0]]], keys], 1)
            values = torch.cat([pv[g[0], :, :lengths[g[0]]], values], 1)
        group = q.shape[1] // k.shape[1]
        keys, values = (x.double().repeat_interleave(group, 0) for x in (keys, values))
        scores = torch.einsum("hd,hnd->hn", q[r].double(), keys) * scale
        out.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values))
    return torch.stack(out)


def decode(q, k, v, own, pk, pv, groups, scale):
    """``kernels.decode`` for the rows ``groups`` (``PrefixGroups``) puts behind prefixes."""
    if groups is None:
        return kernels.decode(q, k, v, own, scale)
    return kernels.decode(q, k, v, own, scale, pk, pv, groups.index, groups.sizes,
                          groups.lengths)


@st.composite
def partitions(draw, b):
    """Some of rows 0..b-1 (each at most once) in groups, in any order."""
    rows = draw(st.permutations(range(b)))
    cuts = sorted(draw(st.lists(st.integers(0, b), max_size=4)))
    parts = [rows[i:j] for i, j in zip([0, *cuts], [*cuts, b], strict=True)]
    return [list(p) for p in parts[:-1] if p]  # the last part: rows in no group


@needs_compiler
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 12), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 4, 7]), d=st.sampled_from([16, 48, 64, 128]),
       data=st.data())
def test_the_decode_kernel_is_attention(seed, b, kv_heads, group, d, data):
    """``kernels.decode`` gives float64 attention over each row's prefix and own keys to
    1e-4, whatever the groups, their prefixes' lengths (none included), the own lengths,
    the group size and the strides."""
    grouped = data.draw(partitions(b))
    q, k, v, own, pk, pv, lengths = decode_case(seed, b, kv_heads, group, d, grouped, 5)
    groups = PrefixGroups.of(grouped, lengths) if grouped else None
    got = decode(q, k, v, own, pk, pv, groups, d ** -0.5)
    assert got is not None and got.shape == q.shape
    want = decode_reference(q, k, v, own, pk, pv, grouped, lengths, d ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


@needs_compiler
def test_decode_threads_and_splits_do_not_change_a_bit():
    """A group's rows are split into more units as threads grow (so that every thread has
    work), but each row is computed alone, in a fixed order: the same bits."""
    q, k, v, own, pk, pv, lengths = decode_case(5, 8, 1, 3, 64, [list(range(8))], 0)
    groups = PrefixGroups.of([list(range(8))], lengths)
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            got.append(decode(q, k, v, own, pk, pv, groups, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[0], x) for x in got[1:])


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and f" {flag}" in line for line in f)
    except OSError:
        return False


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march levels")
@pytest.mark.parametrize("march, needs", [("x86-64", "sse2"), ("x86-64-v3", "avx2")])
def test_narrower_vectors_build_and_compute_the_same(monkeypatch, march, needs):
    """Built for the vectors of 4 floats (SSE) or 8 (AVX2) that other CPUs get instead of
    this one's (``vec.h``'s ``W``), the kernels compile and give float64 attention, and
    the layer kernels and ``gemv`` their torch operations."""
    if not _cpu_has(needs):
        pytest.skip(f"this CPU lacks {needs}")
    flags = tuple(f"-march={march}" if f.startswith("-march=") else f for f in kernels.FLAGS)
    lib = kernels.library(flags)
    assert lib is not None, f"the kernels do not build with -march={march}"
    monkeypatch.setattr(kernels, "library", lambda: lib)
    q, k, v, mask = case(7, 2, 2, 4, 37, 0, 64, True, True)
    got = kernels.attention(q, k, v, mask, 0.125, True)
    want = reference(q, k, v, mask, 0.125, True)
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-4)
    grouped = [[0, 2], [3]]
    q, k, v, own, pk, pv, lengths = decode_case(8, 5, 3, 3, 48, grouped, 3)
    got = decode(q, k, v, own, pk, pv, PrefixGroups.of(grouped, lengths), 0.125)
    want = decode_reference(q, k, v, own, pk, pv, grouped, lengths, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    check_layer_kernels(9, 5, 44, True)
    w, x = torch.randn(37, 48), torch.randn(1, 48)
    torch.testing.assert_close(kernels.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_what_the_decode_kernel_refuses():
    """Not fp32, a head_dim not a multiple of every vector width, a row in two groups or
    past the batch, a row with more own keys than there are or none at all, shapes that
    do not fit together (which the kernel would read past): None; the caller's torch path
    then answers or raises."""
    q, k, v, own, pk, pv, lengths = decode_case(6, 4, 3, 3, 64, [[0, 1], [2]], 0)
    lengths = [5, 7]
    good = PrefixGroups.of([[0, 1], [2]], lengths)
    assert decode(q, k, v, own, pk, pv, good, 0.125) is not None
    none = torch.zeros(4, dtype=torch.int64)
    refused = [(q.bfloat16(), k.bfloat16(), v.bfloat16(), own, pk.bfloat16(), pv.bfloat16(),
                good),
               (q[..., :10], k[..., :10], v[..., :10], own, pk[..., :10], pv[..., :10], good),
               (q, k, v, own, pk, pv, PrefixGroups.of([[0, 1], [1]], lengths)),
               (q, k, v, own, pk, pv, PrefixGroups.of([[0, 4], [2]], lengths)),
               (q, k, v, own + k.shape[2], pk, pv, good),
               (q, k, v, none, pk, pv, PrefixGroups.of([[0, 1], [2]], [0, 7])),
               (q, k, v, own[:3], pk, pv, good),  # shapes that do not fit together
               (q, k, v[:, :, :-1], own, pk, pv, good),
               (q, k, v, own, pk[:1], pv[:1], good)]
    for args in refused:
        assert decode(*args, 0.125) is None


@needs_compiler
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.sampled_from([1, 3, 17, 130]),
       dim=st.sampled_from([1, 7, 16, 40, 576, 1000]), residual=st.booleans())
def test_the_layer_kernels_are_torchs_operations(seed, rows, dim, residual):
    """``rms_norm`` (after the residual add, in place), ``rope`` and ``silu_mul`` equal
    their torch operations, RoPE bit for bit, the others to fp32 rounding, whatever the
    rows (130 rows of 1,000 run on two threads), the width (tails past whole vectors) and
    the row strides; and a row's bits do not depend on the rows beside it."""
    check_layer_kernels(seed, rows, dim, residual)


def check_layer_kernels(seed: int, rows: int, dim: int, residual: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim + 3, generator=gen)[:, :dim] * 3  # rows strided
    delta = torch.randn(rows, dim, generator=gen) if residual else None
    w = torch.randn(dim, generator=gen)
    want = torch.nn.functional.rms_norm(h + (0 if delta is None else delta), (dim,), w, 1e-5)
    before = h.clone()
    got = kernels.rms_norm(h, w, 1e-5, delta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(h, before + (0 if delta is None else delta))
    alone = kernels.rms_norm(h[-1:].clone(), w, 1e-5)
    assert torch.equal(alone, kernels.rms_norm(h.clone(), w, 1e-5)[-1:])

    gate, up = (torch.randn(rows, 2 * dim, generator=gen) * 6).chunk(2, -1)
    torch.testing.assert_close(kernels.silu_mul(gate, up),
                               torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)

    d = 2 * dim
    q, k = torch.randn(rows, 5, d, generator=gen), torch.randn(rows, 2, d, generator=gen)
    cos, sin = (torch.randn(rows, 1, d, generator=gen) for _ in range(2))
    want_q, want_k = (x * cos + x.roll(dim, -1) * sin for x in (q, k))
    assert kernels.rope(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@needs_compiler
def test_what_the_layer_kernels_leave_to_torch():
    """Not fp32, rows that do not collapse into one dimension, shapes that do not fit:
    None or False, and the tensors untouched."""
    h, w = torch.randn(4, 8), torch.randn(8)
    assert kernels.rms_norm(h.double(), w.double(), 1e-5) is None
    assert kernels.rms_norm(h, torch.randn(7), 1e-5) is None
    before = h.clone()
    assert kernels.rms_norm(h, w, 1e-5, torch.randn(3, 8)) is None
    assert kernels.rms_norm(h.t(), torch.randn(4), 1e-5) is None  # features not contiguous
    assert torch.equal(h, before)
    assert kernels.silu_mul(h, torch.randn(4, 7)) is None
    assert kernels.silu_mul(h.bfloat16(), h.bfloat16()) is None
    q, k, cos = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    q0 = q.clone()
    assert not kernels.rope(q, k, cos, torch.randn(2, 1, 8))  # tables for other positions
    assert not kernels.rope(q[:, :, :7], k[:, :, :7], cos[..., :7], cos[..., :7])  # odd d
    assert not kernels.rope(q.transpose(0, 1), k.transpose(0, 1), cos, cos)
    assert torch.equal(q, q0)


@needs_compiler
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 70), k=st.sampled_from([16, 48, 64, 576]),
       biased=st.booleans(), spare=st.integers(0, 3))
def test_gemv_is_a_linear_layer_on_one_row(seed, n, k, biased, spare):
    """``gemv`` gives ``F.linear`` of one row to fp32 rounding, whatever the outputs (a
    last block of fewer than a vector's), the bias and the weight's row stride: within
    the bound of a sum of k + 1 fp32 products in any order, (k + 1) u sum |x_i w_i| (u =
    2^-24), of the float64 value. (A fixed 1e-5 failed where a sum of 576 products
    cancelled to 0.4.)"""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k + spare, generator=gen)[:, :k]
    x, b = torch.randn(1, 1, k, generator=gen), torch.randn(n, generator=gen)
    got = kernels.gemv(x, w, b if biased else None)
    bias = b.double() if biased else None
    exact = torch.nn.functional.linear(x.double(), w.double(), bias)
    bound = (k + 1) * 2.0 ** -24 * (torch.nn.functional.linear(x.double().abs(),
                                                               w.double().abs())
                                    + (bias.abs() if biased else 0))
    assert got is not None and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all()


@needs_compiler
def test_what_gemv_leaves_to_torch():
    """Two rows or more, K not a multiple of every vector width, not fp32, a bias or a
    weight of the wrong size: None."""
    w, x = torch.randn(5, 64), torch.randn(1, 64)
    assert kernels.gemv(x, w) is not None
    assert kernels.gemv(torch.randn(2, 64), w) is None
    assert kernels.gemv(x[:, :10], w[:, :10]) is None
    assert kernels.gemv(x.bfloat16(), w.bfloat16()) is None
    assert kernels.gemv(x, w, torch.randn(4)) is None
    assert kernels.gemv(x, torch.randn(5, 32)) is None
