"""The KV pool: every layer's keys and values in fixed slots, handed out in pages.

RadixAttention keeps K/V in one big preallocated pool. A request (or a radix-tree
node) never owns tensors, only *slot indices* into the pool:

* ``KVPool``: per-layer K and V tensors of shape ``[num_layers, capacity, kv_heads,
  head_dim]`` on the model's device and dtype, plus a free list of pages
  (``alloc`` / ``free``). One token costs ``2 * layers * kv_heads * head_dim *
  dtype bytes`` (``bytes_per_token``).
* ``PageTable``: one request's map from logical token position to pool slot.
* ``forward_paged``: runs an *unmodified* Hugging Face causal LM on a batch of
  requests. A ``transformers`` ``Cache`` adapter writes each new token's K/V into the
  request's slots and hands attention the K/V gathered from its page table, so the
  attention math is exactly the model's own: RadixAttention changes no math.
* For a Llama, the engine's fast paths run the same maths layer by layer
  (``model.llama_forward``): a prefill laid out as a ``PrefillPlan`` (the prefix every
  request shares read once, a run of new tokens several begin with computed once) and a
  decode step over ``WorkingKV``'s contiguous rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import InvalidIdsError, OutOfMemoryError, PoolError
from .model import is_llama, llama_forward, shared_prefix_attention

__all__ = ["KVPool", "PageTable", "PagedBatch", "PoolCache", "PrefillPlan", "WorkingKV",
           "forward_paged", "as_index_tensor"]


def as_index_tensor(values, what: str = "indices") -> torch.Tensor:
    """``values`` (list or tensor) as a 1-D int64 CPU tensor; InvalidIdsError if it is not one."""
    if isinstance(values, torch.Tensor):
        t = values.detach()
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise InvalidIdsError(f"{what} must be integers, got a tensor of dtype {t.dtype}")
        t = t.to("cpu", torch.int64)
    else:
        try:
            t = torch.as_tensor(list(values), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidIdsError(f"{what} must be a 1-D list or tensor of integers: {exc}") \
                from exc
        if any(isinstance(v, bool) or not float(v).is_integer() for v in values):
            raise InvalidIdsError(f"{what} must be integers, got {list(values)!r}")
    if t.dim() != 1:
        raise InvalidIdsError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    return t


class KVPool:
    """Preallocated K/V storage for ``capacity`` tokens, split into pages of ``page_size`` slots.

    Slot ``s`` of layer ``l`` holds one token's key ``k[l, s]`` and value ``v[l, s]``
    (each ``[kv_heads, head_dim]``). Page ``p`` is slots ``p*page_size .. (p+1)*page_size-1``.
    ``alloc`` hands out whole pages (lowest-numbered first, so pictures are predictable);
    ``free`` takes whole pages back. Misuse raises and leaves the pool unchanged.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        page_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in [("num_layers", num_layers), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("page_size", page_size)]:
            if not isinstance(value, int) or value < 1:
                raise PoolError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(capacity, int) or capacity < 1 or capacity % page_size:
            raise PoolError(f"capacity must be a positive multiple of page_size={page_size} "
                            f"tokens, got {capacity!r}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.capacity, self.page_size = capacity, page_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._page_free = torch.ones(capacity // page_size, dtype=torch.bool)  # the free list
        self._ever_allocated = torch.zeros(capacity // page_size, dtype=torch.bool)

    @classmethod
    def for_model(cls, model, capacity_tokens: int, page_size: int = 1) -> KVPool:
        """A pool shaped for ``model`` (layers, KV heads, head dim) on its device and dtype."""
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise PoolError("KVPool supports models whose every layer is full attention; "
                            f"this one has layer types {sorted(set(layer_types))}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        param = next(model.parameters())
        return cls(config.num_hidden_layers, kv_heads, head_dim, capacity_tokens, page_size,
                   dtype=param.dtype, device=param.device)

    # ----------------------------------------------------------------- sizes
    @property
    def num_pages(self) -> int:
        """How many pages the pool has in all."""
        return self.capacity // self.page_size

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V over all layers: ``2 * layers * kv_heads * head_dim * itemsize``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        """Bytes the pool's K and V tensors occupy (``capacity * bytes_per_token``)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def num_free(self) -> int:
        """Free slots (always a whole number of pages)."""
        return int(self._page_free.sum()) * self.page_size

    @property
    def num_used(self) -> int:
        """Allocated slots: owned by the radix tree or by running requests."""
        return self.capacity - self.num_free

    def free_slots(self) -> torch.Tensor:
        """Every free slot, ascending (int64, CPU): the free list written out slot by slot."""
        return self._slots_of(torch.nonzero(self._page_free).flatten())

    def free_pages(self) -> torch.Tensor:
        """Every free page number, ascending."""
        return torch.nonzero(self._page_free).flatten()

    def is_free(self, slots) -> torch.Tensor:
        """A bool per slot: is its page on the free list?"""
        s = as_index_tensor(slots, "slots")
        self._check_range(s)
        return self._page_free[s // self.page_size]

    def _slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages.to(torch.int64)[:, None] * self.page_size + offsets).flatten()

    def _check_range(self, s: torch.Tensor) -> None:
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.capacity):
            bad = s[(s < 0) | (s >= self.capacity)][:5].tolist()
            raise PoolError(f"slots {bad} are outside the pool (capacity {self.capacity})")

    # ------------------------------------------------------ alloc and free
    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Take ``num_tokens`` slots (a multiple of ``page_size``) off the free list, as int64 CPU.

        Lowest-numbered pages first. OutOfMemoryError if fewer are free (nothing is
        taken); PoolError if ``num_tokens`` is negative or not whole pages.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise PoolError(f"alloc needs a non-negative int number of tokens, got {num_tokens!r}")
        if num_tokens % self.page_size:
            raise PoolError(f"alloc({num_tokens}): the pool hands out whole pages of "
                            f"{self.page_size} tokens; ask for a multiple of {self.page_size}")
        need = num_tokens // self.page_size
        free = torch.nonzero(self._page_free).flatten()
        if need > free.numel():
            raise OutOfMemoryError(f"alloc({num_tokens}): only {self.num_free} of "
                                   f"{self.capacity} slots are free")
        pages = free[:need]
        self._page_free[pages] = False
        self._ever_allocated[pages] = True
        return self._slots_of(pages)

    def free(self, slots) -> None:
        """Give whole pages back to the free list.

        PoolError (pool unchanged) for a slot outside the pool, a slot given twice,
        a slot already free (double free) or never allocated, or part of a page only.
        """
        s = as_index_tensor(slots, "slots")
        if s.numel() == 0:
            return
        self._check_range(s)
        uniq = torch.unique(s)
        if uniq.numel() != s.numel():
            raise PoolError(f"free: slots {_dupes(s)} appear more than once in one call")
        pages = s // self.page_size
        if self._page_free[pages].any():
            bad_pages = torch.unique(pages[self._page_free[pages]])
            never = bad_pages[~self._ever_allocated[bad_pages]]
            bad = self._slots_of(bad_pages)
            bad = bad[torch.isin(bad, s)][:8].tolist()
            if never.numel() == bad_pages.numel():
                raise PoolError(f"free: slots {bad} were never allocated")
            raise PoolError(f"free: slots {bad} are already free (double free)")
        page_ids, counts = torch.unique(pages, return_counts=True)
        partial = page_ids[counts != self.page_size]
        if partial.numel():
            p = int(partial[0])
            raise PoolError(f"free: page {p} (slots {p * self.page_size}.."
                            f"{(p + 1) * self.page_size - 1}) given back only in part; "
                            "the pool takes whole pages")
        self._page_free[page_ids] = True

    # ---------------------------------------------------- reading/writing K/V
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[n, kv_heads, head_dim]``) of layer ``layer`` at ``slots``."""
        idx = slots.to(self.device)
        self.k[layer].index_copy_(0, idx, k.to(self.dtype))
        self.v[layer].index_copy_(0, idx, v.to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots`` (any shape ``S``): ``[*S, kv_heads, head_dim]``.

        ``index_select`` on the flattened slots: the values of ``self.k[layer][slots]``, but
        about 3x faster on CPU, which matters because every layer of every forward gathers.
        """
        flat = slots.to(self.device).reshape(-1)
        shape = (*slots.shape, self.kv_heads, self.head_dim)
        return (torch.index_select(self.k[layer], 0, flat).view(shape),
                torch.index_select(self.v[layer], 0, flat).view(shape))

    def snapshot(self) -> tuple[int, ...]:
        """The free pages as a tuple: two snapshots are equal iff the free lists are."""
        return tuple(self.free_pages().tolist())

    def __repr__(self) -> str:
        return (f"KVPool(capacity={self.capacity}, page_size={self.page_size}, "
                f"free={self.num_free}, layers={self.num_layers}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, "
                f"bytes_per_token={self.bytes_per_token})")


def _dupes(s: torch.Tensor) -> list[int]:
    uniq, counts = torch.unique(s, return_counts=True)
    return uniq[counts > 1][:8].tolist()


class PageTable:
    """One request's page table: logical token position ``i`` -> pool slot ``slots[i]``.

    Prefill and decode use the same table. After an insert the first entries are
    re-pointed at the radix tree's slots (``repoint``) before any duplicate is freed.
    """

    def __init__(self, slots=()) -> None:
        self.slots = as_index_tensor(slots, "slots")

    def __len__(self) -> int:
        return int(self.slots.numel())

    def __getitem__(self, pos):
        return self.slots[pos]

    def append(self, slots) -> None:
        """Map the next positions to ``slots``."""
        self.slots = torch.cat([self.slots, as_index_tensor(slots, "slots")])

    def repoint(self, prefix) -> None:
        """Point the first ``len(prefix)`` positions at ``prefix`` (the tree's copy of them)."""
        p = as_index_tensor(prefix, "slots")
        if p.numel() > len(self):
            raise PoolError(f"repoint: {p.numel()} slots for a table of {len(self)} positions")
        self.slots = torch.cat([p, self.slots[p.numel():]])

    def tolist(self) -> list[int]:
        return self.slots.tolist()

    def __repr__(self) -> str:
        return f"PageTable({self.slots.tolist()})"


# ---------------------------------------------------------------------------
# The adapter to transformers' cache interface.


@dataclass
class PagedBatch:
    """What one forward pass needs: where to write new K/V and where to read all K/V from.

    Requests are left-padded to a common length so that each one's last token sits in
    the last column; ``slot_matrix`` pads with slot 0 (any valid slot: masked out).
    """

    new_slots: torch.Tensor    # [sum(new)] slots receiving the new tokens' K/V, request order
    new_rows: torch.Tensor     # [sum(new)] row r * q_len + column of each new token, same order
    slot_matrix: torch.Tensor  # [B, kv_len] slot of every key position (pads: slot 0)
    key_mask: torch.Tensor     # [B, kv_len] True where a key position is real
    position_ids: torch.Tensor # [B, q_len] logical position of every query column

    @property
    def q_len(self) -> int:
        return int(self.position_ids.shape[1])

    def to(self, device: torch.device | str) -> PagedBatch:
        """The same batch with its index tensors on ``device`` (moved once, not per layer)."""
        return PagedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    @property
    def kv_len(self) -> int:
        return int(self.slot_matrix.shape[1])

    @classmethod
    def build(cls, tables: Sequence[PageTable], num_new: Sequence[int]) -> PagedBatch:
        """For each request: its whole table, whose last ``num_new`` entries are the new tokens'."""
        q_len = max(num_new)
        kv_len = max(len(t) for t in tables)
        b = len(tables)
        slot_matrix = torch.zeros(b, kv_len, dtype=torch.int64)
        key_mask = torch.zeros(b, kv_len, dtype=torch.bool)
        position_ids = torch.zeros(b, q_len, dtype=torch.int64)
        new, rows = [], []
        for r, (table, n) in enumerate(zip(tables, num_new, strict=True)):
            total = len(table)
            slot_matrix[r, kv_len - total:] = table.slots
            key_mask[r, kv_len - total:] = True
            position_ids[r, q_len - n:] = torch.arange(total - n, total)
            new.append(table.slots[total - n:])
            rows.append(torch.arange(r * q_len + q_len - n, (r + 1) * q_len))
        return cls(torch.cat(new), torch.cat(rows), slot_matrix, key_mask, position_ids)


class PoolLayer(CacheLayerMixin):
    """One layer's view of the pool, in the shape transformers' attention expects.

    ``update`` writes the new tokens' K/V into their slots, then returns the K/V of
    every position of every request, gathered through the page tables:
    ``[batch, kv_heads, kv_len, head_dim]``.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, pool: KVPool, layer_idx: int, batch: PagedBatch) -> None:
        super().__init__()
        self.pool, self.layer_idx, self.batch = pool, layer_idx, batch
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # nothing to allocate
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        b = self.batch
        k_new = key_states.transpose(1, 2).flatten(0, 1).index_select(0, b.new_rows)
        v_new = value_states.transpose(1, 2).flatten(0, 1).index_select(0, b.new_rows)
        self.pool.write(self.layer_idx, b.new_slots, k_new, v_new)
        k, v = self.pool.gather(self.layer_idx, b.slot_matrix)
        return k.transpose(1, 2).to(key_states.dtype), v.transpose(1, 2).to(value_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.kv_len, 0

    def get_seq_length(self) -> int:
        return self.batch.kv_len - self.batch.q_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise PoolError("a PoolCache cannot be reset: the pool's slots belong to the runtime")


class PoolCache(Cache):
    """A transformers ``Cache`` whose layers read and write the KV pool (one forward pass)."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        super().__init__(layers=[PoolLayer(pool, i, batch) for i in range(pool.num_layers)])
        self.batch = batch


@torch.inference_mode()
def forward_paged(model, pool: KVPool, tables: Sequence[PageTable], new_ids: Sequence,
                  last_only: bool = True, working: WorkingKV | None = None,
                  share_runs: bool = True) -> list[torch.Tensor]:
    """Run ``model`` on the new tokens of several requests through the pool; return logits.

    ``tables[r]`` already maps every position of request ``r``, including its
    ``len(new_ids[r])`` new tokens (the last entries), whose K/V this pass writes.
    Returns, per request, the logits of its last token (``[vocab]``) or, with
    ``last_only=False``, of every new token (``[n_new, vocab]``). ``working``: for a
    decode step (one new token each) of a Llama, attention reads these requests' K/V from
    this ``WorkingKV`` instead of gathering it from the pool (other models gather).
    ``share_runs``: a Llama's prefill computes a run of new tokens that several requests
    begin with once (``PrefillPlan``); False computes every request's tokens itself.
    """
    if len(tables) != len(new_ids) or not tables:
        raise PoolError(f"forward_paged needs one page table per request, got {len(tables)} "
                        f"tables and {len(new_ids)} id lists")
    ids = [as_index_tensor(x, "token ids") for x in new_ids]
    for r, (t, x) in enumerate(zip(tables, ids, strict=True)):
        if x.numel() == 0 or len(t) < x.numel():
            raise PoolError(f"request {r}: {x.numel()} new tokens but a page table of {len(t)} "
                            "positions (allocate slots for the new tokens first)")
    if (working is not None and last_only and all(x.numel() == 1 for x in ids)
            and is_llama(model)):
        return working.forward(model, tables, torch.cat(ids))
    if last_only and is_llama(model):
        return list(_prefill_llama(model, pool, tables, ids, share_runs))
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


@dataclass
class PrefillPlan:
    """How a Llama prefills a batch through the pool (``forward_paged``, last positions only):
    which keys are read once for all, which new tokens are computed once, what each row is.

    ``shared``: leading slots that every table holds in common and that are cached for all;
    attention reads them once per layer for the whole batch. ``common``: new tokens that
    the requests in ``group`` (those starting right after the shared prefix) all begin
    with, a prompt prefix in flight and shorter than a page, so not in the tree: computed
    once, on rows of their own, their K/V written into each of those requests' slots.
    ``own``: the tokens each request computes itself, left-padded to the longest. The
    forward's rows are the common run, then each request's own tokens: ``rows`` of them.
    """

    shared: int
    common: int
    group: list[int]
    own: list[int]
    input_ids: torch.Tensor   # [rows] token of every row (padding: 0)
    positions: torch.Tensor   # [rows] its position in its request
    new_slots: torch.Tensor   # slots receiving new K/V: the run's once per group request,
    source: torch.Tensor      # and the row each one's K/V comes from
    prefix: torch.Tensor      # [shared] the slots read once
    own_slots: torch.Tensor | None  # [b, keys] each request's keys past the prefix, from
    mask: torch.Tensor | None       # the pool, seen through this [b, 1, width, keys] additive
                                    # mask; None: the own tokens' new K/V, causally

    @property
    def rows(self) -> int:
        return int(self.input_ids.numel())

    @property
    def width(self) -> int:
        return max(self.own)

    @property
    def last(self) -> torch.Tensor:
        """The row of each request's last token, whose logits the forward returns."""
        return self.common + torch.arange(1, len(self.own) + 1) * self.width - 1

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
        m = max(own)
        input_ids = torch.zeros(common + b * m, dtype=torch.int64)
        positions = torch.zeros(common + b * m, dtype=torch.int64)
        if common:
            input_ids[:common] = ids[group[0]][:common]
            positions[:common] = torch.arange(shared, shared + common)
        own_ids, own_pos = input_ids[common:].view(b, m), positions[common:].view(b, m)
        real = torch.arange(m) >= m - torch.tensor(own)[:, None]
        for r, (t, x) in enumerate(zip(tables, ids, strict=True)):
            own_ids[r, m - own[r]:] = x[x.numel() - own[r]:]
            own_pos[r, m - own[r]:] = torch.arange(len(t) - own[r], len(t))
        new_slots = torch.cat([tables[r].slots[shared:shared + common] for r in group]
                              + [t.slots[len(t) - n:] for t, n in zip(tables, own, strict=True)])
        source = torch.cat([torch.arange(common).repeat(len(group)),
                            common + real.view(-1).nonzero()[:, 0]])
        own_slots = mask = None
        if common or any(s != shared for s in starts) or len(set(own)) > 1:
            # Keys past the prefix come from the pool, left-padded; who sees which.
            longest = max(len(t) for t in tables)
            width = longest - shared
            own_slots = torch.zeros(b, width, dtype=torch.int64)
            key_pos = torch.full((b, width), -1, dtype=torch.int64)
            for r, t in enumerate(tables):
                own_slots[r, width - len(t) + shared:] = t.slots[shared:]
                key_pos[r, width - len(t) + shared:] = torch.arange(shared, len(t))
            query_pos = torch.where(real, own_pos, longest)  # a padding row sees every key
            sees = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])
            mask = torch.zeros(b, 1, m, width, dtype=dtype).masked_fill_(~sees[:, None],
                                                                        float("-inf"))
        return cls(shared, common, group, own, input_ids, positions, new_slots, source,
                   tables[0].slots[:shared], own_slots, mask)


def _prefill_llama(model, pool: KVPool, tables: Sequence[PageTable],
                   ids: Sequence[torch.Tensor], share_runs: bool = True) -> torch.Tensor:
    """``forward_paged`` for a Llama, last positions only: ``llama_forward`` over the rows
    of a ``PrefillPlan``, attention split at the shared prefix (``shared_prefix_attention``).

    Each layer writes the new K/V to the pool first (the common run's into every one of its
    requests' slots), then the run attends to the prefix and causally to itself, and each
    request's own tokens attend to the prefix and to their own keys: the new K/V themselves
    when nothing else lies past the prefix, else gathered from the pool behind the mask.
    """
    device, b = pool.device, len(tables)
    plan = PrefillPlan.build(tables, ids, pool.dtype, share_runs)
    common, m = plan.common, plan.width
    new_slots, source, prefix = (plan.new_slots.to(device), plan.source.to(device),
                                 plan.prefix.to(device))
    own = None if plan.own_slots is None else plan.own_slots.view(-1).to(device)
    mask = None if plan.mask is None else plan.mask.to(device)
    kv_heads, head_dim = pool.kv_heads, pool.head_dim

    def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
        # q [1, heads, rows, head_dim], k and v [1, kv_heads, rows, head_dim]
        rows_k, rows_v = k[0].transpose(0, 1), v[0].transpose(0, 1)
        pool.write(layer, new_slots, rows_k.index_select(0, source),
                   rows_v.index_select(0, source))
        pk = pool.k[layer].index_select(0, prefix).transpose(0, 1)
        pv = pool.v[layer].index_select(0, prefix).transpose(0, 1)
        heads, out = q.shape[1], []
        if common:
            out.append(shared_prefix_attention(q[:, :, :common], pk, pv, k[:, :, :common],
                                               v[:, :, :common], None, scale, causal=True))
        qo = q[0, :, common:].reshape(heads, b, m, head_dim).transpose(0, 1)
        if own is None:
            ko = k[0, :, common:].reshape(kv_heads, b, m, head_dim).transpose(0, 1)
            vo = v[0, :, common:].reshape(kv_heads, b, m, head_dim).transpose(0, 1)
        else:
            ko = pool.k[layer].index_select(0, own).view(b, -1, kv_heads, head_dim)
            vo = pool.v[layer].index_select(0, own).view(b, -1, kv_heads, head_dim)
            ko, vo = ko.transpose(1, 2), vo.transpose(1, 2)
        out.append(shared_prefix_attention(qo, pk, pv, ko, vo, mask, scale, causal=own is None))
        out = [o.reshape(1, -1, heads * head_dim) for o in out]
        return torch.cat(out, 1) if common else out[0]

    return llama_forward(model, plan.input_ids.view(1, -1).to(device),
                         plan.positions.view(1, -1).to(device), attend, plan.last.to(device))


# ---------------------------------------------------------------------------
# Decode without gathering: the running batch's K/V kept contiguous between steps.


class WorkingKV:
    """Running requests' K/V between decode steps: the prefix they all share once, then one
    contiguous row each for the rest, grown by one position per step.

    ``PoolLayer`` gathers every position of every request from the pool in every layer of
    every step. Here a request's K/V is filled from the pool once, when it joins the decode
    batch: the leading positions whose slots every running request shares (a prefix cached
    in the tree) into ``prefix_k``/``prefix_v`` ``[layers, kv_heads, shared, head_dim]``,
    the rest into its row of ``k``/``v`` ``[layers, rows, kv_heads, positions, head_dim]``.
    Each step writes the new token's K/V to its pool slot (the pool stays the source of
    truth) *and* appends it to the row; attention reads the prefix once for the whole batch
    and each row where it lies (``shared_prefix_attention``). Rows are keyed by the
    ``PageTable`` object; a row whose slots no longer match its table is refilled from the
    pool, and a request that does not share the whole stored prefix starts it over.
    """

    def __init__(self, pool: KVPool, grow: int = 256) -> None:
        self.pool, self.grow = pool, grow
        self.clear()

    def clear(self) -> None:
        """Drop the prefix and every row and give the memory back."""
        p = self.pool
        self.tables: list[PageTable] = []   # the request each row belongs to
        self.slots: list[torch.Tensor] = []  # the slots each request holds here, in order
        self.prefix_slots = torch.zeros(0, dtype=torch.int64)
        self.prefix_k = torch.zeros(p.num_layers, p.kv_heads, 0, p.head_dim, dtype=p.dtype,
                                    device=p.device)
        self.prefix_v = torch.zeros_like(self.prefix_k)
        self.k = torch.zeros(p.num_layers, 0, p.kv_heads, 0, p.head_dim, dtype=p.dtype,
                             device=p.device)
        self.v = torch.zeros_like(self.k)

    @property
    def shared(self) -> int:
        """Positions held once, in the prefix, for every row."""
        return int(self.prefix_slots.numel())

    @property
    def lengths(self) -> torch.Tensor:
        """Positions each row's request holds here (the shared prefix included)."""
        return torch.tensor([s.numel() for s in self.slots], dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        """Bytes the prefix and the rows occupy (allocated, including room to grow)."""
        return 2 * (self.k.numel() + self.prefix_k.numel()) * self.k.element_size()

    def check(self, tables: Sequence[PageTable]) -> None:
        """PoolError unless the prefix and every row serving one of ``tables`` (and still
        matching its slots) hold exactly the pool's K/V at those slots."""
        live = {id(t) for t in tables}
        parts = [(f"row {r}", self.k[:, r], self.v[:, r], s[self.shared:])
                 for r, (t, s) in enumerate(zip(self.tables, self.slots, strict=True))
                 if id(t) in live and torch.equal(t.slots[:s.numel()], s)]
        if parts:  # else the next step starts over: nothing here is read again
            parts.append(("prefix", self.prefix_k, self.prefix_v, self.prefix_slots))
        for what, k, v, slots in parts:  # rows not checked are refilled before use
            idx = slots.to(self.pool.device)
            for name, held in (("k", k), ("v", v)):
                pool = getattr(self.pool, name)[:, idx].transpose(1, 2)
                if not torch.equal(held[:, :, :slots.numel()], pool):
                    raise PoolError(f"working {name} {what} differs from the pool at its "
                                    "slots: the pool is the source of truth")

    def sync(self, tables: Sequence[PageTable]) -> list[int]:
        """The prefix and rows for exactly ``tables`` (each holding all positions but its
        last, the new token's); returns, per row, the index in ``tables`` it serves."""
        index = {id(t): i for i, t in enumerate(tables)}
        keep = [r for r, (t, s) in enumerate(zip(self.tables, self.slots, strict=True))
                if id(t) in index and torch.equal(t.slots[:s.numel()], s)
                and s.numel() == len(t) - 1]
        if not keep or _shared_length(tables, self.shared) < self.shared:
            self._start_prefix(tables)  # no row to keep, or the prefix is not everyone's
            keep = []
        if keep != list(range(len(self.tables))):  # compact: kept rows first, in order
            rows = torch.tensor(keep, dtype=torch.int64, device=self.k.device)
            self.k[:, :len(keep)] = self.k[:, rows]
            self.v[:, :len(keep)] = self.v[:, rows]
            self.tables = [self.tables[r] for r in keep]
            self.slots = [self.slots[r] for r in keep]
        have = {id(t) for t in self.tables}
        new = [t for t in tables if id(t) not in have]
        self._reserve(len(self.tables) + len(new), max(len(t) for t in tables) - self.shared)
        for t in new:  # the one gather per request: every position it has past the prefix
            r, old = len(self.tables), t.slots[self.shared:-1]
            idx = old.to(self.pool.device)
            self.k[:, r, :, :old.numel()] = self.pool.k[:, idx].transpose(1, 2)
            self.v[:, r, :, :old.numel()] = self.pool.v[:, idx].transpose(1, 2)
            self.tables.append(t)
            self.slots.append(t.slots[:-1])
        return [index[id(t)] for t in self.tables]

    def _start_prefix(self, tables: Sequence[PageTable]) -> None:
        """Drop every row; hold the positions every one of ``tables`` shares as the prefix."""
        slots = tables[0].slots[:_shared_length(tables)]
        self.clear()
        idx = slots.to(self.pool.device)
        self.prefix_slots = slots
        self.prefix_k = self.pool.k[:, idx].transpose(1, 2).contiguous()
        self.prefix_v = self.pool.v[:, idx].transpose(1, 2).contiguous()

    def _reserve(self, rows: int, positions: int) -> None:
        """Room for ``rows`` rows of ``positions`` positions (regrown in steps of ``grow``)."""
        _, have_rows, _, have_pos, _ = self.k.shape
        if rows <= have_rows and positions <= have_pos:
            return
        rows, positions = max(rows, have_rows), max(positions, have_pos)
        positions = -(-positions // self.grow) * self.grow
        used = max((s.numel() - self.shared for s in self.slots), default=0)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], rows, old.shape[2], positions, old.shape[4])
            grown[:, :len(self.tables), :, :used] = old[:, :len(self.tables), :, :used]
            setattr(self, name, grown)

    def forward(self, model, tables: Sequence[PageTable], tokens: torch.Tensor
                ) -> list[torch.Tensor]:
        """One decode step: ``tokens[i]`` is the new token of ``tables[i]`` (its last
        position). Returns each request's next-token logits, in ``tables`` order.

        The model runs as ``llama_forward``: in each layer, ``attend`` writes the new K/V onto
        the end of each row, then attends over the prefix and the rows; after the last layer
        the new K/V of all layers go into their pool slots in one copy.
        """
        order = self.sync(tables)
        n, device = len(order), self.pool.device
        lengths = self.lengths
        own = lengths - self.shared  # row positions in use before this step
        width = int(own.max()) + 1
        new_slots = torch.stack([tables[i].slots[-1] for i in order]).to(device)
        if bool((own == width - 1).all()):  # rows of one length: one column, no mask
            rows, column, mask = slice(0, n), width - 1, None
        else:
            rows, column = torch.arange(n, device=device), own.to(device)
            mask = torch.zeros(n, 1, 1, width, dtype=self.pool.dtype, device=device)
            mask.masked_fill_((torch.arange(width) > own[:, None]).view(n, 1, 1, width)
                              .to(device), float("-inf"))

        def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
            keys, values = self.k[layer], self.v[layer]
            keys[rows, :, column] = k[:, :, 0]
            values[rows, :, column] = v[:, :, 0]
            out = shared_prefix_attention(q, self.prefix_k[layer], self.prefix_v[layer],
                                          keys[:n, :, :width], values[:n, :, :width], mask,
                                          scale)
            return out.reshape(n, 1, -1)

        logits = llama_forward(model, tokens[order].view(n, 1).to(device),
                               lengths.view(n, 1).to(device), attend)
        # The new K/V of every layer, now in the rows, into their pool slots in one copy.
        k_new, v_new = self.k[:, rows, :, column], self.v[:, rows, :, column]
        if mask is not None:  # advanced indices around a slice: their dimension comes first
            k_new, v_new = k_new.transpose(0, 1), v_new.transpose(0, 1)
        self.pool.k.index_copy_(1, new_slots, k_new)
        self.pool.v.index_copy_(1, new_slots, v_new)
        for r, i in enumerate(order):
            self.slots[r] = tables[i].slots
        out: list[torch.Tensor] = [logits[0]] * n
        for r, i in enumerate(order):
            out[i] = logits[r]
        return out


def _shared_length(tables: Sequence[PageTable], limit: int | None = None) -> int:
    """How many leading slots all ``tables`` have in common, not counting each one's last
    position (its new token), up to ``limit``."""
    n = min(len(t) for t in tables) - 1
    return _common_prefix([t.slots for t in tables], n if limit is None else min(n, limit))


def _common_prefix(seqs: Sequence[torch.Tensor], limit: int) -> int:
    """How many leading entries all ``seqs`` (1-D tensors) have in common, at most ``limit``."""
    n = max(limit, 0)
    first = seqs[0][:n]
    same = torch.ones(n, dtype=torch.bool)
    for x in seqs[1:]:
        same &= x[:n] == first
    return n if bool(same.all()) else int((~same).nonzero()[0])
