"""The forward pass over pooled K/V: batched prefill, the decode working set, attention
split at a shared prefix and merged by log-sum-exp, and the deterministic switch.

The pool (``minirt.pool``) keeps slots and pages; ``minirt.model`` loads weights. This
module runs a model on a batch of requests whose K/V live in the pool:

* ``forward_paged``: one forward over several requests' new tokens. Any Hugging Face
  causal LM runs unmodified through ``pool.PoolCache`` (RadixAttention changes no
  math); a Llama runs ``llama_forward`` layer by layer, its prefill laid out as a
  ``PrefillPlan`` (the prefix every request shares read once, a run of new tokens several
  begin with computed once) and its decode step over ``WorkingKV``'s contiguous rows.
* ``shared_prefix_attention`` / ``attention_lse``: attention split at the shared prefix,
  the two halves merged exactly through their log-sum-exps.
* ``deterministic=True``: the same requests give the same bits whatever is cached, whatever
  else is in the batch and however a step is split (``aligned_attention``, ``MIN_ROWS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial

import torch

from . import kernels
from .errors import ModelError, PoolError
from .model import _GATE_UP, _QKV, _projections, prepack_bf16
from .pool import KVPool, PagedBatch, PageTable, PoolCache, as_index_tensor

__all__ = ["CHUNK", "MIN_ROWS", "QUERY_BLOCK", "HeldPrefix", "LayerKV", "PrefillPart",
           "PrefillPlan", "WorkingKV", "aligned_attention", "attention_lse", "forward_paged",
           "forward_windowed", "is_llama", "llama_forward", "shared_prefix_attention"]

# ---------------------------------------------------------------------------
# A Llama forward without transformers' cache object, mask or per-layer dispatch.


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
on oneDNN's prepacked weights, which the mode runs in fp32 and bf16
(``model.prepack_bf16``), every row of a product of 4 rows or more has the bits of
the same row alone padded to 4 rows; one row takes a matrix-vector path (and, in the
default mode, ``kernels.gemv``). torch's plain kernels also move rows by their place in
the batch and with the thread count, which padding alone does not fix."""

CHUNK = 256
"""Keys per attention chunk in deterministic mode, chunk ``c`` holding absolute positions
``c * CHUNK .. (c + 1) * CHUNK - 1`` of every request. In its deterministic mode SGLang's
Triton backend also splits decode attention at a fixed tile, 256 keys unless
``SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE`` says otherwise (sglang 0.5.23
`srt/layers/attention/triton_backend.py: TritonAttnBackend.__init__`). Measured here: in
fp32 the per-chunk products need chunks of at least 16 keys to be row-invariant."""


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


def shared_prefix_attention(query: torch.Tensor, prefix_k: torch.Tensor,
                            prefix_v: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            mask: torch.Tensor | None, scale: float,
                            causal: bool = False) -> torch.Tensor:
    """Attention of ``query`` ``[b, heads, m, head_dim]`` when every sequence's keys are one
    shared prefix, then its own: ``[b, m, heads, head_dim]``.

    ``prefix_k``, ``prefix_v`` ``[kv_heads, P, head_dim]`` are the first ``P`` positions of
    every sequence, which every query sees; ``key``, ``value`` ``[b, kv_heads, n, head_dim]``
    the positions after them, seen as ``mask`` (broadcast to ``[b, 1, m, n]``: bool, True
    where a key counts, or additive) and ``causal`` (``attention_lse``) say. The prefix is
    read once for the whole batch, all ``b * heads / kv_heads * m`` query rows of a K/V
    head in one attention, instead of once per sequence. Each half's softmax is normalised
    on its own; with their log-sum-exps ``a`` (own) and ``p`` (prefix) the whole softmax is
    ``own + (prefix - own) * sigmoid(p - a)`` (FlashInfer's cascade attention, the Hydragen
    paper's decomposition). One position per sequence (decode): the query heads sharing a
    K/V head are the rows of one attention against it, as in ``grouped_decode``.
    """
    b, heads, m, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(b, kv_heads, group, d) if m == 1 else query
    out, lse = attention_lse(q, key, value, mask, scale, causal)
    if prefix_k.shape[1]:
        rows = query.reshape(b, kv_heads, group * m, d).transpose(0, 1)
        p_out, p_lse = attention_lse(rows.reshape(1, kv_heads, b * group * m, d),
                                     prefix_k[None], prefix_v[None], None, scale)
        p_out = p_out.reshape(kv_heads, b, group * m, d).transpose(0, 1).reshape(out.shape)
        p_lse = p_lse.reshape(kv_heads, b, group * m).transpose(0, 1).reshape(lse.shape)
        exact = torch.promote_types(query.dtype, torch.float32)  # bf16 merges in fp32
        out = torch.lerp(out.to(exact), p_out.to(exact),
                         torch.sigmoid(p_lse - lse).unsqueeze(-1).to(exact))
    return out.to(query.dtype).reshape(b, heads, m, d).transpose(1, 2)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[b, heads, m, d]`` over ``k``, ``v`` ``[b, kv_heads, n,
    d]`` (``heads`` a multiple of ``kv_heads``), with each row's log-sum-exp of its scaled
    scores ``[b, heads, m]``: what two attentions over two parts of the keys need to be
    merged exactly. ``mask`` broadcasts to ``[b, heads, m, n]`` (bool: True where a key
    counts; or additive); ``causal``: query ``i`` sees keys ``0..i`` (``m == n``).

    On CPU in fp32 this is minirt's own kernel (``minirt/kernels.py``), where it could be
    built; else on CPU torch's flash-attention kernel, which returns the log-sum-exp it
    keeps anyway; elsewhere the same values from matrix products in fp32. Both kernels
    read grouped K/V heads in place (torch's where this torch's does:
    ``_flash_reads_grouped_kv``); otherwise, and off the CPU, they are repeated first, a
    copy of every key per query head (for 16 prompts of 576 positions, 40% of a prefill's
    time). The decode step never needs either, its query rows being grouped by K/V head.
    """
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~mask, float("-inf"))
    own = kernels.attention(q, k, v, mask, scale, causal)
    if own is not None:
        return own
    group = q.shape[1] // k.shape[1]
    flash = _FLASH_CPU is not None and q.device.type == "cpu"
    if group > 1 and not (flash and _flash_reads_grouped_kv()):
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if flash:
        return _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1),
                                    float("-inf"))
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v)
    return out, lse


@cache
def _flash_reads_grouped_kv() -> bool:
    """Does this torch's CPU flash kernel take fewer K/V heads than query heads, giving the
    bits of the repeated heads? Tried once, on a tiny case; where it raises or differs,
    ``attention_lse`` repeats the heads itself."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 4, 8, generator=g) for heads in (4, 2, 2))
    try:
        got = _FLASH_CPU(q, k, v, 0.0, True, scale=0.5)
    except RuntimeError:
        return False
    want = _FLASH_CPU(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.0, True,
                      scale=0.5)
    return all(torch.equal(a, b) for a, b in zip(got[:2], want[:2], strict=True))


QUERY_BLOCK = 256
"""Queries ``aligned_attention`` takes at a time: a block skips the key chunks wholly past
its last position (exact zeros: the same bits). A 1,024-token fp32 prefill on 2 loaded
cores: blocks of 64 cost three times blocks of 256 (many small operations), 512 as 256."""


def aligned_attention(query: torch.Tensor, positions: torch.Tensor, prefix_k: torch.Tensor,
                      prefix_v: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float, chunk: int | None = None) -> torch.Tensor:
    """Deterministic attention of ``query`` ``[b, heads, m, head_dim]`` at absolute
    ``positions`` ``[b, m]``: ``[b, m, heads, head_dim]``, the same bits for a query
    whatever else is in the batch, how much of its sequence was cached and where the keys
    were split between the shared ``prefix_k``, ``prefix_v`` ``[kv_heads, P, head_dim]``
    (positions ``0..P-1``, ``P`` a multiple of ``chunk``) and each sequence's own ``key``,
    ``value`` ``[b, kv_heads, n, head_dim]`` (positions ``P..P+n-1``; a query sees the keys
    at or before its position).

    The keys are cut into chunks of ``chunk`` (default ``CHUNK``) aligned to absolute
    positions, so a key always falls in the same chunk at the same offset. In fp32: the
    scores of a chunk are one matrix product whose reduction runs over ``head_dim`` and whose
    rows (padded to ``MIN_ROWS``) are computed alike; the row's maximum over every visible
    key (a maximum is exact in any order); ``exp(score - max)`` summed and multiplied into
    the values within each chunk (fixed length: fixed order); then the chunks' sums added
    one after the other, left to right. Chunks wholly past a query add exact zeros, so the
    result does not depend on how many there are, and a long prefill runs ``QUERY_BLOCK``
    queries at a time over the chunks those can see (the causal half, not the square).
    """
    chunk = chunk or CHUNK
    b, heads, m, d = query.shape
    kv_heads, p, n = key.shape[1], prefix_k.shape[1], key.shape[2]
    if p % chunk:
        raise PoolError(f"aligned_attention: a shared prefix of {p} keys is not a whole "
                        f"number of {chunk}-key chunks")
    if m > QUERY_BLOCK:  # a block of queries at a time, over the chunks it can see only
        parts = []
        for j in range(0, m, QUERY_BLOCK):
            pos = positions[:, j:j + QUERY_BLOCK]
            seen = min(n, -(-(int(pos.max()) + 1 - p) // chunk) * chunk)
            parts.append(aligned_attention(query[:, :, j:j + QUERY_BLOCK], pos, prefix_k,
                                           prefix_v, key[:, :, :seen], value[:, :, :seen],
                                           scale, chunk))
        return torch.cat(parts, 1)
    group, f32 = heads // kv_heads, torch.float32
    rows = group * m
    q = query.reshape(b, kv_heads, rows, d).to(f32)  # head h -> K/V head h // group
    pos = positions.to(query.device)[:, None, :].expand(b, group, m).reshape(b, 1, rows)
    if rows < MIN_ROWS:  # extra query rows (zeros, seeing every key), dropped at the end
        q = torch.cat([q, q.new_zeros(b, kv_heads, MIN_ROWS - rows, d)], 2)
        pos = torch.cat([pos, pos.new_full((b, 1, MIN_ROWS - rows), p + n)], 2)
    r = q.shape[2]
    width = -(-n // chunk) * chunk  # own keys padded to whole chunks, masked
    ko, vo = key.to(f32), value.to(f32)
    if width > n:
        ko = torch.nn.functional.pad(ko, (0, 0, 0, width - n))
        vo = torch.nn.functional.pad(vo, (0, 0, 0, width - n))
    ko = ko.view(b, kv_heads, width // chunk, chunk, d)
    vo = vo.view(b, kv_heads, width // chunk, chunk, d)
    own = torch.matmul(q[:, :, None], ko.transpose(-1, -2)).mul_(scale)  # [b, kvh, c, r, chunk]
    key_pos = p + torch.arange(width, device=query.device).view(width // chunk, 1, chunk)
    own.masked_fill_(key_pos > pos[:, :, None, :, None], float("-inf"))
    top = own.amax((2, 4))  # [b, kvh, r]
    if p:
        pk = prefix_k.to(f32).view(kv_heads, p // chunk, chunk, d)
        pv = prefix_v.to(f32).view(kv_heads, p // chunk, chunk, d)
        rows_q = q.transpose(0, 1).reshape(kv_heads, 1, b * r, d)
        pre = torch.matmul(rows_q, pk.transpose(-1, -2)).mul_(scale)  # [kvh, c, b*r, chunk]
        top = torch.maximum(top, pre.amax((1, 3)).view(kv_heads, b, r).transpose(0, 1))
        pre = pre.sub_(top.transpose(0, 1).reshape(kv_heads, 1, b * r, 1)).exp_()
        pre_sum, pre_out = pre.sum(-1), torch.matmul(pre, pv)  # [kvh, c, b*r(, d)]
        pre_sum = pre_sum.view(kv_heads, -1, b, r).permute(2, 0, 1, 3)
        pre_out = pre_out.view(kv_heads, -1, b, r, d).permute(2, 0, 1, 3, 4)
    own = own.sub_(top[:, :, None, :, None]).exp_()
    own_sum, own_out = own.sum(-1), torch.matmul(own, vo)  # [b, kvh, c, r(, d)]
    if p:
        own_sum, own_out = torch.cat([pre_sum, own_sum], 2), torch.cat([pre_out, own_out], 2)
    total, out = own_sum[:, :, 0], own_out[:, :, 0]
    for c in range(1, own_sum.shape[2]):  # the chunks in order, left to right
        total, out = total + own_sum[:, :, c], out + own_out[:, :, c]
    out = (out / total[..., None])[:, :, :rows]
    return out.reshape(b, heads, m, d).transpose(1, 2).to(query.dtype)



@torch.inference_mode()
def forward_paged(model, pool: KVPool, tables: Sequence[PageTable], new_ids: Sequence,
                  last_only: bool = True, working: WorkingKV | None = None,
                  share_runs: bool = True, deterministic: bool = False) -> list[torch.Tensor]:
    """Run ``model`` on the new tokens of several requests through the pool; return logits.

    ``tables[r]`` already maps every position of request ``r``, including its
    ``len(new_ids[r])`` new tokens (the last entries), whose K/V this pass writes.
    Returns, per request, the logits of its last token (``[vocab]``) or, with
    ``last_only=False``, of every new token (``[n_new, vocab]``). ``working``: for a
    decode step (one new token each) of a Llama, attention reads these requests' K/V from
    this ``WorkingKV`` instead of gathering it from the pool (other models gather).
    ``share_runs``: a Llama's prefill computes a run of new tokens that several requests
    begin with once (``PrefillPlan``); False computes every request's tokens itself.

    ``deterministic``: the switch. A request's logits come out bit for bit the same whatever
    is cached, whatever else is in the batch and however its tokens are split between
    prefill and decode steps: a Llama only (ModelError otherwise), every matrix product on at
    least ``MIN_ROWS`` rows, attention as ``aligned_attention`` in prefill, cached prefill
    and decode alike. ``share_runs`` is ignored then (each request computes its own tokens).
    The model's projections are fused first (``fuse_projections``, idempotent, as ``Engine``
    does) and, on CPU, run on oneDNN's prepacked weights in bf16 as in fp32
    (``model.prepack_bf16``): those GEMMs give a row the same bits wherever it sits in
    the batch, where the plain kernel at 2 threads did not (fp32 on a 2-core AVX2 CPU: rows
    8-10 of 11; bf16 on a 2-core Xeon: row 4 of 9, a batch of 12 prefills or one-token
    steps differing from each request alone).
    """
    ids = _new_ids(tables, new_ids)
    if deterministic:
        _require_llama(model)
        prepack_bf16(model)  # prepacked GEMMs: a row's bits, wherever it sits
    decode = working is not None and last_only and all(x.numel() == 1 for x in ids)
    if is_llama(model) and (last_only or deterministic):
        part = (working.decode_rows(tables, torch.cat(ids), deterministic) if decode
                else _prefill_rows(pool, tables, ids, share_runs, deterministic, last_only))
        logits = _run(model, [part], deterministic)[0]
        if last_only:
            return list(logits)
        return list(logits.split([x.numel() for x in ids]))
    batch = PagedBatch.build(tables, [x.numel() for x in ids])
    device = pool.device
    input_ids = torch.zeros(len(ids), batch.q_len, dtype=torch.int64)
    input_ids.view(-1)[batch.new_rows] = torch.cat(ids)
    padded = not bool(batch.key_mask.all())
    kwargs = {
        "input_ids": input_ids.to(device),
        "position_ids": batch.position_ids.to(device),
        "attention_mask": batch.key_mask.to(device=device, dtype=torch.int64) if padded else None,
        "use_cache": True,
        "cache": PoolCache(pool, batch.to(device)),
    }
    if last_only:
        kwargs["logits_to_keep"] = 1
    logits = model(**kwargs).logits
    if last_only:
        return [logits[r, -1] for r in range(len(ids))]
    return [logits[r, batch.q_len - x.numel():] for r, x in enumerate(ids)]


@torch.inference_mode()
def forward_mixed(model, pool: KVPool, tables: Sequence[PageTable], new_ids: Sequence,
                  working: WorkingKV, decode_tables: Sequence[PageTable],
                  decode_ids: Sequence, share_runs: bool = True,
                  deterministic: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A prefill and a decode step in one forward pass of a Llama (ModelError otherwise):
    the new prompt tokens of ``tables`` as ``forward_paged`` prefills them, then the next
    token of each of ``decode_tables`` as its decode step over ``working`` reads them, their
    rows side by side. Every weight matrix is read once for both, where two passes read it
    twice. Returns each prefilled request's last-position logits and each decoding
    request's, ``[vocab]`` each, in order. The decoding requests must not be among the
    prefilled ones: their next token is known only once this pass has run."""
    _require_llama(model)
    ids, tokens = _new_ids(tables, new_ids), _new_ids(decode_tables, decode_ids)
    if any(x.numel() != 1 for x in tokens):
        raise PoolError("forward_mixed decodes one new token per decoding request")
    if {id(t) for t in tables} & {id(t) for t in decode_tables}:
        raise PoolError("forward_mixed: a request cannot prefill and decode in one pass")
    if deterministic:
        prepack_bf16(model)
    parts = [_prefill_rows(pool, tables, ids, share_runs, deterministic),
             working.decode_rows(decode_tables, torch.cat(tokens), deterministic)]
    prefill, decode = _run(model, parts, deterministic)
    return list(prefill), list(decode)


def _new_ids(tables: Sequence[PageTable], new_ids: Sequence) -> list[torch.Tensor]:
    """``new_ids`` as index tensors, PoolError unless there is one per table and each
    table already maps its new tokens' positions."""
    if len(tables) != len(new_ids) or not tables:
        raise PoolError(f"a forward pass needs one page table per request, got {len(tables)} "
                        f"tables and {len(new_ids)} id lists")
    ids = [as_index_tensor(x, "token ids") for x in new_ids]
    for r, (t, x) in enumerate(zip(tables, ids, strict=True)):
        if x.numel() == 0 or len(t) < x.numel():
            raise PoolError(f"request {r}: {x.numel()} new tokens but a page table of {len(t)} "
                            "positions (allocate slots for the new tokens first)")
    return ids


def _require_llama(model) -> None:
    if not is_llama(model):
        raise ModelError("deterministic mode and mixed steps run transformers' Llama layer "
                         f"by layer; {type(model).__name__} is not one")


@dataclass
class PrefillPart:
    """Requests of a ``PrefillPlan`` with the same number of own tokens, on consecutive rows
    from ``start`` (``len(requests) * length`` of them): one attention call for them all.

    ``own_slots`` ``[len(requests), keys]``: each request's keys past the shared prefix,
    gathered from the pool and seen through ``mask`` ``[len(requests), 1, length, keys]``
    (additive; the shorter ones left-padded); None: those keys are the part's own new K/V
    themselves, seen causally."""

    requests: list[int]
    start: int
    length: int
    own_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class PrefillPlan:
    """How a Llama prefills a batch through the pool (``forward_paged``, last positions only):
    which keys are read once for all, which new tokens are computed once, what each row is.

    ``shared``: leading slots that every table holds in common and that are cached for all;
    attention reads them once per layer for the whole batch. ``common``: new tokens that
    the requests in ``group`` (those starting right after the shared prefix) all begin
    with, a prompt prefix in flight and shorter than a page, so not in the tree: computed
    once, on rows of their own, their K/V written into each of those requests' slots.
    ``own``: the tokens each request computes itself. The forward's rows are the common
    run, then every request's own tokens, back to back with no padding, requests of the
    same ``own`` length next to each other: each ``PrefillPart`` is one attention call.
    """

    shared: int
    common: int
    group: list[int]
    own: list[int]
    parts: list[PrefillPart]
    input_ids: torch.Tensor   # [rows] token of every row
    positions: torch.Tensor   # [rows] its position in its request
    new_slots: torch.Tensor   # slots receiving new K/V: the run's once per group request,
    source: torch.Tensor      # and the row each one's K/V comes from
    prefix: torch.Tensor      # [shared] the slots read once
    last: torch.Tensor        # [b] the row of each request's last token (its logits)

    @property
    def rows(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def build(cls, tables: Sequence[PageTable], ids: Sequence[torch.Tensor],
              dtype: torch.dtype = torch.float32, share_runs: bool = True) -> PrefillPlan:
        """The plan for ``ids[r]``, the last ``len(ids[r])`` positions of ``tables[r]``
        (``share_runs=False``: no common run, every request computes its own tokens)."""
        b, num_new = len(tables), [x.numel() for x in ids]
        starts = [len(t) - n for t, n in zip(tables, num_new, strict=True)]  # cached lengths
        shared = _common_prefix([t.slots for t in tables], min(starts))
        group = [r for r in range(b) if starts[r] == shared]
        common = _common_prefix([ids[r] for r in group], min(num_new[r] for r in group) - 1) \
            if share_runs and len(group) > 1 else 0
        if not common:
            group = []
        own = [n - common * (r in group) for r, n in enumerate(num_new)]
        lengths = list(dict.fromkeys(own))  # the parts, in order of first appearance
        members = [[r for r in range(b) if own[r] == m] for m in lengths]
        order = [r for rs in members for r in rs]  # requests in row order
        run = [ids[group[0]][:common]] if common else []
        input_ids = torch.cat(run + [ids[r][num_new[r] - own[r]:] for r in order])
        positions = torch.cat([torch.arange(shared, shared + common)]
                              + [torch.arange(len(tables[r]) - own[r], len(tables[r]))
                                 for r in order])
        new_slots = torch.cat([tables[r].slots[shared:shared + common] for r in group]
                              + [tables[r].slots[len(tables[r]) - own[r]:] for r in order])
        source = torch.cat([torch.arange(common).repeat(len(group)),
                            torch.arange(common, common + sum(own))])
        parts, last, start = [], torch.zeros(b, dtype=torch.int64), common
        for m, rs in zip(lengths, members, strict=True):
            for i, r in enumerate(rs):
                last[r] = start + (i + 1) * m - 1
            own_slots = mask = None
            if any(starts[r] != shared or r in group for r in rs):
                # Keys past the prefix come from the pool, left-padded; who sees which.
                longest = max(len(tables[r]) for r in rs)
                width = longest - shared
                own_slots = torch.zeros(len(rs), width, dtype=torch.int64)
                key_pos = torch.full((len(rs), width), -1, dtype=torch.int64)
                for i, r in enumerate(rs):
                    t = tables[r]
                    own_slots[i, width - len(t) + shared:] = t.slots[shared:]
                    key_pos[i, width - len(t) + shared:] = torch.arange(shared, len(t))
                query_pos = torch.stack([torch.arange(len(tables[r]) - m, len(tables[r]))
                                         for r in rs])
                sees = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])
                mask = torch.zeros(len(rs), 1, m, width, dtype=dtype).masked_fill_(
                    ~sees[:, None], float("-inf"))
            parts.append(PrefillPart(rs, start, m, own_slots, mask))
            start += len(rs) * m
        return cls(shared, common, group, own, parts, input_ids, positions, new_slots, source,
                   tables[0].slots[:shared], last)


def _prefill_rows(pool: KVPool, tables: Sequence[PageTable], ids: Sequence[torch.Tensor],
                  share_runs: bool = True, deterministic: bool = False,
                  last_only: bool = True) -> _Rows:
    """A Llama's prefill through the pool, as ``_Rows``: in deterministic mode
    ``_aligned_rows``, else the rows of a ``PrefillPlan`` (last positions only).

    Each layer writes the new K/V to the pool first (the common run's into every one of its
    requests' slots), then the run attends to the prefix and causally to itself, and each
    part's requests attend to the prefix and to their own keys: the new K/V themselves
    when nothing else lies past the prefix, else gathered from the pool behind the mask.
    On a CPU in fp32 one call of minirt's kernel a part does both, reading each request's
    cached keys where they lie in the pool (``kernels.attention``'s ``prefix``): no
    gather, no mask, no merge. Elsewhere the prefix is gathered and the attention split
    at it (``shared_prefix_attention``).
    """
    if deterministic:
        return _aligned_rows(pool, tables, ids, last_only)
    device = pool.device
    plan = PrefillPlan.build(tables, ids, pool.dtype, share_runs)
    common = plan.common
    new_slots, source, prefix = (plan.new_slots.to(device), plan.source.to(device),
                                 plan.prefix.to(device))
    parts = [(len(p.requests), p.start, p.length,
              None if p.own_slots is None else p.own_slots.view(-1).to(device),
              None if p.mask is None else p.mask.to(device),
              _cached_slots([tables[r] for r in p.requests], p.length)) for p in plan.parts]
    kv_heads, head_dim = pool.kv_heads, pool.head_dim

    def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
        # q [1, heads, rows, head_dim], k and v [1, kv_heads, rows, head_dim]
        rows_k, rows_v = k[0].transpose(0, 1), v[0].transpose(0, 1)
        pool.write(layer, new_slots, rows_k.index_select(0, source),
                   rows_v.index_select(0, source))
        gathered: list[torch.Tensor] = []

        def split(qp, ko, vo, mask, causal: bool) -> torch.Tensor:
            # torch's path: the prefix gathered (once a layer), attention split at it
            if not gathered:
                gathered.extend(x[layer].index_select(0, prefix).transpose(0, 1)
                                for x in (pool.k, pool.v))
            return shared_prefix_attention(qp, *gathered, ko, vo, mask, scale, causal)

        def in_place(qp, kn, vn, cached) -> torch.Tensor | None:
            # minirt's kernel: each request's cached keys read in the pool, then its new
            # keys causally, one pass (None where the kernel does not run)
            one = kernels.attention(qp, kn, vn, None, scale, True,
                                    (pool.k[layer], pool.v[layer], *cached))
            return None if one is None else one[0].transpose(1, 2)

        heads, out = q.shape[1], []
        if common:
            qr, kr, vr = q[:, :, :common], k[:, :, :common], v[:, :, :common]
            o = in_place(qr, kr, vr, (plan.prefix,))
            out.append(split(qr, kr, vr, None, causal=True) if o is None else o)
        for n, lo, m, own, mask, cached in parts:
            hi = lo + n * m
            qo = q[0, :, lo:hi].reshape(heads, n, m, head_dim).transpose(0, 1)
            kn = k[0, :, lo:hi].reshape(kv_heads, n, m, head_dim).transpose(0, 1)
            vn = v[0, :, lo:hi].reshape(kv_heads, n, m, head_dim).transpose(0, 1)
            o = in_place(qo, kn, vn, cached)
            if o is None and own is None:
                o = split(qo, kn, vn, None, causal=True)
            elif o is None:  # the keys past the prefix gathered from the pool, masked
                ko = pool.k[layer].index_select(0, own).view(n, -1, kv_heads, head_dim)
                vo = pool.v[layer].index_select(0, own).view(n, -1, kv_heads, head_dim)
                o = split(qo, ko.transpose(1, 2), vo.transpose(1, 2), mask, causal=False)
            out.append(o)
        out = [o.reshape(1, -1, heads * head_dim) for o in out]
        return torch.cat(out, 1) if len(out) > 1 else out[0]

    return _Rows(plan.input_ids.to(device), plan.positions.to(device), plan.last.to(device),
                 attend)


def _cached_slots(tables: Sequence[PageTable], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slots of each request's keys before its last ``m`` positions, as rows
    ``[len(tables), longest]`` (zero-padded, CPU) and their lengths: what
    ``kernels.attention`` reads in place ahead of the ``m`` new keys."""
    lengths = torch.tensor([len(t) - m for t in tables], dtype=torch.int64)
    slots = torch.zeros(len(tables), int(lengths.max()), dtype=torch.int64)
    for i, t in enumerate(tables):
        slots[i, :lengths[i]] = t.slots[:lengths[i]].cpu()
    return slots, lengths


def _aligned_rows(pool: KVPool, tables: Sequence[PageTable], ids: Sequence[torch.Tensor],
                  last_only: bool) -> _Rows:
    """A prefill in deterministic mode: every request's new tokens, one after the other, as
    rows of ``llama_forward``, attention by ``aligned_attention`` (logits at each request's
    last token, or with ``last_only=False`` at all of them).

    The keys every request holds in common, cut at a whole chunk, are read once; the rest
    of each request's keys (its cached part past that, then its new tokens, whose K/V each
    layer writes first) are gathered from the pool, each starting at the cut.
    """
    device, b = pool.device, len(tables)
    num_new = [x.numel() for x in ids]
    starts = [len(t) - n for t, n in zip(tables, num_new, strict=True)]
    cut = _common_prefix([t.slots for t in tables], min(starts)) // CHUNK * CHUNK
    m, width = max(num_new), max(len(t) for t in tables) - cut
    where = torch.zeros(b, m, dtype=torch.int64)  # flat row of each request's j-th new token
    positions = torch.zeros(b, m, dtype=torch.int64)  # padding: its request's last
    own_slots = torch.zeros(b, width, dtype=torch.int64)
    offsets = torch.tensor([0, *num_new]).cumsum(0)
    for r, (t, n) in enumerate(zip(tables, num_new, strict=True)):
        where[r, :n] = torch.arange(offsets[r], offsets[r] + n)
        positions[r, :n] = torch.arange(starts[r], len(t))
        positions[r, n:] = len(t) - 1
        own_slots[r, :len(t) - cut] = t.slots[cut:]
    real = (torch.arange(m) < torch.tensor(num_new)[:, None]).view(-1).nonzero()[:, 0]
    flat_pos = torch.cat([torch.arange(s, len(t)) for s, t in zip(starts, tables, strict=True)])
    new_slots = torch.cat([t.slots[s:] for s, t in zip(starts, tables, strict=True)]).to(device)
    prefix = tables[0].slots[:cut].to(device)
    own = own_slots.view(-1).to(device)
    where, positions, real = where.to(device), positions.to(device), real.to(device)
    kv_heads, head_dim = pool.kv_heads, pool.head_dim

    def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
        # q [1, heads, rows, head_dim], k and v [1, kv_heads, rows, head_dim]
        pool.write(layer, new_slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        pk = pool.k[layer].index_select(0, prefix).transpose(0, 1)
        pv = pool.v[layer].index_select(0, prefix).transpose(0, 1)
        ko = pool.k[layer].index_select(0, own).view(b, width, kv_heads, head_dim)
        vo = pool.v[layer].index_select(0, own).view(b, width, kv_heads, head_dim)
        qb = q[0].index_select(1, where.view(-1)).view(q.shape[1], b, m, head_dim)
        out = aligned_attention(qb.transpose(0, 1), positions, pk, pv, ko.transpose(1, 2),
                                vo.transpose(1, 2), scale)  # [b, m, heads, head_dim]
        return out.reshape(b * m, -1).index_select(0, real)[None]

    rows = offsets[1:] - 1 if last_only else torch.arange(int(offsets[-1]))
    return _Rows(torch.cat(list(ids)).to(device), flat_pos.to(device), rows.to(device), attend)


# ---------------------------------------------------------------------------
# Sliding-window layers (chapter 11): each layer kind reads its own pool and table.


@dataclass(frozen=True)
class LayerKV:
    """Where one layer of ``forward_windowed``'s model keeps its K/V: ``pool``, at layer
    ``index`` of it, read through table ``table`` of each request; ``window``: the layer's
    sliding window W (it reads the W positions ending at the query), None for full
    attention."""

    pool: KVPool
    index: int
    table: int
    window: int | None = None


@torch.inference_mode()
def forward_windowed(model, layers: Sequence[LayerKV], tables: Sequence[Sequence[torch.Tensor]],
                     new_ids: Sequence) -> list[torch.Tensor]:
    """Run a Llama-shaped ``model`` (a Qwen2 with sliding layers included) on the new tokens
    of several requests whose layers keep K/V in different pools; return each request's
    last logits ``[vocab]``.

    ``tables[r][j]`` maps every position of request ``r`` (its ``len(new_ids[r])`` new
    tokens last) to a slot of the pools read through table ``j``; ``-1`` marks a position
    whose K/V that table does not hold. A full layer reads every position; a window layer
    only the ``W - 1`` before a query's first new token and the new ones (the windowed
    gather), so its table may hold nothing further back: PoolError if one it reads is
    missing. Each layer writes the new tokens' K/V first, then attends over what it reads,
    one padded batch per layer, a mask saying which keys each query sees.
    """
    if len(tables) != len(new_ids) or not tables:
        raise PoolError(f"forward_windowed needs one set of tables per request, got "
                        f"{len(tables)} and {len(new_ids)} id lists")
    if len(layers) != len(model.model.layers):
        raise PoolError(f"{len(layers)} LayerKV for a model of {len(model.model.layers)} layers")
    ids = [as_index_tensor(x, "token ids") for x in new_ids]
    device = layers[0].pool.device
    b, num_new = len(ids), [x.numel() for x in ids]
    lengths = [len(t[0]) for t in tables]
    if any(n == 0 or n > n_pos for n, n_pos in zip(num_new, lengths, strict=True)):
        raise PoolError("every request needs new tokens, each with a slot in its tables")
    m = max(num_new)
    input_ids = torch.zeros(b, m, dtype=torch.int64)
    positions = torch.zeros(b, m, dtype=torch.int64)
    real = torch.arange(m) >= m - torch.tensor(num_new)[:, None]  # right-aligned new tokens
    for r, (x, n_pos) in enumerate(zip(ids, lengths, strict=True)):
        input_ids[r, m - x.numel():] = x
        positions[r] = (torch.arange(m) - m + n_pos).clamp(min=n_pos - x.numel())  # pad: first

    reads = {}  # (table, window) -> new slots, key slots [b, width], mask [b, 1, m, width]
    for spec in {(layer.table, layer.window) for layer in layers}:
        j, window = spec
        new_slots, key_slots, key_pos = [], [], []
        for r, (t, n) in enumerate(zip(tables, num_new, strict=True)):
            slots = torch.as_tensor(t[j], dtype=torch.int64)
            lo = 0 if window is None else max(0, len(slots) - n - (window - 1))
            if bool((slots[lo:] < 0).any()):
                raise PoolError(f"request {r}: table {j} lacks K/V at positions "
                                f"{(slots[lo:] < 0).nonzero()[:, 0].add(lo)[:8].tolist()} "
                                "that its layers read")
            new_slots.append(slots[len(slots) - n:])
            key_slots.append(slots[lo:])
            key_pos.append(torch.arange(lo, len(slots)))
        width = max(k.numel() for k in key_slots)
        ks = torch.zeros(b, width, dtype=torch.int64)
        kp = torch.full((b, width), -1, dtype=torch.int64)
        for r, (k, p) in enumerate(zip(key_slots, key_pos, strict=True)):
            ks[r, width - k.numel():], kp[r, width - p.numel():] = k, p
        sees = (kp[:, None, :] >= 0) & (kp[:, None, :] <= positions[:, :, None])
        if window is not None:
            sees &= positions[:, :, None] - kp[:, None, :] < window
        reads[spec] = (torch.cat(new_slots).to(device), ks.to(device), sees[:, None].to(device))
    flat_real = real.view(-1).nonzero()[:, 0].to(device)

    def attend(i: int, q, k, v, scale: float) -> torch.Tensor:
        # q [b, heads, m, head_dim], k and v [b, kv_heads, m, head_dim]
        layer = layers[i]
        new_slots, key_slots, mask = reads[layer.table, layer.window]
        pool, kv_heads = layer.pool, k.shape[1]
        rows_k = k.transpose(1, 2).reshape(b * m, kv_heads, -1).index_select(0, flat_real)
        rows_v = v.transpose(1, 2).reshape(b * m, kv_heads, -1).index_select(0, flat_real)
        pool.write(layer.index, new_slots, rows_k, rows_v)
        keys, values = pool.gather(layer.index, key_slots)  # [b, width, kv_heads, head_dim]
        rep = q.shape[1] // kv_heads
        keys = keys.transpose(1, 2).repeat_interleave(rep, 1)
        values = values.transpose(1, 2).repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values,
                                                               attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(b, m, -1)

    logits = llama_forward(model, input_ids.to(device), positions.to(device), attend)
    return list(logits)


# ---------------------------------------------------------------------------
# Decode without gathering: the running batch's K/V kept contiguous between steps.


@dataclass(eq=False)
class HeldPrefix:
    """Leading positions that several running requests' tables share (a prefix cached in
    the tree), held once for them: the ``slots`` and their K/V ``k``, ``v`` ``[layers,
    kv_heads, len, head_dim]``, views of its place in ``WorkingKV``'s prefix buffers,
    filled from the pool when the group forms."""

    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return int(self.slots.numel())


class WorkingKV:
    """Running requests' K/V between decode steps: each prefix that several of them share
    held once, then one contiguous row each for the rest, grown by one position per step.

    ``PoolLayer`` gathers every position of every request from the pool in every layer of
    every step. Here a request's K/V is filled from the pool once, when it joins the decode
    batch: the leading positions it shares with other running requests (their slots are
    the same, a prefix cached in the tree) into their group's ``HeldPrefix``, the rest into
    its row of ``k``/``v`` ``[layers, rows, kv_heads, positions, head_dim]``. Each step
    writes the new token's K/V to its pool slot (the pool stays the source of truth) *and*
    appends it to the row; attention reads each prefix once for its group and each row
    where it lies (``cascade_decode``). The prefixes lie side by side in ``pk``/``pv``
    ``[layers, groups, kv_heads, positions, head_dim]``, so that one attention call per
    layer reads all of them.

    A request joining takes the running request it shares most with (at least
    ``min_prefix`` positions): it joins that one's group if it shares exactly the group's
    prefix; if it shares more, the two form a group of their own, held at what they share
    (so requests behind several different prefixes get one group each, and ones behind a
    system prompt and a longer history the longer one); else it has no group and all its
    positions are in its row. A group never shrinks: a request sharing less starts another.
    Rows are keyed by the ``PageTable`` object; a row whose slots no longer match its table
    is refilled from the pool.
    """

    def __init__(self, pool: KVPool, grow: int = 256, min_prefix: int = 1) -> None:
        self.pool, self.grow, self.min_prefix = pool, grow, min_prefix
        self.k = torch.zeros(pool.num_layers, 0, pool.kv_heads, 0, pool.head_dim,
                             dtype=pool.dtype, device=pool.device)
        self.v = torch.zeros_like(self.k)
        self.pk, self.pv = torch.zeros_like(self.k), torch.zeros_like(self.k)
        self.clear()

    def clear(self) -> None:
        """Drop every prefix and row. The buffers stay for the next requests: memory the
        process never wrote costs a page fault per page when first written, at every row
        of a fresh buffer (a cost ``_reserve``'s doubling pays once, not at every burst)."""
        self.tables: list[PageTable] = []   # the request each row belongs to
        self.slots: list[torch.Tensor] = []  # the slots each request holds here, in order
        self.held: list[HeldPrefix | None] = []  # each row's group prefix, if any
        self.bank: list[HeldPrefix] = []  # the prefixes held, in their order in pk/pv

    @property
    def prefixes(self) -> list[HeldPrefix]:
        """The prefixes held, each once, in their order in ``pk``/``pv``."""
        return list(self.bank)

    @property
    def lengths(self) -> torch.Tensor:
        """Positions each row's request holds here (its prefix included)."""
        return torch.tensor([s.numel() for s in self.slots], dtype=torch.int64)

    @property
    def own(self) -> torch.Tensor:
        """Positions each row holds itself: its request's, past its group's prefix."""
        return self.lengths - torch.tensor([_held(h) for h in self.held], dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        """Bytes the prefixes and the rows occupy (allocated, including room to grow)."""
        return 2 * (self.k.numel() + self.pk.numel()) * self.k.element_size()

    def check(self, tables: Sequence[PageTable]) -> None:
        """PoolError unless every row serving one of ``tables`` (and still matching its
        slots), and its prefix, hold exactly the pool's K/V at those slots."""
        live = {id(t) for t in tables}
        rows = [r for r, (t, s) in enumerate(zip(self.tables, self.slots, strict=True))
                if id(t) in live and torch.equal(t.slots[:s.numel()], s)]
        parts = [(f"row {r}", self.k[:, r], self.v[:, r], self.slots[r][_held(self.held[r]):])
                 for r in rows]  # rows not checked are refilled before use
        groups = {id(h): h for r in rows if (h := self.held[r]) is not None}
        parts += [("prefix", h.k, h.v, h.slots) for h in groups.values()]
        for what, k, v, slots in parts:
            for name, kept, pool in zip("kv", (k, v), self._pool_kv(slots), strict=True):
                if not torch.equal(kept[:, :, :slots.numel()], pool):
                    raise PoolError(f"working {name} {what} differs from the pool at its "
                                    "slots: the pool is the source of truth")

    def _pool_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K/V at ``slots``, laid out as the rows are: ``[layers, kv_heads,
        len(slots), head_dim]`` each (a gather, so a copy)."""
        idx = slots.to(self.pool.device)
        return (self.pool.k[:, idx].transpose(1, 2), self.pool.v[:, idx].transpose(1, 2))

    def sync(self, tables: Sequence[PageTable], align: int = 1) -> list[int]:
        """The prefixes and rows for exactly ``tables`` (each holding all positions but its
        last, the new token's); returns, per row, the index in ``tables`` it serves.
        ``align``: every prefix is a whole number of ``align`` positions (deterministic
        mode); a prefix that is not is let go, and its rows refilled."""
        index = {id(t): i for i, t in enumerate(tables)}
        keep = [r for r, (t, s, h) in enumerate(zip(self.tables, self.slots, self.held,
                                                      strict=True))
                if id(t) in index and s.numel() == len(t) - 1
                and torch.equal(t.slots[:s.numel()], s) and _held(h) % align == 0]
        if keep != list(range(len(self.tables))):
            self._compact(keep)
            self._release()
        rows, held = list(self.tables), list(self.held)  # after this sync: kept rows, then new
        have = {id(t) for t in rows}
        for t in tables:
            if id(t) not in have:
                held.append(self._group(t, rows, held, align))
                rows.append(t)
        self._reserve(len(rows), max(len(t) - _held(h) for t, h in zip(rows, held, strict=True)))
        for r, (t, h) in enumerate(zip(rows, held, strict=True)):
            if r >= len(self.tables) or h is not self.held[r]:
                self._fill(r, t, h)
        self._release()  # a group whose last row joined a new one
        return [index[id(t)] for t in self.tables]

    def _group(self, t: PageTable, rows: list[PageTable], held: list[HeldPrefix | None],
               align: int) -> HeldPrefix | None:
        """The prefix ``t`` will read once, with the row it shares most with (ties: one
        whose group it joins as it is); a new group re-points that row's entry in ``held``."""
        best, partner = (0, False), -1
        for r, (u, h) in enumerate(zip(rows, held, strict=True)):
            n = _common_prefix([t.slots, u.slots], min(len(t), len(u)) - 1) // align * align
            if n >= max(self.min_prefix, _held(h), 1) and (n, n == _held(h)) > best:
                best, partner = (n, n == _held(h)), r
        (n, joins), r = best, partner
        if r < 0:
            return None
        if joins:
            return held[r]
        held[r] = self._hold(t.slots[:n])
        return held[r]

    def _hold(self, slots: torch.Tensor) -> HeldPrefix:
        """A new prefix at ``slots``, in the next place of ``pk``/``pv``: its K/V from the
        pool, finite zeros after it (read behind ``PrefixGroups``' mask)."""
        g, n = len(self.bank), slots.numel()
        self._reserve_prefixes(g + 1, n)
        for buf, kv in zip((self.pk, self.pv), self._pool_kv(slots), strict=True):
            buf[:, g, :, :n] = kv
            buf[:, g, :, n:] = 0
        self.bank.append(HeldPrefix(slots, self.pk[:, g, :, :n], self.pv[:, g, :, :n]))
        return self.bank[-1]

    def _release(self) -> None:
        """Let go of the prefixes no row reads now. As ``_compact`` does for rows, each kept
        prefix past the end moves into a released one's place (its positions only)."""
        live = {id(h) for h in self.held if h is not None}
        keep = [g for g, h in enumerate(self.bank) if id(h) in live]
        if len(keep) == len(self.bank):
            return
        n, kept = len(keep), set(keep)
        holes = [g for g in range(n) if g not in kept]
        for dst, src in zip(holes, [g for g in keep if g >= n], strict=True):
            h = self.bank[src]
            for buf in (self.pk, self.pv):
                buf[:, dst, :, :len(h)] = buf[:, src, :, :len(h)]
            self.bank[dst] = h
            h.k, h.v = self.pk[:, dst, :, :len(h)], self.pv[:, dst, :, :len(h)]
        self.bank = self.bank[:n]

    def _reserve_prefixes(self, groups: int, positions: int) -> None:
        """Room in ``pk``/``pv`` for ``groups`` prefixes of up to ``positions``, regrown as
        ``_reserve`` regrows the rows; the prefixes held move, and their views with them."""
        _, have, _, have_pos, _ = self.pk.shape
        if groups <= have and positions <= have_pos:
            return
        groups, positions = max(groups, have), max(positions, have_pos)
        groups, positions = 1 << (groups - 1).bit_length(), -(-positions // self.grow) * self.grow
        n = len(self.bank)
        for name in ("pk", "pv"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], groups, old.shape[2], positions, old.shape[4])
            grown[:, :n, :, :have_pos] = old[:, :n]
            grown[:, :n, :, have_pos:] = 0
            setattr(self, name, grown)
        for g, h in enumerate(self.bank):
            h.k, h.v = self.pk[:, g, :, :len(h)], self.pv[:, g, :, :len(h)]

    def _fill(self, r: int, t: PageTable, h: HeldPrefix | None) -> None:
        """Row ``r`` (appended if it is the next) serves ``t`` behind prefix ``h``: the one
        gather per request, every position it has past the prefix, zeros after them."""
        if r == len(self.tables):
            self.tables.append(t)
            self.slots.append(t.slots[:-1])
            self.held.append(h)
        else:
            self.tables[r], self.slots[r], self.held[r] = t, t.slots[:-1], h
        old = t.slots[_held(h):-1]
        self.k[:, r, :, :old.numel()], self.v[:, r, :, :old.numel()] = self._pool_kv(old)
        self.k[:, r, :, old.numel():] = 0  # past its end: masked, so it must be finite
        self.v[:, r, :, old.numel():] = 0

    def _compact(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (ascending), as rows ``0 .. len(keep) - 1``: each kept row
        past the end moves into a dropped row's place, and only its used positions are
        copied, so a request leaving costs one row's copy, not the whole buffer's."""
        n = len(keep)
        kept = set(keep)
        holes = [r for r in range(n) if r not in kept]
        movers = [r for r in keep if r >= n]
        if movers:
            used = int(self.own[movers].max())
            src = torch.tensor(movers, dtype=torch.int64, device=self.k.device)
            dst = torch.tensor(holes, dtype=torch.int64, device=self.k.device)
            for buf in (self.k, self.v):
                buf[:, dst, :, :used] = buf[:, src, :, :used]
        where = dict(zip(holes, movers, strict=True))  # row r now holds what row where[r] held
        self.tables = [self.tables[where.get(r, r)] for r in range(n)]
        self.slots = [self.slots[where.get(r, r)] for r in range(n)]
        self.held = [self.held[where.get(r, r)] for r in range(n)]

    def _reserve(self, rows: int, positions: int) -> None:
        """Room for ``rows`` rows of ``positions`` positions: regrown to a power of two rows
        and a multiple of ``grow`` positions, so a batch that grows by one request a step
        does not reallocate at every step. The new buffer is not cleared as a whole: the
        rows in use are copied and zeroed past their positions, and a row is zeroed past
        its end when a request takes it (``_fill``), so every position attention reads is
        a K/V or a finite zero behind the mask, and rows never used cost no memory writes."""
        _, have_rows, _, have_pos, _ = self.k.shape
        if rows <= have_rows and positions <= have_pos:
            return
        rows, positions = max(rows, have_rows), max(positions, have_pos)
        rows, positions = 1 << (rows - 1).bit_length(), -(-positions // self.grow) * self.grow
        used = int(self.own.max()) if self.tables else 0
        n = len(self.tables)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], rows, old.shape[2], positions, old.shape[4])
            grown[:, :n, :, :used] = old[:, :n, :, :used]
            grown[:, :n, :, used:] = 0
            setattr(self, name, grown)

    def decode_rows(self, tables: Sequence[PageTable], tokens: torch.Tensor,
                    deterministic: bool = False) -> _Rows:
        """One decode step as ``_Rows``: ``tokens[i]`` is the new token of ``tables[i]`` (its
        last position); the logits come out in ``tables`` order.

        In each layer ``attend`` writes the new K/V onto the end of each row, then attends
        over the prefixes and the rows; once the forward has run, the new K/V of all layers
        go into their pool slots in one copy.
        """
        order = self.sync(tables, CHUNK if deterministic else 1)
        n, device = len(order), self.pool.device
        lengths, own = self.lengths, self.own  # row positions in use before this step
        width = int(own.max()) + 1
        new_slots = torch.stack([tables[i].slots[-1] for i in order]).to(device)
        if bool((own == width - 1).all()):  # rows of one length: one column, all keys
            rows, column, seen = slice(0, n), width - 1, None
        else:
            rows, column = torch.arange(n, device=device), own.to(device)
            seen = column + 1  # on the device: cascade_decode masks by it there
        rows_of = [_rows_of(self.held, h) for h in self.bank]
        groups = PrefixGroups.of(rows_of, [len(h) for h in self.bank], self.pk.dtype, device)
        if deterministic:  # each group's rows, and the rows of no group (a prefix of none)
            alone = _rows_of(self.held, None)
            blocks = [(_as_rows(r, device), h) for r, h in zip(rows_of, self.bank, strict=True)]
            blocks += [(_as_rows(alone, device), None)] if alone else []
            pos = lengths.view(n, 1).to(device)
        span = min(-(-width // CHUNK) * CHUNK, self.k.shape[3])
        g, p = len(self.bank), max(map(len, self.bank), default=0)

        def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
            # q [1, heads, n, head_dim], k and v [1, kv_heads, n, head_dim]: row r, request r
            q = q[0].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, head_dim]
            keys, values = self.k[layer], self.v[layer]
            keys[rows, :, column] = k[0].transpose(0, 1)
            values[rows, :, column] = v[0].transpose(0, 1)
            if not deterministic:
                return cascade_decode(q, keys[:n, :, :width], values[:n, :, :width], seen,
                                      self.pk[layer, :g, :, :p], self.pv[layer, :g, :, :p],
                                      groups, scale).reshape(1, n, -1)
            out = q.new_empty(n, 1, q.shape[1], q.shape[3])
            for r, h in blocks:  # whole chunks of the rows (past ``width``: masked)
                pk, pv = ((keys[0, :, :0], values[0, :, :0]) if h is None
                          else (h.k[layer], h.v[layer]))
                out[r] = aligned_attention(q[r], pos[r], pk, pv, keys[r, :, :span],
                                           values[r, :, :span], scale)
            return out.reshape(1, n, -1)

        def after() -> None:
            # The new K/V of every layer, now in the rows, into their pool slots in one copy.
            k_new, v_new = self.k[:, rows, :, column], self.v[:, rows, :, column]
            if seen is not None:  # advanced indices around a slice: their dimension first
                k_new, v_new = k_new.transpose(0, 1), v_new.transpose(0, 1)
            self.pool.k.index_copy_(1, new_slots, k_new)
            self.pool.v.index_copy_(1, new_slots, v_new)
            for r, i in enumerate(order):
                self.slots[r] = tables[i].slots

        row_of = torch.empty(n, dtype=torch.int64)  # the row of tables[i]: logits in order
        row_of[torch.tensor(order, dtype=torch.int64)] = torch.arange(n)
        return _Rows(tokens[order].to(device), lengths.to(device), row_of.to(device), attend,
                     after)


@dataclass(frozen=True)
class PrefixGroups:
    """Which rows of a decode batch read which of ``G`` held prefixes, laid out for one
    attention call over all of them: ``index`` ``[G, m]`` each group's rows (a group of
    fewer than ``m`` padded with its first row), ``real`` the places in ``index.view(-1)``
    that are not padding, ``rows`` the row numbers there, ``mask`` ``[G, 1, 1, P]``
    (additive: ``-inf`` past a shorter prefix's end) or None when all ``G`` are ``P`` long;
    ``sizes`` and ``lengths`` (int64, on the CPU) each group's rows and prefix positions."""

    index: torch.Tensor
    real: torch.Tensor
    rows: torch.Tensor
    mask: torch.Tensor | None
    sizes: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, groups: Sequence[Sequence[int]], lengths: Sequence[int],
           dtype: torch.dtype = torch.float32,
           device: torch.device | str | None = None) -> PrefixGroups | None:
        """The layout for ``groups[i]``, the rows behind prefix ``i`` of ``lengths[i]``
        positions (None for no groups)."""
        if not groups:
            return None
        m, p = max(map(len, groups)), max(lengths)
        index = torch.tensor([[*g, *[g[0]] * (m - len(g))] for g in groups], device=device)
        real = torch.tensor([i * m + j for i, g in enumerate(groups) for j in range(len(g))],
                            device=device)
        mask = None
        if min(lengths) < p:
            past = torch.arange(p) >= torch.tensor(lengths)[:, None]
            mask = torch.zeros(len(groups), 1, 1, p, dtype=dtype).masked_fill_(
                past[:, None, None], float("-inf")).to(device)
        return cls(index, real, index.view(-1)[real], mask,
                   torch.tensor([len(g) for g in groups]), torch.tensor(list(lengths)))


def cascade_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   own: torch.Tensor | None, prefix_k: torch.Tensor | None,
                   prefix_v: torch.Tensor | None, groups: PrefixGroups | None,
                   scale: float) -> torch.Tensor:
    """Decode attention of ``query`` ``[b, heads, 1, head_dim]`` over the first ``own[r]``
    of each sequence's own ``key``, ``value`` ``[b, kv_heads, n, head_dim]`` (``own`` None:
    all ``n``) and, for the rows of each of ``groups``, the prefix ``prefix_k``,
    ``prefix_v`` ``[G, kv_heads, P, head_dim]`` they share before those: ``[b, 1, heads,
    head_dim]``.

    On CPU in fp32 this is minirt's decode kernel (``kernels.decode``): each group's query
    rows read its prefix together, then each row its own keys, the softmax carried across
    in one pass. Otherwise it is ``shared_prefix_attention`` with one prefix per group of
    sequences: each prefix is read once, by all its group's query rows of a K/V head, the
    ``G`` prefixes in one attention call (its batch), and merged into their own half
    through the two log-sum-exps; a sequence in no group sees its own keys.
    """
    b, heads, _, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    fast = kernels.decode(query.view(b, heads, d), key, value, own, scale, *(
        () if groups is None else (prefix_k, prefix_v, groups.index, groups.sizes,
                                   groups.lengths)))
    if fast is not None:
        return fast.view(b, 1, heads, d)
    mask = None
    if own is not None:  # built where the attention runs: no copy to the device per layer
        past = torch.arange(n, device=query.device) >= own.to(query.device)[:, None]
        mask = torch.zeros(b, 1, 1, n, dtype=query.dtype, device=query.device).masked_fill_(
            past[:, None, None], float("-inf"))
    group = heads // kv_heads
    q = query.reshape(b, kv_heads, group, d)  # the query heads of a K/V head: its rows
    out, lse = attention_lse(q, key, value, mask, scale)
    if groups is not None:
        g, m = groups.index.shape
        rows = q[groups.index.view(-1)].view(g, m, kv_heads, group, d)
        rows = rows.permute(0, 2, 1, 3, 4).reshape(g, kv_heads, m * group, d)
        p_out, p_lse = attention_lse(rows, prefix_k, prefix_v, groups.mask, scale)
        p_out = p_out.view(g, kv_heads, m, group, d).transpose(1, 2).reshape(
            g * m, kv_heads, group, d)[groups.real]  # [rows, kv_heads, group, d]
        p_lse = p_lse.view(g, kv_heads, m, group).transpose(1, 2).reshape(
            g * m, kv_heads, group)[groups.real]
        exact = torch.promote_types(query.dtype, torch.float32)  # bf16 merges in fp32
        out, r = out.to(exact), groups.rows
        weight = torch.sigmoid(p_lse - lse[r]).unsqueeze(-1).to(exact)
        out[r] = torch.lerp(out[r], p_out.to(exact), weight)
    return out.to(query.dtype).reshape(b, heads, 1, d).transpose(1, 2)


def _held(h: HeldPrefix | None) -> int:
    """Positions a row reads from its group's prefix: none without one."""
    return 0 if h is None else len(h)


def _rows_of(held: Sequence[HeldPrefix | None], h: HeldPrefix | None) -> list[int]:
    """The rows whose prefix is ``h`` (``None``: the rows in no group)."""
    return [r for r, x in enumerate(held) if x is h]


def _as_rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Row numbers (ascending) as a slice when they are a run (a view, no copy), else as
    an index tensor."""
    if rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _common_prefix(seqs: Sequence[torch.Tensor], limit: int) -> int:
    """How many leading entries all ``seqs`` (1-D tensors) have in common, at most ``limit``."""
    n = max(limit, 0)
    first = seqs[0][:n]
    same = torch.ones(n, dtype=torch.bool)
    for x in seqs[1:]:
        same &= x[:n] == first
    return n if bool(same.all()) else int((~same).nonzero()[0])
