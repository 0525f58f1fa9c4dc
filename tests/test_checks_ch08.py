"""Chapter 08 checkers: each accepts a right answer and rejects plausible wrong ones; a
repeated failure adds a nudge."""

from __future__ import annotations

import pytest
from brute_force import lcp

import minirt.checks as checks
from minirt.checks._common import CheckFailure, reset_attempts

# ---------------------------------------------------------------- Exercise 8.1


def mm_right(tokens, bs, seed, hash_fn, images):
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images
                     if off < end and off + n > start)
        parent = hash_fn((parent, tuple(tokens[start:end]), keys or None))
        out.append(parent)
    return out


def mm_ignores_images(tokens, bs, seed, hash_fn, images):  # placeholder ids alone
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        parent = hash_fn((parent, tuple(tokens[i * bs:(i + 1) * bs]), None))
        out.append(parent)
    return out


def mm_start_block_only(tokens, bs, seed, hash_fn, images):  # key only where the image starts
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images if start <= off < end)
        parent = hash_fn((parent, tuple(tokens[start:end]), keys or None))
        out.append(parent)
    return out


def mm_absolute_offset(tokens, bs, seed, hash_fn, images):  # offset not relative to the block
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off) for off, n, h in images if off < end and off + n > start)
        parent = hash_fn((parent, tuple(tokens[start:end]), keys or None))
        out.append(parent)
    return out


def mm_empty_tuple(tokens, bs, seed, hash_fn, images):  # () where no image overlaps
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images
                     if off < end and off + n > start)
        parent = hash_fn((parent, tuple(tokens[start:end]), keys))
        out.append(parent)
    return out


def mm_no_chain(tokens, bs, seed, hash_fn, images):  # every block's parent is the seed
    out = []
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images
                     if off < end and off + n > start)
        out.append(hash_fn((seed, tuple(tokens[start:end]), keys or None)))
    return out


def mm_touching(tokens, bs, seed, hash_fn, images):  # off + len >= start, off <= end
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images
                     if off <= end and off + n >= start)
        parent = hash_fn((parent, tuple(tokens[start:end]), keys or None))
        out.append(parent)
    return out


def mm_overlap_rule(start_inclusive_end, end_inclusive_start):
    """The cold run's two overlap slips: ``off + len >= start`` or ``off <= end``."""
    def fn(tokens, bs, seed, hash_fn, images):
        out, parent = [], seed
        for i in range(len(tokens) // bs):
            start, end = i * bs, (i + 1) * bs
            keys = tuple(("mm", h, off - start) for off, n, h in images
                         if (off <= end if end_inclusive_start else off < end)
                         and (off + n >= start if start_inclusive_end else off + n > start))
            parent = hash_fn((parent, tuple(tokens[start:end]), keys or None))
            out.append(parent)
        return out
    return fn


def mm_partial_block(tokens, bs, seed, hash_fn, images):  # hashes the partial last block
    out, parent = [], seed
    for i in range(-(-len(tokens) // bs)):
        start, end = i * bs, (i + 1) * bs
        keys = tuple(("mm", h, off - start) for off, n, h in images
                     if off < end and off + n > start)
        parent = hash_fn((parent, tuple(tokens[start:end]), keys or None))
        out.append(parent)
    return out


@pytest.fixture(autouse=True)
def fresh_counts():
    reset_attempts()
    yield
    reset_attempts()


MM_SLIPS = [
    # (wrong answer, what the repeated failure's hint must say)
    (mm_ignores_images, "only the image's hash"),
    (mm_start_block_only, "every block it overlaps"),
    (mm_absolute_offset, "from the start of the block"),
    (mm_empty_tuple, "not an empty tuple"),
    (mm_no_chain, "previous block's hash"),
    (mm_touching, "ends where the block starts"),
    (mm_overlap_rule(True, False), "ends where the block starts"),
    (mm_overlap_rule(False, True), "starts where it"),
    (mm_partial_block, "partial last block"),
]


def test_mm_chain(capsys):
    checks.check_mm_chain_hashes(mm_right)
    assert capsys.readouterr().out.startswith("Exercise 8.1 passed")
    for wrong, _ in MM_SLIPS:
        with pytest.raises(CheckFailure, match="mm_chain_hashes"):
            checks.check_mm_chain_hashes(wrong)


@pytest.mark.parametrize(("wrong", "hint"), MM_SLIPS)
def test_mm_hint_answers_the_kind_of_slip(wrong, hint):
    with pytest.raises(CheckFailure) as first:
        checks.check_mm_chain_hashes(wrong)
    message = str(first.value)
    assert "Hint" not in message and hint not in message and "block_size=" in message
    assert "expected" in message  # the failing input, what came back, what was expected
    with pytest.raises(CheckFailure) as second:
        checks.check_mm_chain_hashes(wrong)
    assert "Hint (failed 2 times)" in str(second.value) and hint in str(second.value)


def test_mm_message_names_the_first_block_that_differs():
    with pytest.raises(CheckFailure) as err:
        checks.check_mm_chain_hashes(mm_absolute_offset)
    message = str(err.value)
    assert "first differ at block 1 (tokens 4..7)" in message
    assert "(('mm', 'cat', 1),)" in message and "(('mm', 'cat', 5),)" in message


# ---------------------------------------------------------------- Exercise 8.2


def hit_right(cached, prompt, bs):
    ids = prompt[:-1]
    return max((min(lcp(p, ids), len(p) // bs * bs) // bs * bs for p in cached), default=0)


def hit_whole_prompt(cached, prompt, bs):  # forgets that the last token is computed
    return max((min(lcp(p, prompt), len(p) // bs * bs) // bs * bs for p in cached),
               default=0)


def hit_token_level(cached, prompt, bs):  # counts tokens, like a radix cache of page 1
    return max((lcp(p, prompt[:-1]) for p in cached), default=0)


def hit_blockwise(cached, prompt, bs):  # compares blocks alone, as if hashes did not chain
    ids = prompt[:-1]
    return max((bs * sum(p[i:i + bs] == ids[i:i + bs] for i in range(0, len(p) // bs * bs, bs))
                for p in cached), default=0)


def test_hit(capsys):
    checks.check_hash_hit(hit_right)
    assert capsys.readouterr().out.startswith("Exercise 8.2 passed")
    for wrong in (hit_whole_prompt, hit_token_level, hit_blockwise):
        with pytest.raises(AssertionError, match="hash_hit"):
            checks.check_hash_hit(wrong)


# ---------------------------------------------------------------- Exercise 8.3


def queue_right(trace):
    refs, queue = {}, []
    for kind, _, blocks in trace:
        if kind == "start":
            for b in blocks:
                if b in queue:
                    queue.remove(b)
                refs[b] = refs.get(b, 0) + 1
        else:
            for b in reversed(blocks):
                refs[b] -= 1
                if refs[b] == 0:
                    queue.append(b)
    return queue


def queue_head_first(trace):  # frees a request's blocks first to last
    return queue_right([(k, r, b if k == "start" else list(reversed(b))) for k, r, b in trace])


def queue_no_refcount(trace):  # every release queues the block (dropping earlier entries)
    queue = []
    for kind, _, blocks in trace:
        for b in (blocks if kind == "start" else reversed(blocks)):
            if b in queue:
                queue.remove(b)
            if kind == "finish":
                queue.append(b)
    return queue


def queue_no_revival(trace):  # a hit leaves the block where it was in the queue
    refs, queue = {}, []
    for kind, _, blocks in trace:
        for b in (blocks if kind == "start" else reversed(blocks)):
            refs[b] = refs.get(b, 0) + (1 if kind == "start" else -1)
            if kind == "finish" and refs[b] == 0 and b not in queue:
                queue.append(b)
    return queue


def test_queue(capsys):
    checks.check_free_queue_order(queue_right)
    assert capsys.readouterr().out.startswith("Exercise 8.3 passed")
    for wrong in (queue_head_first, queue_no_refcount, queue_no_revival):
        with pytest.raises(AssertionError, match="free_queue_order"):
            checks.check_free_queue_order(wrong)


# ---------------------------------------------------------------- Exercise 8.4


def extract_right(probe, vocab, length):
    filler, known = max(vocab) + 1, []
    for _ in range(length):
        times = {v: probe(known + [v, filler]) for v in vocab}
        known.append(min(times, key=times.get))
    return known


def extract_no_filler(probe, vocab, length):  # the last token is never served from cache
    known = []
    for _ in range(length):
        times = {v: probe(known + [v]) for v in vocab}
        known.append(min(times, key=times.get))
    return known


def extract_filler_in_vocab(probe, vocab, length):  # its own probes fool the next guess
    known = []
    for _ in range(length):
        times = {v: probe(known + [v, vocab[0]]) for v in vocab}
        known.append(min(times, key=times.get))
    return known


def extract_slowest(probe, vocab, length):  # reads the timing backwards
    filler, known = max(vocab) + 1, []
    for _ in range(length):
        times = {v: probe(known + [v, filler]) for v in vocab}
        known.append(max(times, key=times.get))
    return known


def test_extract(capsys):
    checks.check_extract_prompt(extract_right)
    assert capsys.readouterr().out.startswith("Exercise 8.4 passed")
    for wrong in (extract_no_filler, extract_filler_in_vocab, extract_slowest):
        with pytest.raises(AssertionError, match="extract_prompt"):
            checks.check_extract_prompt(wrong)


@pytest.mark.parametrize(("check", "wrong"), [
    (checks.check_hash_hit, hit_token_level),
    (checks.check_free_queue_order, queue_head_first),
    (checks.check_extract_prompt, extract_slowest),
])
def test_every_checker_escalates_like_the_others(check, wrong):
    with pytest.raises(CheckFailure) as first:
        check(wrong)
    assert "Hint" not in str(first.value) and "expected" in str(first.value)
    with pytest.raises(CheckFailure) as second:
        check(wrong)
    assert "Hint (failed 2 times)" in str(second.value)
