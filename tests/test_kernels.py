"""minirt's CPU attention kernel (``minirt.kernels``): the values of attention in float64,
what it leaves to torch, and how it is built, cached and switched off."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt import kernels
from minirt.forward import attention_lse

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
    """bf16, a decode step's few rows, a mask that differs between heads and a causal
    attention that is not square are torch's; ``attention_lse`` still gives attention."""
    q, k, v, mask = case(3, 1, 3, 3, 40, 40, 64, False, True)
    per_head = mask.expand(1, 9, 40, 40).clone()
    refused = [(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, False),
               (q[:, :, :5], k, v, None, False),  # 3 heads x 5 positions: 15 rows
               (q, k, v, per_head, False),
               (q[:, :, :20], k, v, None, True)]
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
            assert ("was not built" in caplog.text) == (env == "CC")
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
        built = list((tmp_path / "kernels").glob("attention-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        kernels.library.cache_clear()
        assert kernels.library() is not None
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [stamp]
    finally:
        kernels.library.cache_clear()
