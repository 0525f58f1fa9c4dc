"""EAGLE's last-block rule and the lookahead block key (minirt/eagle_blocks.py)."""

from __future__ import annotations

import random

import pytest
import torch
from brute_force import eagle_hits

from minirt.eagle_blocks import RULES, EagleBlockCache, eagle_drop, lookahead_ids, replay_hits
from minirt.errors import RequestError


def test_eagle_drop():
    assert [eagle_drop(h, 16) for h in (0, 16, 48)] == [0, 0, 32]
    for bad in (-16, 7):
        with pytest.raises(RequestError, match="whole number of blocks"):
            eagle_drop(bad, 16)


def test_lookahead_ids_pair_each_token_with_the_next():
    assert lookahead_ids([3, 1, 4, 1], 10).tolist() == [31, 14, 41]
    assert lookahead_ids([5], 10).tolist() == []
    with pytest.raises(RequestError, match="vocab_size"):
        lookahead_ids([3, 12], 10)


def test_the_three_rules_on_a_hand_example():
    a = list(range(100, 132))            # 32 tokens: two blocks of 16
    b = a + [7, 8, 9]                    # extends a
    c = a[:16] + [1] + a[17:]            # shares exactly one block, then another token
    hits = {rule: replay_hits([a, b, c], 16, rule, 1000) for rule in RULES}
    assert hits["plain"] == [0, 32, 16]
    assert hits["drop"] == [0, 16, 0]          # one block less on every hit
    # a ended exactly at a block boundary: its last block waits for a successor, so b gets
    # one block; c shares 16 tokens and then differs at token 16: the first block's
    # successor differs, so nothing is proven.
    assert hits["lookahead"] == [0, 16, 0]
    # once a's successor is known (a reply token), a's second block is published
    assert replay_hits([a + [7], b], 16, "lookahead", 1000) == [0, 32]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_streams_match_the_hand_rule(block_size):
    rng = random.Random(block_size)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(2, 60))] for _ in range(3)]
    reqs = []
    for _ in range(25):
        s = rng.choice(stems)
        reqs.append(s[:rng.randrange(len(s) + 1)] + [rng.randrange(50, 60)
                                                     for _ in range(rng.randrange(1, 9))])
    for rule in RULES:
        assert replay_hits(reqs, block_size, rule, 64) == eagle_hits(reqs, block_size, rule)


def test_lookahead_never_below_drop_and_never_above_plain():
    rng = random.Random(0)
    reqs = [[1, 2, 3] * rng.randrange(1, 30) + [rng.randrange(4, 9)] for _ in range(30)]
    for b in (2, 8, 32):
        p, d, la = (replay_hits(reqs, b, r, 16) for r in RULES)
        assert all(x <= z <= y for x, y, z in zip(d, p, la, strict=True))


def test_bad_settings_are_refused():
    with pytest.raises(RequestError, match="rule"):
        EagleBlockCache(16, "eagle", 100)
    with pytest.raises(RequestError, match="vocab_size"):
        EagleBlockCache(16, "plain", 0)
    cache = EagleBlockCache(4, "plain", 100)
    cache.insert(torch.arange(9))
    assert cache.lookup(torch.arange(9)) == 8 and cache.lookup([1]) == 0
