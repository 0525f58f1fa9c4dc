"""The forward pass over pooled K/V (``minirt.forward``): split attention, the layer-by-layer
Llama forward, and the deterministic mode."""

from __future__ import annotations

from functools import cache
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minirt.attention as attention
import minirt.forward as forward
import minirt.llama as llama
from minirt import kernels
from minirt.attention import (
    PrefixGroups,
    aligned_attention,
    attention_lse,
    cascade_decode,
    shared_prefix_attention,
)
from minirt.errors import ModelError, PoolError
from minirt.forward import forward_mixed, forward_paged
from minirt.llama import is_llama, llama_forward
from minirt.model import fuse_projections, load_model, tiny_model
from minirt.pool import KVPool, PageTable
from minirt.working_set import WorkingKV


@pytest.mark.parametrize("kernel", ["minirt's cpu kernel", "cpu flash",
                                    "cpu flash, heads repeated", "matrix products"])
@pytest.mark.parametrize("m", [1, 5])
def test_attention_split_at_a_shared_prefix_is_whole_attention(monkeypatch, kernel, m):
    """``shared_prefix_attention``: a prefix read once for the batch, each sequence's own keys
    (ragged, behind a mask, or causal), merged through their log-sum-exps, equals one
    softmax over the whole keys; ``attention_lse``'s log-sum-exp is the scores' own, on
    minirt's CPU kernel (where it takes the shape: the 9 causal rows of each query head),
    on torch's CPU kernel (reading grouped K/V heads in place, or repeated first, as on a
    torch whose kernel cannot) and on the matrix-product path other devices take."""
    if kernel != "minirt's cpu kernel":
        monkeypatch.setattr(kernels, "attention", lambda *a: None)
    elif kernels.library() is None:
        pytest.skip("minirt's kernel could not be built here (no C compiler?)")
    if kernel == "matrix products":
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    if kernel == "cpu flash, heads repeated":
        monkeypatch.setattr(attention, "_flash_reads_grouped_kv", lambda: False)
    gen = torch.Generator().manual_seed(4)
    b, heads, kv_heads, d, p, n = 3, 6, 2, 8, 7, 9
    q = torch.randn(b, heads, m, d, generator=gen)
    pk, pv = torch.randn(2, kv_heads, p, d, generator=gen)
    k, v = torch.randn(2, b, kv_heads, n, d, generator=gen)
    whole_k = torch.cat([pk.expand(b, -1, -1, -1), k], 2)
    whole_v = torch.cat([pv.expand(b, -1, -1, -1), v], 2)
    own_pos = torch.arange(n) - (n - m)  # query j sits at own key n - m + j
    causal = own_pos[None, :] <= torch.arange(m)[:, None]
    ragged = (torch.arange(n) >= torch.tensor([0, 2, 4])[:, None])[:, None, None]  # [b,1,1,n]
    square = torch.randn(b, heads, n, d, generator=gen)  # every own position a query
    for query, own_mask, is_causal in [(q, None, False), (q, ragged & causal, False),
                                       (square, None, True)]:
        rows = query.shape[2]
        sees = torch.ones(b, 1, rows, n, dtype=torch.bool).tril() if is_causal else \
            torch.ones(b, 1, rows, n, dtype=torch.bool) if own_mask is None else own_mask
        whole_mask = torch.cat([torch.ones(b, 1, rows, p, dtype=torch.bool),
                                sees.expand(b, 1, rows, n)], -1)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, whole_k, whole_v, attn_mask=whole_mask, scale=0.3, enable_gqa=True)
        got = shared_prefix_attention(query, pk, pv, k, v, own_mask, 0.3, causal=is_causal)
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
        half = shared_prefix_attention(*(t.bfloat16() for t in (query, pk, pv, k, v)),
                                       own_mask, 0.3, causal=is_causal)  # as on a GPU
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), got, rtol=0.05, atol=0.05)
    scores = (q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * 0.3
    _, lse = attention_lse(q, k, v, ragged, 0.3)
    want_lse = torch.logsumexp(scores.masked_fill(~ragged, float("-inf")), -1)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    out, lse = attention_lse(square, k, v, None, 0.3, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(square, k, v, is_causal=True,
                                                            scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    repeated = attention_lse(square, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                             None, 0.3, causal=True)  # the heads repeated by the caller
    if kernel == "minirt's cpu kernel":  # 9 rows a head: a decode's few, left to torch's
        torch.testing.assert_close(repeated, (out, lse), rtol=0, atol=1e-5)
    else:
        assert torch.equal(repeated[0], out) and torch.equal(repeated[1], lse)


@pytest.mark.parametrize("path", ["minirt's decode kernel", "torch's attention"])
def test_cascade_decode_reads_every_groups_prefix_in_one_call(monkeypatch, path):
    """``cascade_decode``: rows behind two prefixes of different lengths and rows in no
    group, behind ragged own keys, equal attention over each row's whole keys. On torch's
    path it is two attention calls, the own keys and both prefixes at once (the shorter
    one's finite garbage past its end masked); minirt's kernel makes none."""
    gen = torch.Generator().manual_seed(8)
    b, kv_heads, group, d, n = 5, 2, 3, 16, 6
    q = torch.randn(b, kv_heads * group, 1, d, generator=gen)
    own_k, own_v = torch.randn(2, b, kv_heads, n, d, generator=gen)
    own = torch.tensor([6, 3, 5, 2, 4])  # own keys each row sees
    lengths = [7, 4]
    pk, pv = torch.randn(2, 2, kv_heads, 7, d, generator=gen)  # prefix 1: 3 positions past it
    rows = [[0, 3], [2]]  # rows 1 and 4: no prefix
    groups = PrefixGroups.of(rows, lengths)
    calls = []
    monkeypatch.setattr(attention, "attention_lse",
                        lambda *a, f=attention.attention_lse, **k: calls.append(1) or f(*a, **k))
    if path == "torch's attention":
        monkeypatch.setattr(kernels, "decode", lambda *a: None)
    elif kernels.library() is None:
        pytest.skip("no C compiler: minirt uses torch's kernels")
    got = cascade_decode(q, own_k, own_v, own, pk, pv, groups, 0.4)
    assert len(calls) == (2 if path == "torch's attention" else 0)
    for r in range(b):
        g = [i for i, members in enumerate(rows) if r in members]
        keys, values = own_k[r, :, :own[r]], own_v[r, :, :own[r]]
        if g:
            keys = torch.cat([pk[g[0], :, :lengths[g[0]]], keys], 1)
            values = torch.cat([pv[g[0], :, :lengths[g[0]]], values], 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[r:r + 1], keys[None], values[None], scale=0.4, enable_gqa=True)
        torch.testing.assert_close(got[r], want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert PrefixGroups.of([], []) is None and PrefixGroups.of([[1], [0]], [3, 3]).mask is None


@pytest.mark.parametrize("which", ["tiny_model", "default model"])
@pytest.mark.parametrize("fused", [False, True])
def test_llama_forward_gives_the_models_logits(which, fused):
    """The layer-by-layer forward with attention handed to the caller: transformers'
    logits at the last position within fp32 rounding, fused or not, for a batch of rows."""
    model = tiny_model(6) if which == "tiny_model" else load_model(device="cpu")[0]
    if fused:
        fuse_projections(model)
    assert is_llama(model)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(2))
    seen = []

    def attend(layer, q, k, v, scale):  # plain causal attention over the new positions
        seen.append(layer)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).flatten(2)

    positions = torch.arange(20).expand(3, 20)
    with torch.inference_mode():
        got = llama_forward(model, ids, positions, attend)
        want = model(ids).logits[:, -1]
    assert seen == list(range(model.config.num_hidden_layers))
    assert got.shape == want.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["minirt's kernels", "torch's"])
def test_llama_forward_norm_rope_and_silu_are_transformers_own(monkeypatch, kernel):
    """RMSNorm after the residual add, RoPE on q and k, and SiLU(gate) * up, on minirt's
    kernels (``kernels.rms_norm``, ``rope``, ``silu_mul``) and on torch's operations:
    RoPE is transformers' ``apply_rotary_pos_emb`` bit for bit on both, whether q and k
    lie side by side (the fused GEMM's output: one call) or apart; the norm is
    ``LlamaRMSNorm`` bit for bit on torch's path and within fp32 rounding on the kernel,
    as is SiLU; the residual is added into ``h`` in place."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from minirt.llama import _rms_norm, _rope_qk, _rope_tables, _silu_mul

    if not kernel:
        monkeypatch.setattr(kernels, "library", lambda *a: None)
    elif kernels.library() is None:
        pytest.skip("no C compiler: torch's path only")
    model = tiny_model(5)
    gen = torch.Generator().manual_seed(3)
    h, delta = (torch.randn(2, 7, model.config.hidden_size, generator=gen) for _ in range(2))
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.normal_(generator=gen)
        before = h.clone()
        want = layer.input_layernorm(h + delta)
        got = _rms_norm(layer.input_layernorm, h, delta)
        assert torch.equal(got, want) or kernel
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(h, before + delta)  # the residual, added in place
        cos, sin = model.model.rotary_emb(h, torch.arange(3, 10).expand(2, 7))
        tables = _rope_tables(cos, sin)
        fused = torch.randn(2, 7, (4 + 2 + 2) * 16, generator=gen)  # q, k, v heads of 16
        apart = [torch.randn(2, 7, n, 16, generator=gen) for n in (4, 2)]
        for q, k in ([fused[..., :64].view(2, 7, 4, 16), fused[..., 64:96].view(2, 7, 2, 16)],
                     apart):
            want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            got_q, got_k = _rope_qk(q, k, *tables)
            assert torch.equal(got_q.transpose(1, 2), want_q)
            assert torch.equal(got_k.transpose(1, 2), want_k)
        gate, up = (torch.randn(2, 7, 2 * model.config.intermediate_size, generator=gen) * 4
                    ).chunk(2, -1)
        want = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(_silu_mul(layer.mlp, gate.clone(), up), want,
                                   rtol=1e-6, atol=1e-6)


def test_is_llama_only_for_llama_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    assert is_llama(tiny_model(0))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert not is_llama(gpt2)


# ---------------------------------------------------------------- the deterministic mode

@cache
def _tiny(dtype: torch.dtype):
    model = tiny_model(3).to(dtype)
    fuse_projections(model)  # as the engine runs it: fp32 GEMMs on prepacked weights
    return model


def _alone(model, prompt: torch.Tensor, deterministic: bool = True) -> torch.Tensor:
    """One request's uncached pass, by itself, in a fresh pool: its last logits."""
    pool = KVPool.for_model(model, 256)
    return forward_paged(model, pool, [PageTable(pool.alloc(prompt.numel()))], [prompt],
                         deterministic=deterministic)[0]


def _served(model, data, deterministic: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random prompts sharing random prefixes at random cached lengths, in any batch order,
    through one batched prefill, one batched decode step, then a mixed step (more prompts
    prefill while the first ones decode again, one ``llama_forward``): every sequence a
    step ran with the logits it gave at its last position."""
    ids = st.integers(0, 127)
    bases = [torch.tensor(data.draw(st.lists(ids, min_size=0, max_size=60)), dtype=torch.int64)
             for _ in range(2)]
    pool = KVPool.for_model(model, 1024)
    base_tables = []
    for base in bases:  # what the tree holds: each base prefix, computed once
        table = PageTable(pool.alloc(base.numel()))
        if base.numel():
            forward_paged(model, pool, [table], [base], deterministic=deterministic)
        base_tables.append(table)

    def arrive(count: int) -> tuple[list[torch.Tensor], list[PageTable], list[torch.Tensor]]:
        prompts, tables, new = [], [], []
        for _ in range(count):
            which = data.draw(st.integers(0, 1))
            cut = data.draw(st.integers(0, bases[which].numel()))
            suffix = torch.tensor(data.draw(st.lists(ids, min_size=1, max_size=20)))
            prompt = torch.cat([bases[which][:cut], suffix])
            cached = data.draw(st.integers(0, cut))  # how much of the shared part is reused
            slots = torch.cat([base_tables[which].slots[:cached],
                               pool.alloc(prompt.numel() - cached)])
            prompts.append(prompt)
            tables.append(PageTable(slots))
            new.append(prompt[cached:])
        order = data.draw(st.permutations(range(count)))  # any batch order
        return ([prompts[i] for i in order], [tables[i] for i in order],
                [new[i] for i in order])

    def step(seqs: list[torch.Tensor], tables: list[PageTable],
             logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each sequence's greedy next token appended; its table gets a slot for it."""
        ran.extend(zip(seqs, logits, strict=True))
        for t in tables:
            t.append(pool.alloc(1))
        return [torch.cat([x, lg.argmax().view(1)]) for x, lg in zip(seqs, logits, strict=True)]

    ran: list[tuple[torch.Tensor, torch.Tensor]] = []
    prompts, tables, new = arrive(data.draw(st.integers(1, 5)))
    seqs = step(prompts, tables,
                forward_paged(model, pool, tables, new, deterministic=deterministic))
    working = WorkingKV(pool)
    seqs = step(seqs, tables, forward_paged(model, pool, tables, [x[-1:] for x in seqs],
                                            working=working, deterministic=deterministic))
    more, more_tables, more_new = arrive(data.draw(st.integers(1, 3)))
    with mock.patch.object(llama, "llama_forward", wraps=llama.llama_forward) as passes:
        prefilled, decoded = forward_mixed(model, pool, more_tables, more_new, working, tables,
                                           [x[-1:] for x in seqs], deterministic=deterministic)
    assert passes.call_count == 1
    ran.extend(zip(more, prefilled, strict=True))
    ran.extend(zip(seqs, decoded, strict=True))
    return ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_deterministic_logits_are_one_requests_uncached_pass(dtype, data):
    """The mode's promise, bit for bit: whatever is cached (random prefixes shared at random
    lengths), whatever else is in the batch and in whatever order, prefill logits, the next
    decode step's and a mixed step's (prefill and decode in one pass) equal one request's
    uncached pass by itself, in fp32 and bf16.
    Chunks of 16 keys, so that 60-token prefixes cross chunk boundaries; queries in blocks
    of 5 or 16 (``QUERY_BLOCK``), or all at once."""
    model = _tiny(dtype)
    block = data.draw(st.sampled_from([5, 16, 1000]))
    with mock.patch.object(attention, "CHUNK", 16), \
            mock.patch.object(attention, "QUERY_BLOCK", block):
        for seq, logits in _served(model, data, deterministic=True):
            assert torch.equal(logits, _alone(model, seq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_default_mode_stays_within_its_tolerance(dtype, data):
    """Without the switch, the cache and the batch move logits by rounding only: within
    1e-4 in fp32, within 0.05 in bf16 (where they need not be equal bitwise)."""
    model = _tiny(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for seq, logits in _served(model, data, deterministic=False):
        torch.testing.assert_close(logits.float(), _alone(model, seq, False).float(),
                                   rtol=tol, atol=tol)


def test_aligned_attention_is_softmax_attention():
    """``aligned_attention`` computes ordinary causal softmax attention (within fp32
    rounding), whichever split between shared prefix and own keys it is handed."""
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, n = 2, 4, 2, 16, 50
    q = torch.randn(b, heads, 5, d, generator=gen)
    k, v = torch.randn(2, 1, kv_heads, n, d, generator=gen).expand(2, b, -1, -1, -1)
    positions = torch.tensor([[40, 41, 42, 43, 44], [45, 46, 47, 48, 49]])
    sees = torch.arange(n) <= positions[:, None, :, None]  # [b, 1, m, n]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=sees, scale=0.25, enable_gqa=True).transpose(1, 2)
    for cut in (0, 16, 32):
        got = aligned_attention(q, positions, k[0, :, :cut], v[0, :, :cut], k[:, :, cut:],
                                v[:, :, cut:], 0.25, chunk=16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if cut:
            assert torch.equal(got, aligned_attention(
                q, positions, k[0, :, :0], v[0, :, :0], k, v, 0.25, chunk=16))
    with pytest.raises(PoolError, match="whole number of 16-key chunks"):
        aligned_attention(q, positions, k[0, :, :10], v[0, :, :10], k[:, :, 10:],
                          v[:, :, 10:], 0.25, chunk=16)


def test_deterministic_mode_on_a_model_as_loaded_is_batch_invariant():
    """The promise holds for a model straight from ``load_model``, not only for one an
    ``Engine`` has fused: a request alone and batched behind a longer one, the same bits.
    Measured on a 2-core AVX2 CPU: fp32's plain GEMM kernel gave rows 8-10 of an 11-row
    product other bits than the same rows computed alone (its prepacked one does not)."""
    model, tokenizer = load_model(device="cpu", dtype=torch.float32)
    a = torch.tensor(tokenizer.encode("Hello there, how are you doing today my friend?"))
    b = torch.tensor(tokenizer.encode("A much longer prompt about the weather in Paris in "
                                      "spring, when the chestnut trees bloom."))
    pool = KVPool.for_model(model, 256)
    tables = [PageTable(pool.alloc(b.numel())), PageTable(pool.alloc(a.numel()))]
    batched = forward_paged(model, pool, tables, [b, a], deterministic=True)[1]
    assert torch.equal(batched, _alone(model, a))


def test_deterministic_mode_in_bf16_gives_any_row_of_a_batch_its_own_bits():
    """bf16 on the real model: twelve requests prefilled in one batch, then each one's last
    token as one 12-row step after its prompt was cached, give each request's bits alone.
    Measured on a 2-core Xeon at 2 threads: torch's plain bf16 GEMM gave row 4 of a 9-row
    product other bits than the same row padded to 4 rows (at 1 thread it kept them), and
    the mode, before it ran bf16 on prepacked weights too, gave 5 of these 12 prefills
    and 11 of the 12 steps other logits than alone. On a 2-core AVX2 CPU (AMD EPYC, Zen
    3) oneDNN packs no bf16, so the mode runs torch's plain bf16 GEMM there; it moved no
    row of products of 1 to 16 rows at 1 or 2 threads, and this test passes on it."""
    model, _ = load_model(device="cpu", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 40000, (5 + i,), generator=gen) for i in range(12)]
    alone = [_alone(model, p) for p in prompts]
    pool = KVPool.for_model(model, 512)
    tables = [PageTable(pool.alloc(p.numel())) for p in prompts]
    batched = forward_paged(model, pool, tables, prompts, deterministic=True)
    assert [i for i in range(12) if not torch.equal(batched[i], alone[i])] == []
    pool = KVPool.for_model(model, 512)
    tables = [PageTable(pool.alloc(p.numel())) for p in prompts]
    for table, p in zip(tables, prompts, strict=True):
        forward_paged(model, pool, [PageTable(table.slots[:-1])], [p[:-1]], deterministic=True)
    step = forward_paged(model, pool, tables, [p[-1:] for p in prompts], deterministic=True)
    assert [i for i in range(12) if not torch.equal(step[i], alone[i])] == []


def test_deterministic_mode_needs_a_llama():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    pool = KVPool.for_model(gpt2, 16)
    table = PageTable(pool.alloc(3))
    with pytest.raises(ModelError, match="not one"):
        forward_paged(gpt2, pool, [table], [torch.tensor([1, 2, 3])], deterministic=True)
    assert pool.num_free == 13  # nothing else changed


def test_a_mixed_step_refuses_what_it_cannot_run():
    """``forward_mixed``: a Llama only; one new token per decoding request; no request both
    prefilling and decoding. Each refusal writes nothing to the pool."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    gpt2_pool = KVPool.for_model(gpt2, 16)
    a, b = PageTable(gpt2_pool.alloc(3)), PageTable(gpt2_pool.alloc(1))
    with pytest.raises(ModelError, match="not one"):
        forward_mixed(gpt2, gpt2_pool, [a], [torch.tensor([1, 2, 3])], WorkingKV(gpt2_pool),
                      [b], [torch.tensor([4])])
    model = _tiny(torch.float32)
    pool = KVPool.for_model(model, 16)
    a, b = PageTable(pool.alloc(3)), PageTable(pool.alloc(2))
    k = pool.k.clone()
    for tables, ids, decode, tokens, words in [
            ([a], [[1, 2, 3]], [b], [[4, 5]], "one new token"),
            ([a], [[1, 2, 3]], [a], [[4]], "cannot prefill and decode"),
            ([a], [[1, 2, 3, 4]], [b], [[4]], "page table of 3")]:
        with pytest.raises(PoolError, match=words):
            forward_mixed(model, pool, tables, [torch.tensor(x) for x in ids], WorkingKV(pool),
                          decode, [torch.tensor(x) for x in tokens])
        assert torch.equal(pool.k, k)


def test_one_row_projections_take_the_matrix_vector_kernel(monkeypatch):
    """``_project`` on one row (a decode step of one request) runs ``kernels.gemv`` on the
    layer's own weight, fused q/k/v and gate/up included, and gives the GEMM's values to
    fp32 rounding; two rows, or no kernel, run the GEMM."""
    from minirt.llama import _project
    from minirt.model import _GATE_UP, _QKV, _projections, fuse_projections

    if kernels.library() is None:
        pytest.skip("no C compiler: torch's GEMMs only")
    model = tiny_model(4)
    fuse_projections(model)
    layer = model.model.layers[0]
    calls = []
    gemv = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda *a: calls.append(1) or gemv(*a))
    x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for module, names in ((layer.self_attn, _QKV), (layer.mlp, _GATE_UP)):
            got, want = _project(module, names, x), _projections(module, names, x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        for linear in (layer.self_attn.o_proj, model.lm_head):
            torch.testing.assert_close(_project(linear, None, x), linear(x), rtol=1e-5,
                                       atol=1e-5)
        assert len(calls) == 4
        _project(model.lm_head, None, x.expand(1, 2, -1))
        assert len(calls) == 4


@pytest.mark.parametrize("kernel", [True, False], ids=["minirt's kernel", "torch's"])
def test_a_cached_prefill_reads_its_prefix_in_the_pool(monkeypatch, kernel):
    """A prefill of three requests with 30 new tokens each (one part), two behind one cached
    prefix of 40 and one behind another of 25: with the kernel, one pass reads each
    request's cached keys in place (no gathered copy, no mask, no split attention to
    merge); without it, the keys gathered and the split merged. Both give one uncached
    pass's logits to fp32 rounding."""
    if kernel and kernels.library() is None:
        pytest.skip("no C compiler: torch's attention only")
    if not kernel:
        monkeypatch.setattr(kernels, "library", lambda flags=kernels.FLAGS: None)
    model = _tiny(torch.float32)
    gen = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 128, (n,), generator=gen) for n in (40, 25)]
    pool = KVPool.for_model(model, 512)
    cached = [PageTable(pool.alloc(p.numel())) for p in prefixes]
    for table, p in zip(cached, prefixes, strict=True):
        forward_paged(model, pool, [table], [p])
    behind = [0, 0, 1]
    tails = [torch.randint(0, 128, (30,), generator=gen) for _ in behind]
    tables = [PageTable(torch.cat([cached[b].slots, pool.alloc(30)])) for b in behind]
    split = mock.patch.object(forward, "shared_prefix_attention",
                              wraps=forward.shared_prefix_attention)
    calls = []
    attention = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *a: calls.append(a) or attention(*a))
    with split as merged:
        got = forward_paged(model, pool, tables, tails, share_runs=False)
    assert merged.call_count == (0 if kernel else model.config.num_hidden_layers)  # one part
    if kernel:  # no mask: each request's own cached keys, then its new ones causally
        assert calls and all(a[3] is None and a[5] is True and a[6][3].tolist() == [40, 40, 25]
                             for a in calls)
    for b, tail, logits in zip(behind, tails, got, strict=True):
        torch.testing.assert_close(logits, _alone(model, torch.cat([prefixes[b], tail]), False),
                                   rtol=1e-4, atol=1e-4)
