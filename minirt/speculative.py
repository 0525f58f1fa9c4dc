"""Speculative decoding with prompt-lookup (n-gram) drafts: propose, verify, accept, roll back.

A running request's next tokens are often already in its own context (a RAG answer quotes
its document, a code edit repeats the file). A *proposer* guesses up to ``k`` of them by
prompt lookup: find the longest n-gram (``prompt_lookup_min`` to ``prompt_lookup_max``
tokens) that ends the request's tokens and appeared earlier, and propose the tokens that
followed its earliest occurrence (vllm 0.32.0
`v1/spec_decode/ngram_proposer.py: NgramProposer, _find_longest_matched_ngram_and_propose_tokens`).
SGLang drafts from one n-gram trie fed with every running request's recent tokens and
verifies a tree of drafts (sglang 0.5.23
`srt/speculative/ngram_worker.py: NGRAMWorker, NGRAMWorker._update_ngram_corpus`); minirt
looks up the request's own tokens and verifies one chain. The next step *verifies* them:
the request is an extend of ``1 + len(drafts)`` tokens (its last token, then the drafts)
whose logits at every position are read, in the same forward pass as the step's prefills
(``forward.forward_verify``). Then:

* greedy acceptance: the longest run of drafts that agree with the target's argmax, plus
  the target's own next token at the first disagreement (or after the last draft), as
  vllm 0.32.0 `v1/sample/rejection_sampler.py: rejection_greedy_sample_kernel`;
* rejection sampling at temperature > 0 (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding"): accept draft ``d`` with probability
  ``min(1, p(d) / q(d))`` and on rejection draw from ``max(0, p - q)`` renormalised. A
  prompt-lookup draft has no distribution of its own: ``q`` is a point mass on ``d``, so
  the rule becomes *accept with probability p(d); on rejection draw from p with d removed*,
  which is what vllm 0.32.0 `v1/sample/rejection_sampler.py: rejection_random_sample_kernel,
  sample_recovered_tokens_kernel` do without draft probabilities (``NO_DRAFT_PROBS``).
  Every output token is then distributed exactly as the target's sampler would draw it;
* roll back: the K/V of rejected positions was written into the request's slots, so its
  page table shrinks back to the accepted tokens and the whole pages past them go back on
  the free list in the same step (a page partly filled with rejected K/V stays the
  request's: its next tokens overwrite it). ``kv_len`` counts accepted tokens only, and
  the tree is only ever given ``tokens[:kv_len]``, so nothing rejected is inserted.

Drafts are proposed at the end of a step, for the next, as vLLM's model runner proposes
them right after sampling (vllm 0.32.0 `v1/worker/gpu_model_runner.py: GPUModelRunner.sample_tokens`
calls vllm 0.32.0 `v1/worker/gpu_model_runner.py: GPUModelRunner.propose_draft_token_ids`);
a request cancelled in between holds no slot for them. Requests with no drafts in a step
decode as usual, over the working set, in the same pass. A draft model can propose instead
of prompt lookup (``method="draft_model"``, ``minirt.draft_proposer``: the target model
itself by default, as a self-check). ``Speculator``
ties it to a ``lifecycle.Lifecycle``; ``Engine(speculative=...)`` runs it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial

import torch

from .draft_proposer import DraftModelProposer, check_draft_model
from .errors import ModelError, OutOfMemoryError, RequestError
from .forward import forward_verify
from .lifecycle import Lifecycle, Request, greedy_token
from .llama import is_llama
from .pool import PageTable

__all__ = ["METHODS", "NgramProposer", "SpeculativeConfig", "Speculator", "SpecStats",
           "accept_greedy", "check_speculative", "rejection_sample", "target_probs"]


METHODS = ("ngram", "draft_model")  # vLLM's names for the two proposers minirt builds


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request speculates. ``method``: "ngram" (prompt lookup) or "draft_model" (a
    draft model, ``minirt.draft_proposer``); ``num_speculative_tokens``: the draft length k;
    an n-gram of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens is looked up (vLLM's
    names; its defaults are 5 and 5 when neither is given, vllm 0.32.0
    `config/speculative.py: SpeculativeConfig.__post_init__`; minirt's are shorter, for the
    book's short prompts). ``model``: the draft model for "draft_model", None for the
    target model itself (a self-check: the book's model is the smallest of its family)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: object = None


def check_speculative(value, model=None, cache: str | None = None) -> SpeculativeConfig | None:
    """``value`` (None, a ``SpeculativeConfig`` or a dict of its fields) as a config, checked:
    RequestError for a bad setting, ModelError for a model or cache it cannot run on
    (anything but a Llama; chapter 11's window cache). Nothing is built: the engine calls
    this first. The radix and hash caches, a host tier under the radix cache, chunked
    prefill and the deterministic mode all run with it."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        names = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise RequestError(f"speculative: unknown settings {unknown}; known: {sorted(names)}")
        value = SpeculativeConfig(**value)
    if not isinstance(value, SpeculativeConfig):
        raise RequestError(f"speculative must be None, a SpeculativeConfig or a dict, got "
                           f"{type(value).__name__}")
    if value.method not in METHODS:
        raise RequestError(f"speculative method {value.method!r} is not built: minirt "
                           f"proposes with {' or '.join(map(repr, METHODS))}")
    if value.method == "ngram" and value.model is not None:
        raise RequestError("speculative model is the draft model of method='draft_model'; "
                           "method='ngram' proposes from the request's own tokens")
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        v = getattr(value, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
            raise RequestError(f"speculative {name} must be an int from 1 to 64, got {v!r}")
    if value.prompt_lookup_min > value.prompt_lookup_max:
        raise RequestError(f"speculative prompt_lookup_min ({value.prompt_lookup_min}) must be "
                           f"<= prompt_lookup_max ({value.prompt_lookup_max})")
    if model is not None and not is_llama(model):
        raise ModelError(f"speculative decoding verifies drafts through minirt's Llama forward "
                         f"(forward_verify); {type(model).__name__} is not one")
    if value.method == "draft_model":
        check_draft_model(value.model, model)
    if cache == "window":
        raise ModelError("speculative decoding runs on the radix or hash cache; the window "
                         "cache's forward (forward_windowed) has no verify step")
    return value


# ---------------------------------------------------------------- the proposer


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: up to ``k`` tokens that followed the earliest earlier occurrence of the
    longest n-gram (``min_n`` to ``max_n`` tokens) ending the sequence."""

    k: int
    min_n: int
    max_n: int

    def propose(self, tokens: torch.Tensor | Sequence[int], limit: int | None = None,
                owner: object | None = None) -> list[int]:
        """Drafts for what follows ``tokens`` (at most ``limit``, default ``k``; may be []);
        ``owner`` is ignored (a draft model keeps its K/V per owner)."""
        t = torch.as_tensor(tokens, dtype=torch.int64).flatten()
        k, n_tok = self.k if limit is None else min(self.k, limit), int(t.numel())
        if k <= 0:
            return []
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            windows = t[:n_tok - 1].unfold(0, n, 1)  # every n-gram that is not the suffix
            hits = (windows == t[n_tok - n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[0, 0]) + n  # the earliest occurrence
                return t[start:start + k].tolist()
        return []


# ---------------------------------------------------------------- acceptance


def accept_greedy(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a greedy verify appends: the drafts while each equals the target's argmax
    at its position (``target[i]``, ``len(drafts) + 1`` of them), then the target's own
    token at the first disagreement, or after the last draft (the bonus token)."""
    if len(target) != len(drafts) + 1:
        raise RequestError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got "
                           f"{len(target)}")
    out = []
    for d, t in zip(drafts, target, strict=False):
        out.append(int(t))
        if int(d) != int(t):
            return out
    return out + [int(target[-1])]


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    """The distribution ``request.sample_token`` draws from: softmax of the tempered
    logits, restricted to the ``top_k`` largest (0: all). ``[..., vocab]``, fp32 on CPU."""
    x = logits.detach().float().cpu() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.softmax(x, dim=-1)


def rejection_sample(drafts: Sequence[int], probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Leviathan et al.'s rule for point-mass drafts: ``probs`` ``[len(drafts) + 1, vocab]``
    is the target's distribution at each verified position. Draft ``d`` at position i is
    accepted with probability ``probs[i, d]``; at the first rejection a token is drawn from
    ``probs[i]`` with ``d`` removed (renormalised) and the rest dropped; if every draft is
    accepted, a bonus token is drawn from ``probs[-1]``. Returns the tokens appended."""
    if probs.dim() != 2 or probs.shape[0] != len(drafts) + 1:
        raise RequestError(f"{len(drafts)} drafts need probabilities of shape "
                           f"[{len(drafts) + 1}, vocab], got {list(probs.shape)}")
    out = []
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator))
        if u < float(probs[i, d]):  # q(d) = 1: accept with p(d) / q(d) = p(d)
            out.append(int(d))
            continue
        residual = probs[i].clone()
        residual[d] = 0.0  # max(0, p - q) for a point mass q on d
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    return out + [int(torch.multinomial(probs[-1], 1, generator=generator))]


# ---------------------------------------------------------------- the verify step


@dataclass
class SpecStats:
    """Counts since the speculator was built: passes that verified drafts (``steps``),
    request-steps decoded, with drafts or without (``verified``), draft tokens verified
    (``proposed``) and accepted (``accepted``), tokens those request-steps appended
    (``emitted``), and slots rolled back (``rolled_back``: freed past the accepted tokens)."""

    steps: int = 0
    verified: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    rolled_back: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts verified (0.0 before any)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per verify step (1.0 without speculation)."""
        return self.emitted / self.verified if self.verified else 0.0


class Speculator:
    """Speculative decoding over ``lifecycle``: ``step`` stands in for ``Lifecycle.step``.

    ``step(prefill, decode, chunks)`` prefills as ``Lifecycle.step`` does and, for every
    request in ``decode``, verifies the drafts proposed for it at the end of the step before
    (its last token and up to k drafts, one extend each), all in one forward pass; then
    accepts, rolls rejected K/V back and proposes the next drafts. Greedy requests and
    those whose sampler ``track`` recognised speculate; any other sampler runs one token a
    step. RequestError or OutOfMemoryError before anything changes; an exception from the
    forward pass gives back the slots the step took.
    """

    def __init__(self, lifecycle: Lifecycle, config: SpeculativeConfig) -> None:
        self.lifecycle, self.config = lifecycle, config
        self.proposer: NgramProposer | DraftModelProposer
        if config.method == "draft_model":
            self.proposer = DraftModelProposer(config.model or lifecycle.model,
                                               config.num_speculative_tokens)
        else:
            self.proposer = NgramProposer(config.num_speculative_tokens,
                                          config.prompt_lookup_min, config.prompt_lookup_max)
        self.drafts: dict[str, tuple[Request, list[int]]] = {}  # rid -> (request, drafts)
        self._sampling: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.stats = SpecStats()

    def track(self, req: Request) -> None:
        """Note ``req``'s sampling settings (its ``next_token``, a ``request.sampler``)
        so a sampled request can speculate: called before anything wraps the sampler."""
        fn = req.next_token
        if isinstance(fn, partial) and {"temperature", "top_k", "generator"} <= set(fn.keywords):
            kw = fn.keywords
            self._sampling[req] = (kw["temperature"], kw["top_k"], kw["generator"])

    def speculates(self, req: Request) -> bool:
        """Does ``req`` get drafts (greedy, or a sampler ``track`` recognised)?"""
        return req.next_token is greedy_token or req in self._sampling

    # ---- drafts
    def propose(self, reqs: Sequence[Request]) -> None:
        """Drafts for each running, prefilled, unfinished request of ``reqs``, for its next
        step; at most what its ``max_new_tokens`` leaves after that step's own token."""
        live = set(map(id, self.lifecycle.running))
        release = getattr(self.proposer, "release", None)
        for rid, (r, _) in list(self.drafts.items()):
            if id(r) not in live:
                del self.drafts[rid]
                if release is not None:
                    release(r)
        for r in reqs:
            if r.state == "running" and r.output and not r.done and self.speculates(r):
                left = r.max_new_tokens - len(r.output) - 1
                d = self.proposer.propose(r.tokens, left, owner=r)
                self.drafts[r.rid] = (r, d)
            else:
                self.drafts.pop(r.rid, None)
                if release is not None:
                    release(r)

    def draft_for(self, req: Request) -> list[int]:
        """The drafts waiting for ``req``'s next verify ([] if none)."""
        entry = self.drafts.get(req.rid)
        return list(entry[1]) if entry is not None and entry[0] is req else []

    # ---- slots
    def _take_slots(self, reqs: Sequence[Request], drafts: Sequence[list[int]]) -> None:
        """Pages for each request's ``1 + len(drafts)`` new positions, all or nothing."""
        lc, ps = self.lifecycle, self.lifecycle.page_size
        need = []
        for r, d in zip(reqs, drafts, strict=True):
            spare = int(r.private.numel()) - (len(r.page_table) - r.cached_len)
            need.append(-(-max(0, 1 + len(d) - spare) // ps) * ps)
        total = sum(need)
        if total > lc.pool.num_free + lc.cache.evictable_size:
            raise OutOfMemoryError(f"verify needs {total} new slots: only {lc.pool.num_free} "
                                   f"free + {lc.cache.evictable_size} evictable")
        lc.make_room(total)
        for r, d, n in zip(reqs, drafts, need, strict=True):
            if n:
                r.private = torch.cat([r.private, lc.pool.alloc(n)])
            used = len(r.page_table) - r.cached_len
            r.page_table.append(r.private[used:used + 1 + len(d)])

    def rollback(self, req: Request, kv_len: int) -> int:
        """Shrink ``req``'s page table to its first ``kv_len`` positions and free the whole
        private pages past them; returns how many slots went back on the free list."""
        if not req.cached_len <= kv_len <= len(req.page_table):
            raise RequestError(f"{req.rid}: cannot roll back to {kv_len} positions (cached "
                               f"{req.cached_len}, table {len(req.page_table)})")
        ps = self.lifecycle.page_size
        keep = -(-(kv_len - req.cached_len) // ps) * ps
        freed = req.private[keep:]
        req.page_table = PageTable(req.page_table.slots[:kv_len])
        req.private = req.private[:keep]
        self.lifecycle.pool.free(freed)
        return int(freed.numel())

    def truncate(self, req: Request, num_output: int) -> None:
        """Keep only the first ``num_output`` output tokens (a stop string met mid-run):
        ``kv_len`` and the page table follow, as after a rejection."""
        if not 1 <= num_output <= len(req.output):
            raise RequestError(f"{req.rid}: cannot keep {num_output} of {len(req.output)} tokens")
        del req.output[num_output:]
        req.kv_len = req.prompt.numel() + num_output - 1
        self.stats.rolled_back += self.rollback(req, req.kv_len)

    # ---- the step
    def step(self, prefill: Sequence[Request], decode: Sequence[Request],
             chunks: Sequence[int] | None = None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Prefill ``prefill``, verify every request of ``decode`` that has drafts and decode
        the others (over the lifecycle's working set), all in one forward pass; returns the
        prefills' last logits and each decoding request's ``[1 + drafts, vocab]``."""
        lc = self.lifecycle
        prefill, ends = lc._prefill_ready(prefill, chunks) if prefill else ([], [])
        decode = lc._decode_ready(decode) if decode else []
        if not prefill and not decode:
            return [], []
        drafts = [self.draft_for(r) for r in decode]
        self._take_slots(decode, drafts)
        verify = [(r, d) for r, d in zip(decode, drafts, strict=True) if d]
        plain = [r for r, d in zip(decode, drafts, strict=True) if not d]
        try:
            p_logits, v_logits, d_logits = forward_verify(
                lc.model, lc.pool,
                [lc._chunk_table(r, e) for r, e in zip(prefill, ends, strict=True)],
                [r.prompt[r.kv_len:e] for r, e in zip(prefill, ends, strict=True)],
                [r.page_table for r, _ in verify],
                [torch.tensor([r.output[-1], *d], dtype=torch.int64) for r, d in verify],
                lc.share_runs, lc.deterministic, lc.working, [r.page_table for r in plain],
                [torch.tensor([r.output[-1]]) for r in plain])
        except BaseException:
            for r in decode:  # the slots this step took go back: as if it never ran
                self.rollback(r, r.kv_len)
            raise
        lc._prefilled(prefill, p_logits, ends)
        for (r, d), lg in zip(verify, v_logits, strict=True):
            self._accept(r, d, lg)
        lc._decoded(plain, d_logits)  # no drafts: a plain decode step, on the working set
        self.stats.verified += len(plain)
        self.stats.emitted += len(plain)
        self.stats.steps += bool(verify)
        self.propose(list(prefill) + decode)
        by_request = dict(zip(map(id, [r for r, _ in verify] + plain),
                              [*v_logits, *(lg[None] for lg in d_logits)], strict=True))
        return p_logits, [by_request[id(r)] for r in decode]

    def _accept(self, r: Request, drafts: list[int], logits: torch.Tensor) -> None:
        """Append the tokens verification gives ``r`` (cut after an end-of-sequence token),
        count them, and roll back the K/V of the positions it did not accept."""
        if r.next_token is greedy_token:
            tokens = accept_greedy(drafts, logits.argmax(-1).tolist())
        elif r in self._sampling and drafts:
            temperature, top_k, generator = self._sampling[r]
            try:
                tokens = rejection_sample(drafts, target_probs(logits, temperature, top_k),
                                          generator)
            except RuntimeError:  # a distribution multinomial refuses: the sampler says why
                tokens = [r.next_token(logits[0])]
        else:
            tokens = [r.next_token(logits[0])]
        if r.eos_token_id is not None and r.eos_token_id in tokens:
            tokens = tokens[:tokens.index(r.eos_token_id) + 1]
        r.output.extend(tokens)
        r.kv_len += len(tokens)  # the last output token and the accepted drafts
        self.stats.verified += 1
        self.stats.proposed += len(drafts)
        self.stats.accepted += sum(t == d for t, d in zip(tokens, drafts, strict=False))
        self.stats.emitted += len(tokens)
        self.stats.rolled_back += self.rollback(r, r.kv_len)

    def check(self, reqs: Sequence[Request]) -> None:
        """AssertionError unless every prefilled running request of ``reqs`` is rolled back:
        a page table of exactly its ``kv_len`` accepted positions, less than a page of unused
        private slots, and a tree path whose tokens are its own (nothing rejected cached)."""
        ps = self.lifecycle.page_size
        for r in reqs:
            if r.state != "running" or not r.output:
                continue
            if len(r.page_table) != r.kv_len:
                raise AssertionError(f"speculation: {r.rid}'s page table maps "
                                     f"{len(r.page_table)} positions, {r.kv_len} accepted")
            spare = int(r.private.numel()) - (len(r.page_table) - r.cached_len)
            if not 0 <= spare < ps:
                raise AssertionError(f"speculation: {r.rid} holds {spare} unused private slots "
                                     f"(a page is {ps}): rejected slots were not freed")
            keys = [torch.as_tensor(list(getattr(u, "key", getattr(u, "tokens", ()))))
                    for u in self.lifecycle.cache.held_by(r.handle)]
            cached = torch.cat(keys).to(torch.int64) if keys else torch.empty(0, dtype=torch.int64)
            if not torch.equal(cached, r.tokens[:r.cached_len]):
                raise AssertionError(f"speculation: {r.rid}'s cached path is not its accepted "
                                     "tokens")
