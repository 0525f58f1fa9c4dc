"""State layers: a prefix can be continued only from a position where its state was saved.

A state-space or linear-attention layer (Mamba, Qwen3-Next's linear attention) carries one
fixed-size state forward token by token; its "cache" for a prefix is the state at the
prefix's last position, not a K/V per token. A cached prefix is therefore usable only if
a state was *saved* at exactly its end, beside the attention layers' K/V for all of it.

* ``LinearRecurrence``: a toy state layer, ``h_t = decay * h_{t-1} + embed[x_t]``. Running
  a suffix from a saved state gives bit for bit the state of running the whole sequence;
  there is nothing to continue from at a position with no saved state.
* ``StateCache``: the attention K/V in a ``RadixCache`` and states saved at chunk
  boundaries (every ``interval`` tokens, SGLang's ``mamba_cache_chunk_size``, vLLM's
  "align" mode at ``i * block_size``) and, if ``save_ends``, where a request ended. A
  match is the longest prefix that ends at a saved state and has its K/V. ``serve`` plays
  a trace through it and counts hits and memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import RadixCache, as_ids, insert_fresh

__all__ = ["LinearRecurrence", "StateCache", "StateTrace", "prefix_keys"]


class LinearRecurrence:
    """A toy linear-recurrent layer over token ids: ``h_t = decay * h_{t-1} + embed[x_t]``.

    ``dim`` numbers per state, float64, a fixed seed. ``run(ids, state)`` returns the state
    after ``ids`` starting from ``state`` (zeros for None): one state, whatever the length.
    """

    def __init__(self, vocab_size: int = 128, dim: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.decay = torch.rand(dim, generator=g, dtype=torch.float64) * 0.5 + 0.45
        self.embed = torch.randn(vocab_size, dim, generator=g, dtype=torch.float64)
        self.dim = dim

    @property
    def state_bytes(self) -> int:
        return self.dim * 8

    def run(self, ids: Sequence[int], state: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.zeros(self.dim, dtype=torch.float64) if state is None else state.clone()
        for t in as_ids(ids).tolist():
            h = self.decay * h + self.embed[t]
        return h


def prefix_keys(ids: Sequence[int]) -> list[int]:
    """A key per prefix length 1..n, chained (key i covers ids[:i]): one hash per token
    instead of one tuple per prefix."""
    keys, h = [], 0
    for t in ids:
        h = hash((h, int(t)))
        keys.append(h)
    return keys


@dataclass(frozen=True)
class StateTrace:
    """What ``StateCache.serve`` measured on a trace."""

    query_tokens: int
    hit_tokens: int   # usable: ends at a saved state, K/V all there
    kv_hit_tokens: int  # what the K/V alone would have matched
    kv_tokens: int
    states: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def kv_hit_rate(self) -> float:
        return self.kv_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def memory(self, kv_bytes_per_token: int, state_bytes: int) -> int:
        return self.kv_tokens * kv_bytes_per_token + self.states * state_bytes


class StateCache:
    """Attention K/V for every cached token, states only at saved positions.

    ``interval``: save a state every ``interval`` tokens of a prefill (None: never);
    ``save_ends``: save one where each request's computed tokens end. No capacity limit:
    it measures what each saving rule can hit and what it holds.
    """

    def __init__(self, interval: int | None, save_ends: bool = True) -> None:
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval must be a positive int or None, got {interval!r}")
        self.interval, self.save_ends = interval, save_ends
        self.kv = RadixCache()
        self.saved: set[int] = set()  # prefix keys with a saved state
        self._next_slot = 0

    def match(self, ids: Sequence[int]) -> tuple[int, int]:
        """(usable length, K/V length): the longest prefix ending at a saved state with all
        its K/V cached, and the longest with K/V alone."""
        kv_len = self.kv.peek_prefix_len(ids)
        keys = prefix_keys(list(ids)[:kv_len])
        usable = next((p for p in range(kv_len, 0, -1) if keys[p - 1] in self.saved), 0)
        return usable, kv_len

    def serve(self, requests: Sequence[Sequence[int]]) -> StateTrace:
        """Each request: match (all but its last token), compute the rest saving states
        by the rules, cache its K/V. Returns the hits and what the cache holds."""
        query = hit = kv_hit = 0
        for ids in requests:
            ids = list(ids)
            usable, kv_len = self.match(ids[:-1])
            query += len(ids) - 1
            hit += usable
            kv_hit += kv_len
            keys = prefix_keys(ids)
            if self.interval is not None:  # chunk boundaries the prefill passes
                first = usable // self.interval + 1
                self.saved.update(keys[p - 1] for p in
                                  range(first * self.interval, len(ids) + 1, self.interval))
            if self.save_ends:
                self.saved.add(keys[-1])
            _, self._next_slot = insert_fresh(self.kv, ids, self._next_slot)
        return StateTrace(query, hit, kv_hit, self.kv.total_size, len(self.saved))
