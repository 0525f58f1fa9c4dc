"""A small serving engine: prefix-cached prefill and batched decode on a real model.

The engine is online: ``Engine.submit(request)`` queues a request at any time (it
returns a ``RequestHandle``), ``Engine.cancel(handle)`` drops one and frees what it
held, and ``Engine.step()`` runs one scheduling step of the chapter-04 lifecycle for
everything submitted so far, the way mini-sglang's scheduler loop does:

1. *schedule*: waiting requests are admitted in the scheduler's order (first come,
   first served by default; ``schedule=`` picks a chapter-07 policy) while the step's
   token budget (uncached prompt tokens to prefill) and the pool allow;
2. *admit*: match all but the last prompt token, lock the match, allocate slots
   for the gap only (evicting unlocked leaves when the free list is short);
3. *prefill and decode* in one forward pass (``Lifecycle.step``): the uncached tokens of
   everything admitted, through the pool, and the next token of every request already
   running, attention reading its K/V from a contiguous working copy
   (``working_set.WorkingKV``). Each admitted request gets its first output token (that is the
   time to first token, TTFT) and its prompt goes into the tree so that requests admitted
   later can share it (a request that would share whole pages of a prompt of its own
   batch waits one step for them; a shorter run of new tokens that several begin with is
   computed once, ``forward.PrefillPlan``); it decodes from the next step on. With
   ``chunked_prefill=True`` the prompt that would overflow the budget is cut to fill it,
   and its other parts go first in the next steps: its first token comes with the last;
4. *finish*: insert prompt + output, unlock, free the tail that is not a whole page.

``Engine.generate(requests)`` submits a list of requests (all arriving now) and steps
until they are all done. With ``use_cache=False`` the same loop computes every prompt
in full and caches nothing: the baseline the savings are measured against.
``cache="hash"`` runs the same loop on chapter 08's block-hash cache (vLLM's design)
instead of the radix tree; ``cache="window"`` (chosen by itself for a model with
sliding-window layers) on chapter 11's window-aware tree over two pools
(``minirt.window_lifecycle.WindowLifecycle``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .cache import MatchResult, RadixCache
from .errors import InvalidIdsError, ModelError, PoolError, RequestError, TierError
from .eviction import EvictionPolicy
from .lifecycle import Lifecycle, greedy_token, make_cache, node_path
from .lifecycle import Request as LifecycleRequest
from .model import fuse_projections
from .pool import KVPool
from .radix import common_prefix_len
from .request import (
    GenerateResult,
    Request,
    RequestMetrics,
    RequestResult,
    chat_prompt_ids,
    check_request,
    eos_token_id,
    sampler,
    summarize,
)
from .scheduler import Scheduler, make_scheduler
from .token_ids import as_ids

__all__ = ["Engine", "RequestHandle", "StepOutput"]

TokenCallback = Callable[[str, int], None]


class _CountingLifecycle(Lifecycle):
    """The chapter-04 lifecycle, counting the tokens ``make_room`` evicts."""

    evicted_tokens = 0
    evictions = 0

    def make_room(self, num_tokens: int) -> torch.Tensor:
        freed = super().make_room(num_tokens)
        if freed.numel():
            self.evictions += 1
            self.evicted_tokens += int(freed.numel())
        return freed


@dataclass(eq=False)
class RequestHandle:
    """A submitted request, followed while it runs (``Engine.submit`` returns it).

    ``status``: "waiting" (queued), "prefilling" (admitted, a chunked prompt part-way),
    "running" (prefilled, decoding), "finished" or "cancelled". ``output_ids`` grows as
    steps produce tokens; ``result`` is complete once ``done``. ``arrival`` (a
    ``time.perf_counter()`` value) is where its TTFT and latency count from.
    """

    rid: str
    request: Request
    arrival: float
    lc: LifecycleRequest = field(repr=False)
    result: RequestResult = field(repr=False)
    final_slots: int = 0        # slots it holds at most: pages(prompt + max_new - 1)
    status: str = "waiting"
    stopped: bool = False       # one of request.stop appeared in the output
    failure: list[str] = field(default_factory=list, repr=False)  # why its sampler raised
    ttft: float = 0.0
    prefill_time: float = 0.0
    loaded_tokens: int = 0      # prompt tokens loaded back from a host tier at admission

    @property
    def done(self) -> bool:
        """Finished or cancelled: ``result`` will not change any more."""
        return self.status in ("finished", "cancelled")

    @property
    def output_ids(self) -> list[int]:
        """The tokens generated so far."""
        return list(self.lc.output)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the cache at admission (0 while waiting)."""
        return self.lc.reused_len


@dataclass
class StepOutput:
    """What one ``Engine.step`` did: the tokens it produced, in order, as (rid, token),
    the prompt tokens it prefilled, as (rid, how many), the requests whose prompts it
    completed (admitted, prefilled, each given its first token; a chunked prompt counts at
    its last part), the requests that finished, and the seconds it spent admitting and in
    its forward pass (``minirt.serve --step-log``)."""

    tokens: list[tuple[str, int]] = field(default_factory=list)
    prefilled: list[tuple[str, int]] = field(default_factory=list)
    admitted: list[RequestHandle] = field(default_factory=list)
    finished: list[RequestHandle] = field(default_factory=list)
    admit_s: float = 0.0
    forward_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class Engine:
    """Serves requests on ``model`` with a KV pool of ``capacity`` tokens and a radix cache.

    ``token_budget`` caps the uncached prompt tokens prefilled in one scheduling step,
    beside its running requests' decode (the first request of a step is always admitted, so a
    prompt longer than the budget still runs, alone in its step). With ``chunked_prefill``
    the prompt that would overflow the budget is cut instead: its first tokens fill the
    step and the rest follow in the next steps, before anything newer (a request admitted
    this way holds all its slots from admission on). ``check`` runs the
    pool/cache integrity check after every step (for tests). The cache persists across
    ``generate`` calls; ``flush`` empties it. ``schedule`` (a policy name or a
    ``minirt.scheduler.Scheduler``) orders the waiting queue before each admission step;
    the default "fcfs" admits in arrival order. ``cache``: "radix" (the tree, evicting by
    ``policy``) or "hash" (vLLM's hashed blocks of ``page_size`` tokens, free-queue order).
    The engine fuses the model's q/k/v and gate/up projections and prepacks its weights
    (``minirt.model.fuse_projections``: same weights, same logits, faster GEMMs).
    The engine is not thread-safe: one thread calls ``submit``, ``cancel`` and ``step``
    (``minirt.serve`` runs it in one). ``host_capacity`` (tokens; default None: no host
    tier) puts chapter 09's host tier under the pool: ``cache`` and ``host_tier`` are then
    a ``minirt.tiers.HiRadixCache`` with ``write_policy`` and ``write_through_threshold``
    (``host_tier`` is None without one); bad tier settings raise TierError.
    ``deterministic``: every request's logits are the same bits whatever is cached, whatever
    else is in its batch and however its steps are split (``minirt.forward``'s switch, a
    Llama only; chapter 10).
    ``cache="window"`` (the default, ``cache=None``, for a model whose config has sliding
    layers; "radix" otherwise): chapter 11's ``window_lifecycle.WindowLifecycle``, full layers' K/V
    in a pool of ``capacity`` tokens, window layers' in one of ``window_capacity`` (default
    ``capacity``); page size 1, LRU, no host tier, salt or deterministic mode (PoolError,
    TierError, ModelError: nothing is built).
    ``speculative`` (None, a ``minirt.speculative.SpeculativeConfig`` or a dict of its fields):
    prompt-lookup drafts, verified beside the step's prefills, rejected K/V rolled back
    (chapter 13); a setting or combination it does not run is refused before anything is built.
    """

    def __init__(self, model, tokenizer=None, capacity: int = 8192, page_size: int = 1,
                 policy: str | EvictionPolicy = "lru", use_cache: bool = True,
                 token_budget: int = 2048, check: bool = False,
                 schedule: str | Scheduler = "fcfs", cache: str | None = None,
                 host_capacity: int | None = None, write_policy: str = "write_through",
                 write_through_threshold: int = 1, deterministic: bool = False,
                 window_capacity: int | None = None, chunked_prefill: bool = False,
                 speculative=None) -> None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) \
                or token_budget < 1:
            raise RequestError(f"token_budget must be a positive int, got {token_budget!r}")
        from .hybrid import has_window_layers

        if cache is None:
            cache = "window" if has_window_layers(model) else "radix"
        self.windowed, spec = cache == "window", None
        if speculative is not None:  # chapter 13's module, loaded when asked for
            from .speculative import Speculator, check_speculative

            spec = check_speculative(speculative, model, cache)
        if self.windowed:
            _check_window_settings(page_size, policy, deterministic)
        if host_capacity is not None:
            from .tiers import check_tier_settings  # chapter 09's module, loaded when asked for

            check_tier_settings(capacity, host_capacity, page_size, write_policy,
                                write_through_threshold)
            if cache != "radix":
                raise TierError(f"the host tier sits under the radix cache; cache={cache!r} "
                                "has none")
        self.scheduler = make_scheduler(schedule)
        self.model, self.tokenizer = model, tokenizer
        self.host_tier = None  # the cache itself when it has a host tier
        if self.windowed:  # chapter 11: two pools, the window-aware tree
            from .window_lifecycle import WindowLifecycle

            self.lifecycle = WindowLifecycle(model, capacity, window_capacity)
            self.pool, self.cache = self.lifecycle.pool, self.lifecycle.cache
        else:
            self.pool = KVPool.for_model(model, capacity, page_size)
            if host_capacity is None:
                self.cache = make_cache(cache, page_size, policy)
            else:
                from .tiers import HiRadixCache

                self.cache = self.host_tier = HiRadixCache(
                    self.pool, host_capacity, write_policy=write_policy,
                    write_through_threshold=write_through_threshold, policy=policy)
            self.lifecycle = _CountingLifecycle(model, self.pool, self.cache)
        fuse_projections(model)  # q/k/v and gate/up as one GEMM each: same logits
        if self.host_tier is not None:  # load-backs make room the way admissions do
            self.host_tier.make_room = self.lifecycle.make_room
        self.use_cache, self.token_budget, self.check = use_cache, token_budget, check
        if not isinstance(chunked_prefill, bool):
            raise RequestError(f"chunked_prefill must be True or False, got {chunked_prefill!r}")
        self.chunked_prefill = chunked_prefill
        self.lifecycle.share_runs = use_cache  # without a cache, nothing is computed once
        self.lifecycle.deterministic = deterministic  # forward.py's switch (chapter 10)
        self.speculator = None if spec is None else Speculator(self.lifecycle, spec)
        config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.eos_token_id = eos_token_id(model, tokenizer)
        self._next_rid = 0
        self._waiting: deque[RequestHandle] = deque()
        self._prefilling: list[RequestHandle] = []  # admitted, prompt part-way (chunked)
        self._running: list[RequestHandle] = []
        self._live: dict[str, RequestHandle] = {}

    # ------------------------------------------------------------ requests
    def prompt_ids(self, request: Request) -> torch.Tensor:
        """The request's prompt as token ids (chat messages through the chat template)."""
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("a request needs exactly one of `prompt` (token ids) or "
                               "`messages` (chat)")
        if request.messages is not None:
            return as_ids(chat_prompt_ids(self.tokenizer, request.messages))
        try:
            return as_ids(request.prompt, "prompt")
        except InvalidIdsError as exc:
            raise RequestError(f"bad prompt: {exc}") from exc

    def validate(self, request: Request) -> torch.Tensor:
        """Check everything about ``request`` that can be checked before it runs.

        Returns its prompt ids; raises RequestError saying what is wrong (empty prompt,
        token ids outside the vocabulary, ``max_new_tokens`` < 1, bad sampling settings,
        or a request that could never fit in the pool or the model's context).
        """
        if not isinstance(request, Request):
            raise RequestError(f"expected a minirt.request.Request, got {type(request).__name__}")
        ids = self.prompt_ids(request)
        n = int(ids.numel())
        if n == 0:
            raise RequestError("empty prompt: a request needs at least one token")
        if int(ids.max()) >= self.vocab_size:
            raise RequestError(f"token id {int(ids.max())} is outside the model's vocabulary "
                               f"of {self.vocab_size}")
        check_request(request)
        m = request.max_new_tokens
        if request.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer to decode the output")
        if self.max_positions and n + m > self.max_positions:
            raise RequestError(f"prompt ({n}) + max_new_tokens ({m}) exceeds the model's "
                               f"context of {self.max_positions} positions")
        ps = self.pool.page_size
        need = -(-(n + m - 1) // ps) * ps
        if need > self.pool.capacity:
            raise RequestError(f"the request needs up to {need} pool slots (prompt {n} + "
                               f"{m - 1} generated tokens with K/V) but the pool holds only "
                               f"{self.pool.capacity}")
        return ids

    def _rid(self, request: Request) -> str:
        if request.rid is not None:
            return str(request.rid)
        self._next_rid += 1
        return f"q{self._next_rid}"

    # ------------------------------------------------------------ online API
    def submit(self, request: Request, *, arrival: float | None = None) -> RequestHandle:
        """Queue ``request``; it runs from the next ``step`` on. Returns its handle.

        Raises RequestError (nothing queued, nothing changed) if it is invalid.
        ``arrival``: the ``time.perf_counter()`` its TTFT counts from (default: now).
        """
        rid = self._rid(request) if isinstance(request, Request) else "?"
        return self._enqueue(request, rid, time.perf_counter() if arrival is None else arrival)

    def _enqueue(self, request: Request, rid: str, arrival: float) -> RequestHandle:
        ids = self.validate(request)
        lc_req = self.lifecycle.new_request(
            ids, request.max_new_tokens, rid=rid,
            eos_token_id=self.eos_token_id if request.stop_on_eos else None,
            next_token=sampler(request), salt=request.cache_salt)
        ps = self.pool.page_size
        final = -(-(ids.numel() + request.max_new_tokens - 1) // ps) * ps
        job = RequestHandle(rid, request, arrival, lc_req,
                            RequestResult(rid, request, prompt_ids=ids.tolist()), final)
        if self.speculator is not None:  # it reads the sampler's settings: before the guard
            self.speculator.track(lc_req)
        if lc_req.next_token is not greedy_token:
            lc_req.next_token = self._guarded(lc_req.next_token, job.failure)
        self._waiting.append(job)
        self._live[rid] = job
        return job

    def step(self, on_token: TokenCallback | None = None) -> StepOutput:
        """One scheduling step: admit what fits, then one forward pass that prefills the
        admitted requests (or, chunked, their next part) and decodes every running one,
        then finish those that are done.

        Returns the tokens produced (also passed to ``on_token(rid, token)`` as they come)
        and who got their first token and who finished. Does nothing when no request is
        pending.
        """
        out = StepOutput()
        start = time.perf_counter()
        running = list(self._running)  # they decode; the prefilled get their first token
        before = [len(j.lc.output) for j in running]  # a verify step may append several
        plan, chunks = self._admit()
        out.admit_s = time.perf_counter() - start
        if plan or running:
            start = time.perf_counter()
            (self.speculator or self.lifecycle).step([j.lc for j in plan],
                                                     [j.lc for j in running], chunks)
            seconds = time.perf_counter() - start
            for job, chunk in zip(plan, chunks, strict=True):
                job.prefill_time += seconds
                out.prefilled.append((job.rid, chunk))
            self._prefilling = [j for j in self._prefilling if not j.lc.output]
            self._started([j for j in plan if j.lc.output], out, on_token)
            for job, n in zip(running, before, strict=True):
                while n < len(job.lc.output) and not job.stopped:
                    n += 1
                    self._emit(job, out, on_token, n)
                if n < len(job.lc.output):  # a stop string ended it: speculation's tokens go
                    self.speculator.truncate(job.lc, n)
            out.forward_s = time.perf_counter() - start
            self._check()
        for job in [j for j in self._running if self._done(j)]:
            self._running.remove(job)
            self._finish(job)
            out.finished.append(job)
        if not self._running:
            self.lifecycle.working.clear()  # idle: the rows go, their buffers stay
        return out

    def cancel(self, handle: RequestHandle | str) -> bool:
        """Drop a waiting or running request: unlock its prefix, free its private slots.

        What it already inserted into the tree (its prompt, at prefill) stays cached and
        evictable. Returns False if it had already finished or been cancelled.
        """
        rid = handle.rid if isinstance(handle, RequestHandle) else handle
        job = self._live.pop(rid, None)
        if job is None:
            if isinstance(handle, RequestHandle) and handle.done:
                return False
            raise RequestError(f"no request {rid!r} is waiting or running")
        for queue in (self._waiting, self._prefilling, self._running):
            if job in queue:
                queue.remove(job)
        if job.lc.state in ("locked", "running"):
            self.lifecycle.abort(job.lc)
        self.lifecycle.requests.pop(rid, None)
        job.status = "cancelled"
        self._fill_result(job, "cancelled")
        self._check()
        return True

    @property
    def waiting(self) -> list[RequestHandle]:
        """Submitted requests not admitted yet, in queue order."""
        return list(self._waiting)

    @property
    def running(self) -> list[RequestHandle]:
        """Admitted requests not finished: part-way through a chunked prefill, or decoding."""
        return self._prefilling + self._running

    @property
    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._waiting or self._prefilling or self._running)

    # ------------------------------------------------------------ the loop
    def generate(self, requests: Sequence[Request] | Request, *, progress: bool = True,
                 on_token: TokenCallback | None = None) -> GenerateResult:
        """Serve ``requests`` (all arriving now) to completion; results in request order.

        Submits them all, then steps until every one is done (requests submitted before
        the call run alongside). Invalid requests are rejected up front, one by one:
        their result carries the RequestError (``result.ok`` is False) and the others
        are served exactly as if the bad one had never been sent. ``on_token(rid,
        token_id)`` is called for every generated token (streaming); ``progress`` shows
        a tqdm bar. An exception (say, Ctrl-C) cancels this call's requests.
        """
        from tqdm.auto import tqdm

        if isinstance(requests, Request):
            requests = [requests]
        start = time.perf_counter()
        evicted_before = self.lifecycle.evicted_tokens
        results: list[RequestResult] = []
        jobs: list[RequestHandle] = []
        for i, request in enumerate(requests):
            rid = self._rid(request) if isinstance(request, Request) else f"q-bad{i}"
            try:
                jobs.append(self._enqueue(request, rid, start))
                results.append(jobs[-1].result)
            except RequestError as exc:
                results.append(RequestResult(rid, request, error=exc))

        mine = set(map(id, jobs))
        bar = tqdm(total=len(jobs), desc="generate", unit="req", disable=not progress,
                   leave=False)
        try:
            while not all(j.done for j in jobs):
                out = self.step(on_token)
                bar.update(sum(id(j) in mine for j in out.finished))
        except BaseException:
            for job in jobs:  # an interrupt or a failing callback: give everything back
                if not job.done:
                    self.cancel(job)
            raise
        finally:
            bar.close()
        totals = summarize(results, self.lifecycle.evicted_tokens - evicted_before,
                           time.perf_counter() - start)
        return GenerateResult(results, totals)

    def _match(self, job: RequestHandle) -> MatchResult:
        """Step 1: the cached prefix of all but the last prompt token.

        The last token is always computed: its logits are what the first output token
        is sampled from, and a cache holds K/V, not logits.
        """
        req = job.lc
        if self.windowed:
            return self.lifecycle.match(req)
        extra = {} if self.host_tier is None else {"load_back": False}
        req.match = self.cache.match_prefix(req.prompt_ids[:-1], priority=job.request.priority,
                                            salt=req.salt, **extra)
        return req.match

    def _load_back(self, job: RequestHandle, match: MatchResult) -> None:
        """With a host tier (chapter 09): load the host's part of an admitted request's
        match into device slots, as SGLang loads back when it schedules a request. It
        needs the slots computing those tokens would, so ``_fits`` holds as it was."""
        if self.host_tier is None:
            return
        req = job.lc
        req.match = self.host_tier.load_back(req.prompt[:-1], match,
                                             priority=job.request.priority, salt=req.salt)
        job.loaded_tokens += req.match.loaded_len

    def _fits(self, job: RequestHandle, match: MatchResult,
              running: Sequence[RequestHandle]) -> bool:
        """Can the pool hold this request to its last token, next to what runs already?

        Every running request keeps a reservation for the slots its remaining decode
        steps may need, so decoding never runs out of memory mid-flight. Locking the
        match turns its currently evictable part into protected, so that part counts too.
        """
        if self.windowed:
            return self.lifecycle.fits(job.lc, match, [j.lc for j in running])
        reserved = sum(j.final_slots - (j.lc.cached_len + int(j.lc.private.numel()))
                       for j in running)
        pinned = sum(len(u.value) for u in self.cache.held_by(match.handle)
                     if u.ref_count == 0)
        need = job.final_slots - match.cached_len
        return need + pinned <= self.pool.num_free + self.cache.evictable_size - reserved

    # ---- scheduling hook (chapter 07): order the queue, defer for in-batch sharing
    def _schedule(self, waiting: deque[RequestHandle]) -> None:
        """Reorder ``waiting`` in place as the scheduler says (FCFS keeps arrival order)."""
        by_request = {id(j.lc): j for j in waiting}
        ordered = self.scheduler.order([j.lc for j in waiting], self.cache)
        waiting.clear()
        waiting.extend(by_request[id(r)] for r in ordered)

    def _defers(self, job: RequestHandle, match: MatchResult,
                admitted: Sequence[RequestHandle]) -> bool:
        """In-batch sharing: the scheduler lets ``job`` wait a step for a prefix in flight."""
        return self.scheduler.defers(job.lc.prompt, match.cached_len,
                                     [j.lc.prompt for j in admitted])
    # ---- end of the scheduling hook

    def _admit(self) -> tuple[list[RequestHandle], list[int]]:
        """Step 2: the requests to prefill this step and how many prompt tokens of each.

        First the rest of the prompts a chunked prefill has begun, then new requests in the
        scheduler's order within the token budget and memory (each one's match locked, the
        slots for its gap allocated). Without ``chunked_prefill`` a prompt that would
        overflow the budget waits whole; with it, it is cut to what is left.
        """
        waiting, held = self._waiting, self._prefilling + self._running
        self._schedule(waiting)
        budget, plan, chunks, deferred = self.token_budget, [], [], []
        for job in self._prefilling:  # a chunked prompt goes on before anything newer
            if budget <= 0:
                return plan, chunks
            plan.append(job)
            chunks.append(min(budget, job.lc.prompt.numel() - job.lc.kv_len))
            budget -= chunks[-1]
        admitted: list[RequestHandle] = []
        while waiting and budget > 0:
            job = waiting[0]
            match = self._match(job)
            if self._defers(job, match, admitted):
                deferred.append(waiting.popleft())
                continue
            if self._reuses(job, match, self._prefilling + admitted):
                break  # it shares a prompt this batch computes: next step, from the tree
            uncached = job.lc.prompt.numel() - match.cached_len
            if plan and uncached > budget and not self.chunked_prefill:
                break  # the head waits for the next step; nobody overtakes it
            if not self._fits(job, match, held + admitted):
                if not held + admitted:  # pragma: no cover - validate() prevents it
                    raise RequestError(f"{job.rid} cannot fit in an idle pool")
                break
            waiting.popleft()
            admitted.append(job)
            self._load_back(job, match)
            self.lifecycle.admit(job.lc)  # lock + allocate the gap (evicting if short)
            uncached = job.lc.prompt.numel() - job.lc.kv_len  # after any load-back
            chunk = min(uncached, budget) if self.chunked_prefill else uncached
            plan.append(job)
            chunks.append(chunk)
            budget -= chunk
            if chunk < uncached:
                self._prefilling.append(job)
                job.status = "prefilling"
        waiting.extendleft(reversed(deferred))
        return plan, chunks

    def _reuses(self, job: RequestHandle, match: MatchResult,
                admitted: Sequence[RequestHandle]) -> bool:
        """Would ``job`` find more cached once a request of this batch is inserted?

        The batch prefills together, so its requests cannot read each other's K/V; a
        request that shares more whole pages with one of them than the tree holds waits
        one step and then reuses them (prefilling one request at a time finds the same).
        """
        if not self.use_cache:
            return False
        mine, page = job.lc.prompt[:-1], self.pool.page_size
        for other in admitted:
            if other.lc.salt == job.lc.salt:
                shared = common_prefix_len(mine, other.lc.prompt) // page * page
                if self.windowed and shared < other.lc.prompt.numel():
                    continue  # its insert keeps the window K/V of its prompt's tail only
                if shared > match.cached_len:
                    return True
        return False

    def _started(self, jobs: list[RequestHandle], out: StepOutput,
                 on_token: TokenCallback | None) -> None:
        """Step 3, after the pass that completed ``jobs``' prompts: their first tokens, then
        their prompts go into the tree and they run."""
        now = time.perf_counter()
        for job in jobs:
            job.ttft = now - job.arrival
            if self.use_cache:
                handle = self.lifecycle.insert_running(job.lc)
                if isinstance(self.cache, RadixCache):
                    for node in node_path(handle.node):  # locked now: safe to re-key
                        node.priority = max(node.priority, job.request.priority)
            job.status = "running"
            self._running.append(job)
            out.admitted.append(job)
            self._emit(job, out, on_token)

    @staticmethod
    def _guarded(sampler: Callable[[torch.Tensor], int],
                 failure: list[str]) -> Callable[[torch.Tensor], int]:
        """``sampler``, but an exception fails its own request only: it is noted in
        ``failure`` (the request then finishes with reason "error") and argmax stands in
        for the token, so the step goes on for everyone else."""
        def pick(logits: torch.Tensor) -> int:
            try:
                return sampler(logits)
            except Exception as exc:  # noqa: BLE001 - any failure is this request's alone
                failure.append(f"sampling failed: {type(exc).__name__}: {exc}")
                return int(logits.argmax())
        return pick

    def _emit(self, job: RequestHandle, out: StepOutput,
              on_token: TokenCallback | None, n: int | None = None) -> None:
        """Report (and stream) the token the lifecycle just appended (the ``n``-th output
        token when a verify step appended several); watch for stop strings."""
        token = job.lc.output[-1 if n is None else n - 1]
        out.tokens.append((job.rid, token))
        if job.request.stop and not job.stopped:
            text = self.tokenizer.decode(job.lc.output[:n], skip_special_tokens=True)
            job.stopped = any(s in text for s in job.request.stop)
        if on_token is not None:
            on_token(job.rid, token)

    def _done(self, job: RequestHandle) -> bool:
        return job.lc.done or job.stopped or bool(job.failure)

    def _finish(self, job: RequestHandle) -> None:
        """Step 5: cache prompt + output and unlock (or, without the cache, just free)."""
        req = job.lc
        if self.use_cache and not job.failure:
            self.lifecycle.finish(req)
        else:
            self.lifecycle.abort(req)
        self.lifecycle.requests.pop(req.rid, None)
        self._live.pop(job.rid, None)
        self._check()
        eos = req.eos_token_id is not None and req.output[-1] == req.eos_token_id
        job.status = "finished"
        if job.failure:
            job.result.error = RequestError(job.failure[0])
            self._fill_result(job, "error")
            return
        self._fill_result(job, "stop" if job.stopped else "eos" if eos else "length")

    def _fill_result(self, job: RequestHandle, finish_reason: str) -> None:
        """The handle's final result: tokens, text (cut before a stop string), metrics."""
        req, result = job.lc, job.result
        result.output_ids = list(req.output)
        result.finish_reason = finish_reason
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output, skip_special_tokens=True)
            cuts = [text.find(s) for s in job.request.stop if s in text]
            result.text = text[:min(cuts)] if cuts else text
        if req.output:  # prefilled: it has metrics (a cancelled waiting request has none)
            result.metrics = RequestMetrics(
                prompt_tokens=int(req.prompt.numel()), cached_tokens=req.reused_len,
                output_tokens=len(req.output), ttft=job.ttft,
                prefill_time=job.prefill_time, latency=time.perf_counter() - job.arrival,
                loaded_tokens=job.loaded_tokens)

    def _check(self) -> None:
        if self.check:
            self.lifecycle.check_integrity()
            self.lifecycle.working.check([j.lc.page_table for j in self._running])
            if self.speculator is not None:  # rolled back; nothing rejected in the tree
                self.speculator.check([j.lc for j in self._running])

    # ------------------------------------------------------------ housekeeping
    def flush(self) -> int:
        """Evict every unlocked cached token back to the free list; returns how many."""
        if self.windowed:
            return self.lifecycle.flush()
        n = self.cache.evictable_size
        if n:
            self.pool.free(self.cache.evict(n))
        return n

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted to make room since the engine was created."""
        return self.lifecycle.evicted_tokens

    def __repr__(self) -> str:
        policy = getattr(self.cache, "policy", None)
        return (f"Engine(cache={type(self.cache).__name__}, capacity={self.pool.capacity}, "
                f"page_size={self.pool.page_size}, "
                f"policy={policy.name if policy else 'free queue'}, use_cache={self.use_cache}, "
                f"token_budget={self.token_budget}, chunked_prefill={self.chunked_prefill}, "
                f"schedule={self.scheduler.policy!r}, "
                f"cached={self.cache.total_size})")


def _check_window_settings(page_size: int, policy, deterministic: bool) -> None:
    """What chapter 11's window cache does not do: pages, other policies, determinism."""
    if page_size != 1:
        raise PoolError(f"the window cache keeps tokens (page_size=1), got page_size={page_size}")
    if policy != "lru":
        raise PoolError(f"the window cache evicts least recently used first; policy "
                        f"{policy!r} applies to the radix cache only")
    if deterministic:
        raise ModelError("deterministic mode runs a Llama through aligned attention; the "
                         "window cache's forward (forward_windowed) has no such mode")

