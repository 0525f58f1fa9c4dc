"""Workloads: seeded, sharing where promised, and their unique-token bound right."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt import workloads as wl


@pytest.fixture(scope="module")
def tok():
    return wl.default_tokenizer()


def brute_unique(requests) -> int:
    """Distinct non-empty prefixes, by listing them all."""
    return len({tuple(r[:i]) for r in requests for i in range(1, len(r) + 1)})


def brute_radix(requests) -> int:
    """Radix nodes: prefixes where a request ends, or whose one-token extensions are not one."""
    prefixes = {tuple(r[:i]) for r in requests for i in range(1, len(r) + 1)}
    ends = {tuple(r) for r in requests if r}
    extensions: dict[tuple, set] = {}
    for p in prefixes:
        extensions.setdefault(p[:-1], set()).add(p[-1])
    return sum(1 for p in prefixes if p in ends or len(extensions.get(p, ())) != 1)


token_lists = st.lists(st.lists(st.integers(0, 5), max_size=12), max_size=12)


@settings(max_examples=200, deadline=None)
@given(token_lists)
def test_counts_match_brute_force(requests):
    trie, radix = wl.prefix_node_counts(requests)
    assert trie == wl.unique_prefix_count(requests) == brute_unique(requests)
    assert radix == brute_radix(requests)
    trie_hops, radix_hops = wl.lookup_steps(requests)
    assert trie_hops == sum(len(r) for r in requests)
    assert radix_hops <= trie_hops


def test_counts_on_a_hand_example():
    # The seed's A, B, C: the trie has 5 + 2 + 1 nodes, the radix tree 5.
    reqs = [[101, 11, 12, 21, 22], [101, 11, 12, 31, 32], [101, 11, 99]]
    assert wl.prefix_node_counts(reqs) == (8, 5)
    # Looking each up: trie 5 + 5 + 3 hops, radix 3 + 3 + 2.
    assert wl.lookup_steps(reqs) == (13, 8)
    # A request that is a prefix of another ends a node: inserting it splits.
    assert wl.prefix_node_counts([[1, 2, 3], [1, 2]]) == (3, 2)


@pytest.mark.parametrize("make", [wl.multi_turn_chat, wl.few_shot, wl.rag, wl.no_sharing])
def test_seeded_and_deterministic(tok, make):
    a, b, c = make(tok, seed=3), make(tok, seed=3), make(tok, seed=4)
    assert a.requests == b.requests and a.texts == b.texts
    assert a.requests != c.requests
    assert all(isinstance(t, int) for r in a.requests for t in r)
    assert len(a.texts) == len(a.requests)
    assert a.unique_tokens == brute_unique(a.requests)
    assert a.total_tokens == sum(len(r) for r in a.requests)


def test_support_chats_are_what_multi_turn_chat_sends(tok):
    chats = wl.support_chats(tok, num_conversations=3, turns=4, system_tokens=120, seed=5)
    assert chats == wl.support_chats(tok, 3, 4, 120, seed=5)
    assert [len(u) for u in chats.users] == [len(r) for r in chats.replies] == [4, 4, 4]
    w = wl.multi_turn_chat(tok, 3, 4, 120, seed=5, interleave=False)
    for c in range(3):
        for t in range(4):
            text = w.texts[4 * c + t]  # conversation c, turn t: all said so far, no reply yet
            assert chats.system in text and chats.users[c][t] in text
            assert all(r in text for r in chats.replies[c][:t]) and chats.replies[c][t] not in text
    with pytest.raises(ValueError, match="turns"):
        wl.support_chats(tok, turns=0)


def test_requests_are_the_tokenized_texts(tok):
    w = wl.rag(tok, num_requests=3)
    for text, ids in zip(w.texts, w.requests, strict=True):
        assert tok(text, add_special_tokens=False)["input_ids"] == ids
        assert text.startswith("<|im_start|>system")  # the chat template was used


def test_chat_turns_extend_the_conversation(tok):
    w = wl.multi_turn_chat(tok, num_conversations=3, turns=4, interleave=False)
    assert len(w) == 12
    for c in range(3):
        turns = w.requests[4 * c: 4 * c + 4]
        for short, long in zip(turns, turns[1:], strict=False):
            assert long[: len(short)] == short and len(long) > len(short)
    # Interleaved order holds the same requests, turn 1 of every conversation first.
    inter = wl.multi_turn_chat(tok, num_conversations=3, turns=4)
    assert sorted(map(tuple, inter.requests)) == sorted(map(tuple, w.requests))
    assert inter.requests[:3] == [w.requests[0], w.requests[4], w.requests[8]]


def test_chat_size_for_the_engine_chapter(tok):
    w = wl.multi_turn_chat(tok, num_conversations=8, turns=4, system_tokens=500)
    assert len(w) == 32
    system = w.texts[0].split("<|im_end|>")[0]
    n_system = len(tok(system, add_special_tokens=False)["input_ids"])
    assert 500 <= n_system <= 560
    # Every request starts with the same system prompt.
    first = w.requests[0][:n_system]
    assert all(r[:n_system] == first for r in w.requests)
    assert w.best_hit_rate > 0.85


def test_sharing_is_present_where_promised(tok):
    ws = wl.standard_workloads(tok)
    assert set(ws) == {"multi_turn_chat", "few_shot", "rag", "no_sharing"}
    for name in ("multi_turn_chat", "few_shot", "rag"):
        assert ws[name].best_hit_rate > 0.3, ws[name].summary()
    base = ws["no_sharing"]
    assert base.unique_tokens == base.total_tokens and base.best_hit_rate == 0.0
    assert len({r[0] for r in base.requests}) == len(base)


def test_few_shot_prompts_share_their_task_header(tok):
    w = wl.few_shot(tok, num_requests=6, num_tasks=2)
    # Requests 0, 2, 4 are one task; they share all but the query and the template's tail.
    a, b = w.texts[0], w.texts[2]
    head = a[: a.rindex("Review:")]
    assert b.startswith(head) and head.count("Sentiment:") == 4


def test_rag_requests_quote_one_or_two_documents(tok):
    w = wl.rag(tok, num_documents=3, num_requests=10)
    quoted = [t.count("Document 1:") + t.count("Document 2:") for t in w.texts]
    assert set(quoted) <= {1, 2} and 1 in quoted and 2 in quoted, quoted


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_sizes_are_checked(tok, bad):
    with pytest.raises(ValueError, match="positive int"):
        wl.few_shot(tok, num_requests=bad)


def test_summary_line(tok):
    w = wl.no_sharing(tok, num_requests=3)
    assert w.summary().startswith("no_sharing: 3 requests") and "best hit rate 0.000" in w.summary()


def replay(requests, page_size=1):
    """Match then insert every request (fresh slots for the gap) in an unbounded RadixCache."""
    from minirt.cache import RadixCache, insert_fresh

    cache, slot = RadixCache(page_size=page_size), 0
    for r in requests:
        _, slot = insert_fresh(cache, r, slot)
    return cache


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=10))
def test_the_bound_and_the_radix_count_are_what_a_radix_cache_does(requests):
    cache = replay(requests)
    trie, radix = wl.prefix_node_counts(requests)
    assert cache.num_nodes == radix and cache.total_size == trie
    hits = cache.stats.hit_tokens
    assert sum(len(r) for r in requests) - hits == wl.unique_prefix_count(requests)


def test_real_workloads_reach_their_bound_with_an_unbounded_cache(tok):
    for w in wl.standard_workloads(tok).values():
        cache = replay(w.requests)
        assert cache.stats.hit_rate == pytest.approx(w.best_hit_rate)
        assert cache.num_nodes == wl.prefix_node_counts(w.requests)[1]
        paged = replay(w.requests, page_size=16)
        assert paged.stats.hit_rate <= w.best_hit_rate
