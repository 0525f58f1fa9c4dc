"""The forward pass over pooled K/V (``minirt.forward``): split attention, the layer-by-layer
Llama forward, and the deterministic mode."""

from __future__ import annotations

import pytest
import torch

from minirt.forward import attention_lse, is_llama, llama_forward, shared_prefix_attention
from minirt.model import fuse_projections, load_model, tiny_model


@pytest.mark.parametrize("kernel", ["cpu flash", "matrix products"])
@pytest.mark.parametrize("m", [1, 5])
def test_attention_split_at_a_shared_prefix_is_whole_attention(monkeypatch, kernel, m):
    """``shared_prefix_attention``: a prefix read once for the batch, each sequence's own keys
    (ragged, behind a mask, or causal), merged through their log-sum-exps, equals one
    softmax over the whole keys; ``attention_lse``'s log-sum-exp is the scores' own, on
    torch's CPU kernel and on the matrix-product path other devices take."""
    import minirt.forward as forward_module

    if kernel == "matrix products":
        monkeypatch.setattr(forward_module, "_FLASH_CPU", None)
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
    out, _ = attention_lse(square, k, v, None, 0.3, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(square, k, v, is_causal=True,
                                                            scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


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


def test_llama_forward_norm_and_rope_are_transformers_own_bit_for_bit():
    """``_rms_norm`` (one torch call) and ``_rope`` (a roll instead of ``rotate_half``) give
    transformers' ``LlamaRMSNorm`` and ``apply_rotary_pos_emb`` exactly, in fp32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from minirt.forward import _rms_norm, _rope, _rope_tables

    model = tiny_model(5)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 7, model.config.hidden_size, generator=gen)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
        assert torch.equal(_rms_norm(norm, h), norm(h))
        q = torch.randn(2, 7, 4, 16, generator=gen)  # [b, t, heads, head_dim]
        k = torch.randn(2, 7, 2, 16, generator=gen)
        cos, sin = model.model.rotary_emb(h, torch.arange(3, 10).expand(2, 7))
        want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        tables = _rope_tables(cos, sin)
        assert torch.equal(_rope(q, *tables).transpose(1, 2), want_q)
        assert torch.equal(_rope(k, *tables).transpose(1, 2), want_k)


def test_is_llama_only_for_llama_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    assert is_llama(tiny_model(0))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert not is_llama(gpt2)
