"""Routers on replicas: a multi-tenant chat workload served by N in-process engines.

``minirt.router`` decides where a request goes from its text alone; this module runs
those decisions on real engines and counts what they cost. ``tenant_chats`` builds the
workload (several tenants, one system prompt each, many conversations dealt among them),
``make_replicas`` N ``Engine`` replicas sharing one model's weights, each with its own
pool, and ``replay_replicas`` serves the chats through a router, turn by turn with the
model's own answers, and reports per policy the prefill tokens computed (in all and on
the busiest replica), the hit rate and the spread of the router's queue lengths
(``RoutingReport``). ``chat_routing_text`` is the text SGLang's router matches for a
chat request.

Where it sits (BOOK.md s.4's layers): above the engine and the router, with the replay;
nothing below imports it.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .engine import Engine
from .errors import RouterError
from .request import Request
from .router import Router, check_int
from .workloads import support_chats

__all__ = [
    "RoutedRequest",
    "RoutingReport",
    "TenantChats",
    "chat_routing_text",
    "make_replicas",
    "replay_replicas",
    "tenant_chats",
]


@dataclass(frozen=True)
class TenantChats:
    """Chats of several tenants: one system prompt per tenant and, per conversation, its
    tenant and one user message per turn. ``replies``: canned assistant answers per turn
    (for traces sent without waiting for the model, as ``workloads.multi_turn_chat``);
    ``replay_replicas`` uses the model's own answers instead."""

    systems: list[str]
    tenant_of: list[int]
    users: list[list[str]]
    replies: list[list[str]] = field(default_factory=list, repr=False)

    @property
    def num_conversations(self) -> int:
        return len(self.users)

    @property
    def turns(self) -> int:
        return min(len(u) for u in self.users) if self.users else 0

    def canned_messages(self, conversation: int, turn: int) -> list[dict[str, str]]:
        """The messages of turn ``turn`` (from 0) with the canned replies as history."""
        messages = [{"role": "system", "content": self.systems[self.tenant_of[conversation]]}]
        for t in range(turn + 1):
            messages.append({"role": "user", "content": self.users[conversation][t]})
            if t < turn:
                messages.append({"role": "assistant",
                                 "content": self.replies[conversation][t]})
        return messages


_DESKS = ["Billing", "Returns", "Shipping", "Warranty", "Accounts", "Repairs", "Wholesale",
          "Gift cards"]


def tenant_chats(tokenizer, tenants: int = 4, conversations: int = 16, turns: int = 2,
                 system_tokens: int = 120, weights: Sequence[float] | None = None,
                 seed: int = 0) -> TenantChats:
    """``tenants`` support desks (``workloads.support_chats`` with a seed each, every
    system prompt opening with its desk's name) sharing ``conversations`` chats.

    ``weights``: the share of conversations per tenant (default equal); conversations
    are dealt in a seeded shuffle, so tenants interleave as concurrent users would.
    A skewed ``weights`` (say ``[8, 1, 1, 1]``) is where pure cache affinity piles one
    tenant's traffic onto one replica.
    """
    check_int("tenants", tenants, 1)
    check_int("conversations", conversations, 1)
    check_int("turns", turns, 1)
    weights = [1.0] * tenants if weights is None else list(weights)
    if len(weights) != tenants or any(not isinstance(w, (int, float)) or isinstance(w, bool)
                                      or not w >= 0 for w in weights) or not sum(weights) > 0:
        raise RouterError(f"weights must be {tenants} non-negative numbers with a positive "
                          f"sum, got {weights!r}")
    total = sum(weights)
    counts = [math.floor(conversations * w / total) for w in weights]
    for i in sorted(range(tenants), key=lambda i: -(conversations * weights[i] / total
                                                    - counts[i]))[:conversations - sum(counts)]:
        counts[i] += 1
    chats = [support_chats(tokenizer, max(c, 1), turns, system_tokens, seed * 1000 + t)
             for t, c in enumerate(counts)]
    order = [t for t, c in enumerate(counts) for _ in range(c)]
    random.Random(f"tenants-{seed}").shuffle(order)
    used = [0] * tenants
    users, replies = [], []
    for t in order:
        users.append(chats[t].users[used[t]])
        replies.append(chats[t].replies[used[t]])
        used[t] += 1
    systems = [f"{_DESKS[t % len(_DESKS)]} desk (tenant {t}). {c.system}"
               for t, c in enumerate(chats)]
    return TenantChats(systems, order, users, replies)


def chat_routing_text(messages: Sequence[dict[str, str]]) -> str:
    """The text SGLang's router matches for a chat request: the messages' contents
    joined by single spaces (no chat template, no roles)."""
    return " ".join(m["content"] for m in messages if m.get("content"))


# ---------------------------------------------------------------- replay on replicas


def make_replicas(model, tokenizer, n: int, capacity: int = 2048, **engine_kwargs) -> list:
    """``n`` engines sharing ``model``'s weights, each with its own pool of ``capacity``."""
    check_int("n", n, 1)
    return [Engine(model, tokenizer, capacity=capacity, **engine_kwargs) for _ in range(n)]


@dataclass
class RoutedRequest:
    """One served turn: where it went, why, and what the replica computed.

    ``prefill_wait``: the prefill tokens its replica computed from the moment it was
    routed until its own prefill was done, its own included: the work its first token
    waited for, a count that stands for TTFT (times a replica's cost per prefill token).
    """

    conversation: int
    tenant: int
    turn: int
    replica: int
    reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefill_wait: int = 0
    _mark: int = field(default=0, repr=False)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class RoutingReport:
    """A workload served through a router. ``spreads``: ``max - min`` of the router's
    in-flight counts at every routing decision; ``steps``: rounds of the replay loop
    (every replica with work steps once per round: a proxy for wall time)."""

    policy: str
    num_replicas: int
    requests: list[RoutedRequest]
    spreads: list[int]
    steps: int

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        """Prefill tokens computed over all replicas."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_spread(self) -> int:
        return max(self.spreads, default=0)

    @property
    def mean_spread(self) -> float:
        return sum(self.spreads) / len(self.spreads) if self.spreads else 0.0

    @property
    def per_replica(self) -> list[int]:
        """Requests each replica served."""
        counts = [0] * self.num_replicas
        for r in self.requests:
            counts[r.replica] += 1
        return counts

    @property
    def computed_per_replica(self) -> list[int]:
        """Prefill tokens each replica computed; the largest bounds how soon a run of
        parallel replicas can finish, so affinity that piles work on one replica shows
        here even when the total falls."""
        counts = [0] * self.num_replicas
        for r in self.requests:
            counts[r.replica] += r.computed_tokens
        return counts

    @property
    def reasons(self) -> dict[str, int]:
        """How many decisions each reason made."""
        out: dict[str, int] = {}
        for r in self.requests:
            out[r.reason] = out.get(r.reason, 0) + 1
        return out

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        """Output token ids by (conversation, turn)."""
        return {(r.conversation, r.turn): r.output_ids for r in self.requests}

    def summary(self) -> str:
        return (f"{self.policy:<16} computed {self.computed_tokens:>6} (busiest replica "
                f"{max(self.computed_per_replica)})  hit rate {self.hit_rate:.3f}  spread max "
                f"{self.max_spread} mean {self.mean_spread:.2f}  requests per replica "
                f"{self.per_replica}  steps {self.steps}")


def replay_replicas(engines: Sequence, router: Router, chats: TenantChats, *,
                    concurrency: int = 8, max_new_tokens: int = 4) -> RoutingReport:
    """Serve ``chats`` on ``engines`` (one per replica) through ``router``, greedily.

    At most ``concurrency`` conversations are open at once; each has one request in
    flight, and sends its next turn (the history so far, with the model's answers) as
    soon as the previous one finishes; a new conversation opens when one closes. Every
    round of the loop steps each replica that has work once. The router sees each
    request's ``chat_routing_text`` and, as a session id, its conversation.
    """
    if len(engines) != router.num_replicas:
        raise RouterError(f"{len(engines)} engines for a router of {router.num_replicas} "
                          "replicas")
    check_int("concurrency", concurrency, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    if any(e.has_work for e in engines):
        raise RouterError("the engines must be idle before a replay")
    histories = [[{"role": "system", "content": chats.systems[t]}] for t in chats.tenant_of]
    waiting = deque(range(chats.num_conversations))
    live: dict[str, tuple[int, RoutedRequest]] = {}  # rid -> (replica, record)
    records: list[RoutedRequest] = []
    spreads: list[int] = []
    computed = [0] * len(engines)  # prefill tokens each replica has computed so far
    open_convs = 0

    def send(conv: int, turn: int) -> None:
        history = histories[conv]
        history.append({"role": "user", "content": chats.users[conv][turn]})
        spreads.append(max(router.loads) - min(router.loads))
        replica = router.route(chat_routing_text(history), session=f"conversation-{conv}")
        rid = f"c{conv}t{turn}"
        try:
            engines[replica].submit(Request(messages=[dict(m) for m in history],
                                             max_new_tokens=max_new_tokens, rid=rid))
        except Exception:
            router.done(replica)  # the replica refused it: it is not in flight there
            raise
        rec = RoutedRequest(conv, chats.tenant_of[conv], turn, replica,
                            router.decisions[-1].reason, _mark=computed[replica])
        live[rid] = (replica, rec)
        records.append(rec)

    steps = 0
    while waiting or live:
        while waiting and open_convs < concurrency:
            open_convs += 1
            send(waiting.popleft(), 0)
        for replica, engine in enumerate(engines):
            if not engine.has_work:
                continue
            out = engine.step()
            computed[replica] += sum(len(h.lc.prompt) - h.lc.reused_len for h in out.admitted)
            for handle in out.admitted:
                _, rec = live[handle.rid]
                rec.prefill_wait = computed[replica] - rec._mark
            for handle in out.finished:
                _, rec = live.pop(handle.rid)
                result = handle.result
                rec.prompt_tokens = result.metrics.prompt_tokens
                rec.cached_tokens = result.metrics.cached_tokens
                rec.output_ids, rec.text = list(result.output_ids), result.text
                router.done(replica)
                histories[rec.conversation].append({"role": "assistant",
                                                    "content": result.text})
                if rec.turn + 1 < len(chats.users[rec.conversation]):
                    send(rec.conversation, rec.turn + 1)
                else:
                    open_convs -= 1
        steps += 1
    records.sort(key=lambda r: (r.conversation, r.turn))
    return RoutingReport(router.name, router.num_replicas, records, spreads, steps)
