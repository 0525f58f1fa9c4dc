"""The decode working set: the running requests' K/V kept contiguous between decode steps.

Gathering every position of every running request from the pool, in every layer of every
step, costs a decode step more than its attention. ``WorkingKV`` fills a request's K/V from
the pool once, when it joins the decode batch: each prefix several running requests share
(their slots are the same, a prefix cached in the tree) once for its group
(``HeldPrefix``), the rest into one row per request, grown by one position a step. The pool
stays the source of truth: each step writes the new K/V there too (``WorkingKV.check``).
``WorkingKV.decode_rows`` lays a decode step out as rows of ``llama_forward``, attention by
``cascade_decode`` (or ``aligned_attention`` in deterministic mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import attention
from .attention import PrefixGroups, aligned_attention, cascade_decode
from .errors import PoolError
from .llama import _Rows
from .pool import KVPool, PageTable

__all__ = ["HeldPrefix", "WorkingKV"]


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
        order = self.sync(tables, attention.CHUNK if deterministic else 1)
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
        span = min(-(-width // attention.CHUNK) * attention.CHUNK, self.k.shape[3])
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
