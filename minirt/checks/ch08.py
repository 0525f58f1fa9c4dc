"""Checkers for chapter 08: images in the chained hash, hits, the free queue's order,
prompt extraction.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees. A repeated failure of the same
exercise adds a nudge toward the idea (never the algorithm).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from ..hashcache import HashCache, hash_block_tokens, sha256_hash
from ._common import as_int_list, call_reader, passed

__all__ = [
    "check_extract_prompt",
    "check_mm_chain_hashes",
    "check_free_queue_order",
    "check_hash_hit",
]

_failures: Counter[str] = Counter()

NUDGES = {
    "8.1": "Nudge: an image belongs to the extra keys of every block it overlaps, and its "
           "offset is counted from the start of that block.",
    "8.2": "Nudge: a lookup stops at the first block whose hash is missing, it only ever "
           "sees full blocks, and it never covers the prompt's last token.",
    "8.3": "Nudge: a block joins the queue only when its count reaches zero, and a "
           "request's blocks are released last block first.",
    "8.4": "Nudge: the probe that matches one token more than the others is the fastest; "
           "a wrong probe that gets cached matches no more of the secret than before.",
}


def _fail(exercise: str, message: str) -> None:
    _failures[exercise] += 1
    if _failures[exercise] > 1:
        message += "\n" + NUDGES[exercise]
    raise AssertionError(message)


def _check(exercise: str, ok: bool, message: str) -> None:
    if not ok:
        _fail(exercise, message)


# ---------------------------------------------------------------- 8.1 images in the chain

IMAGE_CASES = [
    # (tokens, block_size, images as (offset, length, image_hash))
    ([7] * 12, 4, []),  # no image: extra_keys is None everywhere
    ([7] * 12, 4, [(5, 2, "cat")]),  # inside block 1 only
    ([7] * 12, 4, [(5, 2, "dog")]),  # the same tokens, another image
    ([7] * 16, 4, [(2, 9, "cat")]),  # spans blocks 0-2
    ([1, 2, 3] + [7] * 13, 4, [(3, 2, "a"), (6, 1, "b")]),  # two images in block 1
    ([7] * 14, 4, [(12, 2, "tail")]),  # only in the partial last block: no hash
    (list(range(48)), 16, [(0, 16, "first"), (20, 16, "second")]),
]


def _mm_reference(tokens: Sequence[int], bs: int, seed: bytes, images) -> list:
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images
                     if off < end and off + n > start)
        parent = hash_block_tokens(sha256_hash, parent, tokens[start:end], keys or None)
        out.append(parent)
    return out


def check_mm_chain_hashes(mm_chain_hashes: Callable) -> None:
    """Exercise 8.1: ``mm_chain_hashes(tokens, block_size, seed, hash_fn, images)`` -> hashes."""
    seed = b"checker-seed"
    for tokens, bs, images in IMAGE_CASES:
        expected = _mm_reference(tokens, bs, seed, images)
        got = call_reader(f"mm_chain_hashes({tokens}, {bs}, seed, sha256_hash, {images})",
                          mm_chain_hashes, list(tokens), bs, seed, sha256_hash, list(images))
        got_list = list(got) if isinstance(got, (list, tuple)) else got
        if got_list == expected:
            continue
        if not isinstance(got_list, list) or len(got_list) != len(expected):
            n = len(got_list) if isinstance(got_list, list) else "?"
            detail = f"a result of length {n} where {len(expected)} full blocks were expected"
        else:
            pairs = zip(got_list, expected, strict=True)
            first = next(i for i, (x, y) in enumerate(pairs) if x != y)
            detail = f"hashes that agree with the expected ones up to block {first} only"
        _fail("8.1", f"mm_chain_hashes(tokens={tokens}, block_size={bs}, images={images}) "
                     f"returned {detail}.")
    passed("8.1", f"your chain with images matches vLLM's extra keys on "
                           f"{len(IMAGE_CASES)} prompts")


# ---------------------------------------------------------------- 8.2 predicting a hit

HIT_CASES = [
    # (cached prompts, new prompt, block_size)
    ([list(range(48))], list(range(40)) + [99] * 30, 16),
    ([list(range(48))], list(range(48)), 16),  # the same prompt: the last token is computed
    ([list(range(48))], list(range(49)), 16),
    ([list(range(32))], list(range(33)), 16),
    ([list(range(16)) + [7] * 16], list(range(16)) + [8] * 16 + [1], 16),
    ([list(range(10))], list(range(10)), 4),
    ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]], [1, 2, 3, 4, 9, 9, 9, 9, 5], 4),
    ([[1, 2, 3]], [1, 2, 3, 4, 5], 4),  # nothing full was cached
    ([], list(range(20)), 4),
    ([[0, 1, 2, 3, 9, 9, 9, 9]], [5, 5, 5, 5, 9, 9, 9, 9, 1], 4),  # equal block, other parent
]


def _hash_hit(cached: Sequence[Sequence[int]], prompt: Sequence[int], bs: int) -> int:
    cache = HashCache(bs)
    slot = 0
    for p in cached:
        m = cache.match_prefix(p)
        n = len(p) // bs * bs
        fresh = torch.arange(slot, slot + n - m.cached_len)
        slot += n - m.cached_len
        cache.insert_prefix(p[:n], torch.cat([m.indices, fresh]))
    return cache.match_prefix(list(prompt)[:-1]).cached_len


def check_hash_hit(hash_hit: Callable) -> None:
    """Exercise 8.2: ``hash_hit(cached_prompts, prompt, block_size)`` -> tokens served."""
    for cached, prompt, bs in HIT_CASES:
        expected = _hash_hit(cached, prompt, bs)
        got = call_reader(f"hash_hit({cached}, {prompt}, {bs})", hash_hit,
                          [list(p) for p in cached], list(prompt), bs)
        ok = isinstance(got, int) and not isinstance(got, bool) and got == expected
        _check("8.2", ok, f"hash_hit(cached_prompts={cached}, prompt={prompt}, "
                          f"block_size={bs}) returned {got!r}, expected {expected}.")
    passed("8.2", f"{len(HIT_CASES)} hits predicted without running a cache")


# ---------------------------------------------------------------- 8.3 the free queue

QUEUE_CASES = [
    [("start", "A", [0, 1]), ("start", "B", [0, 1, 2]), ("finish", "B", [0, 1, 2])],
    # a trace: ("start" | "finish", request name, its block ids in prompt order)
    [("start", "A", [0, 1, 2]), ("finish", "A", [0, 1, 2])],
    [("start", "A", [0, 1, 2]), ("start", "B", [0, 1, 3]), ("finish", "A", [0, 1, 2]),
     ("finish", "B", [0, 1, 3])],
    [("start", "A", [0, 1, 2]), ("start", "B", [0, 1, 3]), ("finish", "B", [0, 1, 3]),
     ("finish", "A", [0, 1, 2])],
    [("start", "A", [0, 1]), ("finish", "A", [0, 1]), ("start", "B", [0, 4, 5]),
     ("finish", "B", [0, 4, 5]), ("start", "C", [0, 1, 6]), ("finish", "C", [0, 1, 6])],
    [("start", "A", [0, 1, 2, 3]), ("finish", "A", [0, 1, 2, 3]), ("start", "B", [0]),
     ("start", "C", [0, 1, 7]), ("finish", "C", [0, 1, 7]), ("finish", "B", [0])],
    [("start", "A", [0, 1, 2]), ("start", "B", [0, 1, 3]), ("finish", "A", [0, 1, 2]),
     ("start", "C", [0, 5]), ("finish", "B", [0, 1, 3])],
]


def _queue_order(trace) -> list[int]:
    refs: Counter[int] = Counter()
    queue: list[int] = []
    for event, _, blocks in trace:
        if event == "start":
            for b in blocks:
                if b in queue:
                    queue.remove(b)
                refs[b] += 1
        else:
            for b in reversed(blocks):
                refs[b] -= 1
                if refs[b] == 0:
                    queue.append(b)
    return queue


def check_free_queue_order(free_queue_order: Callable) -> None:
    """Exercise 8.3: ``free_queue_order(trace)`` -> block ids in eviction order, head first."""
    for trace in QUEUE_CASES:
        expected = _queue_order(trace)
        got = as_int_list(call_reader(f"free_queue_order({trace})", free_queue_order,
                                      [(e, r, list(b)) for e, r, b in trace]))
        _check("8.3", got == expected,
               f"free_queue_order({trace}) returned {got}, expected {expected} (the block "
               "evicted first comes first).")
    passed("8.3", "the free queue's order predicted on "
                  f"{len(QUEUE_CASES)} traces, revivals and shared blocks included")


# ---------------------------------------------------------------- 8.4 prompt extraction


class _Server:
    """A shared radix cache (page 1) behind a TTFT clock: ``probe(tokens)`` -> seconds.

    TTFT = base + per_token * uncached tokens (+ noise), and the probe itself is cached,
    as it would be on a real server.
    """

    def __init__(self, secret: list[int], noise: float, seed: int) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.rng = random.Random(seed)
        self.noise, self.probes = noise, 0
        self._insert(secret)

    def _insert(self, tokens: Sequence[int]) -> None:
        for i in range(1, len(tokens) + 1):
            self.cached.add(tuple(tokens[:i]))

    def probe(self, tokens: Sequence[int]) -> float:
        tokens = [int(t) for t in tokens]
        self.probes += 1
        hit = 0
        while hit < len(tokens) - 1 and tuple(tokens[:hit + 1]) in self.cached:
            hit += 1
        self._insert(tokens)
        return 0.02 + 0.004 * (len(tokens) - hit) + self.rng.uniform(0, self.noise)


EXTRACT_CASES = [
    # (vocabulary, secret, noise)
    (list(range(10)), [3, 1, 4, 1, 5], 0.0),
    (list(range(10)), [9, 9, 0, 2], 0.002),
    (list(range(20, 36)), [33, 21, 21, 34, 20, 35], 0.003),
]


def check_extract_prompt(extract_prompt: Callable) -> None:
    """Exercise 8.4: ``extract_prompt(probe, vocab, length)`` -> the cached secret's tokens."""
    for i, (vocab, secret, noise) in enumerate(EXTRACT_CASES):
        server = _Server(secret, noise, seed=i)
        got = as_int_list(call_reader(f"extract_prompt(probe, {vocab}, {len(secret)})",
                                      extract_prompt, server.probe, list(vocab), len(secret)))
        budget = len(secret) * len(vocab) + 1
        _check("8.4", got == secret,
               f"extract_prompt(probe, vocab={vocab}, length={len(secret)}) returned {got}, "
               f"expected the secret {secret} (TTFT noise up to {noise * 1e3:.0f} ms, "
               f"{server.probes} probes used).")
        _check("8.4", server.probes <= budget,
               f"extract_prompt used {server.probes} probes for a {len(secret)}-token secret "
               f"over {len(vocab)} tokens; {budget} are enough (one per candidate per "
               "position, plus one).")
    passed("8.4", "every secret recovered from TTFT alone, one token at a time")
