"""State layers: a prefix can be continued only from a position where its state was saved.

A state-space or linear-attention layer (Mamba, Qwen3-Next's linear attention) carries one
fixed-size state forward token by token; its "cache" for a prefix is the state at the
prefix's last position, not a K/V per token. A cached prefix is therefore usable only if
a state was *saved* at exactly its end, beside the attention layers' K/V for all of it.

* ``LinearRecurrence``: a toy state layer, ``h_t = decay * h_{t-1} + embed[x_t]``. ``run``
  is the sequential loop: resuming it from a saved state is bitwise the whole run, which
  shows only that the state is the whole memory of the prefix. ``scan`` is the chunked
  form real prefill kernels use (a closed form per chunk of ``chunk`` tokens, counted from
  where the run starts): resuming from a state saved on the chunk grid repeats the uncached
  run's operations, so its bits; resuming off the grid regroups the sums (equal in real
  arithmetic, not in bits). That is why engines checkpoint on the kernel's chunk grid.
* ``StateCache``: the attention K/V in a ``RadixCache`` and states saved by rules that
  follow the engines' checkpoints. A request's uncached part is prefilled in steps of
  ``chunk`` tokens (None: one step). ``interval``: each step saves one state, at the last
  multiple of ``interval`` it reaches (SGLang's extra buffer, ``mamba_cache_chunk_size``;
  vLLM's "align" mode, whose steps end on the block grid). ``save_ends``: each step saves
  the state at its own end, the request's end included (SGLang's ``no_buffer``, page size
  1). ``branch``: a request whose K/V match reaches past its usable prefix also saves the
  state at that point, rounded down to the grid (SGLang's ``mamba_branching_seqlen``,
  vLLM's shared-prefix junction). ``chunk=interval`` saves a state at every multiple of
  ``interval``, denser than either engine. A match is the longest prefix that ends at a
  saved state and has its K/V. ``serve`` plays a trace through it and counts hits and
  memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import RadixCache, insert_fresh
from .token_ids import as_ids

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

    def scan(self, ids: Sequence[int], state: torch.Tensor | None = None, chunk: int = 8
             ) -> torch.Tensor:
        """The state after ``ids`` from ``state``, chunk by chunk in float32, as a chunked
        prefill kernel computes it: for each ``chunk`` tokens counted from the start of
        ``ids``, ``h = decay**L * h + sum_j decay**(L-1-j) * embed[x_j]`` (one weighted sum
        per chunk, not ``L`` steps). Equal to ``run`` in real arithmetic; its bits depend on
        where the chunks start."""
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        decay, embed = self.decay.float(), self.embed.float()
        h = torch.zeros(self.dim) if state is None else state.float().clone()
        ids = as_ids(ids).tolist()
        for start in range(0, len(ids), chunk):
            x = embed[ids[start:start + chunk]]
            n = x.shape[0]
            powers = decay ** torch.arange(n - 1, -1, -1, dtype=torch.float32)[:, None]
            h = decay ** n * h + (powers * x).sum(0)
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
    """Attention K/V for every cached token, states only where a rule saved one.

    ``interval``: the checkpoint grid; each prefill step saves one state, at the last
    multiple of ``interval`` it reaches (None: no grid states). ``save_ends``: each step
    saves the state at its own end (with ``chunk`` None, only the request's end).
    ``chunk``: the prefill step in tokens, counted from the usable prefix (None: the
    whole uncached part in one step). ``branch``: a request whose K/V match reaches past
    its usable prefix saves a state there, rounded down to the grid. No capacity limit:
    it measures what each saving rule can hit and what it holds.
    """

    def __init__(self, interval: int | None, save_ends: bool = True, *, chunk: int | None = None,
                 branch: bool = False) -> None:
        for name, value in (("interval", interval), ("chunk", chunk)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.interval, self.save_ends = interval, save_ends
        self.chunk, self.branch = chunk, branch
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

    def checkpoints(self, n: int, usable: int, kv_len: int) -> list[int]:
        """The positions (prefix lengths, sorted) at which a request of ``n`` tokens saves
        a state, given its usable prefix and its K/V match."""
        points: set[int] = set()
        step = self.chunk or max(n - usable, 1)
        for start in range(usable, n, step):
            end = min(start + step, n)
            if self.interval is not None and end // self.interval * self.interval > start:
                points.add(end // self.interval * self.interval)
            if self.save_ends:
                points.add(end)
        if self.branch and kv_len > usable:
            point = kv_len if self.interval is None else kv_len // self.interval * self.interval
            if point > usable:
                points.add(point)
        return sorted(points)

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
            self.saved.update(keys[p - 1] for p in self.checkpoints(len(ids), usable, kv_len))
            _, self._next_slot = insert_fresh(self.kv, ids, self._next_slot)
        return StateTrace(query, hit, kv_hit, self.kv.total_size, len(self.saved))
