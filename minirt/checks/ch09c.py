"""Checkers for chapter 09c's exercises (KV cache events): the block hashes an event carries
(9c.1), one replica's held blocks folded from its events (9c.2), and the tokens a precise
router credits each replica with (9c.3).

Each checker runs the reader's function on inputs of its own, compares with a reference
built from ``minirt.kv_events`` and ``minirt.precise_router`` and names the first input that
disagrees. A second failure of the same exercise adds a nudge toward the idea.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    VLLM_NONE_HASH_SEED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    external_block_hash,
    vllm_block_hashes,
)
from ..precise_router import BlockIndex, KVEventSubscriber
from ._common import as_int_list, call_reader, checker, expect, passed

__all__ = ["check_event_hashes", "check_fold_events", "check_matched_tokens"]


# ---------------------------------------------------------------- 9c.1 the hashes of an event

def event_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None,
                 lora: tuple[str, str] | None = None) -> list[int]:
    """Reference for 9c.1: the ints a ``BlockStored`` carries for the full blocks of
    ``tokens`` (vLLM's SHA-256 chain from ``NONE_HASH`` of "vllm-none-hash")."""
    return [external_block_hash(h) for h in
            vllm_block_hashes(list(tokens), block_size, salt=salt, lora=lora,
                              seed=VLLM_NONE_HASH_SEED)]


HASH_CASES: list[tuple[list[int], int, str | None, tuple[str, str] | None]] = [
    (list(range(100, 108)), 4, None, None),          # two full blocks
    (list(range(100, 110)), 4, None, None),          # a partial block at the end
    ([7, 8, 9], 4, None, None),                      # no full block at all
    ([5, 5, 5, 5, 5, 5], 2, None, None),             # equal blocks, different hashes
    (list(range(300, 312)), 4, "tenant-a", None),    # a salt
    (list(range(300, 312)), 4, None, ("sql", "/adapters/sql")),        # a LoRA adapter
    (list(range(300, 312)), 4, "tenant-a", ("sql", "/adapters/sql")),  # both
    ([49151, 0, 70000, 1], 1, None, None),           # block size 1, large ids
]

_NUDGE_91 = ("Each block's hash takes the previous block's hash as its parent (NONE_HASH for "
             "the first), and the extra keys are a tuple of tagged tuples. Which block gets "
             "the salt, which get the adapter, and which 64 bits of the digest does an "
             "event carry?")


def _call(fn: Callable, tokens, block_size, salt, lora):
    kwargs: dict[str, Any] = {}
    if salt is not None:
        kwargs["salt"] = salt
    if lora is not None:
        kwargs["lora"] = lora
    shown = f"event_hashes({tokens}, {block_size}" + "".join(
        f", {k}={v!r}" for k, v in kwargs.items()) + ")"
    return shown, call_reader(shown, lambda: fn(list(tokens), block_size, **kwargs))


@checker("9c.1", _NUDGE_91)
def check_event_hashes(fn: Callable) -> None:
    """Exercise 9c.1: ``fn(tokens, block_size, salt=None, lora=None)`` -> the list of ints
    a ``BlockStored`` event carries for the full blocks of ``tokens``."""
    for tokens, block_size, salt, lora in HASH_CASES:
        want = event_hashes(tokens, block_size, salt, lora)
        shown, got = _call(fn, tokens, block_size, salt, lora)
        got_list = as_int_list(got)
        expect(got_list is not None and len(got_list) == len(want),
               f"{shown} returned {got!r}; expected a list of {len(want)} ints, one per full "
               "block.")
        wrong = [i for i, (g, w) in enumerate(zip(got_list, want, strict=True)) if g != w]
        if wrong:
            i = wrong[0]
            expect(False, f"{shown}: block {i} is {got_list[i]}; expected {want[i]} (all "
                          f"blocks expected: {want}).")
    passed("9c.1", f"{len(HASH_CASES)} prompts, salts and adapters included; your hashes are "
                   "the ones vLLM publishes")


# ---------------------------------------------------------------- 9c.2 folding events

def fold_events(events: Sequence[Any], medium: str = MEDIUM_GPU) -> dict[int, int]:
    """Reference for 9c.2: hash -> how many blocks with that hash one replica holds after
    ``events``, as ``KVEventSubscriber.apply_event`` keeps it (other media ignored)."""
    sub = KVEventSubscriber(BlockIndex(1), medium=medium)
    for event in events:
        sub.apply_event(0, event)
    return dict(sub.index.held(0))


def _stored(hashes: list[int], medium: str | None = MEDIUM_GPU, parent: int | None = None,
            size: int = 2) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(range(size * len(hashes))), block_size=size,
                       lora_id=None, medium=medium, lora_name=None)


def _removed(hashes: list[int], medium: str | None = MEDIUM_GPU) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


FOLD_CASES: list[tuple[str, list[Any]]] = [
    ("stored then one removed", [_stored([11, 12, 13]), _removed([13])]),
    ("a medium of None counts as the device", [_stored([1, 2], medium=None), _removed([2], None)]),
    ("the same hash stored twice, removed once", [_stored([21, 22]), _stored([21]),
                                                  _removed([21])]),
    ("a removal the index never saw", [_stored([31]), _removed([99, 31]), _stored([32])]),
    ("everything cleared, then new blocks", [_stored([41, 42]), AllBlocksCleared(),
                                             _stored([43], parent=None)]),
    ("blocks of the host tier", [_stored([51, 52]), _stored([51, 52], medium=MEDIUM_CPU),
                                 _removed([52], MEDIUM_CPU)]),
    ("a removal on the host tier only", [_stored([61]), _removed([61], MEDIUM_CPU)]),
]

_NUDGE_92 = ("The index answers 'how many blocks with this hash does the replica hold': "
             "a count, not a set. What should an event for another medium, a removal of a "
             "hash it never saw, and a clear do to that count?")


def _normalise(got: Any) -> dict | None:
    if not isinstance(got, (dict, Counter)):
        return None
    return {h: n for h, n in got.items() if n != 0}


@checker("9c.2", _NUDGE_92)
def check_fold_events(fn: Callable) -> None:
    """Exercise 9c.2: ``fn(events)`` -> {hash: blocks held} for one replica's device tier."""
    for name, events in FOLD_CASES:
        want = fold_events(events)
        got = call_reader(f"fold_events(<{name}>)", fn, list(events))
        norm = _normalise(got)
        shown = "; ".join(_describe(e) for e in events)
        expect(norm is not None, f"fold_events({shown}) returned {got!r}; expected a dict "
                                 f"(or Counter) of hash -> count, here {want}.")
        expect(norm == want, f"fold_events({shown}) returned {norm}; expected {want} "
                             f"({name}).")
    passed("9c.2", f"{len(FOLD_CASES)} event streams: duplicates, unknown removals, clears "
                   "and the host tier")


def _describe(event: Any) -> str:
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared"
    kind = "stored" if isinstance(event, BlockStored) else "removed"
    return f"{kind} {event.block_hashes} on {event.medium}"


# ---------------------------------------------------------------- 9c.3 matched tokens

def matched_tokens(prompt: Sequence[int], block_size: int,
                   held: Sequence[set[int]]) -> list[int]:
    """Reference for 9c.3: per replica, the prompt tokens the precise router credits it
    with, ``held[r]`` the event ints replica ``r`` holds (``PreciseRouter.matched``)."""
    index = BlockIndex(len(held))
    for r, hashes in enumerate(held):
        index.stored(r, sorted(hashes))
    hashes = event_hashes(list(prompt)[:-1], block_size)
    return [run * block_size for run in index.match(hashes)]


def _matched_cases() -> list[tuple[str, list[int], int, list[set[int]]]]:
    a = list(range(500, 516))           # 16 tokens: the last block is full
    b = list(range(500, 514))           # 14 tokens
    ha = event_hashes(a, 4)             # 4 blocks
    other = event_hashes(list(range(900, 916)), 4)
    return [
        ("one replica holds every block", b, 4, [set(), set(ha), set(ha[:1])]),
        ("a prompt that ends on a block boundary", a, 4, [set(ha), set(ha[:2])]),
        ("a replica that lost a middle block", b, 4, [{ha[0], ha[2]}, set(ha[:2])]),
        ("blocks of another prompt", b, 4, [set(other), set()]),
        ("block size 2", list(range(500, 507)), 2,
         [set(event_hashes(list(range(500, 506)), 2)), set()]),
    ]


_NUDGE_93 = ("A replica is credited with the blocks it holds in a row from the first, and "
             "the router counts tokens. Which tokens of the prompt can vLLM serve from its "
             "cache at all?")


@checker("9c.3", _NUDGE_93)
def check_matched_tokens(fn: Callable) -> None:
    """Exercise 9c.3: ``fn(prompt, block_size, held)`` -> matched prompt tokens per replica."""
    for name, prompt, block_size, held in _matched_cases():
        want = matched_tokens(prompt, block_size, held)
        shown = (f"matched_tokens(<{len(prompt)} tokens>, {block_size}, <{len(held)} "
                 f"replicas: {name}>)")
        got = call_reader(shown, fn, list(prompt), block_size, [set(h) for h in held])
        got_list = as_int_list(got)
        expect(got_list == want, f"{shown} returned {got!r}; expected {want}.")
    passed("9c.3", "leading runs, the last token and block boundaries")
