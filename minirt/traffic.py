"""A production trace through the book's scheduler, host tier and routers, without a model.

Chapter 09b replays Mooncake's traces (``minirt.traces``) through what chapters 07, 09 and
09a built. Each piece here turns trace requests into what an earlier module already
takes, and counts what comes back; none adds a mechanism of its own:

* ``schedule_requests``: trace requests as ``scheduler.SimRequest``\\ s, arrival times cut
  into decode steps of ``step_ms`` milliseconds and each request decoding its
  ``output_length`` tokens, for ``scheduler.simulate_schedule``;
* ``replay_tiers``: prompts one at a time through a ``tiers.HiRadixCache`` (device pool
  plus host tier), counting device hits and tokens loaded back from the host;
* ``replay_routed``: prompts over ``N`` replicas, each its own ``RadixCache`` of a given
  capacity, chosen by a ``router.Router`` at arrival; a request stays in flight (the
  router's load) for ``output_length`` decode steps of ``ms_per_token``;
* ``routing_text``: the text a router sees for a trace request, one character per block.

Everything counts tokens of the prompts it is given; at ``block_size=1``
(``Trace.token_ids(1)``) a token is a 512-token block of the trace, so a capacity is in
blocks and a hit rate is a share of blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import RadixCache
from .errors import RequestError
from .pool import KVPool
from .router import Router
from .scheduler import SimRequest
from .tiers import HiRadixCache
from .traces import TraceRequest

__all__ = [
    "RoutedReplay",
    "TierReplay",
    "replay_routed",
    "replay_tiers",
    "routing_text",
    "schedule_requests",
    "serve_prompt",
]

# A block's character: code points from here on are neither surrogates nor private use.
_FIRST_CHAR = 0x10000


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name} must be a positive int, got {value!r}")
    return value


def _prompts(prompts: Sequence[Sequence[int]], capacity: int, what: str) -> list[list[int]]:
    out = [list(p) for p in prompts]
    for i, p in enumerate(out):
        if not p:
            raise RequestError(f"prompt {i} is empty")
        if len(p) > capacity:
            raise RequestError(f"prompt {i} of {len(p)} tokens does not fit {what} of "
                               f"{capacity}: its K/V must all be resident while it runs")
    return out


def schedule_requests(requests: Sequence[TraceRequest], *, block_size: int = 1,
                      step_ms: int = 50, output_scale: int = 1) -> list[SimRequest]:
    """Trace requests as ``SimRequest``\\ s for ``scheduler.simulate_schedule``.

    ``arrival``: the request's timestamp, from the first request's, in whole steps of
    ``step_ms`` ms (requests in the same step arrive together: a burst).
    ``max_new_tokens``: ``ceil(output_length / output_scale)`` decode steps (1 keeps the
    trace's lengths; more shortens every request alike, to replay faster). ``rid``: the
    request's index in ``requests``.
    """
    _positive("step_ms", step_ms)
    _positive("output_scale", output_scale)
    if not requests:
        return []
    start = requests[0].timestamp_ms
    return [SimRequest(torch.tensor(r.token_ids(block_size), dtype=torch.int64),
                       max_new_tokens=-(-r.output_length // output_scale),
                       arrival=(r.timestamp_ms - start) // step_ms, rid=str(i))
            for i, r in enumerate(requests)]


def serve_prompt(cache: RadixCache, ids: Sequence[int], capacity: int, next_slot: int) -> int:
    """One request on a cache of ``capacity`` tokens without a model: match, lock, evict just
    enough for the uncached part, insert it under fresh slots, unlock (as
    ``simulate.simulate`` does per request). Returns the next fresh slot number."""
    t = torch.tensor(ids, dtype=torch.int64)
    match = cache.match_prefix(t)
    cache.lock(match.handle)
    need = len(ids) - match.cached_len
    overflow = cache.total_size + need - capacity
    if overflow > 0:
        cache.evict(overflow)
    fresh = torch.arange(next_slot, next_slot + need, dtype=torch.int64)
    cache.insert_prefix(t, torch.cat([match.indices, fresh]))
    cache.unlock(match.handle)
    return next_slot + need


@dataclass(frozen=True)
class TierReplay:
    """What ``replay_tiers`` counted: prompt tokens, device hits, tokens loaded back."""

    prompt_tokens: int
    device_hits: int
    loaded: int

    @property
    def computed(self) -> int:
        """Tokens neither tier held: what prefill computed."""
        return self.prompt_tokens - self.device_hits - self.loaded

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens not computed (device hits and load-backs)."""
        return 1 - self.computed / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_tiers(prompts: Sequence[Sequence[int]], device_capacity: int,
                 host_capacity: int | None = None,
                 write_policy: str = "write_back") -> TierReplay:
    """Prompts one at a time through a device pool of ``device_capacity`` tokens, with a host
    tier of ``host_capacity`` tokens under it (``tiers.HiRadixCache``), or none (None).

    Per prompt: match (a longer prefix on the host is loaded back, evicting device leaves
    if it must), lock, make room for the rest, insert it, unlock. The pool holds one
    number per token (1 layer, 1 head of size 1): only the counts matter here.
    """
    _positive("device_capacity", device_capacity)
    todo = _prompts(prompts, device_capacity, "a device pool")
    pool = KVPool(1, 1, 1, device_capacity)
    cache: RadixCache
    if host_capacity is None:
        cache = RadixCache()
    else:
        cache = HiRadixCache(pool, host_capacity, write_policy=write_policy)
    total = device = loaded = 0
    for ids in todo:
        t = torch.tensor(ids, dtype=torch.int64)
        m = cache.match_prefix(t)
        cache.lock(m.handle)
        gap = len(ids) - m.cached_len
        short = gap - pool.num_free
        if short > 0:
            pool.free(cache.evict(short))
        slots = pool.alloc(gap)
        cache.insert_prefix(t, torch.cat([m.indices, slots]))
        cache.unlock(m.handle)
        got = getattr(m, "loaded_len", 0)
        total, device, loaded = total + len(ids), device + m.cached_len - got, loaded + got
    return TierReplay(total, device, loaded)


def routing_text(request: TraceRequest) -> str:
    """The text a router sees for ``request``: one character per block, equal blocks equal
    characters, so the router's character match rate is the share of blocks matched."""
    return "".join(chr(_FIRST_CHAR + h) for h in request.hash_ids)


@dataclass(frozen=True)
class RoutedReplay:
    """What ``replay_routed`` counted, in tokens of the prompts, and the router's loads."""

    router: str
    prompt_tokens: int
    hit_tokens: int
    requests_per_replica: tuple[int, ...]
    max_spread: int  # the largest max - min of the loads any routing decision saw

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_routed(requests: Sequence[TraceRequest], router: Router, capacity: int, *,
                  block_size: int = 1, ms_per_token: int = 30) -> RoutedReplay:
    """Trace requests in arrival order over ``router.num_replicas`` replicas, each a
    ``RadixCache`` of ``capacity`` tokens, the replica chosen by ``router``.

    At each arrival, the requests that have finished by then are reported ``done``
    (a request runs ``output_length * ms_per_token`` ms from its arrival), then the request
    is routed (``routing_text``) and served on its replica at once (``serve_prompt``).
    Prefill time is left out: only the order of arrivals and finishes matters.
    """
    _positive("capacity", capacity)
    _positive("ms_per_token", ms_per_token)
    prompts = _prompts([r.token_ids(block_size) for r in requests], capacity, "a replica")
    n = router.num_replicas
    caches = [RadixCache() for _ in range(n)]
    slots = [0] * n
    running: list[tuple[int, int, int]] = []  # (finish ms, index, replica)
    total = 0
    first = len(router.decisions)
    for i, (r, ids) in enumerate(zip(requests, prompts, strict=True)):
        while running and running[0][0] <= r.timestamp_ms:
            router.done(heapq.heappop(running)[2])
        k = router.route(routing_text(r))
        slots[k] = serve_prompt(caches[k], ids, capacity, slots[k])
        heapq.heappush(running, (r.timestamp_ms + r.output_length * ms_per_token, i, k))
        total += len(ids)
    for _, _, k in running:
        router.done(k)
    decisions = router.decisions[first:]
    per = [0] * n
    for d in decisions:
        per[d.replica] += 1
    spread = max((max(d.loads) - min(d.loads) for d in decisions), default=0)
    hits = sum(c.stats.hit_tokens for c in caches)
    return RoutedReplay(router.name, total, hits, tuple(per), spread)
