"""Chapter 13 checkers accept the reference solutions and reject plausible wrong ones."""

from __future__ import annotations

import pytest
from brute_force import eagle_hits, lcp
from exercise_util import rejects

from minirt.checks import ch13
from minirt.checks._common import reset_attempts

# --------------------------------------------------------------------------- references
# (the same code as solutions/13_speculative.ipynb)


def accepted(drafts, target):
    out = []
    for d, t in zip(drafts, target, strict=False):
        out.append(t)
        if d != t:
            return out
    return out + [target[len(drafts)]]


def slots_to_free(cached_len, num_private, kv_len, page_size):
    used = kv_len - cached_len
    keep = (used + page_size - 1) // page_size * page_size
    return num_private - keep


def tokens_per_step(alpha, k):
    return float(sum(alpha ** i for i in range(k + 1)))


# --------------------------------------------------------------------------- 13.1


def test_accepted_accepts_the_reference(capsys):
    reset_attempts("13.1")
    ch13.check_accepted(accepted)
    assert "Exercise 13.1 passed" in capsys.readouterr().out


def accepted_no_bonus(drafts, target):  # forgets the bonus token after a full acceptance
    return accepted(drafts, target)[:len(drafts)] if accepted(drafts, target)[:len(drafts)] \
        == list(drafts) else accepted(drafts, target)


def accepted_every_agreeing(drafts, target):  # keeps agreeing drafts after a rejection
    return [t for d, t in zip(drafts, target, strict=False) if d == t] + [target[-1]]


def accepted_drafts_only(drafts, target):  # the agreeing run, without the model's token
    out = []
    for d, t in zip(drafts, target, strict=False):
        if d != t:
            break
        out.append(d)
    return out


@pytest.mark.parametrize("wrong", [accepted_no_bonus, accepted_every_agreeing,
                                   accepted_drafts_only])
def test_accepted_rejects(wrong):
    rejects(ch13.check_accepted, wrong, "13.1")


# --------------------------------------------------------------------------- 13.2


def test_slots_to_free_accepts_the_reference(capsys):
    reset_attempts("13.2")
    ch13.check_slots_to_free(slots_to_free)
    assert "Exercise 13.2 passed" in capsys.readouterr().out


def free_rejected_slots(cached_len, num_private, kv_len, page_size):  # ignores pages
    return num_private - (kv_len - cached_len)


def free_floor_pages(cached_len, num_private, kv_len, page_size):  # frees a page in use
    return num_private - (kv_len - cached_len) // page_size * page_size


def free_from_zero(cached_len, num_private, kv_len, page_size):  # forgets the cached part
    return max(0, num_private - (kv_len + page_size - 1) // page_size * page_size)


@pytest.mark.parametrize("wrong", [free_rejected_slots, free_floor_pages, free_from_zero])
def test_slots_to_free_rejects(wrong):
    rejects(ch13.check_slots_to_free, wrong, "13.2")


# --------------------------------------------------------------------------- 13.3


def test_tokens_per_step_accepts_the_reference(capsys):
    reset_attempts("13.3")
    ch13.check_tokens_per_step(tokens_per_step)
    assert "Exercise 13.3 passed" in capsys.readouterr().out


def test_tokens_per_step_accepts_the_closed_form(capsys):
    reset_attempts("13.3")
    ch13.check_tokens_per_step(
        lambda a, k: k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a))
    assert "Exercise 13.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda a, k: 1 + a * k,                                  # each draft counted alone
    lambda a, k: float(sum(a ** i for i in range(1, k + 1))),  # no model token
    lambda a, k: 1 / (1 - a) if a < 1 else float("inf"),     # no limit of k drafts
])
def test_tokens_per_step_rejects(wrong):
    rejects(ch13.check_tokens_per_step, wrong, "13.3")


# --------------------------------------------------------------------------- 13.4


def test_eagle_hits_accepts_the_reference(capsys):
    reset_attempts("13.4")
    ch13.check_eagle_hits(eagle_hits)
    assert "Exercise 13.4 passed" in capsys.readouterr().out


def eagle_lookahead_is_plain(requests, block_size, rule):  # the successor not checked
    return eagle_hits(requests, block_size, "plain" if rule == "lookahead" else rule)


def eagle_no_cap(requests, block_size, rule):  # a request may hit all of its tokens
    hits = []
    for i, ids in enumerate(requests):
        best = max((min(lcp(ids, e), len(ids)) // block_size * block_size
                    for e in requests[:i]), default=0)
        hits.append(max(0, best - block_size) if rule == "drop" else best)
    return hits


def eagle_drop_a_token(requests, block_size, rule):  # drops one token, not one block
    plain = eagle_hits(requests, block_size, "plain")
    return [max(0, h - 1) for h in plain] if rule == "drop" else \
        eagle_hits(requests, block_size, rule)


def eagle_lookahead_inside_the_cap(requests, block_size, rule):  # the next token too in ids[:-1]
    if rule != "lookahead":
        return eagle_hits(requests, block_size, rule)
    return [max((min(lcp(ids, e) - 1, len(ids) - 2, len(e) - 1) // block_size * block_size
                 for e in requests[:i]), default=0) for i, ids in enumerate(requests)]


@pytest.mark.parametrize("wrong", [eagle_lookahead_is_plain, eagle_no_cap, eagle_drop_a_token,
                                   eagle_lookahead_inside_the_cap])
def test_eagle_hits_rejects(wrong):
    rejects(ch13.check_eagle_hits, wrong, "13.4")
