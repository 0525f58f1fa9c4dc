"""Chapter 11 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest

import minirt.checks.ch11 as ch11
from minirt.checks._common import reset_attempts

# ---------------------------------------------------------------- 11.1


def usable_right(path, matched, window):
    need, best, run, depth = window - 1, 0, 0, 0
    for length, tomb in path:
        m = min(length, matched - depth)
        if m <= 0:
            break
        if tomb:
            run = 0
            if need == 0:
                best = depth + m
        else:
            run += m
            if run >= min(depth + m, need):
                best = depth + m
        depth += m
    return best


def usable_ignores_tombstones(path, matched, window):
    return matched


def usable_forgets_short_prefixes(path, matched, window):  # demands need tokens always
    need, best, run, depth = window - 1, 0, 0, 0
    for length, tomb in path:
        m = min(length, matched - depth)
        if m <= 0:
            break
        run = 0 if tomb else run + m
        if not tomb and run >= need:
            best = depth + m
        depth += m
    return best


def usable_keeps_run_across_tombstones(path, matched, window):
    need, best, run, depth = window - 1, 0, 0, 0
    for length, tomb in path:
        m = min(length, matched - depth)
        if m <= 0:
            break
        if not tomb:
            run += m
            if run >= min(depth + m, need):
                best = depth + m
        depth += m
    return best


@pytest.fixture(autouse=True)
def fresh_counts():
    reset_attempts()
    yield
    reset_attempts()


def test_usable_prefix(capsys):
    ch11.check_usable_prefix(usable_right)
    assert capsys.readouterr().out.startswith("Exercise 11.1 passed")
    for wrong in (usable_ignores_tombstones, usable_forgets_short_prefixes,
                  usable_keeps_run_across_tombstones):
        with pytest.raises(AssertionError, match="usable_prefix"):
            ch11.check_usable_prefix(wrong)


# ---------------------------------------------------------------- 11.2


def freed_right(computed, cached, window, branch):
    need = window - 1
    keep = set(range(computed - need, computed))
    if branch is not None:
        keep |= set(range(branch - need, branch))
    return [p for p in range(cached, computed) if p not in keep]


def freed_keeps_w(computed, cached, window, branch):  # keeps W, not W - 1
    return freed_right(computed, cached, window + 1, branch)


def freed_tree_owned(computed, cached, window, branch):  # frees what the tree owns
    return freed_right(computed, 0, window, branch)


def freed_no_branch(computed, cached, window, branch):
    return freed_right(computed, cached, window, None)


def test_freed_window(capsys):
    ch11.check_freed_window(freed_right)
    assert "11.2 passed" in capsys.readouterr().out
    for wrong in (freed_keeps_w, freed_tree_owned, freed_no_branch):
        with pytest.raises(AssertionError, match="freed_window"):
            ch11.check_freed_window(wrong)


# ---------------------------------------------------------------- 11.3


def state_right(requests, interval, save_ends):
    saved, kv, hits = set(), set(), 0
    for ids in requests:
        q = ids[:-1]
        kv_len = 0
        while kv_len < len(q) and tuple(q[:kv_len + 1]) in kv:
            kv_len += 1
        usable = max((p for p in range(kv_len + 1) if tuple(q[:p]) in saved), default=0)
        hits += usable
        if interval:
            start = (usable // interval + 1) * interval
            saved |= {tuple(ids[:p]) for p in range(start, len(ids) + 1, interval)}
        if save_ends:
            saved.add(tuple(ids))
        kv |= {tuple(ids[:p]) for p in range(1, len(ids) + 1)}
    return hits


def state_rounds_kv(requests, interval, save_ends):  # assumes states wherever K/V are
    kv, hits = set(), 0
    for ids in requests:
        q = ids[:-1]
        n = 0
        while n < len(q) and tuple(q[:n + 1]) in kv:
            n += 1
        hits += n
        kv |= {tuple(ids[:p]) for p in range(1, len(ids) + 1)}
    return hits


def state_counts_last_token(requests, interval, save_ends):  # matches the whole request
    saved, kv, hits = set(), set(), 0
    for ids in requests:
        kv_len = 0
        while kv_len < len(ids) and tuple(ids[:kv_len + 1]) in kv:
            kv_len += 1
        usable = max((p for p in range(kv_len + 1) if tuple(ids[:p]) in saved), default=0)
        hits += usable
        if interval:
            saved |= {tuple(ids[:p]) for p in range(interval, len(ids) + 1, interval)}
        if save_ends:
            saved.add(tuple(ids))
        kv |= {tuple(ids[:p]) for p in range(1, len(ids) + 1)}
    return hits


def state_ignores_ends(requests, interval, save_ends):
    return state_right(requests, interval, False)


def test_state_hits(capsys):
    ch11.check_state_hits(state_right)
    assert "11.3 passed" in capsys.readouterr().out
    for wrong in (state_rounds_kv, state_counts_last_token, state_ignores_ends):
        with pytest.raises(AssertionError, match="state_hits"):
            ch11.check_state_hits(wrong)


# ---------------------------------------------------------------- 11.4


def block_right(cached, block_size, window):
    need = -(-(window - 1) // block_size)
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        run = run + 1 if cached[i] else 0
        if cached[i] and run >= need:
            return (i + run) * block_size
    return run * block_size


def block_needs_w(cached, block_size, window):  # cdiv(W, block) blocks
    return block_right(cached, block_size, window + 1)


def block_left_to_right(cached, block_size, window):  # the leading run only
    n = 0
    while n < len(cached) and cached[n]:
        n += 1
    return n * block_size


def block_no_leading_run(cached, block_size, window):  # a short run at block 0 is no hit
    need = -(-(window - 1) // block_size)
    got = block_right(cached, block_size, window)
    return got if got >= need * block_size else 0


def test_window_block_hit(capsys):
    ch11.check_window_block_hit(block_right)
    assert "11.4 passed" in capsys.readouterr().out
    for wrong in (block_needs_w, block_left_to_right, block_no_leading_run):
        with pytest.raises(AssertionError, match="window_block_hit"):
            ch11.check_window_block_hit(wrong)


def test_repeat_adds_a_nudge():
    with pytest.raises(AssertionError):
        ch11.check_window_block_hit(block_needs_w)
    with pytest.raises(AssertionError, match="Hint"):
        ch11.check_window_block_hit(block_needs_w)
