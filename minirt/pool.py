"""The KV pool: every layer's keys and values in fixed slots, handed out in pages.

RadixAttention keeps K/V in one big preallocated pool. A request (or a radix-tree
node) never owns tensors, only *slot indices* into the pool:

* ``KVPool``: per-layer K and V tensors of shape ``[num_layers, capacity, kv_heads,
  head_dim]`` on the model's device and dtype, plus a free list of pages
  (``alloc`` / ``free``). One token costs ``2 * layers * kv_heads * head_dim *
  dtype bytes`` (``bytes_per_token``).
* ``PageTable``: one request's map from logical token position to pool slot.
* ``PoolCache``: an adapter to transformers' ``Cache`` interface. Its layers write each new
  token's K/V into the request's slots and hand attention the K/V gathered from its page
  table, so an *unmodified* Hugging Face model's attention runs on pooled K/V:
  RadixAttention changes no math. The forward passes themselves live in
  ``minirt.forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import InvalidIdsError, OutOfMemoryError, PoolError

__all__ = ["KVPool", "PageTable", "PagedBatch", "PoolCache", "PoolLayer", "as_index_tensor"]


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
        self._free_pages = capacity // page_size  # its count, kept: read at every step
        self._ever_allocated = torch.zeros(capacity // page_size, dtype=torch.bool)

    @classmethod
    def for_model(cls, model, capacity_tokens: int, page_size: int = 1) -> KVPool:
        """A pool shaped for ``model`` (layers, KV heads, head dim) on its device and dtype."""
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise PoolError("KVPool supports models whose every layer is full attention; "
                            f"this one has layer types {sorted(set(layer_types))} (the "
                            "engine serves it with cache='window', chapter 11)")
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
        return self._free_pages * self.page_size

    @property
    def num_used(self) -> int:
        """Allocated slots: owned by the radix tree or by running requests."""
        return self.capacity - self.num_free

    def free_slots(self) -> torch.Tensor:
        """Every free slot, ascending (int64, CPU): the free list written out slot by slot."""
        return self._slots_of(self.free_pages())

    def free_pages(self) -> torch.Tensor:
        """Every free page number, ascending.

        The scan runs on the calling thread (numpy's ``nonzero``). torch's splits a map of
        46,592 pages across its OpenMP threads, and in ``minirt.serve``, whose HTTP threads
        share the cores, that parallel region waited 10-15 ms for a core in a third of
        admissions."""
        return torch.from_numpy(self._page_free.numpy().nonzero()[0])

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
        free = self.free_pages()
        if need > free.numel():
            raise OutOfMemoryError(f"alloc({num_tokens}): only {self.num_free} of "
                                   f"{self.capacity} slots are free")
        pages = free[:need]
        self._page_free[pages] = False
        self._free_pages -= need
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
        self._free_pages += page_ids.numel()

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
