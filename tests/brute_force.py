"""Brute-force references the tests compare against: the longest common prefix, token by
token, and EAGLE's cache hits (``minirt.eagle_blocks`` and exercise 13.4's checker)."""

from __future__ import annotations

from collections.abc import Sequence


def lcp(a: Sequence, b: Sequence) -> int:
    """How many leading items (tokens, or characters) ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def eagle_hits(requests: Sequence[Sequence[int]], block_size: int, rule: str) -> list[int]:
    """Each request's hit, in whole blocks, against every earlier one, under ``rule``:
    ``plain`` (the longest common prefix, never the last token), ``drop`` (EAGLE drops the
    last hit block) or ``lookahead`` (pairs of tokens: one fewer on each side)."""
    hits = []
    for i, ids in enumerate(requests):
        best = 0
        for earlier in requests[:i]:
            shared = lcp(ids, earlier)
            if rule == "lookahead":  # pairs agree up to shared - 1, earlier's up to len - 1
                n = min(shared - 1, len(ids) - 1, len(earlier) - 1)
            else:
                n = min(shared, len(ids) - 1, len(earlier))
            best = max(best, n // block_size * block_size)
        hits.append(max(0, best - block_size) if rule == "drop" else best)
    return hits
