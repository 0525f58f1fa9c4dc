"""EAGLE's last-block rule, and the block key that makes it unnecessary, on minirt's hash cache.

An EAGLE-style drafter reads, at position i, the target's hidden state at i *and* the token
at i + 1. A cached block of K/V proves the target's tokens ``0 .. end`` equal, not the token
after the block, so the drafter's K/V at the block's last position may have been computed
from another successor. vLLM therefore drops the last matched block of every prefix-cache
hit when an EAGLE/MTP drafter is on, and recomputes it: "If eagle is enabled, drop the last
matched block to force recompute the last block to get the required hidden states for eagle
drafting head" (the docstring of vllm 0.32.0
`v1/core/single_type_kv_cache_manager.py: SingleTypeKVCacheManager.find_longest_cache_hit`;
the full-attention lookup, vllm 0.32.0
`v1/core/single_type_kv_cache_manager.py: FullAttentionManager.find_longest_cache_hit`,
subtracts ``min(alignment_tokens, block_size)`` from the hit when ``drop_eagle_block``). The
lookup is capped at ``num_tokens - 1`` first (vllm 0.32.0
`v1/core/kv_cache_manager.py: KVCacheManager.get_computed_blocks`).

The fix proposed in vLLM's RFC #50438 ("Lookahead-aware prefix-cache hashing for
EAGLE-style draft models") hashes each block together with the one token that follows it:
a hit then proves the drafter's input at the block's last position equal, and nothing is
dropped; a block whose next token is not known yet is not published. SGLang's radix cache
already keys an EAGLE tree by *bigrams*, ``(t[i], t[i + 1])``
(sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.maybe_to_bigram_view`, called by
sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixCache.match_prefix, RadixCache.insert`):
the same idea at token granularity. minirt builds the lookahead key exactly that way: the
block hashes of the *pair ids* ``t[i] * vocab + t[i + 1]`` (``lookahead_ids``) are, block for
block, hashes of a block's tokens and its successor.

``EagleBlockCache`` is chapter 08's ``HashCache`` of unlimited size with one of three
lookup rules (``RULES``): ``plain`` (no drafter), ``drop`` (vLLM's EAGLE rule) and
``lookahead`` (the RFC's key); ``replay_hits`` serves a stream of requests through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import RequestError
from .hashcache import HashCache
from .token_ids import as_ids

__all__ = ["RULES", "EagleBlockCache", "eagle_drop", "lookahead_ids", "replay_hits"]

RULES = ("plain", "drop", "lookahead")


def eagle_drop(hit_len: int, block_size: int) -> int:
    """vLLM's EAGLE rule on a block-aligned hit of ``hit_len`` tokens: one block less (0
    stays 0)."""
    if hit_len < 0 or block_size < 1 or hit_len % block_size:
        raise RequestError(f"a hit of {hit_len} tokens is not a whole number of blocks of "
                           f"{block_size}")
    return max(0, hit_len - block_size)


def lookahead_ids(tokens, vocab_size: int) -> torch.Tensor:
    """The pair ids ``t[i] * vocab_size + t[i + 1]`` of ``tokens`` (one fewer than tokens):
    full blocks of these hash a block's tokens together with the token after it."""
    t = as_ids(tokens)
    if t.numel() and int(t.max()) >= vocab_size:
        raise RequestError(f"token {int(t.max())} is not below vocab_size {vocab_size}")
    return t[:-1] * vocab_size + t[1:] if t.numel() else t


class EagleBlockCache:
    """An unlimited block-hash cache (``HashCache``, blocks of ``block_size``) read by one
    of ``RULES``. ``lookup(tokens)``: the tokens a request of ``tokens`` gets from the cache
    (at most ``len(tokens) - 1``, as vLLM caps it); ``insert(tokens)``: the K/V of
    ``tokens`` was computed, cache its full blocks (under ``lookahead``, only the blocks whose
    next token is in ``tokens``)."""

    def __init__(self, block_size: int, rule: str, vocab_size: int) -> None:
        if rule not in RULES:
            raise RequestError(f"rule must be one of {RULES}, got {rule!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise RequestError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.rule, self.vocab_size = rule, vocab_size
        self.cache = HashCache(block_size, hash_fn="builtin", seed=0)
        self.block_size = self.cache.block_size
        self._next_page = 0

    def _keys(self, tokens) -> torch.Tensor:
        t = as_ids(tokens)
        return lookahead_ids(t, self.vocab_size) if self.rule == "lookahead" else t

    def lookup(self, tokens) -> int:
        """Tokens of ``tokens`` served from the cache under this cache's rule."""
        t = as_ids(tokens)
        if t.numel() < 2:
            return 0
        if self.rule == "lookahead":  # n tokens give n - 1 pairs: the cap is built in
            return self.cache.peek_prefix_len(self._keys(t))
        hit = self.cache.peek_prefix_len(t[:-1])
        return eagle_drop(hit, self.block_size) if self.rule == "drop" else hit

    def insert(self, tokens) -> None:
        """Cache the full blocks of ``tokens`` (their K/V computed), on fresh pages."""
        keys = self._keys(tokens)
        b, n = self.block_size, keys.numel() - keys.numel() % self.block_size
        pages = torch.arange(self._next_page * b, self._next_page * b + n)
        self._next_page += n // b
        self.cache.insert_prefix(keys[:n], pages)


def replay_hits(requests: Sequence, block_size: int, rule: str, vocab_size: int) -> list[int]:
    """Serve ``requests`` (token id sequences) in order through an empty ``EagleBlockCache``:
    each is looked up, then its tokens are inserted. Returns the tokens each one hit."""
    cache = EagleBlockCache(block_size, rule, vocab_size)
    hits = []
    for ids in requests:
        hits.append(cache.lookup(ids))
        cache.insert(ids)
    return hits
