"""A Llama's layer arithmetic, without transformers' cache object, mask or per-layer dispatch.

``llama_forward`` runs a ``LlamaForCausalLM`` (``is_llama``) layer by layer with the
model's own weights and maths: RMSNorm adding the residual (``_rms_norm``), the fused
projections (``_project``), RoPE (``_rope_qk``), SiLU (``_silu_mul``), each one call of
minirt's kernel on a CPU in fp32 (``minirt.kernels``) where it could be built. Attention is
left to the caller's ``attend(layer, q, k, v, scale)``: it knows where its batch's K/V lie
(``minirt.attention`` for the arithmetic, ``minirt.forward`` and ``minirt.working_set`` for
the rows). ``_Rows`` and ``_run`` put several such parts of a step, a prefill's and a
decode's, side by side in one pass, every weight read once for all of them.

Its part of the deterministic switch (chapter 10): every matrix product on at least
``MIN_ROWS`` rows (``_rows``), on prepacked weights where oneDNN packs the dtype, else the
plain kernel (``model.prepack_bf16``), so a row's bits do not depend on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from . import kernels
from .model import _GATE_UP, _QKV, _projections

__all__ = ["MIN_ROWS", "is_llama", "llama_forward"]


def is_llama(model) -> bool:
    """True if ``model`` is transformers' Llama, layer for layer (what ``llama_forward`` runs)."""
    from transformers.models.llama import modeling_llama as m

    return type(model) is m.LlamaForCausalLM and all(
        type(layer) is m.LlamaDecoderLayer and type(layer.self_attn) is m.LlamaAttention
        and type(layer.mlp) is m.LlamaMLP for layer in model.model.layers)


def llama_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  attend, last: torch.Tensor | None = None,
                  deterministic: bool = False) -> torch.Tensor:
    """A Llama's next-token logits at the last column of ``input_ids`` ``[b, t]``:
    ``[b, vocab]`` (``last``: at these flat indices into ``b * t`` instead).

    The layers run in transformers' order with the model's own weights and maths (RMSNorm,
    RoPE, the fused projections where ``fuse_projections`` made them, SiLU), but attention
    is ``attend(layer, q, k, v, scale)``: it gets the new positions' ``q`` ``[b, heads, t,
    head_dim]`` and ``k``, ``v`` ``[b, kv_heads, t, head_dim]`` after RoPE, stores the K/V
    where it keeps them, and returns the attention output ``[b, t, heads * head_dim]``.
    No cache object, no mask built for the caller: the caller knows its batch's shape.
    Each layer is a handful of calls (``_rms_norm`` adding the residual, ``_rope_qk``,
    ``_silu_mul``), and the output head runs on the positions asked for only.

    ``deterministic``: every matrix product gets at least ``MIN_ROWS`` rows (``_rows``), so
    a row's result does not depend on how many rows the step has (the caller's ``attend``
    must be row-invariant too: ``aligned_attention``).
    """
    def run(module, names, x):
        if deterministic:
            return _rows(partial(_project, module, names), x)
        return _project(module, names, x)

    inner = model.model
    h = inner.embed_tokens(input_ids)
    cos, sin = _rope_tables(*inner.rotary_emb(h, position_ids))
    delta = None  # each block's output, added to h by the norm that follows it
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = (t.view(*h.shape[:-1], -1, attn.head_dim)
                   for t in run(attn, _QKV, _rms_norm(layer.input_layernorm, h, delta)))
        q, k = _rope_qk(q, k, cos, sin)
        delta = run(attn.o_proj, None, attend(i, q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), attn.scaling))
        gate, up = run(mlp, _GATE_UP, _rms_norm(layer.post_attention_layernorm, h, delta))
        delta = run(mlp.down_proj, None, _silu_mul(mlp, gate, up))
    if last is None:
        h, delta = h[:, -1], delta[:, -1]
    else:
        h, delta = (x.view(-1, x.shape[-1]).index_select(0, last) for x in (h, delta))
    return run(model.lm_head, None, _rms_norm(inner.norm, h, delta))


@dataclass
class _Rows:
    """Rows of one ``llama_forward`` and how they attend: a prefill plan's or a decode
    step's, alone or side by side with another's in one mixed pass (``_run``).

    ``input_ids`` and ``positions`` ``[rows]``; ``last``: the rows whose logits are wanted,
    in the order they are returned; ``attend(layer, q, k, v, scale)`` on these rows alone
    (``q`` ``[1, heads, rows, head_dim]``, ``k``, ``v`` ``[1, kv_heads, rows, head_dim]``)
    returns ``[1, rows, heads * head_dim]``; ``after``: what is left once the forward ran."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    after: Callable[[], None] | None = None


def _run(model, parts: Sequence[_Rows], deterministic: bool = False) -> list[torch.Tensor]:
    """One ``llama_forward`` over every part's rows, one after the other: every weight is
    read once for all of them, and each part's attention sees its own rows only. Returns
    each part's logits ``[len(part.last), vocab]``."""
    cuts = [0]
    for part in parts:
        cuts.append(cuts[-1] + part.input_ids.numel())

    def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
        out = [part.attend(layer, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], scale)
               for part, lo, hi in zip(parts, cuts, cuts[1:], strict=False)]
        return torch.cat(out, 1) if len(out) > 1 else out[0]

    logits = llama_forward(model, torch.cat([p.input_ids for p in parts]).view(1, -1),
                           torch.cat([p.positions for p in parts]).view(1, -1), attend,
                           torch.cat([p.last + lo for p, lo in zip(parts, cuts, strict=False)]),
                           deterministic=deterministic)
    for part in parts:
        if part.after is not None:
            part.after()
    return list(logits.split([p.last.numel() for p in parts]))


MIN_ROWS = 4
"""The fewest rows a matrix product gets in deterministic mode. Measured with torch 2.13's
CPU build at 2 threads (``benchmarks/deterministic.py --probe``, every row of each count):
on oneDNN's prepacked weights, which the mode runs in fp32 and, where oneDNN packs it, bf16
(``model.prepack_bf16``), every row of a product of 4 rows or more has the bits of
the same row alone padded to 4 rows; one row takes a matrix-vector path (and, in the
default mode, ``kernels.gemv``). torch's plain kernels also move rows by their place in
the batch and with the thread count, which padding alone does not fix."""


def _rows(fn, x: torch.Tensor):
    """``fn(x)`` (a row-wise map of ``x`` ``[..., features]``: a Linear, or fused projections
    returning a list) with ``x`` padded by zero rows to at least ``MIN_ROWS`` rows."""
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_ROWS:
        return fn(x)
    padded = torch.cat([x.reshape(rows, -1), x.new_zeros(MIN_ROWS - rows, x.shape[-1])])
    out = fn(padded)
    def cut(y: torch.Tensor) -> torch.Tensor:
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1])

    return cut(out) if isinstance(out, torch.Tensor) else [cut(y) for y in out]


def _project(module, names: tuple[str, ...] | None, x: torch.Tensor):
    """``module(x)`` for an ``nn.Linear`` (``names`` None), else ``module``'s projections
    ``names`` (``_projections``: one GEMM where fused). A single row in fp32 on a CPU goes
    to minirt's matrix-vector kernel on the layer's own weight (``kernels.gemv``, to within
    rounding), which streams the weights faster than oneDNN's product."""
    if x.numel() == x.shape[-1]:
        if names is None:
            y = kernels.gemv(x, module.weight, module.bias)
            if y is not None:
                return y
        elif getattr(module, "_minirt_fused", False):
            y = kernels.gemv(x, module.fused_weight, module.fused_bias)
            if y is not None:
                return y.split(module.fused_sizes, -1)
    return module(x) if names is None else _projections(module, names, x)


def _rms_norm(norm, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` of ``x``, after the residual add ``x += delta`` where
    ``delta`` is given. In fp32 on a CPU, one call of minirt's kernel (``kernels.rms_norm``,
    to within rounding: its sum of squares adds in its own order); otherwise torch's."""
    if x.dtype == torch.float32:
        out = kernels.rms_norm(x, norm.weight, norm.variance_epsilon, delta)
        if out is not None:
            return out
    if delta is not None:
        x += delta
    if x.dtype != torch.float32:
        return norm(x)
    return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``[b, t, 1, head_dim]`` for ``_rope``: ``sin``'s first half negated,
    so that transformers' ``rotate_half(x) * sin`` becomes ``x.roll(half) * sin`` (exact)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat([-sin[..., :half], sin[..., half:]], -1).unsqueeze(2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` on ``x`` ``[b, t, heads, head_dim]`` in four operations."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rope`` on ``q`` and ``k``: in place by one call of minirt's kernel where it can
    (``kernels.rope``, the same bits), by torch's operations otherwise."""
    if kernels.rope(q, k, cos, sin):
        return q, k
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _silu_mul(mlp, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of ``gate`` times ``up``: for SiLU in fp32 on a CPU one call of
    minirt's kernel (``kernels.silu_mul``, to within rounding), otherwise torch's."""
    if getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu":
        out = kernels.silu_mul(gate, up)
        if out is not None:
            return out
    return mlp.act_fn(gate).mul_(up)
