"""Attention arithmetic over pooled K/V: attention split at a shared prefix and merged
exactly through log-sum-exps, and the deterministic switch's attention in aligned chunks.

* ``attention_lse``: softmax attention with each row's log-sum-exp, what two attentions
  over two parts of the keys need to be merged exactly.
* ``shared_prefix_attention``: a prefix every sequence of a batch shares, read once for all
  of them, merged into each sequence's own keys (prefill); ``cascade_decode`` the same for
  a decode step, with one prefix per group of rows (``PrefixGroups``).
* ``aligned_attention``: the same bits for a query whatever else is in the batch and however
  its keys were split, keys cut into ``CHUNK``-key chunks at absolute positions.

These take tensors and return tensors: where the keys come from (the pool, the decode
working set) is the caller's business (``minirt.forward``, ``minirt.working_set``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from . import kernels
from .errors import PoolError
from .llama import MIN_ROWS

__all__ = ["CHUNK", "QUERY_BLOCK", "PrefixGroups", "aligned_attention", "attention_lse",
           "cascade_decode", "shared_prefix_attention"]


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


CHUNK = 256
"""Keys per attention chunk in deterministic mode, chunk ``c`` holding absolute positions
``c * CHUNK .. (c + 1) * CHUNK - 1`` of every request. In its deterministic mode SGLang's
Triton backend also splits decode attention at a fixed tile, 256 keys unless
``SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE`` says otherwise (sglang 0.5.23
`srt/layers/attention/triton_backend.py: TritonAttnBackend.__init__`). Measured here: in
fp32 the per-chunk products need chunks of at least 16 keys to be row-invariant."""


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
