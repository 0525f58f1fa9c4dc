"""A draft model as the proposer: ``SpeculativeConfig(method="draft_model")``.

vLLM's name for it is ``method="draft_model"`` (vllm 0.32.0
`config/speculative.py: SpeculativeConfig`; its proposer, vllm 0.32.0
`v1/spec_decode/draft_model.py: DraftModelProposer`, runs a smaller model of the target's
family, with the same vocabulary, ``k`` tokens ahead). SGLang calls a separate draft model
``STANDALONE`` (sglang 0.5.23 `srt/speculative/spec_info.py: SpeculativeAlgorithm`), run by
sglang 0.5.23 `srt/speculative/standalone_worker_v2.py: StandaloneWorkerV2`, EAGLE's worker
with the draft's own embeddings and output head.

Which draft model serves this book's lesson? The book's model, SmolLM2-135M-Instruct, is the
smallest of its family, so there is no smaller model with its tokenizer to draft for it. A
draft of the *same* model is therefore minirt's default (``model=None``): a self-check, not
a speed-up. Its greedy drafts are the target's own greedy tokens, so in exact arithmetic
every draft is accepted and each verify step appends ``k + 1`` tokens; any rejection is a
row where the draft's one-token forward and the verify's ``k + 1``-row forward round
differently (chapter 10's row classes), and a wrong rollback or a verify that scores the
wrong positions shows up at once as a rejection or as changed outputs. Another model (an
``nn.Module`` with the target's vocabulary, for example ``tiny_model`` with another seed in
the tests) can be given as ``model``: acceptance then measures how often the two agree.

The draft runs through transformers' own forward with a ``DynamicCache`` per request: a
proposal feeds the tokens the request gained since its last one (its accepted drafts and
the target's token), then ``k - 1`` one-token steps, greedily, and crops its cache back to
the request's tokens, so the draft's rejected K/V is dropped as the target's is. The drafts
are greedy, a point mass, so ``speculative.rejection_sample`` keeps the target's
distribution for sampled requests with them too.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .errors import ModelError, RequestError

__all__ = ["DraftModelProposer", "check_draft_model"]


def check_draft_model(draft, target) -> None:
    """RequestError unless ``draft`` is None (the target itself) or a torch module;
    ModelError if it is a module whose vocabulary size differs from ``target``'s (drafts
    would be ids the target cannot score; vllm 0.32.0
    `v1/spec_decode/draft_model.py: DraftModelProposer._raise_if_vocab_size_mismatch`)."""
    if draft is None:
        return
    if not isinstance(draft, torch.nn.Module):
        raise RequestError(f"speculative model must be None (the target model itself) or a "
                           f"loaded torch model, got {type(draft).__name__}")
    vocab = getattr(getattr(draft, "config", None), "vocab_size", None)
    want = getattr(getattr(target, "config", None), "vocab_size", None)
    if vocab is None or (want is not None and vocab != want):
        raise ModelError(f"the draft model's vocabulary ({vocab} tokens) is not the target's "
                         f"({want}): a draft must use the target's token ids")


class DraftModelProposer:
    """Up to ``k`` greedy tokens of ``model`` after a request's tokens, one transformers
    ``DynamicCache`` per request (``owner``), kept across steps and cropped to the
    request's tokens before each proposal."""

    def __init__(self, model: torch.nn.Module, k: int) -> None:
        self.model, self.k = model, k
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.forwards = 0  # draft forward calls, for the curious

    def propose(self, tokens: torch.Tensor | Sequence[int], limit: int | None = None,
                owner: object | None = None) -> list[int]:
        """Drafts for what follows ``tokens`` (at most ``limit``, default ``k``). With an
        ``owner`` (the request) the draft's K/V for ``tokens`` is kept for its next call."""
        from transformers import DynamicCache

        k = self.k if limit is None else min(self.k, limit)
        t = torch.as_tensor(tokens, dtype=torch.int64).flatten()
        if k <= 0 or t.numel() == 0:
            return []
        cache, seen = self._caches.get(owner, (None, None)) if owner is not None else (None,
                                                                                        None)
        if cache is None:
            cache, seen = DynamicCache(config=self.model.config), t[:0]
        same = min(seen.numel(), t.numel() - 1)  # at least one token is fed
        diff = (seen[:same] != t[:same]).nonzero()
        keep = int(diff[0, 0]) if diff.numel() else same
        if cache.get_seq_length() > keep:
            cache.crop(keep - cache.get_seq_length())
        device = next(self.model.parameters()).device
        feed, drafts = t[keep:].to(device), []
        with torch.inference_mode():
            for i in range(k):
                logits = self.model(feed[None], cache=cache, use_cache=True).logits
                self.forwards += 1
                drafts.append(int(logits[0, -1].argmax()))
                if i + 1 < k:
                    feed = feed.new_tensor([drafts[-1]])
        if k > 1:  # the drafts' own K/V: dropped, the request's tokens kept
            cache.crop(-(k - 1))
        if owner is not None:
            self._caches[owner] = (cache, t)
        return drafts

    def release(self, owner: object) -> None:
        """Drop ``owner``'s draft K/V (it finished or was cancelled)."""
        self._caches.pop(owner, None)

    def held(self) -> int:
        """Requests whose draft K/V is kept."""
        return len(self._caches)
