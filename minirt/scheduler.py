"""Cache-aware scheduling: the order in which waiting requests are admitted.

When the pool cannot hold every shared prefix at once, the admission order decides how
much prefill is repeated. ``Scheduler`` orders the waiting queue before each admission
step, as SGLang's ``SchedulePolicy.calc_priority`` does (sglang 0.5.23
`srt/managers/schedule_policy.py: SchedulePolicy.calc_priority`; SGLang's default
``--schedule-policy`` is ``fcfs``, sglang 0.5.23 `srt/arg_groups/fields/schedule.py`):

* ``"fcfs"``: by arrival (vLLM's and SGLang's default, and minirt's);
* ``"lpm"``: longest cached prefix first, read from the cache at scheduling time (a
  read-only peek; SGLang's match touches the tree instead); like SGLang it falls back to
  FCFS when more than ``lpm_max_queue`` (128, a number SGLang's source calls arbitrary)
  requests wait, for ``"hrrn"`` too;
* ``"dfs-weight"``: a depth-first walk, heavier subtrees (more requests) first. minirt's
  default walk (``dfs_walk="prompts"``, ``dfs_weight_order``) is the theorem's offline
  DFS over the radix tree of the waiting prompts themselves; ``dfs_walk="cache"``
  (``cache_dfs_weight_order``) is SGLang's: a post-order walk of the *cache's* tree, each
  request at its deepest cached node (sglang 0.5.23
  `srt/mem_cache/base_prefix_cache.py: _dfs_weight_order`);
* ``"hrrn"``: highest response ratio next with token-based aging, SGLang's: prefill
  tokens processed since the request arrived over its uncached tokens, highest first
  (sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy._sort_by_hrrn`);
* ``"lof"`` (longest output first) and a seeded ``"random"``: baselines.

Ties keep arrival order (SGLang sorts its queue in place, so its ties keep the previous
step's order). Two guards: in-batch prefix sharing (``in_batch``) and aging
(``max_wait_steps``: a request that has waited that many steps goes first, whatever the
policy). In-batch sharing has two rules, with SGLang's thresholds (32 and 32):

* ``in_batch_rule="minirt"`` (minirt's, stricter): at admission, a request with at most
  ``in_batch_max_cached`` cached tokens that shares at least ``in_batch_min_shared``
  tokens beyond them with a prompt admitted earlier in the same step waits one step
  (``Scheduler.defers``), on any policy;
* ``in_batch_rule="sglang"``: SGLang's own (sglang 0.5.23
  `srt/managers/schedule_policy.py: SchedulePolicy._compute_prefix_matches` and
  `_sort_by_longest_prefix` beside it): when ordering, each waiting request with at
  most ``in_batch_max_cached`` cached tokens is matched against the earlier *waiting*
  requests; if it shares at least ``in_batch_min_shared`` tokens (cached ones included)
  it is only sorted to the back of this step's order, under ``lpm`` and ``hrrn``. The
  admission loop still admits it in the same batch if the budget allows (sglang 0.5.23
  `srt/managers/scheduler.py: Scheduler.get_new_batch_prefill`).

Below the scheduler, the theory of chapter 07: ``sequential_cost`` (tokens computed when
requests run one at a time through an LRU cache that keeps ``capacity`` tokens),
``best_order`` (brute force over every order) and ``dfs_weight_order``; SGLang's Theorem
3.1 says that with ``capacity`` >= the longest request a DFS order costs exactly
``edge_sum`` (the radix tree's edge lengths), the least any order can.
``simulate_schedule`` replays arrivals step by step without a model, for measurements
where only the tokens count (queues, starvation, batched prefill).
"""

from __future__ import annotations

import itertools
import math
import random
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from os.path import commonprefix
from typing import Any, Protocol

import torch

from .cache import PrefixCache, RadixCache
from .errors import ScheduleError
from .radix import RadixNode
from .token_ids import as_ids
from .workloads import unique_prefix_count

__all__ = [
    "POLICIES",
    "Scheduler",
    "SimRequest",
    "SimResult",
    "best_order",
    "cache_dfs_weight_order",
    "cached_prefix_len",
    "dfs_weight_order",
    "edge_sum",
    "make_scheduler",
    "schedule_order",
    "sequential_cost",
    "simulate_schedule",
]

POLICIES = ("fcfs", "lpm", "dfs-weight", "hrrn", "lof", "random")
DFS_WALKS = ("prompts", "cache")
IN_BATCH_RULES = ("minirt", "sglang")


class Schedulable(Protocol):
    """What the scheduler reads from a waiting request (a ``lifecycle.Request`` has it)."""

    prompt: torch.Tensor
    arrival: int
    max_new_tokens: int


def cached_prefix_len(cache: PrefixCache, ids: Any, salt: Any = None) -> int:
    """The longest cached prefix of ``ids`` in whole pages, read only.

    Unlike ``match_prefix`` it splits no node, touches no access time and counts no
    statistics: minirt's choice is that a scheduler peeking at every waiting prompt must
    not make the cache look hotter than it is. SGLang chooses the opposite on purpose: its
    cache-aware policies match with ``match_prefix`` (access times, splits), and under the
    other policies it refreshes the waiting prefixes' access times so that they survive
    until admission (sglang 0.5.23
    `srt/managers/schedule_policy.py: SchedulePolicy._touch_waiting_prefixes`).
    """
    return cache.peek_prefix_len(ids, salt=salt)


def _peek(cache: PrefixCache, r: Any) -> int:
    """A waiting request's cached prefix (all but its last token, as the engine matches)."""
    return cached_prefix_len(cache, r.prompt[:-1], getattr(r, "salt", None))


def _tokens(prompt: Any) -> tuple[int, ...]:
    return tuple(prompt.tolist() if isinstance(prompt, torch.Tensor) else map(int, prompt))


def dfs_weight_order(prompts: Sequence[Any], cached: Sequence[int] | None = None,
                     arrivals: Sequence[int] | None = None) -> list[int]:
    """Indices of ``prompts`` in a depth-first walk of their radix tree.

    At each node the requests ending there come first (a prompt that is a prefix of
    others is computed before them), then the children: the one with the most cached
    tokens first (``cached[i]``: prompt i's cached prefix length; it keeps a walk that a
    previous step began going in the same subtree), then the heaviest (most requests),
    then the earliest arrival. Every order this returns is a DFS order of the tree.
    """
    n = len(prompts)
    toks = [_tokens(p) for p in prompts]
    cached = list(cached) if cached is not None else [0] * n
    arrivals = list(arrivals) if arrivals is not None else list(range(n))
    out: list[int] = []

    def walk(members: list[int], depth: int) -> None:
        here = sorted((i for i in members if len(toks[i]) == depth), key=lambda i: arrivals[i])
        out.extend(here)
        groups: dict[int, list[int]] = {}
        for i in members:
            if len(toks[i]) > depth:
                groups.setdefault(toks[i][depth], []).append(i)
        children = []
        for group in groups.values():
            end = depth + len(commonprefix([toks[i][depth:] for i in group]))
            warm = min(end, max(cached[i] for i in group))
            children.append((-warm, -len(group), min(arrivals[i] for i in group), group, end))
        for *_, group, end in sorted(children, key=lambda c: c[:3]):
            walk(group, end)

    walk(list(range(n)), 0)
    return out


def cache_dfs_weight_order(cache: RadixCache, prompts: Sequence[Any],
                           salts: Sequence[Any] | None = None) -> list[int]:
    """Indices of ``prompts`` (in queue order) in SGLang's dfs-weight order.

    SGLang's walk (sglang 0.5.23 `srt/mem_cache/base_prefix_cache.py: _dfs_weight_order`,
    called by sglang 0.5.23
    `srt/managers/schedule_policy.py: SchedulePolicy._sort_by_dfs_weight`):
    each waiting request sits at the deepest node its cached prefix reaches (its match,
    all but the last token, as the engine matches); a node's weight is the number of
    requests in its subtree; the walk visits children heaviest first (ties in the tree's
    child order) and puts a node's own requests *after* its children, in queue order.
    With an empty cache every request sits at the root and the order is the queue's.
    A request whose match ends inside an edge sits where SGLang's match would split it:
    after the requests deeper on that edge.
    """
    if not isinstance(cache, RadixCache):
        raise ScheduleError("SGLang's dfs-weight walks a radix tree; "
                            f"{type(cache).__name__} has none")
    salts = list(salts) if salts is not None else [None] * len(prompts)
    at: dict[int, list[tuple[int, int]]] = {}   # id(node) -> [(-depth on its edge, index)]
    weight: dict[int, int] = {}
    for i, p in enumerate(prompts):
        # Where SGLang's match would split the node, the request sits on its edge here.
        node, depth, _ = cache.peek_position(list(_tokens(p)[:-1]), salt=salts[i])
        at.setdefault(id(node), []).append((-depth, i))
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + 1
            node = node.parent
    out: list[int] = []
    stack: list[tuple[RadixNode, bool]] = [(cache.root, False)]
    while stack:
        node, visited = stack.pop()
        if visited:
            out.extend(i for _, i in sorted(at.get(id(node), ())))
            continue
        stack.append((node, True))
        children = sorted((c for c in node.children.values() if weight.get(id(c))),
                          key=lambda c: -weight[id(c)])
        stack.extend((c, False) for c in reversed(children))
    return out


class Scheduler:
    """Orders the waiting queue before each admission step (see the module docstring).

    ``order(waiting, cache)`` is called once per step; it counts steps, so it knows how
    long each request has waited (``waited``). Under ``"hrrn"`` it also counts the prefill
    tokens of the requests that left the queue since the last step (``processed_tokens``:
    their uncached tokens as peeked when they were ordered, what the engine then
    prefills; whole prompts in steps past the cutoff, where nothing is peeked), the clock
    HRRN ages by. ``defers(prompt, cached_len, admitted)`` is minirt's
    in-batch sharing rule the admission loop asks about each candidate.
    """

    def __init__(self, policy: str = "fcfs", *, lpm_max_queue: int = 128,
                 in_batch: bool = False, in_batch_rule: str = "minirt",
                 in_batch_max_cached: int = 32, in_batch_min_shared: int = 32,
                 max_wait_steps: int | None = None, dfs_walk: str = "prompts",
                 seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ScheduleError(f"unknown schedule policy {policy!r}; use one of "
                                f"{', '.join(POLICIES)}")
        for name, value, least in (("lpm_max_queue", lpm_max_queue, 0),
                                   ("in_batch_max_cached", in_batch_max_cached, 0),
                                   ("in_batch_min_shared", in_batch_min_shared, 1),
                                   ("max_wait_steps", max_wait_steps, 0), ("seed", seed, 0)):
            if value is None and name == "max_wait_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ScheduleError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(in_batch, bool):
            raise ScheduleError(f"in_batch must be True or False, got {in_batch!r}")
        if in_batch_rule not in IN_BATCH_RULES:
            raise ScheduleError(f"in_batch_rule must be one of {', '.join(IN_BATCH_RULES)}, "
                                f"got {in_batch_rule!r}")
        if dfs_walk not in DFS_WALKS:
            raise ScheduleError(f"dfs_walk must be one of {', '.join(DFS_WALKS)}, "
                                f"got {dfs_walk!r}")
        self.policy, self.lpm_max_queue = policy, lpm_max_queue
        self.in_batch, self.in_batch_rule = in_batch, in_batch_rule
        self.in_batch_max_cached = in_batch_max_cached
        self.in_batch_min_shared, self.max_wait_steps = in_batch_min_shared, max_wait_steps
        self.dfs_walk, self.seed = dfs_walk, seed
        self._rng = random.Random(seed)
        self.steps = 0
        self.processed_tokens = 0
        self.last_policy = policy  # what the last ``order`` used (LPM, HRRN may fall back)
        self.last_deprioritized: list = []  # SGLang's in-batch rule, last ``order``
        self._first_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._arrival_processed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_uncached: dict[int, tuple[Any, int]] = {}

    def active_policy(self, queue_len: int) -> str:
        """The policy a queue of ``queue_len`` gets: LPM and HRRN fall back to FCFS past the
        cutoff, as in SGLang's
        sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy._determine_active_policy`.
        """
        if self.policy in ("lpm", "hrrn") and queue_len > self.lpm_max_queue:
            return "fcfs"
        return self.policy

    def waited(self, request: Schedulable) -> int:
        """Scheduling steps ``request`` has spent waiting (0 in the step it was first seen)."""
        return self.steps - 1 - self._first_seen.get(request, self.steps - 1)

    def waited_tokens(self, request: Schedulable) -> int:
        """Prefill tokens processed since ``request`` joined the queue (HRRN's clock)."""
        return self.processed_tokens - self._arrival_processed.get(request,
                                                                   self.processed_tokens)

    def _sglang_deprioritized(self, fcfs: list, cached: dict[int, int]) -> set[int]:
        """SGLang's in-batch check: ids of the requests sorted to the back this step.

        Each waiting request (queue order) with at most ``in_batch_max_cached`` cached
        tokens is matched against the earlier waiting requests checked so far; at least
        ``in_batch_min_shared`` shared tokens (cached ones included) and it goes to the
        back, else it joins them."""
        seen: list[tuple[Any, tuple[int, ...]]] = []
        out: set[int] = set()
        for r in fcfs:
            if cached[id(r)] > self.in_batch_max_cached:
                continue
            mine, salt = _tokens(r.prompt), getattr(r, "salt", None)
            shared = max((len(commonprefix([mine, t])) for s, t in seen if s == salt),
                         default=0)
            if shared >= self.in_batch_min_shared:
                out.add(id(r))
            else:
                seen.append((salt, mine))
        return out

    def order(self, waiting: Iterable[Schedulable], cache: PrefixCache | None = None) -> list:
        """The waiting requests in the order this step should try to admit them."""
        reqs = list(waiting)
        step, self.steps = self.steps, self.steps + 1
        here = {id(r) for r in reqs}
        self.processed_tokens += sum(n for key, (_, n) in self._last_uncached.items()
                                     if key not in here)  # left the queue: admitted
        for r in reqs:
            self._first_seen.setdefault(r, step)
            self._arrival_processed.setdefault(r, self.processed_tokens)
        policy = self.last_policy = self.active_policy(len(reqs))
        fcfs = sorted(reqs, key=lambda r: r.arrival)
        if policy in ("lpm", "dfs-weight", "hrrn") and cache is None:
            raise ScheduleError(f"policy {policy!r} reads the cache: pass it to order()")
        peeks = policy in ("lpm", "hrrn") or (policy == "dfs-weight" and self.dfs_walk == "prompts")
        cached = {id(r): _peek(cache, r) for r in fcfs} if peeks else {}
        if self.policy == "hrrn":  # past the cutoff nothing is peeked: whole prompts count
            self._last_uncached = {id(r): (r, r.prompt.numel() - cached.get(id(r), 0))
                                   for r in fcfs}
        back: set[int] = set()
        if self.in_batch and self.in_batch_rule == "sglang" and policy in ("lpm", "hrrn"):
            back = self._sglang_deprioritized(fcfs, cached)
        self.last_deprioritized = [r for r in fcfs if id(r) in back]
        if policy == "lpm":
            ordered = sorted(fcfs, key=lambda r: math.inf if id(r) in back
                             else -cached[id(r)])
        elif policy == "hrrn":
            ordered = sorted(fcfs, key=lambda r: math.inf if id(r) in back else
                             -self.waited_tokens(r) / (r.prompt.numel() - cached[id(r)]))
        elif policy == "dfs-weight" and self.dfs_walk == "cache":
            ordered = [fcfs[i] for i in cache_dfs_weight_order(
                cache, [r.prompt for r in fcfs], [getattr(r, "salt", None) for r in fcfs])]
        elif policy == "dfs-weight":
            ordered = [fcfs[i] for i in dfs_weight_order(
                [r.prompt for r in fcfs], [cached[id(r)] for r in fcfs],
                [r.arrival for r in fcfs])]
        elif policy == "lof":
            ordered = sorted(fcfs, key=lambda r: -r.max_new_tokens)
        elif policy == "random":
            ordered = fcfs[:]
            self._rng.shuffle(ordered)
        else:
            ordered = fcfs
        if self.max_wait_steps is not None:
            old = [r for r in fcfs if step - self._first_seen[r] >= self.max_wait_steps]
            if old:
                aged = set(map(id, old))
                ordered = old + [r for r in ordered if id(r) not in aged]
        return ordered

    def defers(self, prompt: Any, cached_len: int, admitted: Sequence[Any]) -> bool:
        """minirt's in-batch rule: should this candidate wait one step for a prefix being
        computed?

        True when ``in_batch`` is on with ``in_batch_rule="minirt"``, at most
        ``in_batch_max_cached`` of its tokens are cached, and it shares at least
        ``in_batch_min_shared`` tokens beyond that with a prompt admitted earlier in this
        step. SGLang's rule only reorders (``order``); its admission has no such check.
        """
        if not self.in_batch or self.in_batch_rule != "minirt" or not admitted \
                or cached_len > self.in_batch_max_cached:
            return False
        mine = _tokens(prompt)
        for other in admitted:
            shared = len(commonprefix([mine, _tokens(other)]))
            if shared - cached_len >= self.in_batch_min_shared:
                return True
        return False

    def __repr__(self) -> str:
        extra = "".join([f", in_batch={self.in_batch_rule}({self.in_batch_max_cached}, "
                         f"{self.in_batch_min_shared})" if self.in_batch else "",
                         f", dfs_walk={self.dfs_walk!r}" if self.dfs_walk != "prompts" else "",
                         f", max_wait_steps={self.max_wait_steps}"
                         if self.max_wait_steps is not None else ""])
        return f"Scheduler({self.policy!r}, lpm_max_queue={self.lpm_max_queue}{extra})"


def make_scheduler(schedule: str | Scheduler) -> Scheduler:
    """A ``Scheduler`` from a policy name, or the given one."""
    if isinstance(schedule, Scheduler):
        return schedule
    if isinstance(schedule, str):
        return Scheduler(schedule)
    raise ScheduleError(f"schedule must be a policy name ({', '.join(POLICIES)}) or a "
                        f"Scheduler, got {type(schedule).__name__}")


def schedule_order(requests: Iterable[Schedulable], policy: str = "fcfs",
                   cache: PrefixCache | None = None) -> list:
    """Waiting requests in the order one scheduling step with ``policy`` tries them.

    Besides ``POLICIES``, ``"spf"`` (shortest-prefill-first) sorts by each request's
    ``uncached_len`` (its last match), ties by arrival.
    """
    reqs = list(requests)
    if policy == "spf":
        return sorted(reqs, key=lambda r: (r.uncached_len, r.arrival))
    return Scheduler(policy).order(reqs, cache)


# ---------------------------------------------------------------- the theory


def edge_sum(prompts: Sequence[Any]) -> int:
    """Sum of the edge lengths of the prompts' radix tree: the distinct prefixes.

    Every distinct prefix must be computed at least once, so no order computes fewer.
    """
    return unique_prefix_count([_tokens(p) for p in prompts])


def sequential_cost(prompts: Sequence[Any], capacity: int,
                    order: Sequence[int] | None = None) -> int:
    """Tokens computed serving ``prompts`` one at a time in ``order`` (default: as given).

    Token-level model: a request reuses its longest cached prefix and computes the rest;
    all its prefixes are then cached, and least recently used leaf tokens (the deepest
    first among equals) are evicted until at most ``capacity`` tokens remain.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ScheduleError(f"capacity must be an int >= 0, got {capacity!r}")
    toks = [_tokens(p) for p in prompts]
    order = range(len(toks)) if order is None else order
    if sorted(order) != list(range(len(toks))):
        raise ScheduleError(f"order must be a permutation of 0..{len(toks) - 1}, got {order!r}")
    used: dict[tuple[int, ...], int] = {}   # cached prefix -> last use
    children: dict[tuple[int, ...], int] = {}
    cost = 0
    for t, i in enumerate(order):
        p = toks[i]
        hit = 0
        while hit < len(p) and p[:hit + 1] in used:
            hit += 1
        cost += len(p) - hit
        for k in range(1, len(p) + 1):
            if p[:k] not in used:
                children[p[:k - 1]] = children.get(p[:k - 1], 0) + 1
            used[p[:k]] = t
        while len(used) > capacity:
            leaf = min((q for q in used if not children.get(q)), key=lambda q: (used[q], -len(q)))
            del used[leaf]
            children[leaf[:-1]] -= 1
    return cost


def best_order(prompts: Sequence[Any], capacity: int) -> tuple[int, list[int]]:
    """Brute force: the least ``sequential_cost`` over every order, and an order reaching it."""
    best: tuple[int, list[int]] | None = None
    for perm in itertools.permutations(range(len(prompts))):
        cost = sequential_cost(prompts, capacity, perm)
        if best is None or cost < best[0]:
            best = (cost, list(perm))
    return best if best is not None else (0, [])


# ---------------------------------------------------------------- step simulation


@dataclass(eq=False)
class SimRequest:
    """A request for ``simulate_schedule``: a prompt, an output length and an arrival step."""

    prompt: torch.Tensor
    max_new_tokens: int = 1
    arrival: int = 0
    rid: str = ""
    admitted_step: int | None = field(default=None, compare=False)
    finished_step: int | None = field(default=None, compare=False)
    computed: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        self.prompt = as_ids(self.prompt, "prompt")

    @property
    def wait(self) -> int:
        """Steps from arrival to admission."""
        return -1 if self.admitted_step is None else self.admitted_step - self.arrival


@dataclass
class SimResult:
    """What ``simulate_schedule`` saw: requests (with steps and computed tokens), orders."""

    requests: list[SimRequest]
    admitted: list[str]
    finished: list[str]
    steps: int

    @property
    def computed(self) -> int:
        """Prompt tokens prefilled in total (counting duplicates a batch computed twice)."""
        return sum(r.computed for r in self.requests)


def simulate_schedule(requests: Sequence[SimRequest], capacity: int,
                      scheduler: str | Scheduler = "fcfs", token_budget: int = 2048,
                      batched: bool = True, on_step: Callable[[int], None] | None = None
                      ) -> SimResult:
    """Replay ``requests`` step by step through a scheduler and a cache, without a model.

    Each step: arrivals join the queue; the scheduler orders it; requests are admitted
    in that order while the step's ``token_budget`` of uncached tokens and the cache's
    ``capacity`` (prompt K/V only; running prompts stay locked) allow. ``batched``: the
    step's admissions are prefilled together (SGLang), so each sees only the cache as
    it was when the step began; otherwise each is inserted before the next is matched.
    Then every running request makes one token; finished ones unlock.
    """
    sched = make_scheduler(scheduler)
    reqs = list(requests)
    for r in reqs:
        if r.prompt.numel() > capacity:
            raise ScheduleError(f"request {r.rid!r} of {r.prompt.numel()} tokens does not "
                                f"fit a cache of {capacity}")
        r.admitted_step = r.finished_step = None
        r.computed = 0
    cache = RadixCache()
    pending = sorted(reqs, key=lambda r: r.arrival)
    waiting: list[SimRequest] = []
    running: dict[int, tuple[SimRequest, Any, int]] = {}
    admitted_ids, finished_ids = [], []
    step, slot = 0, 0

    def insert(r: SimRequest) -> Any:
        nonlocal slot
        m = cache.match_prefix(r.prompt)
        cache.lock(m.handle)
        need = r.prompt.numel() - m.cached_len
        over = cache.total_size + need - capacity
        if over > 0:
            cache.evict(over)
        fresh = torch.arange(slot, slot + need, dtype=torch.int64)
        slot += need
        res = cache.insert_prefix(r.prompt, torch.cat([m.indices, fresh]))
        cache.lock(res.handle)
        cache.unlock(m.handle)
        return res.handle

    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.pop(0))
        step_admitted: list[SimRequest] = []
        budget, planned = token_budget, 0
        for r in sched.order(waiting, cache):
            cached = _peek(cache, r)
            if sched.defers(r.prompt, cached, [a.prompt for a in step_admitted]):
                continue
            uncached = r.prompt.numel() - cached
            if step_admitted and uncached > budget:
                break
            if cache.protected_size + planned + uncached > capacity:
                break
            step_admitted.append(r)
            budget -= uncached
            r.computed, r.admitted_step = uncached, step
            if batched:
                planned += uncached
            else:
                running[id(r)] = (r, insert(r), 1)
        for r in step_admitted:
            waiting.remove(r)
            admitted_ids.append(r.rid)
            if batched:
                running[id(r)] = (r, None, 1)
        if batched:
            for r in step_admitted:
                running[id(r)] = (r, insert(r), 1)
        if not step_admitted and not running and waiting:  # pragma: no cover - guarded above
            raise ScheduleError("no waiting request fits an idle cache")
        for key, (r, handle, made) in list(running.items()):
            if r.admitted_step != step:
                made += 1
            if made >= r.max_new_tokens:
                cache.unlock(handle)
                r.finished_step = step
                finished_ids.append(r.rid)
                del running[key]
            else:
                running[key] = (r, handle, made)
        if on_step is not None:
            on_step(step)
        step += 1
    return SimResult(reqs, admitted_ids, finished_ids, step)
