"""Routing requests across engine replicas: SGLang's cache-aware router and its baselines.

One engine's prefix cache helps only the requests that reach it. With N replicas, each
with its own pool, the router decides how much of that reuse survives: send a tenant's
requests to the replica that already holds its system prompt and the prefix is computed
once; spread them round-robin and every replica computes it again.

``CacheAwareRouter`` is the cache-aware policy of SGLang's router (PyPI ``sglang-router``,
version 0.3.2, a Rust binary), read from its source: sglang-router 0.3.2
`src/policies/cache_aware.rs: CacheAwarePolicy` and
sglang-router 0.3.2 `src/policies/tree.rs: Tree`, with the defaults of
sglang-router 0.3.2 `src/sglang_router/router_args.py: RouterArgs`:

* the router never sees a replica's cache. It keeps an *approximate* radix tree over
  the **text** (characters, not token ids) of the requests it routed: one tree per
  model, whose nodes record which replicas ("tenants") were sent them (``ApproxTree``);
* load is its own count of requests in flight per replica (``route`` adds one,
  ``done`` removes it);
* if ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``
  over the loads, the request goes to the least-loaded replica (shortest queue);
* otherwise the match rate is matched characters / request characters of the longest
  prefix in the tree; above ``cache_threshold`` (strictly) the request goes to a replica
  holding that prefix, else to the least-loaded replica. Ties between loads go to the
  lowest index (Rust's ``min_by_key`` keeps the first minimum);
* the request's text is then inserted under the chosen replica. The real router cuts
  each tenant's part of the tree back to ``max_tree_size`` characters on a timer, every
  ``eviction_interval_secs`` (60 by default), evicting least recently used leaves.

The functions read are ``CacheAwarePolicy`` (``select_worker``,
``select_worker_min_load``, ``evict_cache``) and ``Tree`` (``insert``,
``prefix_match_with_counts``, ``evict_tenant_by_size``); ``tools/router_demo.py`` checks
this module against the wheel itself. Where this module is simpler: a match reports
the first replica that reached the matched node (the real tree caches that one too, and
falls back to a hash-map's order); every match refreshes the node's access time (the
real one, 1 match in 8); eviction runs every ``evict_every`` requests, not on a timer;
"lowest index" means the real router's own worker order (its ``GET /workers``), which
need not be the order of ``--worker-urls``.

Baselines with the same interface: ``RoundRobinRouter``, ``RandomRouter`` (seeded),
``LeastLoadRouter`` and ``ConsistentHashRouter`` (a hash ring on a session id).

Where it sits (BOOK.md s.4's layers): above serve, beside the replay. A router sees only
the text of the requests it routes and its own in-flight counts, so this module imports
no engine, cache or model; ``minirt.replicas`` runs the routers on in-process engines.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import RouterError

__all__ = [
    "DEFAULTS",
    "ROUTING_POLICIES",
    "ApproxTree",
    "CacheAwareRouter",
    "ConsistentHashRouter",
    "Decision",
    "LeastLoadRouter",
    "RandomRouter",
    "RoundRobinRouter",
    "Router",
    "TreeMatch",
    "check_int",
    "make_router", "register_policy",
]

# The defaults of sglang-router 0.3.2 (RouterArgs in src/sglang_router/router_args.py).
DEFAULTS: dict[str, float | int] = {
    "cache_threshold": 0.3,
    "balance_abs_threshold": 64,
    "balance_rel_threshold": 1.5,
    "max_tree_size": 2**26,
}

ROUTING_POLICIES = ("cache_aware", "round_robin", "random", "least_load", "consistent_hash")


# ---------------------------------------------------------------- the approximate tree


class _Node:
    """A node of the approximate tree: ``text`` (characters), children by first character,
    and, per tenant holding it, the tick of that tenant's last access (0: only passed
    through). Tenants keep insertion order: the first is the one a match reports."""

    __slots__ = ("text", "children", "tenants", "parent", "id")
    _ids = itertools.count()

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.tenants: dict[int, int] = {}
        self.parent = parent
        self.id = next(_Node._ids)


@dataclass(frozen=True)
class TreeMatch:
    """The longest prefix of a text found in the tree: the tenant holding it (``None`` if
    nothing matched), characters matched and characters in the text."""

    tenant: int | None
    matched_chars: int
    input_chars: int

    @property
    def rate(self) -> float:
        """matched / input characters (0.0 for an empty text), as the router computes it."""
        return self.matched_chars / self.input_chars if self.input_chars else 0.0


class ApproxTree:
    """The router's multi-tenant radix tree over request text (the router's Rust ``Tree``).

    One tree for all replicas: each node records which tenants (replica indices) sent a
    text through it. ``size(t)`` is the characters of all nodes tenant ``t`` holds, the
    quantity ``max_tree_size`` bounds. It stores no K/V and knows nothing of what a
    replica evicted: it is the router's guess of each replica's cache.
    """

    def __init__(self) -> None:
        self.root = _Node("", None)
        self._size: dict[int, int] = {}
        self._tick = 0

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def size(self, tenant: int) -> int:
        """Characters held for ``tenant`` (0 if it never inserted anything)."""
        return self._size.get(tenant, 0)

    @property
    def tenants(self) -> list[int]:
        """Every tenant the tree has seen (the root holds them all)."""
        return sorted(self.root.tenants)

    def _hold(self, node: _Node, tenant: int) -> None:
        if tenant not in node.tenants:
            node.tenants[tenant] = 0
            self._size[tenant] += len(node.text)

    def insert(self, text: str, tenant: int) -> None:
        """Record that ``tenant`` received ``text``: add the missing suffix as a leaf,
        splitting a node where the text leaves it, and mark every node on the path."""
        self.root.tenants.setdefault(tenant, 0)
        self._size.setdefault(tenant, 0)
        node, rest = self.root, text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                leaf = _Node(rest, node)
                leaf.tenants[tenant] = self._next_tick()
                self._size[tenant] += len(rest)
                node.children[rest[0]] = leaf
                return
            shared = _shared_prefix(rest, child.text)
            if shared < len(child.text):
                child = self._split(node, child, shared)
            self._hold(child, tenant)
            node, rest = child, rest[shared:]
        node.tenants[tenant] = self._next_tick()

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int) -> _Node:
        """A new node for ``child.text[:at]`` between ``parent`` and ``child``; it holds the
        same tenants (same order) as ``child`` and costs no tenant any size."""
        mid = _Node(child.text[:at], parent)
        mid.tenants = dict(child.tenants)
        child.text = child.text[at:]
        child.parent = mid
        mid.children[child.text[0]] = child
        parent.children[mid.text[0]] = mid
        return mid

    def prefix_match(self, text: str) -> TreeMatch:
        """Walk down ``text`` as far as the tree goes (a partly matched node counts for the
        characters it shares) and report that node's first tenant; refreshes its access."""
        node, rest, matched = self.root, text, 0
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            shared = _shared_prefix(rest, child.text)
            matched += shared
            node = child
            if shared < len(child.text):
                break
            rest = rest[shared:]
        tenant = next(iter(node.tenants), None) if node is not self.root else None
        if tenant is not None:
            node.tenants[tenant] = self._next_tick()
        return TreeMatch(tenant, matched, len(text))

    def _holds_below(self, node: _Node, tenant: int) -> bool:
        return any(tenant in c.tenants for c in node.children.values())

    def _drop(self, node: _Node, tenant: int) -> None:
        del node.tenants[tenant]
        self._size[tenant] -= len(node.text)
        if not node.children and not node.tenants and node.parent is not None:
            del node.parent.children[node.text[0]]

    def evict_tenant_by_size(self, max_size: int) -> int:
        """Cut every tenant down to ``max_size`` characters; returns characters evicted.

        As the router does: all (tenant, leaf) pairs in one heap by last access, oldest
        first; a tenant already within the limit is skipped; a parent whose last child
        of that tenant went becomes that tenant's leaf. Ties: lower tenant, older node.
        """
        heap: list[tuple[int, int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            for tenant, tick in node.tenants.items():
                if not self._holds_below(node, tenant):
                    heap.append((tick, tenant, node.id, node))
        heapq.heapify(heap)
        evicted = 0
        while heap:
            _, tenant, _, node = heapq.heappop(heap)
            if self._size[tenant] <= max_size:
                continue
            if tenant not in node.tenants or self._holds_below(node, tenant):
                continue
            evicted += len(node.text)
            parent = node.parent
            self._drop(node, tenant)
            if parent is not self.root and tenant in parent.tenants \
                    and not self._holds_below(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], tenant, parent.id, parent))
        return evicted

    def remove_tenant(self, tenant: int) -> None:
        """Forget everything ``tenant`` holds (a replica that left)."""
        stack = [self.root]
        order = []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents
            if node is not self.root and tenant in node.tenants:
                self._drop(node, tenant)
        self.root.tenants.pop(tenant, None)
        self._size.pop(tenant, None)

    def num_nodes(self) -> int:
        """Nodes below the root."""
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def text(self, width: int = 24) -> str:
        """The tree as indented lines, children in key order: each node's text (cut to
        ``width`` characters) and the tenants (replicas) holding it."""
        lines: list[str] = []

        def walk(node: _Node, depth: int) -> None:
            for key in sorted(node.children):
                child = node.children[key]
                shown = child.text if len(child.text) <= width else child.text[:width - 3] + "..."
                lines.append(f"{'  ' * depth}{shown!r} tenants {sorted(child.tenants)}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Sizes equal the held characters; every tenant of a node holds its parent; no
        empty leaf; children keyed by their first character. AssertionError if not."""
        sizes: dict[int, int] = dict.fromkeys(self._size, 0)
        stack = list(self.root.children.items())
        while stack:
            key, node = stack.pop()
            assert node.text and node.text[0] == key, f"child keyed {key!r} holds {node.text!r}"
            assert node.tenants or node.children, f"node {node.text[:20]!r} holds nothing"
            for tenant in node.tenants:
                assert node.parent is self.root or tenant in node.parent.tenants, \
                    f"tenant {tenant} holds {node.text[:20]!r} but not its parent"
                sizes[tenant] = sizes.get(tenant, 0) + len(node.text)
            stack.extend(node.children.items())
        assert sizes == self._size, f"sizes {self._size} but nodes hold {sizes}"


def _shared_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---------------------------------------------------------------- routers


@dataclass(frozen=True)
class Decision:
    """One routing decision: the replica, why, and the state it was made in.

    ``reason``: "imbalanced" (shortest queue), "cache_hit" (match rate above the
    threshold), "low_match" (least loaded) for the cache-aware router; the policy's name
    for the baselines. ``loads``: in-flight requests per replica before this one.
    """

    replica: int
    reason: str
    loads: tuple[int, ...]
    match_rate: float | None = None


class Router:
    """What every routing policy offers: ``route`` a request, ``done`` when it finishes.

    ``loads[i]`` is the number of requests routed to replica ``i`` and not yet done (the
    router's own count, as SGLang's router keeps it). ``set_healthy`` takes a replica
    out of (or back into) rotation. ``decisions`` keeps every decision, in order.
    """

    name = "router"

    def __init__(self, num_replicas: int) -> None:
        check_int("num_replicas", num_replicas, 1)
        self.num_replicas = num_replicas
        self.loads = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self.decisions: list[Decision] = []

    def _healthy(self) -> list[int]:
        ids = [i for i in range(self.num_replicas) if self.healthy[i]]
        if not ids:
            raise RouterError("no healthy replica to route to")
        return ids

    def _least_loaded(self) -> int:
        return min(self._healthy(), key=lambda i: self.loads[i])

    def _pick(self, text: str, session: str | None) -> Decision:
        raise NotImplementedError

    def route(self, text: str, session: str | None = None) -> int:
        """Choose a replica for a request with prompt ``text`` (``session``: a key that
        consistent hashing keeps together); counts the request as in flight there."""
        if not isinstance(text, str):
            raise RouterError(f"route() takes the request's text, got {type(text).__name__}")
        if session is not None and not isinstance(session, str):
            raise RouterError(f"session must be a str or None, got {session!r}")
        decision = self._pick(text, session)
        self.loads[decision.replica] += 1
        self.decisions.append(decision)
        return decision.replica

    def done(self, replica: int) -> None:
        """A request routed to ``replica`` finished (or failed): one fewer in flight."""
        self._check_replica(replica)
        if self.loads[replica] == 0:
            raise RouterError(f"done({replica}) without a request in flight there")
        self.loads[replica] -= 1

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Mark ``replica`` (un)healthy: unhealthy replicas get no new requests."""
        self._check_replica(replica)
        self.healthy[replica] = bool(healthy)

    def _check_replica(self, replica: int) -> None:
        if isinstance(replica, bool) or not isinstance(replica, int) \
                or not 0 <= replica < self.num_replicas:
            raise RouterError(f"replica must be an int in [0, {self.num_replicas}), "
                              f"got {replica!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas={self.num_replicas}, loads={self.loads})"


class RoundRobinRouter(Router):
    """Replicas in turn (a counter modulo the healthy replicas, as SGLang's round_robin)."""

    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._count = 0

    def _pick(self, text: str, session: str | None) -> Decision:
        ids = self._healthy()
        replica = ids[self._count % len(ids)]
        self._count += 1
        return Decision(replica, self.name, tuple(self.loads))


class RandomRouter(Router):
    """A uniformly random healthy replica from a generator seeded by ``seed``."""

    name = "random"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        check_int("seed", seed)
        self._rng = random.Random(seed)

    def _pick(self, text: str, session: str | None) -> Decision:
        return Decision(self._rng.choice(self._healthy()), self.name, tuple(self.loads))


class LeastLoadRouter(Router):
    """The replica with the fewest requests in flight (ties: lowest index)."""

    name = "least_load"

    def _pick(self, text: str, session: str | None) -> Decision:
        return Decision(self._least_loaded(), self.name, tuple(self.loads))


def _hash64(key: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHashRouter(Router):
    """A hash ring: ``virtual_nodes`` points per replica; a session goes to the first
    point clockwise of its hash that belongs to a healthy replica. Requests without a
    session hash their text. Taking a replica out moves only the sessions it held."""

    name = "consistent_hash"

    def __init__(self, num_replicas: int, virtual_nodes: int = 160) -> None:
        super().__init__(num_replicas)
        check_int("virtual_nodes", virtual_nodes, 1)
        ring = sorted((_hash64(f"replica-{r}#{v}"), r)
                      for r in range(num_replicas) for v in range(virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def _pick(self, text: str, session: str | None) -> Decision:
        self._healthy()
        start = bisect_right(self._points, _hash64(text if session is None else session))
        for k in range(len(self._points)):
            owner = self._owners[(start + k) % len(self._points)]
            if self.healthy[owner]:
                return Decision(owner, self.name, tuple(self.loads))
        raise AssertionError("unreachable: a healthy replica owns ring points")


class CacheAwareRouter(Router):
    """SGLang's cache-aware policy (sglang-router 0.3.2); see the module docstring.

    ``cache_threshold`` in [0, 1]: the match rate a replica's tree must exceed to win the
    request. ``balance_abs_threshold`` (>= 0, requests) and ``balance_rel_threshold``
    (>= 1): both must be exceeded for the loads to count as imbalanced.
    ``max_tree_size``: characters each replica's tree keeps; the trees are cut back every
    ``evict_every`` routed requests (the real router does it on a timer,
    ``--eviction-interval-secs``, default 60 s).
    """

    name = "cache_aware"

    def __init__(self, num_replicas: int,
                 cache_threshold: float = DEFAULTS["cache_threshold"],
                 balance_abs_threshold: int = DEFAULTS["balance_abs_threshold"],
                 balance_rel_threshold: float = DEFAULTS["balance_rel_threshold"],
                 max_tree_size: int = DEFAULTS["max_tree_size"],
                 evict_every: int = 1) -> None:
        super().__init__(num_replicas)
        check_number("cache_threshold", cache_threshold, 0.0, 1.0)
        check_int("balance_abs_threshold", balance_abs_threshold, 0)
        check_number("balance_rel_threshold", balance_rel_threshold, 1.0)
        check_int("max_tree_size", max_tree_size, 1)
        check_int("evict_every", evict_every, 1)
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = max_tree_size
        self.evict_every = evict_every
        self.tree = ApproxTree()
        for replica in range(num_replicas):  # the router seeds every worker with ""
            self.tree.insert("", replica)
        self.evicted_chars = 0
        self._routed = 0

    def imbalanced(self, loads: Sequence[int] | None = None) -> bool:
        """The router's test: ``max - min > abs`` and ``max > rel * min`` (all replicas)."""
        loads = self.loads if loads is None else loads
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _pick(self, text: str, session: str | None) -> Decision:
        loads = tuple(self.loads)
        healthy = self._healthy()
        if self.imbalanced():
            replica = self._least_loaded()
            self._record(text, replica)
            return Decision(replica, "imbalanced", loads)
        match = self.tree.prefix_match(text)
        rate = match.rate
        if rate > self.cache_threshold:
            if match.tenant is not None and self.healthy[match.tenant]:
                replica, reason = match.tenant, "cache_hit"
            else:  # the real router forgets the dead tenant and takes the first healthy
                if match.tenant is not None:
                    self.tree.remove_tenant(match.tenant)
                return Decision(healthy[0], "fallback", loads, rate)
        else:
            replica, reason = self._least_loaded(), "low_match"
        self._record(text, replica)
        return Decision(replica, reason, loads, rate)

    def _record(self, text: str, replica: int) -> None:
        self.tree.insert(text, replica)
        self._routed += 1
        if self._routed % self.evict_every == 0:
            self.evicted_chars += self.tree.evict_tenant_by_size(self.max_tree_size)

    def tree_sizes(self) -> list[int]:
        """Characters the router's tree holds per replica."""
        return [self.tree.size(r) for r in range(self.num_replicas)]

    def __repr__(self) -> str:
        return (f"CacheAwareRouter(num_replicas={self.num_replicas}, cache_threshold="
                f"{self.cache_threshold}, balance_abs_threshold={self.balance_abs_threshold}, "
                f"balance_rel_threshold={self.balance_rel_threshold}, max_tree_size="
                f"{self.max_tree_size}, loads={self.loads})")


_ROUTERS: dict[str, type[Router]] = {
    "cache_aware": CacheAwareRouter, "round_robin": RoundRobinRouter,
    "random": RandomRouter, "least_load": LeastLoadRouter,
    "consistent_hash": ConsistentHashRouter,
}


def make_router(policy: str, num_replicas: int, **settings: Any) -> Router:
    """A router by policy name (one of ``ROUTING_POLICIES``, or one another module added
    with ``register_policy``: importing ``minirt.precise_router`` adds ``"precise"``) with
    its settings."""
    factory = _ROUTERS.get(policy) or _REGISTERED.get(policy)
    if factory is None:
        raise RouterError(f"unknown routing policy {policy!r}; choose one of "
                          f"{', '.join([*ROUTING_POLICIES, *_REGISTERED])}")
    try:
        return factory(num_replicas, **settings)
    except TypeError as exc:
        raise RouterError(f"bad settings for {policy!r}: {exc}") from exc


# Policies of modules that build on this one (which therefore cannot be imported here).
_REGISTERED: dict[str, Any] = {}


def register_policy(name: str, factory: Any) -> None:
    """Let ``make_router(name, n, **settings)`` build ``factory(n, **settings)``; a name
    already taken by a different factory is refused."""
    if not isinstance(name, str) or not name:
        raise RouterError(f"a policy name must be a non-empty str, got {name!r}")
    taken = _ROUTERS.get(name) or _REGISTERED.get(name)
    if taken is not None and taken is not factory:
        raise RouterError(f"routing policy {name!r} is taken by {taken!r}")
    if not callable(factory):
        raise RouterError(f"the factory of {name!r} must be callable, got {factory!r}")
    _REGISTERED[name] = factory


def check_int(name: str, value: Any, low: int | None = None) -> None:
    """RouterError unless ``value`` is an int (not a bool), at least ``low`` if given."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or (low is not None and value < low):
        raise RouterError(f"{name} must be an int{f' >= {low}' if low is not None else ''}, "
                          f"got {value!r}")


def check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """RouterError unless ``value`` is a finite int or float (not a bool) in [low, high]."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value) and value >= low and (high is None or value <= high)
    if not ok:
        where = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RouterError(f"{name} must be a finite number {where}, got {value!r}")
