"""minirt.router: the cache-aware router against a brute-force reference, its tree's
eviction, the baselines, bad settings, and replicas that serve what one engine serves."""

from __future__ import annotations

import pytest
from brute_force import lcp
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt.errors import MinirtError, RouterError
from minirt.replicas import (
    TenantChats,
    chat_routing_text,
    make_replicas,
    replay_replicas,
    tenant_chats,
)
from minirt.router import (
    DEFAULTS,
    ApproxTree,
    CacheAwareRouter,
    ConsistentHashRouter,
    LeastLoadRouter,
    RandomRouter,
    RoundRobinRouter,
    make_router,
)

# ---------------------------------------------------------------- the reference


def reference_pick(history: list[tuple[str, int]], loads: list[int], healthy: list[bool],
                   text: str, threshold: float, abs_t: int, rel_t: float) -> tuple[int, str]:
    """The decision, from the list of (text, replica) routed so far, without a tree.

    The deepest node a match reaches is held by exactly the replicas of the earlier
    texts that share the longest common prefix with ``text``; the tree reports the one
    that got such a text first.
    """
    def least() -> int:
        return min((i for i in range(len(loads)) if healthy[i]), key=lambda i: loads[i])

    if max(loads) - min(loads) > abs_t and max(loads) > rel_t * min(loads):
        return least(), "imbalanced"
    best = max((lcp(t, text) for t, _ in history), default=0)
    rate = best / len(text) if text else 0.0
    if rate > threshold and best > 0:
        holder = next(r for t, r in history if lcp(t, text) == best)
        if healthy[holder]:
            return holder, "cache_hit"
    return least(), "low_match"


texts = st.text(alphabet="abc", min_size=0, max_size=8)
ops = st.lists(st.one_of(st.tuples(st.just("route"), texts),
                         st.tuples(st.just("done"), st.integers(0, 2))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, threshold=st.sampled_from([0.0, 0.3, 0.5, 0.99]),
       abs_t=st.integers(0, 3), rel_t=st.sampled_from([1.0, 1.5, 3.0]))
def test_cache_aware_matches_reference(ops, threshold, abs_t, rel_t):
    router = CacheAwareRouter(3, cache_threshold=threshold, balance_abs_threshold=abs_t,
                              balance_rel_threshold=rel_t)
    history: list[tuple[str, int]] = []
    for op, arg in ops:
        if op == "done":
            if router.loads[arg]:
                router.done(arg)
            continue
        expected = reference_pick(history, list(router.loads), router.healthy, arg,
                                  threshold, abs_t, rel_t)
        got = router.route(arg)
        assert (got, router.decisions[-1].reason) == expected, (history, router.loads, arg)
        history.append((arg, got))
        router.tree.check_integrity()


def loaded(router, loads):
    """Put ``loads`` in flight without touching the tree (as requests of empty text would)."""
    router.loads = list(loads)
    return router


# ---------------------------------------------------------------- hand-built states


def test_imbalance_edges():
    r = CacheAwareRouter(3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert not r.imbalanced([5, 1, 3])          # max - min == abs: balanced
    assert r.imbalanced([6, 1, 3])              # 5 > 4 and 6 > 1.5
    assert not r.imbalanced([15, 10, 12])       # 5 > 4 but 15 == 1.5 * 10
    assert r.imbalanced([16, 10, 12])
    assert r.imbalanced([5, 0, 0])              # min 0: any spread above abs
    # imbalanced: the shortest queue wins even against a full cache hit
    r.route("system prompt A / question")
    r.done(0)
    r = loaded(r, [9, 3, 3])
    assert r.route("system prompt A / question") == 1
    assert r.decisions[-1].reason == "imbalanced"


def test_threshold_is_strict():
    r = CacheAwareRouter(2, cache_threshold=0.5, balance_abs_threshold=100)
    loaded(r, [0, 1])
    assert r.route("abXY") == 0  # replica 0 least loaded; tree empty
    r.done(0)
    loaded(r, [1, 0])           # now replica 1 is the least loaded
    assert r.route("abcd") == 1  # shares "ab" with replica 0's text: rate 0.5, not > 0.5
    assert r.decisions[-1].reason == "low_match"
    assert r.decisions[-1].match_rate == 0.5
    assert r.route("abXZ") == 0  # "abX" = 0.75 > 0.5: replica 0 despite its load
    assert r.decisions[-1].reason == "cache_hit"


def test_match_counts_characters_not_bytes_and_reports_first_holder():
    r = CacheAwareRouter(3, cache_threshold=0.5)
    loaded(r, [0, 0, 0])
    r.route("天气很好")                # replica 0
    loaded(r, [5, 0, 0])
    r.route("天气很好!")               # a hit (4/5 chars): replica 0 again
    assert r.decisions[-1].reason == "cache_hit" and r.decisions[-1].match_rate == 0.8
    loaded(r, [5, 5, 0])
    r.route("心情很好")                 # nothing shared: least loaded, replica 2
    assert r.decisions[-1].replica == 2
    m = r.tree.prefix_match("天气")
    assert (m.tenant, m.matched_chars, m.input_chars) == (0, 2, 2)


def test_ties_go_to_the_lowest_index_and_skip_unhealthy():
    r = CacheAwareRouter(4)
    assert [r.route(t) for t in ("w", "x", "y")] == [0, 1, 2]  # loads 0,1,2 ... each new
    r.set_healthy(3, False)
    loaded(r, [1, 1, 1, 0])
    assert r.route("z") == 0  # replica 3 has the least load but is unhealthy
    lr = LeastLoadRouter(3)
    assert [lr.route("") for _ in range(4)] == [0, 1, 2, 0]


def test_cache_hit_on_an_unhealthy_replica_forgets_it():
    r = CacheAwareRouter(3)
    loaded(r, [0, 0, 0])
    r.route("tenant one system prompt")
    r.done(0)
    r.set_healthy(0, False)
    assert r.route("tenant one system prompt, again") == 1  # first healthy
    assert r.decisions[-1].reason == "fallback"
    assert r.tree.size(0) == 0
    r.tree.check_integrity()


# ---------------------------------------------------------------- the tree


def test_tree_sizes_count_shared_prefixes_per_tenant():
    t = ApproxTree()
    t.insert("hello world", 0)
    t.insert("hello there", 1)
    t.insert("hello world!", 1)
    assert t.size(0) == len("hello world")
    assert t.size(1) == len("hello there") + len("world!")
    t.check_integrity()
    t.remove_tenant(1)
    assert t.size(1) == 0 and t.size(0) == 11
    t.check_integrity()
    assert t.prefix_match("hello there").matched_chars == len("hello ")


def test_eviction_to_max_tree_size_drops_least_recent_leaves_first():
    t = ApproxTree()
    for text in ("sys A q1", "sys A q2", "sys B q1", "sys B q2"):
        t.insert(text, 0)
    t.insert("other", 1)
    t.prefix_match("sys A q1")  # refresh: the oldest leaves are now "2" of A, "1" of B
    before = t.size(0)
    evicted = t.evict_tenant_by_size(before - 2)
    assert evicted == 2 and t.size(0) == before - 2
    assert [t.prefix_match(f"sys {x}").matched_chars for x in ("A q2", "B q1", "A q1", "B q2")
            ] == [7, 7, 8, 8]  # the two oldest one-character leaves went
    assert t.size(1) == 5  # within the limit: untouched
    t.check_integrity()
    t.evict_tenant_by_size(0)  # everything, leaf by leaf up to the root
    assert t.size(0) == t.size(1) == 0 and t.num_nodes() == 0
    t.check_integrity()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(texts, st.integers(0, 2)), max_size=25), st.integers(0, 12))
def test_eviction_bound_and_integrity(inserts, max_size):
    t = ApproxTree()
    for text, tenant in inserts:
        t.insert(text, tenant)
    t.check_integrity()
    t.evict_tenant_by_size(max_size)
    t.check_integrity()
    assert all(t.size(k) <= max_size for k in range(3))


def test_router_evicts_its_trees():
    r = CacheAwareRouter(2, max_tree_size=30, balance_abs_threshold=100)
    for i in range(20):
        r.route(f"conversation {i} says hello")
        r.done(r.decisions[-1].replica)
        assert max(r.tree_sizes()) <= 30
    assert r.evicted_chars > 0
    r.tree.check_integrity()


# ---------------------------------------------------------------- baselines


def test_round_robin_skips_unhealthy():
    r = RoundRobinRouter(3)
    assert [r.route("t") for _ in range(4)] == [0, 1, 2, 0]
    r.set_healthy(1, False)
    assert all(r.route("t") in (0, 2) for _ in range(6))


def test_random_is_seeded():
    def picks(seed: int) -> list[int]:
        r = RandomRouter(5, seed=seed)
        return [r.route("t") for _ in range(40)]

    assert picks(3) == picks(3) and picks(3) != picks(4)
    assert set(picks(3)) == set(range(5))


def test_consistent_hash_keeps_sessions_and_moves_only_the_lost_replica():
    r = ConsistentHashRouter(4)
    sessions = [f"user-{i}" for i in range(200)]
    first = {s: r.route("whatever text", session=s) for s in sessions}
    assert all(r.route("other text", session=s) == first[s] for s in sessions)
    assert len(set(first.values())) == 4
    r.set_healthy(2, False)
    moved = {s: r.route("", session=s) for s in sessions}
    assert all(moved[s] == first[s] for s in sessions if first[s] != 2)
    assert all(moved[s] != 2 for s in sessions)


def test_load_bookkeeping_and_decisions():
    r = make_router("least_load", 2)
    r.route("a")
    r.route("b")
    assert r.loads == [1, 1]
    r.done(1)
    assert r.loads == [1, 0] and [d.replica for d in r.decisions] == [0, 1]
    assert r.decisions[1].loads == (1, 0)


# ---------------------------------------------------------------- bad settings


@pytest.mark.parametrize("kwargs, words", [
    ({"cache_threshold": 1.5}, "cache_threshold"),
    ({"cache_threshold": float("nan")}, "cache_threshold"),
    ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
    ({"balance_abs_threshold": 2.5}, "balance_abs_threshold"),
    ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
    ({"max_tree_size": 0}, "max_tree_size"),
    ({"evict_every": True}, "evict_every"),
])
def test_bad_cache_aware_settings(kwargs, words):
    with pytest.raises(RouterError, match=words):
        CacheAwareRouter(2, **kwargs)


def test_bad_calls():
    assert issubclass(RouterError, MinirtError) and issubclass(RouterError, ValueError)
    with pytest.raises(RouterError, match="num_replicas"):
        RoundRobinRouter(0)
    with pytest.raises(RouterError, match="unknown routing policy 'fastest'"):
        make_router("fastest", 2)
    with pytest.raises(RouterError, match="bad settings for 'round_robin'"):
        make_router("round_robin", 2, cache_threshold=0.5)
    r = CacheAwareRouter(2)
    with pytest.raises(RouterError, match="without a request in flight"):
        r.done(0)
    with pytest.raises(RouterError, match=r"replica must be an int in \[0, 2\)"):
        r.done(2)
    with pytest.raises(RouterError, match="takes the request's text"):
        r.route([1, 2, 3])
    r.set_healthy(0, False)
    r.set_healthy(1, False)
    with pytest.raises(RouterError, match="no healthy replica"):
        r.route("x")
    assert r.loads == [0, 0] and r.decisions == [] and r.tree.num_nodes() == 0
    with pytest.raises(RouterError, match="weights"):
        tenant_chats(None, tenants=2, weights=[1, -1])


def test_defaults_are_sglang_router_0_3_2():
    r = CacheAwareRouter(1)
    assert (r.cache_threshold, r.balance_abs_threshold, r.balance_rel_threshold,
            r.max_tree_size) == (0.3, 64, 1.5, 2**26) == tuple(DEFAULTS.values())


# ---------------------------------------------------------------- replicas


class CharTokenizer:
    """One token per printable ASCII character: enough for chat templates on tiny_model."""

    chat_template = "role: content"
    eos_token_id = 95

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 32 for c in text if 32 <= ord(c) < 127]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"{m['role'][0]}:{m['content']}|" for m in messages) + "a:"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i) for i in ids if i < 95)


def test_chat_routing_text():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "bye"}]
    assert chat_routing_text(msgs) == "S hi bye"


def test_replicas_serve_what_one_engine_serves(one_thread, tiny64):
    tok = CharTokenizer()
    chats = TenantChats(
        systems=["You are desk A. Be brief and kind.", "Desk B here: refunds only, no jokes."],
        tenant_of=[0, 1, 0, 1, 0, 0],
        users=[[f"order {i} is late", "thanks"] for i in range(6)])
    single = replay_replicas(make_replicas(tiny64, tok, 1, capacity=1024),
                             make_router("round_robin", 1), chats, concurrency=6,
                             max_new_tokens=3)
    reports = {}
    for policy in ("cache_aware", "round_robin", "consistent_hash"):
        engines = make_replicas(tiny64, tok, 3, capacity=1024, check=True)
        reports[policy] = replay_replicas(engines, make_router(policy, 3), chats,
                                          concurrency=4, max_new_tokens=3)
        assert reports[policy].outputs() == single.outputs(), policy
        assert len(reports[policy].requests) == 12
        assert all(not e.has_work for e in engines)
    ca, rr = reports["cache_aware"], reports["round_robin"]
    assert ca.computed_tokens < rr.computed_tokens
    assert ca.prompt_tokens == rr.prompt_tokens == single.prompt_tokens
    assert rr.per_replica == [4, 4, 4]
    assert sum(ca.reasons.values()) == 12
    assert sum(ca.computed_per_replica) == ca.computed_tokens
    assert max(rr.computed_per_replica) <= rr.computed_tokens
    # Each request's prefill wait covers its own computed tokens; alone on one replica,
    # with nothing else in flight, it is exactly that.
    for rep in (single, *reports.values()):
        assert all(r.prefill_wait >= r.computed_tokens for r in rep.requests)
    lone = replay_replicas(make_replicas(tiny64, tok, 1, capacity=1024),
                           make_router("round_robin", 1), chats, concurrency=1,
                           max_new_tokens=3)
    assert all(r.prefill_wait == r.computed_tokens for r in lone.requests)
    assert max(r.prefill_wait for r in single.requests) > max(r.computed_tokens
                                                              for r in single.requests)


def test_tree_text_lists_tenants_per_node():
    router = CacheAwareRouter(2)
    for text in ["shared prefix, then one", "shared prefix, then two", "other"]:
        router.route(text)
    text = router.tree.text()
    assert "'shared prefix, then ' tenants [0]" in text and "'other' tenants [1]" in text
    assert len(text.splitlines()) == router.tree.num_nodes()


def test_tenant_chats_weights():
    tok = CharTokenizer()
    tok.chat_template = None
    chats = tenant_chats(tok, tenants=3, conversations=10, turns=2, system_tokens=40,
                         weights=[8, 1, 1])
    assert [chats.tenant_of.count(t) for t in range(3)] == [8, 1, 1]
    assert len(set(chats.systems)) == 3 and chats.turns == 2
    assert [m["role"] for m in chats.canned_messages(0, 1)] == ["system", "user",
                                                                 "assistant", "user"]
