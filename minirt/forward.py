"""The forward pass over pooled K/V: a batch of requests whose K/V live in the pool.

The pool (``minirt.pool``) keeps slots and pages; ``minirt.model`` loads weights;
``minirt.llama`` is a Llama's layer arithmetic and ``minirt.attention`` the attention
arithmetic. This module lays a batch out for them:

* ``forward_paged``: one forward over several requests' new tokens. Any Hugging Face
  causal LM runs unmodified through ``pool.PoolCache`` (RadixAttention changes no
  math); a Llama runs ``llama_forward`` layer by layer, its prefill laid out as a
  ``PrefillPlan`` (the prefix every request shares read once, a run of new tokens several
  begin with computed once) and its decode step over the decode working set's contiguous
  rows (``minirt.working_set.WorkingKV``). ``forward_mixed``: a prefill and a decode step in
  one pass.
* ``deterministic=True``: the switch. The same requests give the same bits whatever is
  cached, whatever else is in the batch and however a step is split (every matrix product
  on at least ``llama.MIN_ROWS`` rows, attention by ``attention.aligned_attention``).
* ``forward_windowed``: a model whose sliding-window layers keep K/V in a pool of their own
  (chapter 11), each layer read through its own table (``LayerKV``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from . import attention, kernels
from .attention import aligned_attention, shared_prefix_attention
from .errors import ModelError, PoolError
from .llama import _Rows, _run, is_llama, llama_forward
from .model import prepack_bf16
from .pool import KVPool, PagedBatch, PageTable, PoolCache, as_index_tensor
from .working_set import WorkingKV, _common_prefix

__all__ = ["LayerKV", "PrefillPart", "PrefillPlan", "forward_mixed", "forward_paged",
           "forward_verify", "forward_windowed"]


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
    8-10 of 11; bf16 on a 2-core Xeon: row 4 of 9 of a batch). oneDNN packs bf16 only with
    AVX-512 or AVX-NE-CONVERT: elsewhere bf16 stays on the plain kernel, row-checked in tests.
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
    chunk = attention.CHUNK
    cut = _common_prefix([t.slots for t in tables], min(starts)) // chunk * chunk
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
# Speculative decoding (minirt.speculative): a verify step beside the step's prefills.


@torch.inference_mode()
def forward_verify(model, pool: KVPool, tables: Sequence[PageTable], new_ids: Sequence,
                   verify_tables: Sequence[PageTable], verify_ids: Sequence,
                   share_runs: bool = True, deterministic: bool = False,
                   working: WorkingKV | None = None, decode_tables: Sequence[PageTable] = (),
                   decode_ids: Sequence = (),
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Prefills, verify extends and decode steps in one forward pass of a Llama (ModelError
    otherwise); any of the three lists may be empty, not all.

    ``tables``/``new_ids``: prefills, as ``forward_paged`` runs them (last logits each,
    ``[vocab]``). ``verify_tables``/``verify_ids``: each speculating request's last token
    followed by its drafts, the last ``len(verify_ids[r])`` positions of its table (slots
    already taken): an extend like a prefill chunk, but the logits of *every* position are
    returned, ``[len(verify_ids[r]), vocab]`` each; each extend computes its own tokens (no
    common run). ``decode_tables``/``decode_ids``: requests with no drafts this step, one
    token each over ``working``, as ``forward_mixed`` decodes them (``[vocab]`` each). In
    deterministic mode a verified position gets the bits one-token decode would give.
    """
    _require_llama(model)
    if not tables and not verify_tables and not decode_tables:
        raise PoolError("forward_verify needs something to prefill, verify or decode")
    ids_of = [{id(t) for t in group} for group in (tables, verify_tables, decode_tables)]
    if sum(map(len, ids_of)) != len(set().union(*ids_of)):
        raise PoolError("forward_verify: a request can only prefill, verify or decode in a pass")
    if decode_tables and working is None:
        raise PoolError("forward_verify decodes over a WorkingKV: pass `working`")
    if deterministic:
        prepack_bf16(model)
    parts, vids, kinds = [], [], []
    if tables:
        parts.append(_prefill_rows(pool, tables, _new_ids(tables, new_ids), share_runs,
                                   deterministic))
        kinds.append("prefill")
    if verify_tables:
        vids = _new_ids(verify_tables, verify_ids)
        parts.append(_extend_rows(pool, verify_tables, vids, deterministic))
        kinds.append("verify")
    if decode_tables:
        tokens = _new_ids(decode_tables, decode_ids)
        if any(x.numel() != 1 for x in tokens):
            raise PoolError("forward_verify decodes one new token per decoding request")
        parts.append(working.decode_rows(decode_tables, torch.cat(tokens), deterministic))
        kinds.append("decode")
    out = dict(zip(kinds, _run(model, parts, deterministic), strict=True))
    return (list(out["prefill"]) if tables else [],
            list(out["verify"].split([x.numel() for x in vids])) if verify_tables else [],
            list(out["decode"]) if decode_tables else [])


def _extend_rows(pool: KVPool, tables: Sequence[PageTable], ids: Sequence[torch.Tensor],
                 deterministic: bool) -> _Rows:
    """``_prefill_rows`` of ``ids`` with the logits of every new token, request by request
    (a ``PrefillPlan``'s rows are grouped by length: each request's run of rows is found in
    its part)."""
    if deterministic:
        return _aligned_rows(pool, tables, ids, last_only=False)
    plan = PrefillPlan.build(tables, ids, pool.dtype, share_runs=False)
    first = {r: p.start + i * p.length for p in plan.parts for i, r in enumerate(p.requests)}
    rows = torch.cat([torch.arange(first[r], first[r] + x.numel()) for r, x in enumerate(ids)])
    return replace(_prefill_rows(pool, tables, ids, share_runs=False), last=rows.to(pool.device))
