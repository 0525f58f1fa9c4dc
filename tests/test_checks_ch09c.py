"""Chapter 09c checkers accept the reference solutions and reject plausible wrong ones."""

from __future__ import annotations

from collections import Counter

from exercise_util import rejects

from minirt.checks import ch09c
from minirt.checks._common import reset_attempts
from minirt.kv_events import (
    MEDIUM_GPU,
    VLLM_NONE_HASH_SEED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    none_hash,
    vllm_sha256,
)

# --------------------------------------------------------------------------- references
# (the same code as solutions/09c_kv_events.ipynb)


def event_hashes(tokens, block_size, salt=None, lora=None):
    out, parent = [], none_hash(VLLM_NONE_HASH_SEED)
    for i in range(len(tokens) // block_size):
        keys = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if i == 0 and salt:
            keys.append(("cache_salt", salt))
        block = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = vllm_sha256((parent, block, tuple(keys) if keys else None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def fold_events(events, medium=MEDIUM_GPU):
    held = Counter()
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif event.medium not in (None, medium):
            continue
        elif isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if held[h] > 0:
                    held[h] -= 1
    return +held


def matched_tokens(prompt, block_size, held):
    hashes = event_hashes(prompt[:-1], block_size)
    out = []
    for blocks in held:
        run = 0
        while run < len(hashes) and hashes[run] in blocks:
            run += 1
        out.append(run * block_size)
    return out


# --------------------------------------------------------------------------- 9c.1


def test_event_hashes_accepts_the_reference(capsys):
    reset_attempts("9c.1")
    ch09c.check_event_hashes(event_hashes)
    assert "Exercise 9c.1 passed" in capsys.readouterr().out


def _hashes_with(keys_fn, cut=lambda d: int.from_bytes(d, "big") & ((1 << 64) - 1),
                 first=lambda: none_hash(VLLM_NONE_HASH_SEED), partial=False):
    def fn(tokens, block_size, salt=None, lora=None):
        out, parent = [], first()
        n = -(-len(tokens) // block_size) if partial else len(tokens) // block_size
        for i in range(n):
            keys = keys_fn(i, salt, lora)
            block = tuple(tokens[i * block_size:(i + 1) * block_size])
            parent = vllm_sha256((parent, block, tuple(keys) if keys else None))
            out.append(cut(parent))
        return out
    return fn


def _right_keys(i, salt, lora):
    keys = [("lora", lora[0], lora[1])] if lora else []
    return keys + ([("cache_salt", salt)] if i == 0 and salt else [])


def test_event_hashes_rejects_a_salt_on_every_block():
    wrong = _hashes_with(lambda i, s, lo: [("cache_salt", s)] if s else [])
    rejects(ch09c.check_event_hashes, wrong, "9c.1", contains="salt='tenant-a'")


def test_event_hashes_rejects_an_adapter_without_its_path():
    wrong = _hashes_with(lambda i, s, lo: ([("lora", lo[0])] if lo else [])
                         + ([("cache_salt", s)] if i == 0 and s else []))
    rejects(ch09c.check_event_hashes, wrong, "9c.1", contains="lora=")


def test_event_hashes_rejects_the_high_64_bits():
    wrong = _hashes_with(_right_keys, cut=lambda d: int.from_bytes(d[:8], "big"))
    rejects(ch09c.check_event_hashes, wrong, "9c.1", contains="block 0")


def test_event_hashes_rejects_a_partial_last_block():
    wrong = _hashes_with(_right_keys, partial=True)
    rejects(ch09c.check_event_hashes, wrong, "9c.1", contains="list of 2 ints")


def test_event_hashes_rejects_no_none_hash():
    wrong = _hashes_with(_right_keys, first=lambda: None)
    rejects(ch09c.check_event_hashes, wrong, "9c.1")


# --------------------------------------------------------------------------- 9c.2


def test_fold_events_accepts_the_reference(capsys):
    reset_attempts("9c.2")
    ch09c.check_fold_events(fold_events)
    ch09c.check_fold_events(lambda events: dict(fold_events(events)))
    assert "Exercise 9c.2 passed" in capsys.readouterr().out


def test_fold_events_rejects_a_set():
    def wrong(events):
        held = set()
        for e in events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif e.medium not in (None, MEDIUM_GPU):
                continue
            elif isinstance(e, BlockStored):
                held.update(e.block_hashes)
            else:
                held.difference_update(e.block_hashes)
        return {h: 1 for h in held}
    rejects(ch09c.check_fold_events, wrong, "9c.2", contains="stored twice")


def test_fold_events_rejects_every_medium():
    def wrong(events):
        return fold_events([e if isinstance(e, AllBlocksCleared) else
                            type(e)(**{**vars(e), "medium": MEDIUM_GPU}) for e in events])
    rejects(ch09c.check_fold_events, wrong, "9c.2", contains="host tier")


def test_fold_events_rejects_negative_counts():
    def wrong(events):
        held = Counter()
        for e in events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif e.medium not in (None, MEDIUM_GPU):
                continue
            elif isinstance(e, BlockStored):
                held.update(e.block_hashes)
            else:
                held.subtract(e.block_hashes)
        return dict(held)
    rejects(ch09c.check_fold_events, wrong, "9c.2", contains="never saw")


def test_fold_events_rejects_ignoring_a_clear():
    def wrong(events):
        return fold_events([e for e in events if not isinstance(e, AllBlocksCleared)])
    rejects(ch09c.check_fold_events, wrong, "9c.2", contains="cleared")


def test_fold_events_rejects_a_list():
    rejects(ch09c.check_fold_events, lambda events: list(fold_events(events)), "9c.2",
            contains="expected a dict")


# --------------------------------------------------------------------------- 9c.3


def test_matched_tokens_accepts_the_reference(capsys):
    reset_attempts("9c.3")
    ch09c.check_matched_tokens(matched_tokens)
    assert "Exercise 9c.3 passed" in capsys.readouterr().out


def test_matched_tokens_rejects_the_whole_prompt():
    def wrong(prompt, block_size, held):
        return matched_tokens(prompt + [0], block_size, held)  # hashes every token
    rejects(ch09c.check_matched_tokens, wrong, "9c.3", contains="block boundary")


def test_matched_tokens_rejects_counting_any_held_block():
    def wrong(prompt, block_size, held):
        hashes = event_hashes(prompt[:-1], block_size)
        return [sum(h in blocks for h in hashes) * block_size for blocks in held]
    rejects(ch09c.check_matched_tokens, wrong, "9c.3", contains="middle block")


def test_matched_tokens_rejects_blocks_for_tokens():
    def wrong(prompt, block_size, held):
        return [n // block_size for n in matched_tokens(prompt, block_size, held)]
    rejects(ch09c.check_matched_tokens, wrong, "9c.3")
