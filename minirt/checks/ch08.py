"""Checkers for chapter 08: images in the chained hash, hits, the free queue's order,
prompt extraction.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees: what came back and what was
expected. A repeated failure of the same exercise adds a hint toward the idea (never the
algorithm); for 8.1 the hint answers the kind of slip the returned hashes show.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from ..hashcache import HashCache, hash_block_tokens, sha256_hash
from ._common import as_int_list, call_reader, checker, expect, passed

__all__ = [
    "check_extract_prompt",
    "check_mm_chain_hashes",
    "check_free_queue_order",
    "check_hash_hit",
]


# ---------------------------------------------------------------- 8.1 images in the chain

IMAGE_CASES = [
    # (tokens, block_size, images as (offset, length, image_hash))
    ([7] * 12, 4, []),  # no image: extra_keys is None everywhere
    ([7] * 12, 4, [(5, 2, "cat")]),  # inside block 1 only
    ([7] * 12, 4, [(5, 2, "dog")]),  # the same tokens, another image
    ([7] * 16, 4, [(2, 9, "cat")]),  # spans blocks 0-2
    ([1, 2, 3] + [7] * 13, 4, [(3, 2, "a"), (6, 1, "b")]),  # two images in block 1
    ([7] * 14, 4, [(12, 2, "tail")]),  # only in the partial last block: no hash
    (list(range(48)), 16, [(0, 16, "first"), (20, 16, "second")]),  # "first" ends at 16
]

_NUDGE_81 = ("Compare your hash of the first block that differs with hash_fn((parent, "
             "tuple(block tokens), extra_keys)) for the parent and the extra keys the message "
             "names, one input at a time.")


def _overlaps(off: int, n: int, start: int, end: int) -> bool:
    return off < end and off + n > start


# Ways to build one block's extra keys: the right one first, then the slips the hint
# names. Each maps (images, block start, block end) -> extra_keys.
_KEY_RULES: dict[str, Callable] = {
    "right": lambda ims, s, e: tuple(("mm", h, o - s) for o, n, h in ims
                                     if _overlaps(o, n, s, e)) or None,
    "empty tuple": lambda ims, s, e: tuple(("mm", h, o - s) for o, n, h in ims
                                           if _overlaps(o, n, s, e)),
    "absolute offset": lambda ims, s, e: tuple(("mm", h, o) for o, n, h in ims
                                               if _overlaps(o, n, s, e)) or None,
    "start block only": lambda ims, s, e: tuple(("mm", h, o - s) for o, n, h in ims
                                                if s <= o < e) or None,
    "touching counts": lambda ims, s, e: tuple(("mm", h, o - s) for o, n, h in ims
                                               if o <= e and o + n >= s) or None,
    # Last: where an earlier rule also gives None (an image that started in an earlier
    # block), the slip that failed is the more specific one.
    "no images": lambda ims, s, e: None,
}

_KEY_NUDGES = {
    "empty tuple": "A block that no image overlaps has extra_keys None, not an empty tuple: "
                   "the two hash differently.",
    "no images": "The placeholder tokens are the same whatever the image shows: only the "
                 "image's hash in extra_keys tells two images apart.",
    "absolute offset": "The offset in an image's extra key is counted from the start of the "
                       "block, not from the start of the prompt.",
    "start block only": "An image belongs to the extra keys of every block it overlaps, not "
                        "only the block where it starts.",
    "touching counts": "An image overlaps a block only if one of its tokens lies inside the "
                       "block: an image that ends where the block starts, or starts where it "
                       "ends, does not.",
    "seed parent": "Each block's parent is the previous block's hash; only block 0's parent "
                   "is the argument seed.",
    "too many": "Only full blocks get a hash: a partial last block has none.",
    "too few": "Every full block gets a hash, the last full one too.",
}


def _mm_chain(tokens: Sequence[int], bs: int, seed: bytes, images, rule: str = "right",
              chain: bool = True) -> list:
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = _KEY_RULES[rule](images, start, end)
        h = hash_block_tokens(sha256_hash, parent if chain or i == 0 else seed,
                              tokens[start:end], keys)
        parent = h
        out.append(h)
    return out


def _mm_reference(tokens: Sequence[int], bs: int, seed: bytes, images) -> list:
    return _mm_chain(tokens, bs, seed, images)


def _explain_block(got, k: int, tokens, bs: int, seed: bytes, images) -> tuple[str, str | None]:
    """What the reader's hash of block ``k`` (the first that differs) was built from, if it
    is one of the slips tried: (a sentence, the nudge for that slip)."""
    start, end = k * bs, (k + 1) * bs
    parent = seed if k == 0 else got[k - 1]  # blocks before k agree with the reference
    block = tokens[start:end]
    want_keys = _KEY_RULES["right"](images, start, end)
    parent_name = "seed" if k == 0 else f"block {k - 1}'s hash"
    expected = (f"expected hash_fn(({parent_name}, tuple(tokens[{start}:{end}]), "
                f"{want_keys!r}))")
    parents = [(parent_name, parent, None)]
    if k > 0:
        parents.append(("seed", seed, "seed parent"))
    for p_name, p, p_slip in parents:
        for rule, make in _KEY_RULES.items():
            keys = make(images, start, end)
            if got[k] == hash_block_tokens(sha256_hash, p, block, keys):
                slip = p_slip or (None if rule == "right" else rule)
                return (f"{expected}; yours is hash_fn(({p_name}, tuple(tokens[{start}:{end}]),"
                        f" {keys!r})).", _KEY_NUDGES.get(slip) if slip else None)
    return (f"{expected}; yours is none of the variants the check tried (parent, tokens, "
            "extra keys).", None)


@checker("8.1", _NUDGE_81)
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
        call = (f"mm_chain_hashes(tokens={tokens}, block_size={bs}, seed, sha256_hash, "
                f"images={images})")
        if not isinstance(got_list, list):
            expect(False, f"{call} returned {got!r}; expected a list of {len(expected)} "
                          "hashes, one per full block.")
        if len(got_list) != len(expected):
            slip = "too many" if len(got_list) > len(expected) else "too few"
            expect(False, f"{call} returned {len(got_list)} hashes; expected "
                          f"{len(expected)}, one per full block of {bs} tokens "
                          f"({len(tokens)} tokens).", _KEY_NUDGES[slip])
        first = next(i for i, (x, y) in enumerate(zip(got_list, expected, strict=True))
                     if x != y)
        what, nudge = _explain_block(got_list, first, tokens, bs, seed, images)
        expect(False, f"{call} returned hashes that first differ at block {first} (tokens "
                      f"{first * bs}..{(first + 1) * bs - 1}): {what}", nudge)
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


@checker("8.2", "A lookup stops at the first block whose hash is missing, it only ever sees "
                "full blocks, and it never covers the prompt's last token.")
def check_hash_hit(hash_hit: Callable) -> None:
    """Exercise 8.2: ``hash_hit(cached_prompts, prompt, block_size)`` -> tokens served."""
    for cached, prompt, bs in HIT_CASES:
        expected = _hash_hit(cached, prompt, bs)
        got = call_reader(f"hash_hit({cached}, {prompt}, {bs})", hash_hit,
                          [list(p) for p in cached], list(prompt), bs)
        ok = isinstance(got, int) and not isinstance(got, bool) and got == expected
        expect(ok, f"hash_hit(cached_prompts={cached}, prompt={prompt}, "
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


@checker("8.3", "A block joins the queue only when its count reaches zero, and a request's "
                "blocks are released last block first.")
def check_free_queue_order(free_queue_order: Callable) -> None:
    """Exercise 8.3: ``free_queue_order(trace)`` -> block ids in eviction order, head first."""
    for trace in QUEUE_CASES:
        expected = _queue_order(trace)
        got = as_int_list(call_reader(f"free_queue_order({trace})", free_queue_order,
                                      [(e, r, list(b)) for e, r, b in trace]))
        expect(got == expected,
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


@checker("8.4", "The probe that matches one token more than the others is the fastest; a "
                "wrong probe that gets cached matches no more of the secret than before.")
def check_extract_prompt(extract_prompt: Callable) -> None:
    """Exercise 8.4: ``extract_prompt(probe, vocab, length)`` -> the cached secret's tokens."""
    for i, (vocab, secret, noise) in enumerate(EXTRACT_CASES):
        server = _Server(secret, noise, seed=i)
        got = as_int_list(call_reader(f"extract_prompt(probe, {vocab}, {len(secret)})",
                                      extract_prompt, server.probe, list(vocab), len(secret)))
        budget = len(secret) * len(vocab) + 1
        expect(got == secret,
               f"extract_prompt(probe, vocab={vocab}, length={len(secret)}) returned {got}, "
               f"expected the secret {secret} (TTFT noise up to {noise * 1e3:.0f} ms, "
               f"{server.probes} probes used).")
        expect(server.probes <= budget,
               f"extract_prompt used {server.probes} probes for a {len(secret)}-token secret "
               f"over {len(vocab)} tokens; {budget} are enough (one per candidate per "
               "position, plus one).")
    passed("8.4", "every secret recovered from TTFT alone, one token at a time")
