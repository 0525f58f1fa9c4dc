"""The window lifecycle: chapter 04's request lifecycle on ``hybrid.WindowRadixCache``, for a
model that mixes full-attention and sliding-window layers.

``WindowLifecycle`` keeps the full layers' K/V and the window layers' in two ``KVPool``s,
with ``forward.forward_windowed`` as its forward: a request frees its own window K/V as
soon as they leave its window (vLLM's ``remove_skipped_blocks``), keeps them where a later
request may branch, and inserts the rest as tombstones. ``Engine(cache="window")`` serves
through it (chosen by itself for a model whose config has sliding layers); ``WindowRunner``
runs one request at a time through it, for the chapter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import OutOfMemoryError, PoolError, RequestError, StaleHandleError
from .forward import LayerKV, forward_windowed
from .hybrid import NO_SLOT, HybridSpec, WindowMatch, WindowRadixCache, has_window_layers
from .lifecycle import Lifecycle, Request, _greedy_picks, greedy_token
from .pool import KVPool, PageTable

__all__ = ["WindowLifecycle", "WindowRunner"]


class WindowLifecycle(Lifecycle):
    """Chapter 04's request lifecycle for a model with window layers, over two ``KVPool``s.

    Full layers keep K/V in ``pools["full"]`` (``capacity`` tokens, also ``self.pool``),
    window layers in ``pools["window"]`` (``window_capacity``, default ``capacity``); the
    cache is a ``WindowRadixCache``; each request has a page table per pool (the window
    one in ``window_tables``, ``NO_SLOT`` where it holds nothing). The forward is
    ``forward.forward_windowed``: window layers read only their last ``W - 1`` positions.
    Page size 1 (tokens); no cache salts; greedy or sampled picks as the base class.

    After each forward a request frees its own window K/V that left its window (vLLM's
    ``remove_skipped_blocks``), except the *branching range* just before its longest
    full-K/V hit, where a later request may branch (SGLang's ``swa_branching_seqlen``);
    what it inserts (its prompt at prefill, everything at ``finish``) has tombstones where
    it freed. ``window_aware=False`` is the baseline keeping every layer's K/V of every
    cached token: no early frees, so no tombstones but those eviction makes.
    """

    mixes = False  # ``step`` runs its prefill and its decode as two ``forward_windowed``s

    def __init__(self, model, capacity: int, window_capacity: int | None = None,
                 window_aware: bool = True) -> None:
        if not has_window_layers(model):
            raise PoolError("the window cache serves models with sliding-window layers "
                            "(config.layer_types); this one has none: use cache='radix'")
        spec = HybridSpec.from_config(model.config.get_text_config(decoder=True))
        c = model.config.get_text_config(decoder=True)
        kv_heads = c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        param = next(model.parameters())
        self.pools = {
            kind: KVPool(max(1, len(layers)), kv_heads, head_dim, cap,
                         dtype=param.dtype, device=param.device)
            for kind, layers, cap in (
                ("full", spec.full_layers, capacity),
                ("window", spec.window_layers,
                 capacity if window_capacity is None else window_capacity))}
        where = {i: (kind, j) for kind, layers in (("full", spec.full_layers),
                                                  ("window", spec.window_layers))
                 for j, i in enumerate(layers)}
        self.layers = [LayerKV(self.pools[where[i][0]], where[i][1], int(where[i][0] == "window"),
                               spec.window if where[i][0] == "window" else None)
                       for i in range(len(spec.layer_types))]
        super().__init__(model, self.pools["full"], WindowRadixCache(spec.window))
        self.spec, self.window_aware = spec, window_aware
        self.window_tables: dict[str, list[int]] = {}
        self._branch: dict[str, range] = {}
        self.evicted_tokens = self.evictions = 0  # full tokens evicted by make_room
        self.peak_window_used = 0  # the window pool's most used slots after a forward

    # -------------------------------------------------- requests and memory
    def _extra_window(self, max_new_tokens: int) -> int:
        """Window slots a request needs past its prompt's: its decode steps' own K/V, of
        which at most ``need + 1`` are held at once when window-aware."""
        extra = max_new_tokens - 1
        return min(extra, self.spec.need + 1) if self.window_aware else extra

    def new_request(self, prompt, max_new_tokens: int = 1, rid: str | None = None,
                    eos_token_id: int | None = None, next_token=greedy_token,
                    salt: str | bytes | None = None) -> Request:
        """The base class's, and RequestError for a salt or a request the window pool can
        never hold (its prompt's window K/V are all written at prefill)."""
        if salt is not None:
            raise RequestError("the window cache keeps no cache salts: every request shares")
        req = super().new_request(prompt, max_new_tokens, rid, eos_token_id, next_token)
        need = req.prompt.numel() + self._extra_window(max_new_tokens)
        if need > self.pools["window"].capacity:
            del self.requests[req.rid]
            raise RequestError(f"the request needs up to {need} window-pool slots but the "
                               f"window pool holds only {self.pools['window'].capacity}")
        return req

    def make_room(self, num_tokens: int, window: int = 0) -> torch.Tensor:
        """Evict until ``num_tokens`` full and ``window`` window slots are free (full first:
        a leaf takes both kinds with it); returns the evicted full slots. OutOfMemoryError,
        nothing evicted, if free + evictable of either kind is not enough."""
        short_f = num_tokens - self.pools["full"].num_free
        short_w = window - self.pools["window"].num_free
        if short_f > self.cache.evictable_full or short_w > self.cache.evictable_window:
            raise OutOfMemoryError(
                f"need {num_tokens} full and {window} window slots: free "
                f"{self.pools['full'].num_free} and {self.pools['window'].num_free}, "
                f"evictable {self.cache.evictable_full} and {self.cache.evictable_window}")
        freed: list[int] = []
        if short_f > 0:
            freed += self._evict(full=short_f)
        short_w = window - self.pools["window"].num_free  # a removed leaf freed some
        if short_w > 0:
            freed += self._evict(window=short_w)
        if freed:
            self.evictions += 1
            self.evicted_tokens += len(freed)
        return torch.tensor(freed, dtype=torch.int64)

    def _evict(self, full: int = 0, window: int = 0) -> list[int]:
        freed_full, freed_window = self.cache.evict(full=full, window=window)
        for kind, slots in (("full", freed_full), ("window", freed_window)):
            if slots:
                self.pools[kind].free(torch.tensor(slots, dtype=torch.int64))
        return freed_full

    def flush(self) -> int:
        """Evict every unlocked cached token; returns how many full tokens went."""
        return len(self._evict(full=self.cache.evictable_full))

    def fits(self, req: Request, match: WindowMatch, running: Sequence[Request]) -> bool:
        """Can both pools hold ``req`` to its last token beside ``running``? (The engine's
        admission test: each running request keeps a reservation for what its remaining
        steps may need, and locking the match pins its unlocked part.)"""
        def left(r: Request) -> int:  # full slots its remaining steps still take
            return r.prompt.numel() + r.max_new_tokens - 1 - r.cached_len - r.private.numel()

        def held(r: Request) -> int:  # its own window slots that stay its own
            if r.kv_len == r.cached_len:  # admitted, not prefilled: the gap's slots go to
                return 0                  # the tree or back to the pool after prefill
            return sum(s != NO_SLOT for s in self.window_tables[r.rid][r.cached_len:])

        res_f = sum(left(r) for r in running)
        res_w = sum(min(left(r), max(0, self.spec.need + 1 - held(r))) if self.window_aware
                    else left(r) for r in running)
        pin_f = pin_w = 0
        node = match.handle.node
        while node.parent is not None:
            if node.ref_count == 0:
                pin_f += node.length
                pin_w += node.length if node.window_value is not None else 0
            node = node.parent
        gap = req.prompt.numel() - match.cached_len
        cache, pools = self.cache, self.pools
        return (gap + req.max_new_tokens - 1 + pin_f
                <= pools["full"].num_free + cache.evictable_full - res_f
                and gap + self._extra_window(req.max_new_tokens) + pin_w
                <= pools["window"].num_free + cache.evictable_window - res_w)

    # -------------------------------------------------- steps 1-4
    def match(self, req: Request) -> WindowMatch:
        """Step 1: the longest usable prefix of all but the last prompt token."""
        self._require(req, "waiting")
        req.match = self.cache.match_prefix(req.prompt_ids[:-1])
        return req.match

    def _start_tables(self, req: Request) -> None:
        """Step 3's page tables (``Lifecycle.lock`` calls this): both start with the match's
        slots; the branching range is noted."""
        m = req.match
        req.page_table = PageTable(m.full)
        self.window_tables[req.rid] = list(m.window)
        self._branch[req.rid] = range(max(m.cached_len, m.full_len - self.spec.need), m.full_len)

    def allocate(self, req: Request) -> torch.Tensor:
        """Step 4: full and window slots for the uncached gap (evicting if short)."""
        self._require(req, "locked")
        gap = req.prompt.numel() - req.cached_len
        self.make_room(gap, gap)
        slots = self.pools["full"].alloc(gap)
        self.window_tables[req.rid] += self.pools["window"].alloc(gap).tolist()
        req.private = slots
        req.page_table.append(slots)
        req.state = "running"
        return slots

    def _unlock_back_to_waiting(self, req: Request) -> None:
        super()._unlock_back_to_waiting(req)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self.window_tables.pop(req.rid, None)
        self._branch.pop(req.rid, None)

    # -------------------------------------------------- the model
    def _tables(self, req: Request) -> list[torch.Tensor]:
        return [req.page_table.slots, torch.tensor(self.window_tables[req.rid])]

    def _left_window(self, req: Request) -> None:
        """Free ``req``'s own window K/V that no later position of it reads (positions
        before ``kv_len - need``), but for its branching range."""
        self.peak_window_used = max(self.peak_window_used, self.pools["window"].num_used)
        if not self.window_aware:
            return
        table, branch = self.window_tables[req.rid], self._branch[req.rid]
        dead = [p for p in range(req.cached_len, max(req.cached_len, req.kv_len - self.spec.need))
                if table[p] != NO_SLOT and p not in branch]
        if dead:
            self.pools["window"].free(torch.tensor([table[p] for p in dead]))
            for p in dead:
                table[p] = NO_SLOT

    def prefill_batch(self, reqs: Sequence[Request], all_logits: bool = False,
                      chunks: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Prefill several requests (``chunks`` of their prompts, as the base class's) in
        one ``forward_windowed`` (last logits only), then free what left each one's window."""
        if all_logits:
            raise RequestError("the window lifecycle returns last-position logits only")
        reqs, ends = self._prefill_ready(reqs, chunks)
        logits = forward_windowed(self.model, self.layers,
                                  [[t[:e] for t in self._tables(r)]
                                   for r, e in zip(reqs, ends, strict=True)],
                                  [r.prompt[r.kv_len:e] for r, e in zip(reqs, ends, strict=True)])
        self._prefilled(reqs, logits, ends)
        for req in reqs:
            self._left_window(req)
        return logits

    def decode(self, reqs: Sequence[Request]) -> list[torch.Tensor]:
        """One decode step for a batch: a full and a window slot each (OutOfMemoryError
        before anything changes if they cannot be found), the forward, the frees."""
        reqs = self._decode_ready(reqs)
        n = len(reqs)
        self.make_room(n, n)
        full, window = self.pools["full"].alloc(n), self.pools["window"].alloc(n).tolist()
        for r, f, w in zip(reqs, full, window, strict=True):
            r.private = torch.cat([r.private, f.view(1)])
            r.page_table.append(f.view(1))
            self.window_tables[r.rid].append(w)
        logits = forward_windowed(self.model, self.layers, [self._tables(r) for r in reqs],
                                  [torch.tensor([r.output[-1]]) for r in reqs])
        for r, lg, token in zip(reqs, logits, _greedy_picks(reqs, logits), strict=True):
            r.kv_len += 1
            r.output.append(r.next_token(lg) if token is None else token)
            self._left_window(r)
        return logits

    # -------------------------------------------------- insert, finish, abort
    def _insert(self, req: Request):
        """Insert the tokens with K/V, both kinds; re-point both tables at the tree's
        slots, then free this request's duplicates (the base class's order)."""
        n, table = req.kv_len, self.window_tables[req.rid]
        res = self.cache.insert_prefix(req.cache_ids(n), req.page_table.slots[:n], table[:n])
        tree_full, tree_window = self.cache.path_slots(res.handle)
        req.page_table.repoint(tree_full)                # 1. re-point first ...
        table[:n] = tree_window
        self.pools["full"].free(torch.tensor(res.free_full, dtype=torch.int64))  # 2. ... free
        self.pools["window"].free(torch.tensor(res.free_window, dtype=torch.int64))
        req.private = req.private[n - req.cached_len:]   # the tree owns the rest now
        return res, n

    def finish(self, req: Request) -> None:
        super().finish(req)
        self._forget(req)

    def abort(self, req: Request) -> None:
        self._require(req, "locked", "running")
        mine = [s for s in self.window_tables[req.rid][req.cached_len:] if s != NO_SLOT]
        self.pools["window"].free(torch.tensor(mine, dtype=torch.int64))
        super().abort(req)
        self._forget(req)

    # -------------------------------------------------- invariants
    def check_integrity(self) -> None:
        """The tree's invariants for both kinds; every used slot of each pool owned once,
        by the tree or one running request, none free; each running request's tables
        start with its handle's path and hold every window K/V its next token reads;
        every lock is a running request's."""
        def require(cond: bool, what: str) -> None:
            if not cond:
                raise AssertionError(f"window integrity: {what}")

        self.cache.check_integrity()
        owned = dict(zip(("full", "window"), self.cache.all_slots(), strict=True))
        locks: dict[int, int] = {}
        for r in self.running:
            table = self.window_tables[r.rid]
            require(len(table) == len(r.page_table), f"{r.rid}: two tables of one length")
            try:
                full, window = self.cache.path_slots(r.handle)
            except StaleHandleError:
                raise AssertionError(f"window integrity: {r.rid}'s handle is stale") from None
            # (another request's insert may have refilled a tombstone on the path since)
            require(r.page_table.slots[:r.cached_len].tolist() == full
                    and all(s in (t, NO_SLOT) for s, t in zip(table, window, strict=False)),
                    f"{r.rid}: its tables do not start with its handle's tree slots")
            require(r.page_table.slots[r.cached_len:].tolist() == r.private.tolist(),
                    f"{r.rid}: full table past the cached prefix is not its private slots")
            reads = table[max(0, r.kv_len - self.spec.need):r.kv_len]
            require(NO_SLOT not in reads, f"{r.rid} lost window K/V its next token reads")
            owned["full"] += r.private.tolist()
            owned["window"] += [s for s in table[r.cached_len:] if s != NO_SLOT]
            locks[r.handle.node.id] = locks.get(r.handle.node.id, 0) + 1
        for kind, slots in owned.items():
            pool = self.pools[kind]
            require(len(set(slots)) == len(slots), f"a {kind} slot is owned twice")
            require(not slots or not bool(pool.is_free(torch.tensor(slots)).any()),
                    f"a {kind} slot the tree or a request owns is free")
            require(pool.num_used == len(slots),
                    f"{kind} pool: {pool.num_used} used, {len(slots)} owned (leaked)")
        require(locks == {i: held for i, (_, held) in self.cache._locks.items()},
                "the tree's locks are the running requests' handles")


class WindowRunner:
    """One request at a time through a ``WindowLifecycle``: the chapter's runner.

    ``model``: a Llama-shaped transformers model whose config has ``layer_types`` and
    ``sliding_window`` (``with_sliding_window`` makes one); ``full_capacity`` and
    ``window_capacity``: the two pools' slots. ``window_aware=False`` is the baseline that
    keeps every layer's K/V of every cached token: run both on one trace to see the memory
    saved and the hits lost. ``check``: the integrity check after every step.
    """

    def __init__(self, model, full_capacity: int, window_capacity: int,
                 window_aware: bool = True, check: bool = False) -> None:
        self.lifecycle = WindowLifecycle(model, full_capacity, window_capacity, window_aware)
        self.model, self.spec, self.check = model, self.lifecycle.spec, check
        self.cache, self.pools = self.lifecycle.cache, self.lifecycle.pools

    @property
    def peak_window_used(self) -> int:
        return self.lifecycle.peak_window_used

    def bytes_per_token(self, kind: str) -> int:
        layers = self.spec.full_layers if kind == "full" else self.spec.window_layers
        pool = self.pools[kind]
        return 2 * len(layers) * pool.kv_heads * pool.head_dim * pool.k.element_size()

    @property
    def cached_bytes(self) -> int:
        """Bytes of K/V the tree holds: full tokens at the full layers' cost, window tokens
        at the window layers' (the baseline holds window K/V for every token)."""
        return (self.cache.full_tokens * self.bytes_per_token("full")
                + self.cache.window_tokens * self.bytes_per_token("window"))

    def _step(self, fn, *args) -> None:
        fn(*args)
        if self.check:
            self.lifecycle.check_integrity()

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy ``max_new_tokens`` tokens for ``prompt``, with the prefix cache. On an
        error the request's slots and lock are given back (the tree keeps its state)."""
        lc = self.lifecycle
        req = lc.new_request(prompt, max_new_tokens)
        try:
            self._step(lc.admit, req)
            self._step(lc.prefill, req)
            self._step(lc.insert_running, req)
            while not req.done:
                self._step(lc.decode, [req])
            self._step(lc.finish, req)
        except BaseException:
            if req.state in ("locked", "running"):
                lc.abort(req)
            raise
        finally:
            lc.requests.pop(req.rid, None)
        return list(req.output)

    def check_integrity(self) -> None:
        self.lifecycle.check_integrity()

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return [self.generate(p, max_new_tokens) for p in prompts]
