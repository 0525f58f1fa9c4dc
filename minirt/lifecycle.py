"""The life of a request against the prefix cache and the KV pool, as reusable library code.

The steps of SGLang's and mini-sglang's request path, one method each on ``Lifecycle`` (the
engine of chapter 06 reuses them):

1. ``match``: the longest cached prefix of the prompt -> a handle (not yet safe to use).
2. schedule: which waiting request goes first (``minirt.scheduler``, chapter 07; the
   ``uncached_len`` of each request's last match is what a prefix-aware order reads).
3. ``lock``: ref_count +1 from the handle's node to the root; the prefix turns protected.
4. ``allocate``: pool slots for the uncached gap only, evicting unlocked leaves when short
   (``evict`` hands back slots, which go back on the pool's free list).
5. ``prefill`` on the model through the pool, then ``insert_running``: the new tokens join
   the tree; duplicates another request inserted meanwhile are freed *after* the request's
   page table is re-pointed at the tree's copy; the lock moves to the longer prefix. That
   order is minirt's: SGLang frees the duplicates first and re-points in the same call
   (sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixCache._insert_cache,
   RadixCache.checkpoint`), and mini-sglang frees them without re-pointing (mini-sglang
   `python/minisgl/scheduler/cache.py: CacheManager.cache_req`).
6. ``decode`` steps (a batch of requests of different lengths), then ``finish``: insert
   prompt + output, unlock, free the tail that is not a whole page.
7. ``make_room``: evict (policy-driven, tree-level) versus ``KVPool.free`` (plain return).

``check_integrity`` states the invariants that make this safe: every pool slot is owned
exactly once (free list, tree, or one running request), ref counts equal the number of
running requests whose handle runs through each node, and no page table points at a
free slot. ``state_snapshot``, ``pool_map`` and ``matched_paths`` read that state;
``viz.LifecycleState`` draws it and ``widgets.lifecycle_stepper`` steps through it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .cache import CacheHandle, MatchResult, PrefixCache, check_salt
from .errors import OutOfMemoryError, PoolError, RequestError, StaleHandleError
from .forward import forward_mixed, forward_paged
from .llama import is_llama
from .pool import KVPool, PageTable
from .radix import RadixNode
from .token_ids import TokenIds, as_ids, slots_tensor
from .working_set import WorkingKV

__all__ = [
    "Lifecycle",
    "Request",
    "check_integrity",
    "greedy_reference",
    "greedy_token", "make_cache",
    "matched_paths",
    "node_path",
    "pool_map",
    "state_snapshot",
]

_EMPTY = torch.empty(0, dtype=torch.int64)
_rids = itertools.count(1)


def greedy_token(logits: torch.Tensor) -> int:
    """The most likely next token: how a request picks unless it was given a sampler."""
    return int(logits.argmax())


def _greedy_picks(reqs: Sequence[Request], logits: Sequence[torch.Tensor]) -> list[int | None]:
    """``greedy_token`` of every greedy request's logits in one argmax over the stacked
    rows (None for the others, who sample their own way)."""
    rows = [i for i, r in enumerate(reqs) if r.next_token is greedy_token]
    picks: list[int | None] = [None] * len(reqs)
    if rows:
        tokens = torch.stack([logits[i] for i in rows]).argmax(-1).tolist()
        for i, token in zip(rows, tokens, strict=True):
            picks[i] = token
    return picks


@dataclass(eq=False)
class Request:
    """One generation request and everything the runtime tracks for it.

    ``page_table`` maps positions to slots: the first ``cached_len`` belong to the tree
    (protected by ``handle``), the rest are the request's own ``private`` slots, in order
    (``private`` may end with unused slots of its last page). ``kv_len`` positions have
    K/V in the pool; the last output token's K/V is written by the next decode step.
    A prompt prefilled in chunks has ``kv_len`` between ``cached_len`` and its length,
    and no output until its last chunk.
    """

    rid: str
    prompt: torch.Tensor
    max_new_tokens: int
    eos_token_id: int | None = None
    arrival: int = 0
    state: str = "waiting"  # waiting -> locked -> running -> finished
    output: list[int] = field(default_factory=list)
    match: MatchResult | None = None
    handle: CacheHandle | None = None
    cached_len: int = 0
    kv_len: int = 0
    reused_len: int = 0  # prompt tokens taken from the cache at admission
    page_table: PageTable = field(default_factory=PageTable)
    private: torch.Tensor = field(default_factory=lambda: _EMPTY)
    next_token: Callable[[torch.Tensor], int] = field(default=greedy_token, repr=False)
    salt: str | bytes | None = None  # cache salt: only requests with the same salt share K/V
    prompt_ids: TokenIds = field(init=False, repr=False)  # the prompt, checked once

    def __post_init__(self) -> None:
        # copied and checked once, the ids the cache is handed; the tensor the model reads is
        # made from that copy, so the caller changing its own ids afterwards changes neither
        self.prompt_ids = TokenIds(self.prompt, "prompt")
        self.prompt = as_ids(self.prompt_ids)

    @property
    def tokens(self) -> torch.Tensor:
        """Prompt followed by the tokens generated so far."""
        return torch.cat([self.prompt, torch.tensor(self.output, dtype=torch.int64)])

    def cache_ids(self, n: int) -> TokenIds:
        """The first ``n`` of ``tokens`` as the cache takes them: a view of ``prompt_ids``
        while they are prompt, else all ``n`` (prompt included) copied and checked anew."""
        return self.prompt_ids[:n] if n <= len(self.prompt_ids) else TokenIds(self.tokens[:n])

    @property
    def done(self) -> bool:
        """Generated ``max_new_tokens``, or the end-of-sequence token."""
        return len(self.output) >= self.max_new_tokens or (
            self.eos_token_id is not None and bool(self.output)
            and self.output[-1] == self.eos_token_id)

    @property
    def uncached_len(self) -> int:
        """Prompt tokens the last match did not find: the prefill work (schedule key)."""
        matched = self.match.cached_len if self.match is not None else 0
        return self.prompt.numel() - matched

    def __repr__(self) -> str:
        return (f"Request({self.rid}, state={self.state}, prompt={self.prompt.numel()} tokens, "
                f"cached_len={self.cached_len}, kv_len={self.kv_len}, output={self.output})")


def _slot_tensor(value) -> torch.Tensor:
    """A unit's slots as a tensor: hash blocks hold tensors, radix nodes ``Tokens`` views."""
    return value if isinstance(value, torch.Tensor) else slots_tensor([value])


def node_path(node: RadixNode) -> list[RadixNode]:
    """``node`` and its ancestors, root excluded, root-most first."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Lifecycle:
    """Requests over one model, one ``KVPool`` and one prefix cache (same page size).

    The cache is anything that implements ``cache.PrefixCache``: the ``RadixCache``
    of chapters 03-05, or chapter 08's ``HashCache``.

    Every method either completes or raises leaving pool, tree and requests exactly as
    they were (``state_snapshot`` compares), so a scheduler can simply try and retry.
    """

    mixes = True  # ``step`` prefills and decodes in one forward pass where the model allows

    def __init__(self, model, pool: KVPool, cache: PrefixCache) -> None:
        if cache.page_size != pool.page_size:
            raise PoolError(f"cache page_size {cache.page_size} != pool page_size "
                            f"{pool.page_size}")
        self.model, self.pool, self.cache = model, pool, cache
        self.page_size = pool.page_size
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.working = WorkingKV(pool)  # decode reads running K/V here, not gathered
        self.share_runs = True  # prefill computes a run several requests begin with once
        self.deterministic = False  # same bits whatever is cached or batched (chapter 10)

    # ------------------------------------------------------------ requests
    def new_request(self, prompt, max_new_tokens: int = 1, rid: str | None = None,
                    eos_token_id: int | None = None,
                    next_token: Callable[[torch.Tensor], int] = greedy_token,
                    salt: str | bytes | None = None) -> Request:
        """A waiting request; RequestError if it is empty or could never fit in the pool.

        ``next_token`` turns a position's logits into the token to append (greedy by default);
        ``salt`` keeps its cached K/V apart from every request with another salt.
        """
        ids = as_ids(prompt, "prompt")
        salt = check_salt(salt)
        if ids.numel() == 0:
            raise RequestError("a request needs at least one prompt token")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None and int(ids.max()) >= vocab:
            raise RequestError(f"token id {int(ids.max())} is outside the model's vocabulary "
                               f"of {vocab}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        need = _pages(ids.numel() + max_new_tokens - 1, self.page_size) * self.page_size
        if need > self.pool.capacity:
            raise RequestError(f"the request needs up to {need} slots (prompt {ids.numel()} + "
                               f"{max_new_tokens - 1} generated tokens with K/V) but the pool "
                               f"holds only {self.pool.capacity}")
        rid = rid if rid is not None else f"R{next(_rids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, max_new_tokens, eos_token_id, arrival=next(self._arrivals),
                      next_token=next_token, salt=salt)
        self.requests[rid] = req
        return req

    @property
    def running(self) -> list[Request]:
        """Requests holding a lock or slots (locked or running), by arrival."""
        return [r for r in self.requests.values() if r.state in ("locked", "running")]

    def _require(self, req: Request, *states: str) -> None:
        if self.requests.get(req.rid) is not req:
            raise RequestError(f"{req.rid} does not belong to this lifecycle")
        if req.state not in states:
            raise RequestError(f"{req.rid} is {req.state}; this step needs it "
                               f"{' or '.join(states)}")

    # ------------------------------------------------------------ steps 1-4
    def match(self, req: Request) -> MatchResult:
        """Step 1: find the cached prefix (never the whole prompt: one token must be computed).

        The result is only a candidate: until ``lock``, eviction may still take it.
        """
        self._require(req, "waiting")
        req.match = self.cache.match_prefix(req.prompt_ids[:-1], salt=req.salt)
        return req.match

    def lock(self, req: Request) -> CacheHandle:
        """Step 3: protect the matched prefix (re-matching if the match went stale)."""
        self._require(req, "waiting")
        if req.match is None:
            self.match(req)
        try:
            self.cache.lock(req.match.handle)
        except StaleHandleError:
            self.match(req)
            self.cache.lock(req.match.handle)
        m = req.match
        req.handle, req.cached_len, req.kv_len = m.handle, m.cached_len, m.cached_len
        req.reused_len = m.cached_len
        self._start_tables(req)
        req.state = "locked"
        return m.handle

    def _start_tables(self, req: Request) -> None:
        """The locked request's page table starts with its match's slots (the hook a
        lifecycle with more than one pool overrides)."""
        req.page_table = PageTable(req.match.indices)

    def make_room(self, num_tokens: int) -> torch.Tensor:
        """Evict unlocked leaves until ``num_tokens`` slots are free; returns the evicted slots.

        The tree only hands back slot indices; putting them on the free list is ours.
        OutOfMemoryError (nothing evicted) if free + evictable is not enough.
        """
        short = num_tokens - self.pool.num_free
        if short <= 0:
            return _EMPTY
        if short > self.cache.evictable_size:
            raise OutOfMemoryError(
                f"need {num_tokens} free slots: {self.pool.num_free} free + "
                f"{self.cache.evictable_size} evictable is not enough "
                f"({self.cache.protected_size} cached tokens are locked, "
                f"{self._private_total()} belong to running requests)")
        freed = self.cache.evict(short)
        self.pool.free(freed)
        return freed

    def _alloc(self, num_tokens: int) -> torch.Tensor:
        """Whole pages for ``num_tokens`` tokens, evicting first if the free list is short."""
        need = _pages(num_tokens, self.page_size) * self.page_size
        self.make_room(need)
        return self.pool.alloc(need)

    def allocate(self, req: Request) -> torch.Tensor:
        """Step 4: slots for the uncached gap only (the cached prefix is never re-allocated)."""
        self._require(req, "locked")
        gap = req.prompt.numel() - req.cached_len
        slots = self._alloc(gap)
        req.private = slots
        req.page_table.append(slots[:gap])
        req.state = "running"
        return slots[:gap]

    def admit(self, req: Request) -> None:
        """Steps 1, 3, 4 at once, all or nothing: on OutOfMemoryError the lock is released."""
        self._require(req, "waiting")
        self.lock(req)
        try:
            self.allocate(req)
        except Exception:
            self._unlock_back_to_waiting(req)
            raise

    def _unlock_back_to_waiting(self, req: Request) -> None:
        self.cache.unlock(req.handle)
        req.handle, req.cached_len, req.kv_len, req.reused_len = None, 0, 0, 0
        req.page_table, req.private, req.state = PageTable(), _EMPTY, "waiting"

    # ------------------------------------------------------------ step 5-6: model
    def prefill(self, req: Request, all_logits: bool = False,
                chunk: int | None = None) -> torch.Tensor:
        """Run the uncached prompt tokens through the model, writing their K/V into the pool.

        Appends the next token (``req.next_token``) to ``req.output``; returns the last position's
        logits (or every new position's with ``all_logits=True``). ``chunk``: prefill only the
        next ``chunk`` prompt tokens (chunked prefill); the token comes with the last chunk.
        """
        return self.prefill_batch([req], all_logits, None if chunk is None else [chunk])[0]

    def _prefill_ready(self, reqs: Sequence[Request],
                       chunks: Sequence[int] | None = None) -> tuple[list[Request], list[int]]:
        """``reqs`` as a list and the prompt length each has K/V for after this prefill;
        RequestError unless each is running, not yet fully prefilled, once, and its chunk
        (default: the rest of its prompt) is a positive int no longer than what is left."""
        reqs = list(reqs)
        for req in reqs:
            self._require(req, "running")
            if req.output:
                raise RequestError(f"{req.rid} was already prefilled")
        if len({r.rid for r in reqs}) != len(reqs):
            raise RequestError("a request appears twice in one prefill batch")
        left = [r.prompt.numel() - r.kv_len for r in reqs]
        if chunks is None:
            return reqs, [r.prompt.numel() for r in reqs]
        chunks = list(chunks)
        if len(chunks) != len(reqs):
            raise RequestError(f"{len(chunks)} chunk sizes for {len(reqs)} requests")
        for r, c, n in zip(reqs, chunks, left, strict=True):
            if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= n:
                raise RequestError(f"{r.rid}: a chunk must be an int from 1 to the {n} prompt "
                                   f"tokens left, got {c!r}")
        return reqs, [r.kv_len + c for r, c in zip(reqs, chunks, strict=True)]

    @staticmethod
    def _chunk_table(req: Request, end: int) -> PageTable:
        """``req``'s page table up to position ``end``: what a prefill chunk ending there
        reads (its cached length is the table's length less the chunk's tokens)."""
        return req.page_table if end == len(req.page_table) else PageTable(
            req.page_table.slots[:end])

    def _decode_ready(self, reqs: Sequence[Request]) -> list[Request]:
        """``reqs`` as a list; RequestError unless each is prefilled, not done, once."""
        reqs = list(reqs)
        for r in reqs:
            self._require(r, "running")
            if not r.output or r.kv_len != r.prompt.numel() + len(r.output) - 1:
                raise RequestError(f"{r.rid} must be prefilled before it can decode")
            if r.done:
                raise RequestError(f"{r.rid} is done; finish it instead of decoding")
        if len({r.rid for r in reqs}) != len(reqs):
            raise RequestError("a request appears twice in one decode batch")
        return reqs

    def prefill_batch(self, reqs: Sequence[Request], all_logits: bool = False,
                      chunks: Sequence[int] | None = None) -> list[torch.Tensor]:
        """``prefill`` for several requests in one forward pass: a ragged batch, each with its
        own cached length and new tokens, each reading its own cached prefix from the pool.
        ``chunks``: how many of each one's remaining prompt tokens (default: all)."""
        reqs, ends = self._prefill_ready(reqs, chunks)
        logits = forward_paged(self.model, self.pool,
                               [self._chunk_table(r, e) for r, e in zip(reqs, ends, strict=True)],
                               [r.prompt[r.kv_len:e] for r, e in zip(reqs, ends, strict=True)],
                               last_only=not all_logits, share_runs=self.share_runs,
                               deterministic=self.deterministic)
        self._prefilled(reqs, [lg if lg.dim() == 1 else lg[-1] for lg in logits], ends)
        return logits

    def _prefilled(self, reqs: Sequence[Request], logits: Sequence[torch.Tensor],
                   ends: Sequence[int]) -> None:
        """After their prefill: K/V up to each one's ``end``; the first token of each whose
        prompt is now complete."""
        for req, lg, end in zip(reqs, logits, ends, strict=True):
            req.kv_len = end
            if end == req.prompt.numel():
                req.output.append(req.next_token(lg))

    def _slot_for_next(self, req: Request) -> torch.Tensor | None:
        """A slot for position ``kv_len``: the next unused private one, or a new page."""
        used = len(req.page_table) - req.cached_len
        if used < req.private.numel():
            return None
        return self._alloc(1)

    def decode(self, reqs: Sequence[Request]) -> list[torch.Tensor]:
        """One decode step for a batch (any lengths): feed each last token, append the next.

        Slots are found before the model runs: if free + evictable cannot cover every
        request that needs a new page, OutOfMemoryError is raised before anything changes.
        """
        reqs = self._decode_ready(reqs)
        self._take_decode_slots(reqs)
        logits = forward_paged(self.model, self.pool, [r.page_table for r in reqs],
                               [torch.tensor([r.output[-1]]) for r in reqs],
                               working=self.working, deterministic=self.deterministic)
        self._decoded(reqs, logits)
        return logits

    def _take_decode_slots(self, reqs: Sequence[Request]) -> None:
        """A slot for each request's next position (evicting if short), or OutOfMemoryError
        before anything changes."""
        short = [r for r in reqs if len(r.page_table) - r.cached_len >= r.private.numel()]
        need = len(short) * self.page_size
        if need > self.pool.num_free + self.cache.evictable_size:
            raise OutOfMemoryError(
                f"decode needs {need} new slots for {[r.rid for r in short]}: only "
                f"{self.pool.num_free} free + {self.cache.evictable_size} evictable")
        self.make_room(need)
        taken = [self._slot_for_next(r) for r in reqs]
        for r, slots in zip(reqs, taken, strict=True):
            if slots is not None:
                r.private = torch.cat([r.private, slots])
            used = len(r.page_table) - r.cached_len
            r.page_table.append(r.private[used:used + 1])

    def _decoded(self, reqs: Sequence[Request], logits: Sequence[torch.Tensor]) -> None:
        """After a decode step: one more position with K/V; each request's next token
        (the greedy ones in one argmax)."""
        for r, lg, token in zip(reqs, logits, _greedy_picks(reqs, logits), strict=True):
            r.kv_len += 1
            r.output.append(r.next_token(lg) if token is None else token)

    def step(self, prefill: Sequence[Request], decode: Sequence[Request],
             chunks: Sequence[int] | None = None,
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Prefill ``prefill`` (``chunks`` of their prompts, as ``prefill_batch``) and run one
        decode step for ``decode`` (other requests): a *mixed* step, one forward pass for
        both on a Llama (``forward_mixed``: every weight read once), else ``prefill_batch``
        then ``decode``. Returns both's logits.

        A request whose prompt completes here gets its first token and decodes from the
        next step on. RequestError or OutOfMemoryError before anything changes, as the two
        calls raise.
        """
        if not (prefill and decode and self.mixes and is_llama(self.model)):
            if prefill and decode:  # both checked before either runs
                self._prefill_ready(prefill, chunks)
                self._decode_ready(decode)
            return (self.prefill_batch(prefill, chunks=chunks) if prefill else [],
                    self.decode(decode) if decode else [])
        (prefill, ends), decode = self._prefill_ready(prefill, chunks), self._decode_ready(decode)
        self._take_decode_slots(decode)
        p_logits, d_logits = forward_mixed(
            self.model, self.pool,
            [self._chunk_table(r, e) for r, e in zip(prefill, ends, strict=True)],
            [r.prompt[r.kv_len:e] for r, e in zip(prefill, ends, strict=True)], self.working,
            [r.page_table for r in decode], [torch.tensor([r.output[-1]]) for r in decode],
            self.share_runs, self.deterministic)
        self._prefilled(prefill, p_logits, ends)
        self._decoded(decode, d_logits)
        return p_logits, d_logits

    # ------------------------------------------------------------ insert, finish
    def _insert(self, req: Request):
        """Insert the tokens with K/V; re-point the page table; free this request's duplicates.

        Order matters: the page table points at the tree's slots *before* the duplicate
        slots go back on the free list, so the request never reads a freed slot.
        """
        n = req.kv_len
        slots = req.page_table.slots[:n]
        res = self.cache.insert_prefix(req.cache_ids(n), slots, salt=req.salt)
        aligned = int(res.indices.numel())
        req.page_table.repoint(res.indices)              # 1. re-point first ...
        duplicates = slots[req.cached_len:res.cached_len]
        self.pool.free(duplicates)                       # 2. ... then free duplicates
        req.private = req.private[aligned - req.cached_len:]  # the tree owns the rest now
        return res, aligned

    def insert_running(self, req: Request) -> CacheHandle:
        """Step 5: cache the prefilled tokens while the request keeps running.

        The lock moves from the old handle to the inserted prefix (lock new, then unlock
        old), so other requests can share this prompt right away.
        """
        self._require(req, "running")
        res, aligned = self._insert(req)
        self.cache.lock(res.handle)
        self.cache.unlock(req.handle)
        req.handle, req.cached_len = res.handle, aligned
        return res.handle

    def finish(self, req: Request) -> None:
        """Step 6: insert prompt + output, unlock, and free what could not be inserted.

        Shared pages are not freed here: they stay cached (evictable) until ``make_room``
        evicts them. Only the non-page-aligned tail (and unused slots of the last page)
        goes straight back to the free list.
        """
        self._require(req, "running")
        if not req.output:
            raise RequestError(f"{req.rid} was never prefilled; use abort() to drop it")
        _, aligned = self._insert(req)
        self.cache.unlock(req.handle)
        self.pool.free(req.private)
        req.page_table = PageTable(req.page_table.slots[:aligned])
        req.private, req.handle, req.state = _EMPTY, None, "finished"

    def abort(self, req: Request) -> None:
        """Drop a locked or running request without caching anything it computed."""
        self._require(req, "locked", "running")
        self.cache.unlock(req.handle)
        self.pool.free(req.private)
        req.page_table, req.private, req.handle = PageTable(), _EMPTY, None
        req.state = "finished"

    def run(self, req: Request) -> list[int]:
        """Admit, prefill, insert, decode to the end and finish one request; its output."""
        self.admit(req)
        self.prefill(req)
        self.insert_running(req)
        while not req.done:
            self.decode([req])
        self.finish(req)
        return list(req.output)

    # ------------------------------------------------------------ inspection
    def _private_total(self) -> int:
        return sum(int(r.private.numel()) for r in self.running)

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken pool/cache/request invariant."""
        check_integrity(self.pool, self.cache, self.running)

    def counters(self) -> dict[str, int]:
        """Free, evictable, protected and request-private slot counts (they sum to capacity)."""
        return {"free": self.pool.num_free, "evictable": self.cache.evictable_size,
                "protected": self.cache.protected_size, "private": self._private_total(),
                "capacity": self.pool.capacity}


def greedy_reference(model, prompt, max_new_tokens: int) -> list[int]:
    """Greedy tokens from plain full forwards, no cache of any kind: the ground truth."""
    seq = as_ids(prompt, "prompt").to(next(model.parameters()).device)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            tok = int(model(seq[None]).logits[0, -1].argmax())
            out.append(tok)
            seq = torch.cat([seq, seq.new_tensor([tok])])
    return out


# ---------------------------------------------------------------- invariants


def check_integrity(pool: KVPool, cache: PrefixCache, requests: Iterable[Request]) -> None:
    """The invariants of pool + cache + running requests; AssertionError names the broken one.

    * free + evictable + protected + request-private == capacity;
    * every slot owned exactly once: by the free list, the tree, or one request;
    * a request's page table = the slots of the units (nodes or blocks) its handle holds,
      then its private slots; no page table points at a free slot;
    * each unit's ref_count = the number of running handles holding it, and the cache's
      own invariants hold.
    """
    def require(cond: bool, what: str) -> None:
        if not cond:
            raise AssertionError(f"integrity: {what}")

    cache.check_integrity()
    reqs = [r for r in requests if r.state in ("locked", "running")]
    private = sum(int(r.private.numel()) for r in reqs)
    free, ev, pr = pool.num_free, cache.evictable_size, cache.protected_size
    total = free + ev + pr + private
    require(total == pool.capacity,
            f"free {free} + evictable {ev} + protected {pr} + private {private} = {total} "
            f"!= capacity {pool.capacity}: " + ("some slots are counted twice" if total >
            pool.capacity else "slots counted nowhere: leaked, or missing from `private`"))
    owner = torch.full((pool.capacity,), -1, dtype=torch.int64)
    names = ["free list", "tree"] + [r.rid for r in reqs]
    for who, slots in enumerate([pool.free_slots(), cache.all_values()]
                                + [r.private for r in reqs]):
        if not slots.numel():
            continue
        uniq, counts = slots.unique(return_counts=True)
        require(bool((counts == 1).all()),
                f"slot {int(uniq[counts > 1][0]) if (counts > 1).any() else -1} "
                f"listed twice by {names[who]}")
        clash = slots[owner[slots] >= 0]
        require(clash.numel() == 0, f"slot {int(clash[0]) if clash.numel() else -1} owned "
                f"twice: by {names[int(owner[clash[0]])] if clash.numel() else '?'} and "
                f"by {names[who]}")
        owner[slots] = who
    leaked = (owner < 0).nonzero().flatten()
    require(leaked.numel() == 0, f"slots {leaked[:8].tolist()} leaked: owned by nobody")
    expected_refs: dict[int, int] = {}
    for r in reqs:
        require(r.handle is not None, f"{r.rid} is {r.state} without a handle")
        try:
            path = cache.held_by(r.handle)
        except StaleHandleError:
            raise AssertionError(f"integrity: {r.rid}'s handle is stale (evicted)") from None
        tree_slots = torch.cat([_slot_tensor(n.value) for n in path]) if path else _EMPTY
        require(r.cached_len == tree_slots.numel() == r.handle.cached_len,
                f"{r.rid}: cached_len {r.cached_len} != its handle's prefix {tree_slots.numel()}")
        table = r.page_table.slots
        if table.numel():
            freed = table[pool.is_free(table)]
            require(freed.numel() == 0, f"{r.rid}'s page table points at free slots "
                    f"{freed[:8].tolist()} (use after free)")
        require(torch.equal(table[:r.cached_len], tree_slots),
                f"{r.rid}: page table does not start with its handle's tree slots")
        mine = table[r.cached_len:]
        require(mine.numel() <= r.private.numel()
                and torch.equal(mine, r.private[:mine.numel()]),
                f"{r.rid}: page table beyond the cached prefix is not its private slots")
        for n in path:
            expected_refs[id(n)] = expected_refs.get(id(n), 0) + 1
    for n in cache.units():
        require(n.ref_count == expected_refs.get(id(n), 0),
                f"{n} has ref_count {n.ref_count} but {expected_refs.get(id(n), 0)} "
                "running requests use it")


# ---------------------------------------------------------------- snapshots


def state_snapshot(lc: Lifecycle) -> tuple:
    """Everything observable about pool, tree and requests, as nested tuples (for ==).

    The cache is recorded by its own ``snapshot`` (the radix tree token by token, so a
    ``split_at`` done by a match, which moves metadata only, does not count as a change).
    """
    reqs = tuple(
        (r.rid, r.state, r.cached_len, r.kv_len, tuple(r.output), tuple(r.page_table.tolist()),
         tuple(r.private.tolist()), None if r.handle is None else r.handle.cached_len)
        for r in lc.requests.values())
    return lc.pool.snapshot(), lc.cache.snapshot(), reqs


def matched_paths(lc: Lifecycle) -> list[RadixNode]:
    """Nodes on the matched paths of waiting requests, root included, in tree order.

    Only matches still in the tree count: a handle whose node was evicted (or whose
    cache was reset) is stale and shows nothing.
    """
    live = {id(n) for n in lc.cache.nodes()}
    on_path: set[int] = set()
    for req in lc.requests.values():
        m = req.match
        if req.state == "waiting" and m is not None and m.cached_len and id(m.handle.node) in live:
            on_path.update(id(n) for n in node_path(m.handle.node))
    if not on_path:
        return []
    return [lc.cache.root] + [n for n in lc.cache.nodes() if id(n) in on_path]


def pool_map(lc: Lifecycle) -> list[str]:
    """The owner of every slot: 'free', 'cached' (evictable tree), 'protected', or a request id."""
    labels = ["?"] * lc.pool.capacity
    for s in lc.pool.free_slots().tolist():
        labels[s] = "free"
    for n in lc.cache.units():
        for s in n.value.tolist():
            labels[s] = "protected" if n.ref_count else "cached"
    for r in lc.running:
        for s in r.private.tolist():
            labels[s] = r.rid
    return labels


# ---------------------------------------------------------------- a cache by name

from .cache import RadixCache  # noqa: E402 - only make_cache needs these two
from .eviction import EvictionPolicy  # noqa: E402


def make_cache(kind: str, page_size: int, policy: str | EvictionPolicy = "lru") -> PrefixCache:
    """A prefix cache for a ``Lifecycle``: "radix" (``RadixCache``, evicting by ``policy``) or
    "hash" (chapter 08's ``HashCache``, free-queue order); ValueError for anything else."""
    if kind == "radix":
        return RadixCache(page_size=page_size, policy=policy)
    if kind == "hash":
        if policy != "lru":
            raise ValueError(f"policy {policy!r} applies to the radix cache only: the hash "
                             "cache evicts in free-queue order")
        from .hashcache import HashCache  # chapter 08's module, loaded only when asked for

        return HashCache(block_size=page_size)
    raise ValueError(f"cache must be 'radix', 'hash' or 'window', got {kind!r}")
