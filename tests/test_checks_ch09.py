"""Chapter 09 checkers: each accepts a right answer, rejects plausible wrong ones, and adds
a nudge on a repeated failure."""

from __future__ import annotations

import heapq

import pytest
from brute_force import lcp

import minirt.checks as checks
from minirt.checks._common import reset_attempts


@pytest.fixture(autouse=True)
def fresh_hints():
    reset_attempts()
    yield
    reset_attempts()


# ---------------------------------------------------------------- Exercise 9.1

def _make_break_even(strict=True, use_latency=True, use_before=True, self_pair=True,
                     never=None):
    def fn(latency, copy, prefill, attn, before):
        if attn == 0 and prefill <= copy:
            return never
        h = 1
        while True:
            pairs = h * (h + 1) / 2 if self_pair else h * (h - 1) / 2
            recompute = h * prefill + attn * (h * (before if use_before else 0) + pairs)
            load = (latency if use_latency else 0) + h * copy
            if (load < recompute) if strict else (load <= recompute):
                return h
            h += 1
    return fn


def test_break_even_accepts_the_reference(capsys):
    checks.check_load_break_even(_make_break_even())
    assert capsys.readouterr().out.startswith("Exercise 9.1 passed")


@pytest.mark.parametrize("wrong", [
    _make_break_even(strict=False),  # a tie counted as a win
    _make_break_even(use_latency=False),  # the fixed cost of a transfer forgotten
    _make_break_even(use_before=False),  # attention to the cached prefix forgotten
    _make_break_even(self_pair=False),  # a token does not attend to itself
    _make_break_even(never=0),  # 0 instead of None when loading never wins
])
def test_break_even_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="load_break_even"):
        checks.check_load_break_even(wrong)


def test_break_even_hints_escalate():
    wrong = _make_break_even(use_latency=False)
    with pytest.raises(AssertionError) as first:
        checks.check_load_break_even(wrong)
    assert "Hint" not in str(first.value) and "expected" in str(first.value)
    with pytest.raises(AssertionError) as second:
        checks.check_load_break_even(wrong)
    assert "Hint" in str(second.value)


# ---------------------------------------------------------------- Exercise 9.4

def _make_replication(prefix_per_replica=True, balance_cold=True, tie_total=True,
                      only=None, larger_on_ties=False):
    def loads_for(k, n_hot, p, s, n_cold, c, replicas):
        loads = [0] * replicas
        q, r = divmod(n_hot, k)
        for i in range(k):
            count = q + (i < r)
            if count:
                loads[i] += (p if prefix_per_replica else (p if i == 0 else 0)) + count * s
        if balance_cold:
            heap = [(x, i) for i, x in enumerate(loads)]
            heapq.heapify(heap)
            for _ in range(n_cold):
                x, i = heapq.heappop(heap)
                loads[i] = x + c
                heapq.heappush(heap, (loads[i], i))
        else:  # round-robin over all replicas
            for j in range(n_cold):
                loads[j % replicas] += c
        return loads

    def fn(n_hot, p, s, n_cold, c, replicas):
        ks = [only if only else k for k in range(1, replicas + 1)]
        best = None
        for k in ks:
            loads = loads_for(min(k, replicas), n_hot, p, s, n_cold, c, replicas)
            key = (max(loads), sum(loads) if tie_total else 0, -k if larger_on_ties else k)
            best = key if best is None or key < best else best
        k = abs(best[2])
        return k, best[0], sum(loads_for(k, n_hot, p, s, n_cold, c, replicas))
    return fn


def test_replication_accepts_the_reference(capsys):
    checks.check_best_replication(_make_replication())
    assert capsys.readouterr().out.startswith("Exercise 9.4 passed")


@pytest.mark.parametrize("wrong", [
    _make_replication(only=1),  # pure cache affinity: never spread
    _make_replication(only=99),  # round-robin: always spread over every replica
    _make_replication(prefix_per_replica=False),  # the prefix counted once in all
    _make_replication(balance_cold=False),  # cold requests dealt round-robin
    _make_replication(larger_on_ties=True),  # equal busiest loads: the larger k
])
def test_replication_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="best_replication"):
        checks.check_best_replication(wrong)


@pytest.mark.parametrize(("wrong", "nudge"), [
    (_make_replication(prefix_per_replica=False), "not what your own k"),  # loads miscounted
    (_make_replication(only=1), "Another k"),  # the loads of k = 1 are right; k is not
    (_make_replication(larger_on_ties=True), "Several k"),
])
def test_replication_hint_names_the_kind_of_mistake(wrong, nudge):
    with pytest.raises(AssertionError) as first:
        checks.check_best_replication(wrong)
    assert "Hint" not in str(first.value) and "expected (k, busiest, total)" in str(first.value)
    with pytest.raises(AssertionError) as second:
        checks.check_best_replication(wrong)
    assert "Hint (failed 2 times)" in str(second.value) and nudge in str(second.value)


# ---------------------------------------------------------------- Exercise 9.2

def _make_router(at_least=False, either=False, latest=False, no_balance=False):
    def fn(events, n, threshold, abs_t, rel_t):
        loads, sent, out = [0] * n, [], []
        for kind, arg in events:
            if kind == "done":
                loads[arg] -= 1
                continue
            hi, lo = max(loads), min(loads)
            gap, ratio = hi - lo > abs_t, hi > rel_t * lo
            if not no_balance and ((gap or ratio) if either else (gap and ratio)):
                r = loads.index(lo)
            else:
                best = max((lcp(t, arg) for _, t in sent), default=0)
                rate = best / len(arg) if arg else 0.0
                if best and (rate >= threshold if at_least else rate > threshold):
                    holders = [rep for rep, t in sent if t[:best] == arg[:best]]
                    r = holders[-1] if latest else holders[0]
                else:
                    r = loads.index(min(loads))
            loads[r] += 1
            sent.append((r, arg))
            out.append(r)
        return out
    return fn


def test_route_trace_accepts_the_reference(capsys):
    checks.check_route_trace(_make_router())
    assert capsys.readouterr().out.startswith("Exercise 9.2 passed")


@pytest.mark.parametrize("wrong", [
    _make_router(at_least=True),  # a match rate equal to the threshold counted as a hit
    _make_router(either=True),  # imbalanced when either test holds
    _make_router(latest=True),  # the replica that received the prefix last
    _make_router(no_balance=True),  # pure cache affinity
])
def test_route_trace_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="route_trace"):
        checks.check_route_trace(wrong)


# ---------------------------------------------------------------- Exercise 9.3

def _make_tiers(reset_hits=True, recount=False, refresh=True, strict=False,
                load_is_insert=True):
    def fn(trace, device_docs, policy, threshold):
        device, hits, on_host = [], {}, set()
        counts = [0, 0, 0, 0]

        def write(x):
            if recount or x not in on_host:
                counts[3] += 1
            on_host.add(x)

        def enter(x):
            if len(device) == device_docs:
                victim = device.pop(0)
                if reset_hits:
                    hits.pop(victim, None)
                if policy == "write_back":
                    write(victim)
            device.append(x)
            hits.setdefault(x, 0)

        for x in trace:
            if x in device:
                counts[0] += 1
                if refresh:
                    device.remove(x)
                    device.append(x)
                hits[x] += 1
                hot = hits[x] > threshold if strict else hits[x] >= threshold
                if policy == "write_through_selective" and hot:
                    write(x)
            elif x in on_host:
                counts[1] += 1
                if load_is_insert:
                    enter(x)
            else:
                counts[2] += 1
                enter(x)
                if policy == "write_through":
                    write(x)
        return tuple(counts)
    return fn


def test_tier_counts_accepts_the_reference(capsys):
    checks.check_tier_counts(_make_tiers())
    assert capsys.readouterr().out.startswith("Exercise 9.3 passed")


@pytest.mark.parametrize("wrong", [
    _make_tiers(reset_hits=False),  # hit counts survive an eviction
    _make_tiers(recount=True),  # a document already on the host is copied again
    _make_tiers(refresh=False),  # a device hit does not refresh LRU (FIFO)
    _make_tiers(strict=True),  # written only after more than `threshold` hits
    _make_tiers(load_is_insert=False),  # a host hit served from the host, not loaded back
])
def test_tier_counts_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError, match="tier_counts"):
        checks.check_tier_counts(wrong)


# ---------------------------------------------------------------- Exercise 9.4, the prediction

RIGHT_GUESSES = {"A": 3, "B": 2, "C": 1}


def test_spread_guesses_accepts_the_best_k(capsys):
    from minirt.checks.ch09 import SPREAD_GUESS_CASES, best_replication

    # The right guesses are the reference's, computed here, not typed from the checker.
    assert RIGHT_GUESSES == {n: best_replication(*a)[0] for n, a in SPREAD_GUESS_CASES.items()}
    checks.check_spread_guesses(dict(RIGHT_GUESSES))
    assert capsys.readouterr().out.startswith("Exercise 9.4 passed")


def test_spread_guess_cases_are_not_answered_by_the_code_check():
    from minirt.checks.ch09 import REPLICATION_CASES, SPREAD_GUESS_CASES

    assert not set(SPREAD_GUESS_CASES.values()) & set(REPLICATION_CASES)
    assert len(set(RIGHT_GUESSES.values())) == 3  # neither extreme answers every workload


@pytest.mark.parametrize("wrong", [
    {**RIGHT_GUESSES, "A": 4},  # spreads over every replica
    {"A": 1, "B": 1, "C": 1},  # never spreads
    {"A": 4, "B": 4, "C": 4},  # always spreads (round-robin)
    {**RIGHT_GUESSES, "C": 4},  # "many hot requests: spread them"
    {"A": 3, "B": 2},  # not every workload
    [3, 2, 1],  # a list, not a dict
    {**RIGHT_GUESSES, "B": 2.0},  # not an int
    {**RIGHT_GUESSES, "B": 0},  # not 1..4
])
def test_spread_guesses_rejects_wrong_guesses(wrong):
    with pytest.raises(AssertionError):
        checks.check_spread_guesses(wrong)


def test_spread_guesses_names_the_form():
    with pytest.raises(AssertionError) as err:
        checks.check_spread_guesses([3, 2, 1])
    assert '{"A": k, "B": k, "C": k}' in str(err.value)


@pytest.mark.parametrize(("guesses", "nudge"), [
    ({**RIGHT_GUESSES, "A": 2}, "at k + 1"),  # too few replicas
    ({**RIGHT_GUESSES, "A": 4}, "at k - 1"),  # too many
    ({**RIGHT_GUESSES, "C": 3}, "at k - 1"),
])
def test_spread_guesses_never_reveal_the_answer_and_hint_by_kind(guesses, nudge):
    from minirt.checks.ch09 import SPREAD_GUESS_CASES, best_replication

    name = next(n for n in SPREAD_GUESS_CASES if guesses[n] != RIGHT_GUESSES[n])
    best = best_replication(*SPREAD_GUESS_CASES[name])
    with pytest.raises(AssertionError) as first:
        checks.check_spread_guesses(guesses)
    message = str(first.value)
    assert f"Workload {name!r}" in message and "Hint" not in message
    assert "expected" not in message and str(best[1]) not in message  # no best k, no best load
    with pytest.raises(AssertionError) as second:
        checks.check_spread_guesses(guesses)
    assert nudge in str(second.value) and "expected" not in str(second.value)
