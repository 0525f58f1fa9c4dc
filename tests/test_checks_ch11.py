"""Chapter 11 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import random

import pytest

import minirt.checks.ch11 as ch11
from minirt.checks._common import reset_attempts

# ---------------------------------------------------------------- 11.1


def _live(path, matched):
    return [not tomb for length, tomb in path for _ in range(length)][:matched]


def usable_right(path, matched, window, page_size):
    live, need = _live(path, matched), window - 1
    d = matched - matched % page_size
    while d > 0 and not all(live[d - min(d, need):d]):
        d -= page_size
    return d


def usable_page_one(path, matched, window, page_size):  # the chapter's listing, no pages
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


def usable_rounds_down(path, matched, window, page_size):  # the listing, rounded to a page
    d = usable_page_one(path, matched, window, page_size)
    return d - d % page_size


def usable_node_ends_only(path, matched, window, page_size):  # only page-aligned node ends
    live, need, best, depth = _live(path, matched), window - 1, 0, 0
    for length, _ in path:
        depth = min(depth + length, matched)
        if depth % page_size == 0 and all(live[depth - min(depth, need):depth]):
            best = depth
    return best


def usable_needs_w(path, matched, window, page_size):  # reads W positions, not W - 1
    return usable_right(path, matched, window + 1, page_size)


def usable_ignores_tombstones(path, matched, window, page_size):
    return matched - matched % page_size


@pytest.fixture(autouse=True)
def fresh_counts():
    reset_attempts()
    yield
    reset_attempts()


def test_usable_prefix_reference_is_the_tree():
    """At page size 1 the checker's reference agrees with WindowRadixCache.usable_length."""
    rng = random.Random(0)
    for _ in range(300):
        path = [(rng.randint(1, 6), rng.random() < 0.4) for _ in range(rng.randint(1, 5))]
        matched, window = rng.randint(0, sum(n for n, _ in path)), rng.randint(1, 7)
        assert ch11.usable_prefix(path, matched, window, 1) == \
            ch11.usable_prefix_by_tree(path, matched, window)


def test_usable_prefix(capsys):
    ch11.check_usable_prefix(usable_right)
    assert capsys.readouterr().out.startswith("Exercise 11.1 passed")
    for wrong in (usable_page_one, usable_rounds_down, usable_node_ends_only, usable_needs_w,
                  usable_ignores_tombstones):
        with pytest.raises(AssertionError, match="usable_prefix"):
            ch11.check_usable_prefix(wrong)


def test_usable_prefix_hint_names_the_rounding():
    """A repeated failure from rounding the page-size-1 answer gets the hint for that mistake."""
    with pytest.raises(AssertionError):
        ch11.check_usable_prefix(usable_rounds_down)
    with pytest.raises(AssertionError, match="window reaches further back"):
        ch11.check_usable_prefix(usable_rounds_down)
    reset_attempts()
    with pytest.raises(AssertionError):
        ch11.check_usable_prefix(usable_needs_w)
    with pytest.raises(AssertionError) as info:
        ch11.check_usable_prefix(usable_needs_w)
    assert "Hint" in str(info.value) and "further back" not in str(info.value)


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


def _state_run(requests, interval, save_ends, saves):
    """Play ``requests``; ``saves(ids, usable)`` gives the prefix lengths a request saves."""
    saved, kv, hits = set(), set(), 0
    for ids in requests:
        q = ids[:-1]
        kv_len = 0
        while kv_len < len(q) and tuple(q[:kv_len + 1]) in kv:
            kv_len += 1
        usable = max((p for p in range(kv_len + 1) if tuple(q[:p]) in saved), default=0)
        hits += usable
        saved |= {tuple(ids[:p]) for p in saves(ids, usable)}
        kv |= {tuple(ids[:p]) for p in range(1, len(ids) + 1)}
    return hits


def state_right(requests, interval, save_ends):
    def saves(ids, usable):
        out = set()
        if interval and len(ids) // interval * interval > usable:
            out.add(len(ids) // interval * interval)
        if save_ends:
            out.add(len(ids))
        return out
    return _state_run(requests, interval, save_ends, saves)


def state_relative(requests, interval, save_ends):  # one grid state, counted from the start
    def saves(ids, usable):
        out = set()
        if interval and len(ids) - usable >= interval:
            out.add(usable + (len(ids) - usable) // interval * interval)
        if save_ends:
            out.add(len(ids))
        return out
    return _state_run(requests, interval, save_ends, saves)


def state_cold_run(requests, interval, save_ends):
    """The cold run's accepted wrong answer: every interval counted from where the prefill
    starts (``usable + k * interval``)."""
    def saves(ids, usable):
        new = set(range(usable + interval, len(ids) + 1, interval)) if interval else set()
        return new | ({len(ids)} if save_ends else set())
    return _state_run(requests, interval, save_ends, saves)


def state_every_multiple(requests, interval, save_ends):  # a state at every multiple passed
    def saves(ids, usable):
        new = set(range((usable // interval + 1) * interval, len(ids) + 1, interval)) \
            if interval else set()
        return new | ({len(ids)} if save_ends else set())
    return _state_run(requests, interval, save_ends, saves)


def state_rounds_kv(requests, interval, save_ends):  # assumes states wherever K/V are
    return _state_run(requests, interval, save_ends, lambda ids, usable: range(len(ids) + 1))


def state_counts_last_token(requests, interval, save_ends):  # matches the whole request
    return state_right([ids + [-1] for ids in requests], interval, save_ends)


def state_ignores_ends(requests, interval, save_ends):
    return state_right(requests, interval, False)


def test_state_hits(capsys):
    ch11.check_state_hits(state_right)
    assert "11.3 passed" in capsys.readouterr().out
    for wrong in (state_relative, state_cold_run, state_every_multiple, state_rounds_kv,
                  state_counts_last_token, state_ignores_ends):
        with pytest.raises(AssertionError, match="state_hits"):
            ch11.check_state_hits(wrong)


def test_state_hits_relative_grid_case():
    """The cold run's counterexample is in the checker, and counting from the prefill's
    start gets the hint for that mistake on a repeat."""
    trace = [[1, 2, 3, 4, 5], list(range(1, 11)), list(range(1, 10)) + [99, 100]]
    assert (trace, 4, True) in ch11.STATE_CASES
    assert state_right(trace, 4, True) == 13 and state_relative(trace, 4, True) == 14
    assert state_cold_run(trace, 4, True) == 14
    with pytest.raises(AssertionError):
        ch11.check_state_hits(state_relative)
    with pytest.raises(AssertionError, match="absolute"):
        ch11.check_state_hits(state_relative)


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


def block_w1_whole_length(cached, block_size, window):  # W = 1 taken as "everything hits"
    return len(cached) * block_size if window == 1 else block_right(cached, block_size, window)


def test_window_block_hit(capsys):
    ch11.check_window_block_hit(block_right)
    assert "11.4 passed" in capsys.readouterr().out
    for wrong in (block_needs_w, block_left_to_right, block_no_leading_run,
                  block_w1_whole_length):
        with pytest.raises(AssertionError, match="window_block_hit"):
            ch11.check_window_block_hit(wrong)


def test_repeat_adds_a_nudge():
    with pytest.raises(AssertionError):
        ch11.check_window_block_hit(block_needs_w)
    with pytest.raises(AssertionError, match="Hint"):
        ch11.check_window_block_hit(block_needs_w)
