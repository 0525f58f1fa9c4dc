"""Chapter 05 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest
import torch
from exercise_util import rejects

import minirt.checks as checks
from minirt.checks import ch05
from minirt.radix import RadixNode

# ---------------------------------------------------------------- Exercise 5.1


def _order(cache, num_tokens, *, include_inner=False, honour_locks=True, cascade=True,
           check_parent_lock=True, strict_stop=False):
    """Eviction order by simulation; the keyword arguments switch on one mistake each."""
    alive = {}  # node -> number of its children still cached
    stack = list(cache.root.children.values())
    nodes = []
    while stack:
        n = stack.pop()
        nodes.append(n)
        alive[n] = len(n.children)
        stack.extend(n.children.values())

    def unlocked(n):
        return n.ref_count == 0 or not honour_locks

    if include_inner:
        candidates = {n for n in nodes if unlocked(n)}
    else:
        candidates = {n for n in nodes if alive[n] == 0 and unlocked(n)}
    out, freed = [], 0
    while (freed <= num_tokens if strict_stop else freed < num_tokens) and candidates:
        victim = min(candidates, key=lambda n: (n.last_access, n.id))
        candidates.discard(victim)
        out.append(victim)
        freed += victim.length
        parent = victim.parent
        if parent is not cache.root:
            alive[parent] -= 1
            ok = parent.ref_count == 0 or not check_parent_lock or not honour_locks
            if cascade and alive[parent] == 0 and ok:
                candidates.add(parent)
    return out


def order_right(cache, num_tokens):
    return _order(cache, num_tokens)


def order_any_unlocked_node(cache, num_tokens):  # forgets that only leaves may go
    return _order(cache, num_tokens, include_inner=True)


def order_ignores_locks(cache, num_tokens):  # evicts what running requests use
    return _order(cache, num_tokens, honour_locks=False)


def order_no_cascade(cache, num_tokens):  # a parent left childless never becomes a candidate
    return _order(cache, num_tokens, cascade=False)


def order_cascade_into_locked(cache, num_tokens):  # the childless parent may be locked
    return _order(cache, num_tokens, check_parent_lock=False)


def order_one_too_many(cache, num_tokens):  # keeps going when exactly num_tokens are freed
    return _order(cache, num_tokens, strict_stop=True)


def order_by_evicting(cache, num_tokens):  # right answer, but evicts for real
    got = _order(cache, num_tokens)
    cache.evict(num_tokens)
    return got


def test_eviction_order_accepts_reference(capsys):
    checks.check_eviction_order(order_right)
    assert capsys.readouterr().out.startswith("Exercise 5.1 passed")


@pytest.mark.parametrize("wrong", [order_any_unlocked_node, order_ignores_locks,
                                   order_no_cascade, order_cascade_into_locked,
                                   order_one_too_many, order_by_evicting])
def test_eviction_order_rejects(wrong):
    rejects(checks.check_eviction_order, wrong, "5.1", contains="eviction_order(")


def test_eviction_order_rejects_non_nodes():
    with pytest.raises(AssertionError, match="list of RadixNode"):
        checks.check_eviction_order(lambda c, n: [tuple(x.key.tolist()) for x in order_right(c, n)])


def test_build_cache_is_reproducible():
    script = ch05.EVICTION_TREES[1][1]
    a, b = ch05.build_cache(script), ch05.build_cache(script)
    assert a.evict(5).tolist() == b.evict(5).tolist()
    a.check_integrity()
    assert a.protected_size == 3  # C = [101, 11, 99] is locked


# ---------------------------------------------------------------- Exercise 5.2


def orphans_right(node):
    out, stack = [], list(node.children.values())
    while stack:
        n = stack.pop()
        out += n.value.tolist()
        stack += n.children.values()
    return sorted(out)


def orphans_including_self(node):  # the node's own slots are freed by eviction, not stranded
    return sorted(node.value.tolist() + orphans_right(node))


def orphans_children_only(node):  # forgets grandchildren
    return sorted(s for c in node.children.values() for s in c.value.tolist())


def orphans_as_tensor(node):  # a tensor is a fine answer
    return torch.tensor(orphans_right(node), dtype=torch.int64)


def test_orphaned_slots_accepts_reference(capsys):
    checks.check_orphaned_slots(orphans_right)
    checks.check_orphaned_slots(orphans_as_tensor)
    assert "Exercise 5.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [orphans_including_self, orphans_children_only,
                                   lambda node: [], lambda node: orphans_right(node) * 2])
def test_orphaned_slots_rejects(wrong):
    rejects(checks.check_orphaned_slots, wrong, "5.2", contains="orphaned_slots(")


# ---------------------------------------------------------------- Exercise 5.3

_DELTA = {"alloc": 1, "hit": 1, "insert": 1, "finish": -1, "evict": -1}


def refs_right(events):
    refs, out = {}, []
    for kind, blocks in events:
        freed = []
        for b in blocks:
            refs[b] = refs.get(b, 0) + _DELTA[kind]
            if refs[b] == 0:
                freed.append(b)
        out.append(freed)
    return out


def refs_evict_frees(events):  # evict returns the leaf's blocks at once, in use or not
    refs, out = {}, []
    for kind, blocks in events:
        freed = []
        for b in blocks:
            refs[b] = refs.get(b, 0) + _DELTA[kind]
            if kind == "evict" or refs[b] == 0:
                freed.append(b)
                refs[b] = 0
        out.append(freed)
    return out


def refs_finish_frees_all(events):  # a finishing request frees every block it touched
    refs, out = {}, []
    for kind, blocks in events:
        freed = []
        for b in blocks:
            refs[b] = refs.get(b, 0) + _DELTA[kind]
            if kind == "finish" or refs[b] == 0:
                freed.append(b)
        out.append(freed)
    return out


def refs_hit_not_counted(events):  # a cache hit takes no reference
    return refs_right([(k, b if k != "hit" else []) for k, b in events])


def test_refcounts_accepts_reference(capsys):
    checks.check_refcounts(refs_right)
    assert "Exercise 5.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [refs_evict_frees, refs_finish_frees_all, refs_hit_not_counted,
                                   lambda events: [[] for _ in events]])
def test_refcounts_rejects(wrong):
    rejects(checks.check_refcounts, wrong, "5.3", contains="replay_refs(")


def test_refcount_scenarios_never_go_negative():
    for _, events in ch05.REFCOUNT_SCENARIOS:
        assert ch05._replay_refs(events) == refs_right(events)


# ---------------------------------------------------------------- Exercise 5.4


def _belady(trace, capacity, *, tie_deeper=True, lru=False):
    trace = [tuple(r) for r in trace]
    cached, last_use, hits = set(), {}, 0
    for t, req in enumerate(trace):
        n = 0
        while n < len(req) and req[: n + 1] in cached:
            n += 1
        hits += n
        for i in range(len(req)):
            cached.add(req[: i + 1])
            last_use[req[: i + 1]] = t

        def next_use(p, t=t):
            return next((u for u in range(t + 1, len(trace)) if trace[u][: len(p)] == p),
                        len(trace))

        while len(cached) > capacity:
            if lru:
                victim = min(cached, key=lambda p: (last_use[p], -len(p)))
            else:
                depth = (lambda p: len(p)) if tie_deeper else (lambda p: -len(p))
                victim = max(cached, key=lambda p: (next_use(p), depth(p)))
            cached.remove(victim)
    return hits


def belady_right(trace, capacity):
    return _belady(trace, capacity)


def belady_shallow_ties(trace, capacity):  # ties broken toward the shallower token
    return _belady(trace, capacity, tie_deeper=False)


def belady_token_lru(trace, capacity):  # least recently used token instead of furthest next use
    return _belady(trace, capacity, lru=True)


def belady_rate(trace, capacity):  # a hit rate, not a token count
    total = sum(len(r) for r in trace)
    return _belady(trace, capacity) / total


def belady_whole_requests(trace, capacity):  # forgets earliest-used requests as whole units
    cached, hits = [], 0
    for req in trace:
        req = tuple(req)
        best = max((sum(1 for _ in iter_common(req, c)) for c in cached), default=0)
        hits += best
        cached.append(req)
        while sum(len(c) for c in cached) > capacity:
            cached.pop(0)
    return hits


def iter_common(a, b):
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def test_belady_accepts_reference(capsys):
    checks.check_belady_hits(belady_right)
    assert "Exercise 5.4 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [belady_shallow_ties, belady_token_lru, belady_rate,
                                   belady_whole_requests])
def test_belady_rejects(wrong):
    rejects(checks.check_belady_hits, wrong, "5.4", contains="belady_hits(")


def test_reference_belady_agrees_with_minirt_on_every_trace():
    for _, trace, capacity in ch05.BELADY_TRACES:
        assert belady_right(trace, capacity) == ch05._belady_hits(trace, capacity)


def test_path_tokens():
    cache = ch05.build_cache([("insert", [1, 2, 3]), ("insert", [1, 2, 4])])
    leaf = cache.root.children[1].children[4]
    assert isinstance(leaf, RadixNode) and ch05.path_tokens(leaf) == [1, 2, 4]
