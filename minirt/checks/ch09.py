"""Checkers for chapter 09's exercises, which cover 09 and its part 09a: when loading back
beats recomputing (9.1), the replica the router picks (9.2), the hits a write policy gives
(9.3), and how far to spread a hot prefix, predicted first (9.4).

Each checker runs the reader's function on inputs of its own, compares with a reference
(computed here, or by ``minirt.router`` and ``minirt.tiers``) and names the first input
that disagrees. A second failure of the same exercise adds a nudge toward the idea.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

import torch

from ._common import call_reader, checker, expect, passed, same_int

__all__ = ["check_best_replication", "check_load_break_even", "check_route_trace",
           "check_spread_guesses", "check_tier_counts"]


# ---------------------------------------------------------------- 9.1 load or recompute

def _recompute_cost(h: int, prefill: float, attn: float, before: int) -> float:
    # Token j of the h (0-based) attends to the `before` tokens, the j earlier ones and itself.
    return h * prefill + attn * (h * before + h * (h + 1) / 2)


def load_break_even(latency: float, copy_per_token: float, prefill_per_token: float,
                    attn_per_pair: float, cached_before: int) -> int | None:
    """Reference for 9.1: the fewest host tokens whose load-back is strictly cheaper than
    recomputing them, or None if loading never wins."""
    if attn_per_pair == 0 and prefill_per_token <= copy_per_token:
        return None
    h = 1
    while latency + h * copy_per_token >= _recompute_cost(h, prefill_per_token, attn_per_pair,
                                                          cached_before):
        h += 1
    return h


BREAK_EVEN_CASES = [
    # (latency, copy_per_token, prefill_per_token, attn_per_pair, cached_before)
    (10.0, 1.0, 3.0, 0.0, 0),  # a tie at h = 5: loading must be *strictly* cheaper
    (10.0, 1.0, 3.0, 0.0, 100),  # no attention term: what came before does not matter
    (10.0, 3.0, 3.0, 0.0, 0),  # copying costs as much as computing: never
    (10.0, 4.0, 3.0, 0.0, 0),  # copying costs more: never
    (100.0, 4.0, 3.0, 0.5, 0),  # attention makes recompute grow faster than any copy
    (100.0, 4.0, 3.0, 0.5, 40),  # ... and sooner after a long cached prefix
    (0.0, 1.0, 2.0, 0.0, 0),  # no latency: one token already pays
    (20e-6, 22e-6, 1.4e-3, 0.0, 0),  # a CPU: load-back tens of us/token, prefill ~1-2 ms/token
    (50e-6, 0.4e-6, 1e-6, 1e-10, 4096),  # a GPU over PCIe: prefill is fast, copies are not
    (1e-3, 2e-6, 1e-6, 1e-9, 0),  # copying is slower per token; attention decides late
]

_NUDGE_91 = ("Write both costs as functions of h and compare them for h = 1, 2, ...: "
             "the latency is paid once, the copy and prefill per token, and the attention "
             "cost of a recomputed token grows with everything before it. When can the "
             "difference never become positive?")


@checker("9.1", _NUDGE_91)
def check_load_break_even(fn: Callable) -> None:
    """Exercise 9.1: ``fn(latency, copy_per_token, prefill_per_token, attn_per_pair,
    cached_before)`` -> the smallest h, or None."""
    for args in BREAK_EVEN_CASES:
        want = load_break_even(*args)
        got = call_reader(f"load_break_even{args}", fn, *args)
        ok = got is None if want is None else same_int(got, want)
        expect(ok, f"load_break_even(latency={args[0]}, copy_per_token={args[1]}, "
                   f"prefill_per_token={args[2]}, attn_per_pair={args[3]}, "
                   f"cached_before={args[4]}) returned {got!r}; expected {want!r}.")
    passed("9.1", f"{len(BREAK_EVEN_CASES)} break-even points, including two where loading "
                  "never wins")


# ---------------------------------------------------------------- 9.2 the router's choices

def route_trace(events, num_replicas: int, cache_threshold: float, abs_threshold: int,
                rel_threshold: float) -> list[int]:
    """Reference for 9.2: ``minirt.router.CacheAwareRouter`` run on ``events``."""
    from ..router import CacheAwareRouter

    router = CacheAwareRouter(num_replicas, cache_threshold=cache_threshold,
                              balance_abs_threshold=abs_threshold,
                              balance_rel_threshold=rel_threshold)
    out = []
    for kind, arg in events:
        if kind == "route":
            out.append(router.route(arg))
        else:
            router.done(arg)
    return out


_SYS_A = "You are the librarian of Harbour Street. "
_SYS_B = "You are a bicycle mechanic. "


def _random_events(rng: random.Random, n: int, replicas: int, threshold: float,
                   abs_threshold: int, rel_threshold: float) -> list[tuple[str, object]]:
    """A random trace of routes and completions; each completion names a replica that has
    a request in flight (as the reference routes them)."""
    from ..router import CacheAwareRouter

    router = CacheAwareRouter(replicas, cache_threshold=threshold,
                              balance_abs_threshold=abs_threshold,
                              balance_rel_threshold=rel_threshold)
    prefixes = ["abcdefgh", "abcdxyzw", "qrstuvwx", ""]
    events: list[tuple[str, object]] = []
    for _ in range(n):
        live = [r for r in range(replicas) if router.loads[r]]
        if live and rng.random() < 0.35:
            events.append(("done", rng.choice(live)))
            router.done(events[-1][1])
        else:
            tail = "".join(rng.choice("mnop") for _ in range(rng.randint(1, 6)))
            events.append(("route", rng.choice(prefixes) + tail))
            router.route(events[-1][1])
    return events


ROUTE_CASES = [
    # (events, num_replicas, cache_threshold, balance_abs_threshold, balance_rel_threshold)
    ([("route", _SYS_A + "Do you have atlases?"), ("route", _SYS_B + "My chain slips."),
      ("route", _SYS_A + "When do you open?"), ("route", _SYS_B + "Brakes squeal.")],
     3, 0.3, 64, 1.5),
    # nothing in flight finishes: affinity until the loads drift apart
    ([("route", _SYS_A + f"question {i}") for i in range(6)], 3, 0.3, 2, 1.5),
    # the same, with completions in between: the loads never drift
    ([e for i in range(6) for e in (("route", _SYS_A + f"question {i}"), ("done", 0))],
     3, 0.3, 2, 1.5),
    # a short request matches little of anything: least loaded
    ([("route", _SYS_A + "a"), ("route", _SYS_B + "b"), ("route", "Hi"),
      ("route", "You are")], 2, 0.3, 64, 1.5),
    # a match rate exactly at the threshold does not count: least loaded instead
    ([("route", "abcd"), ("route", "efgh"), ("route", "ijkl"), ("done", 1),
      ("route", "abXY")], 2, 0.5, 64, 1.5),
    # two replicas hold the matched prefix: the first to have received it wins
    ([("route", "zzz"), ("route", "shared-prefix one"), ("route", "shared-prefix two"),
      ("done", 0), ("done", 1), ("done", 2), ("route", "shared-prefix six")],
     3, 0.3, 0, 1.0),
    # the absolute gap alone is not enough: max must also exceed rel * min
    ([("route", "xxxxxxxx1"), ("route", "yyyyyyyy1"), ("route", "xxxxxxxx2"),
      ("route", "xxxxxxxx3"), ("route", "xxxxxxxx4"), ("route", "xxxxxxxx5")],
     2, 0.3, 1, 3.0),
]


@checker("9.2", "Keep the router's own state: requests in flight per replica and every "
                "text sent to each. Decide in this order: is the load imbalanced (both "
                "tests)? if not, how much of the text matches what was sent before, and "
                "is that strictly above the threshold? Then record the text.")
def check_route_trace(fn: Callable) -> None:
    """Exercise 9.2: ``fn(events, num_replicas, cache_threshold, balance_abs_threshold,
    balance_rel_threshold)`` -> the replica of each routed request, in order."""
    rng = random.Random(92)
    cases = list(ROUTE_CASES) + [(_random_events(rng, 24, 3, 0.5, 2, 1.5), 3, 0.5, 2, 1.5)
                                 for _ in range(6)]
    for events, n, ct, ab, rel in cases:
        want = route_trace(events, n, ct, ab, rel)
        got = call_reader("route_trace(...)", fn, list(events), n, ct, ab, rel)
        try:
            got_list = [int(x) for x in got]
        except (TypeError, ValueError):
            got_list = None
        if got_list != want:
            pairs = enumerate(zip(got_list or [], want, strict=False))
            first = next((i for i, (g, w) in pairs if g != w), None)
            where = "" if first is None else f" (first difference at routed request {first})"
            expect(False, f"route_trace(events={events}, num_replicas={n}, cache_threshold="
                          f"{ct}, balance_abs_threshold={ab}, balance_rel_threshold={rel}) "
                          f"returned {got!r}; expected {want}{where}.")
    passed("9.2", f"the router's choices on {len(cases)} traces")


# ---------------------------------------------------------------- 9.3 a write policy's hits

DOC_LEN = 3  # tokens per document in the reference run (any length gives the same counts)


def tier_counts(trace, device_docs: int, policy: str, threshold: int) -> tuple[int, int, int, int]:
    """Reference for 9.3: ``minirt.tiers.HiRadixCache`` serving ``trace`` (document ids),
    each document ``DOC_LEN`` tokens no other shares, the device holding ``device_docs`` of
    them and the host all of them. (device hits, host hits, misses, documents written)."""
    from ..pool import KVPool
    from ..tiers import HiRadixCache

    docs = sorted(set(trace))
    pool = KVPool(1, 1, 1, device_docs * DOC_LEN, 1)
    cache = HiRadixCache(pool, max(len(docs), device_docs) * DOC_LEN, write_policy=policy,
                         write_through_threshold=threshold)
    device = host = miss = 0
    for doc in trace:
        ids = [1000 + doc] + [doc] * (DOC_LEN - 1)
        m = cache.match_prefix(ids)
        device += m.device_len == DOC_LEN
        host += m.loaded_len == DOC_LEN
        miss += m.cached_len == 0
        gap = DOC_LEN - m.cached_len
        cache.lock(m.handle)
        cache.make_room(gap)
        cache.insert_prefix(ids, torch.cat([m.indices, pool.alloc(gap)]))
        cache.unlock(m.handle)
    return device, host, miss, cache.tier_stats.written_tokens // DOC_LEN


TIER_CASES = [
    # (trace, device_docs, policy, threshold)
    ([0, 1, 2, 0, 1, 2], 2, "write_back", 1),  # LRU cycles: nothing survives on the device
    ([0, 1, 2, 0, 1, 2], 2, "write_through", 1),
    ([0, 1, 2, 0, 1, 2], 2, "write_through_selective", 2),
    ([0, 0, 1, 2, 0], 2, "write_through_selective", 2),  # one device hit is not enough
    ([0, 0, 0, 1, 2, 0], 2, "write_through_selective", 2),  # the second hit writes it
    ([0, 1, 0, 2, 3, 0, 1], 2, "write_back", 1),
    ([0, 1, 0, 2, 3, 0, 1], 2, "write_through", 1),
    ([0, 0, 1, 1, 2, 0, 0, 3, 0], 1, "write_through_selective", 2),  # hits reset on leaving
    ([0, 1, 2, 3, 0, 1, 2, 3], 3, "write_back", 1),
    ([0, 1, 0, 1, 2, 0], 2, "write_through_selective", 1),
]

_NUDGE_93 = ("Keep the device as a list in LRU order and the host as a set. Ask for each "
             "request: on the device? on the host? neither? Then ask what each policy copies "
             "and when: at a miss, at an eviction, or at the k-th hit since the document last "
             "entered the device. A document already on the host is not copied again.")


@checker("9.3", _NUDGE_93)
def check_tier_counts(fn: Callable) -> None:
    """Exercise 9.3: ``fn(trace, device_docs, policy, threshold)`` -> (device hits, host
    hits, misses, documents written to the host)."""
    rng = random.Random(93)
    cases = list(TIER_CASES)
    for _ in range(30):
        trace = [rng.randrange(4) for _ in range(rng.randint(4, 12))]
        cases.append((trace, rng.randint(1, 3), rng.choice(
            ["write_back", "write_through", "write_through_selective"]), rng.randint(1, 3)))
    for trace, d, policy, k in cases:
        want = tier_counts(trace, d, policy, k)
        got = call_reader(f"tier_counts({trace}, {d}, {policy!r}, {k})", fn,
                          list(trace), d, policy, k)
        try:
            ok = len(got) == 4 and all(same_int(g, w) for g, w in zip(got, want, strict=True))
        except TypeError:
            ok = False
        expect(ok, f"tier_counts(trace={trace}, device_docs={d}, policy={policy!r}, "
                   f"threshold={k}) returned {got!r}; expected (device hits, host hits, "
                   f"misses, written) = {want}.")
    passed("9.3", f"{len(cases)} traces under all three write policies, counted as "
                  "minirt.tiers counts them")


# ---------------------------------------------------------------- 9.4 spreading a hot prefix

def spread_loads(k: int, n_hot: int, prefix_len: int, suffix_len: int, n_cold: int,
                 cold_len: int, replicas: int) -> list[int]:
    """Prefill tokens each replica computes when the hot tenant is spread over ``k``."""
    loads = [0] * replicas
    q, r = divmod(n_hot, k)
    for i in range(k):
        count = q + (i < r)
        if count:
            loads[i] += prefix_len + count * suffix_len
    heap = [(load, i) for i, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(n_cold):
        load, i = heapq.heappop(heap)
        loads[i] = load + cold_len
        heapq.heappush(heap, (loads[i], i))
    return loads


def best_replication(n_hot: int, prefix_len: int, suffix_len: int, n_cold: int,
                     cold_len: int, replicas: int) -> tuple[int, int, int]:
    """Reference for 9.4: (k, busiest replica's tokens, total tokens) for the best k."""
    best = None
    for k in range(1, replicas + 1):
        loads = spread_loads(k, n_hot, prefix_len, suffix_len, n_cold, cold_len, replicas)
        key = (max(loads), sum(loads), k)
        if best is None or key < best:
            best = key
    makespan, total, k = best
    return k, makespan, total


REPLICATION_CASES = [
    # (n_hot, prefix_len, suffix_len, n_cold, cold_len, replicas)
    (12, 400, 20, 0, 0, 4),  # only the hot tenant: spread, paying the prefix per replica
    (12, 400, 20, 8, 100, 4),
    (3, 1000, 10, 30, 100, 4),  # a long prefix, few hot requests: keep them together
    (40, 200, 50, 4, 60, 4),  # many hot requests: spread them
    (5, 100, 10, 0, 0, 8),  # more replicas than it pays to use
    (7, 50, 50, 3, 500, 3),  # long cold requests dominate
    (1, 100, 10, 5, 10, 2),
    (20, 600, 30, 20, 300, 4),
]

_NUDGE_94 = ("Reread the model in the exercise and recount one k by hand: which replicas get "
             "hot requests, what each of them computes, and where each cold request goes.")


def _replication_nudge(got, want: tuple[int, int, int], args: tuple) -> str | None:
    """A nudge for the kind of mistake ``got`` shows: wrong loads for its own k, a k that
    is not the best, or a tie broken the wrong way; None if it cannot tell."""
    replicas = args[-1]
    try:
        gk, gb, gt = (int(x) for x in got)
    except (TypeError, ValueError):
        return "Return a tuple of three ints: (k, busiest, total)."
    if not 1 <= gk <= replicas:
        return f"k counts the replicas the hot tenant is spread over: 1 to {replicas}."
    loads = spread_loads(gk, *args)
    if (gb, gt) != (max(loads), sum(loads)):
        return (f"Your busiest and total are not what your own k = {gk} gives. Recount one k: "
                "the prefix once on each replica that gets hot requests, the hot requests "
                "dealt as evenly as possible, and each cold request to the replica with the "
                "least work so far, ties to the lowest index.")
    if max(loads) > want[1]:
        return ("Another k leaves the busiest replica less work than yours: is every k from 1 "
                "to the number of replicas compared?")
    return ("Several k leave the busiest replica the same work here: the smaller total "
            "wins, then the smaller k.")


@checker("9.4", _NUDGE_94)
def check_best_replication(fn: Callable) -> None:
    """Exercise 9.4: ``fn(n_hot, prefix_len, suffix_len, n_cold, cold_len, replicas)`` ->
    ``(k, busiest, total)``."""
    for args in REPLICATION_CASES:
        want = best_replication(*args)
        got = call_reader(f"best_replication{args}", fn, *args)
        try:
            ok = len(got) == 3 and all(same_int(g, w) for g, w in zip(got, want, strict=True))
        except TypeError:
            ok = False
        expect(ok, f"best_replication(n_hot={args[0]}, prefix_len={args[1]}, "
                   f"suffix_len={args[2]}, n_cold={args[3]}, cold_len={args[4]}, "
                   f"replicas={args[5]}) returned {got!r}; expected (k, busiest, total) = "
                   f"{want}.", None if ok else _replication_nudge(got, want, args))
    passed("9.4", f"the best spread of {len(REPLICATION_CASES)} skewed workloads")


# The workloads of Exercise 9.4's prediction: (n_hot, prefix_len, suffix_len, n_cold,
# cold_len, replicas), keyed as the exercise names them. None is in REPLICATION_CASES, so
# the code check's messages never give a prediction away; their best k are 3, 2 and 1.
SPREAD_GUESS_CASES = {
    "A": (9, 600, 50, 4, 100, 4),
    "B": (16, 300, 50, 6, 200, 4),
    "C": (12, 300, 10, 10, 200, 4),
}

_NUDGE_94_FEW = ("Work out the busiest replica's tokens at your k and at k + 1: does one more "
                 "copy of the prefix cost less than the hot requests it takes off the busiest "
                 "replica?")
_NUDGE_94_MANY = ("Every replica that gets hot requests computes the prefix again, and the "
                  "cold requests fill whatever the hot tenant leaves idle. Work out the "
                  "busiest replica's tokens at your k and at k - 1: which replica is the "
                  "busiest, and what is it computing?")


@checker("9.4 prediction", "Work out the busiest replica's tokens for each k from 1 to 4 "
         "on paper, as the model in the text describes it.")
def check_spread_guesses(guesses: dict) -> None:
    """Exercise 9.4, the prediction: ``guesses`` maps each name of ``SPREAD_GUESS_CASES``
    ("A", "B", "C") to the number of replicas (an int, 1..replicas) the hot tenant is best
    spread over.

    A wrong guess is named with the work it leaves the busiest replica, never with the
    right k; the nudge on a repeat depends on whether the guess spread too little or too
    much.
    """
    form = '{"A": k, "B": k, "C": k}, each k an int from 1 to 4'
    expect(isinstance(guesses, dict) and set(guesses) == set(SPREAD_GUESS_CASES),
           f"my_guesses must be a dict {form}; got "
           f"{sorted(guesses) if isinstance(guesses, dict) else guesses!r}"
           f"{' as its keys' if isinstance(guesses, dict) else ''}.")
    for name, args in SPREAD_GUESS_CASES.items():
        guess = guesses[name]
        expect(any(same_int(guess, k) for k in range(1, args[-1] + 1)),
               f"the guess for {name!r} is {guess!r}; my_guesses must be {form}.")
    wrong = [name for name, args in SPREAD_GUESS_CASES.items()
             if not same_int(guesses[name], best_replication(*args)[0])]
    if wrong:
        name, args = wrong[0], SPREAD_GUESS_CASES[wrong[0]]
        guess, best = int(guesses[name]), best_replication(*args)[0]
        busiest = max(spread_loads(guess, *args))
        expect(False, f"{len(wrong)} of {len(SPREAD_GUESS_CASES)} guesses are not the best k. "
                      f"Workload {name!r} (n_hot, prefix_len, suffix_len, n_cold, cold_len, "
                      f"replicas = {args}): with the hot tenant on {guess} replica"
                      f"{'s' if guess > 1 else ''} the busiest replica computes {busiest} "
                      f"tokens, and another k leaves it less.",
               _NUDGE_94_FEW if guess < best else _NUDGE_94_MANY)
    passed("9.4", f"all {len(SPREAD_GUESS_CASES)} predictions right")
