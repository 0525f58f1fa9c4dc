"""The precise router: route by what the replicas say they cache, not by what was sent.

Chapter 09a's ``CacheAwareRouter`` keeps an approximate tree of the text it routed and
trims it on its own schedule; it cannot see a replica evict, restart or serve a request
another router sent. Here every replica publishes KV cache events (``minirt.kv_events``,
vLLM 0.32's format and transport), and the router keeps

* ``BlockIndex``: block hash -> the replicas holding it (counted: a hash cache without
  dedup can hold one hash twice and removes it once per block);
* ``KVEventSubscriber``: one ZMQ SUB socket per replica, each batch's sequence number
  checked against the last one applied (``ReplicaFeed``):

  - the next number: applied;
  - a jump ahead (a gap, or a router that starts late): the missing batches are asked
    for on the replica's replay socket, as vllm 0.32.0
    `distributed/kv_events.py: ZmqEventPublisher._service_replay` serves them; if the
    replica's buffer no longer holds them, that replica's index is dropped and rebuilt
    from everything the buffer holds (``partial_rebuilds`` counts rebuilds whose buffer
    did not reach back to batch 0); without a replay socket the index is dropped and
    rebuilt from the next events only;
  - a number at or below one already received on the socket: the publisher started
    over, i.e. the replica restarted with an empty cache: its index is dropped and
    rebuilt from the new publisher's batches (replayed from 0 when it can).

  A replica's connection closing (ZMQ's socket monitor reports ``EVENT_DISCONNECTED``
  on its SUB socket: its process exited, or the network between dropped the
  connection) drops its index at the next poll, after the batches the old connection
  delivered: the replica may have gone with its cache. Its next batch is then a first
  one, caught up from the replay socket like a late start. A host that vanishes
  without closing the connection is not noticed this way (ZMQ's heartbeat options,
  not set here, would be the tool).

  Batches or events that cannot be read, events for another medium (``"CPU"``) or block
  size, and removals of hashes the index does not hold are counted and ignored.
* ``Speculation``: the blocks of requests the router sent to a replica, until its
  ``BlockStored`` confirms them or no request the router sent there is in flight;
  ``StoreHistory``: block hash -> the replica that last stored it, kept after removal
  (bounded). Both live in the ``BlockIndex``.
* ``PreciseRouter``: the request's block hashes (``kv_events.vllm_block_hashes`` at the
  replicas' block size, over the prompt but its last token, as vLLM caps a hit), the
  longest leading run of them each replica holds (continued through its expected blocks
  when ``speculative``, the default), and chapter 09a's rule with the run in place of
  the tree's match: loads imbalanced -> least loaded; else matched tokens / prompt
  tokens above ``cache_threshold`` -> the replica with the longest run (ties: least
  loaded, then lowest index); else, with ``affinity`` (off by default), the replica that
  last stored the deepest of the request's blocks ever stored (``"affinity"``); else
  least loaded (``"low_match"``). ``affinity=False, speculative=False`` is 09a's rule.
* ``OracleRouter``: the same rule reading each replica's cache directly
  (``peek_prefix_len``), its speculation and history following the caches' own events
  (``observe``): the upper bound no deployed router has.

Why the speculation. Events say what a replica stored, and a replica stores a prompt's
blocks only when it prefills it: between routing a request and that event the router
would not know that a tenant's second request belongs where its first went, and sends it
elsewhere (the tree credits a replica the moment it routes there). llm-d's precise
scorer closes the same gap with speculative entries written at routing time
("speculativeIndexing", off by default, entries living ``speculativeTTL``, 2 s by default:
llm-d/llm-d-inference-scheduler, pkg/epp/framework/plugins/scheduling/scorer/
preciseprefixcache/README.md, read at commit 520af478). Here an entry lives until the
event confirms it or the replica has nothing of this router's in flight (no clock, so a
run is deterministic); an entry a failed request leaves lasts until then. Blocks the
replica held when the request was routed are expected too: a request still waiting for
its prefill has not locked them, the replica may evict them meanwhile (the index then
drops them), and its prefill stores them again; until then they stay credited where the
request went, as the tree would credit them.

Why affinity is off. It keeps a request no replica holds where its prefix last was, as
the tree does when it credits a replica that has evicted; a choice neither production
router makes: NVIDIA Dynamo prices a worker as its prefill blocks left after the cached
overlap (scaled) plus its decode blocks and active requests (ai-dynamo/dynamo
lib/kv-router/src/scheduling/selector/default.rs, worker_logit, read at commit 07a6c9c),
load alone when nothing overlaps, ties at random (minimum_cost_index); llm-d's
no-hit-lru-scorer scores highest, for a request with no hit, the pod least recently
given one, "to evenly distribute cache growth" (scorer/nohitlru/README.md, same commit
as above); SGLang's router takes the least-loaded worker
on a match at or below ``cache_threshold`` (sglang-router 0.3.2
`src/policies/cache_aware.rs: CacheAwarePolicy`, in ``select_worker``; its header comment
says "smallest tree size"). ``benchmarks/kv_routing.py`` measures both steps.

A restart is seen twice over: the connection closes when the old process exits (the
index is dropped then), and the new publisher's numbers start again from 0. vLLM's
batches carry no publisher epoch, so without the first signal a router that misses every
batch of a restarted replica until its numbers pass the old ones could not tell; the
closed connection is the epoch boundary here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import RouterError
from .hashcache import block_hashes as chained_block_hashes
from .kv_event_caches import cached_vllm_sha256
from .kv_events import (
    END_SEQ,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventError,
    decode_batch,
    external_block_hash,
    none_hash,
)
from .router import (
    DEFAULTS,
    CacheAwareRouter,
    Decision,
    Router,
    check_int,
    check_number,
    register_policy,
)

__all__ = ["BlockIndex", "EventSource", "FeedStats", "KVEventSubscriber", "OracleRouter",
           "PreciseRouter", "ReplicaFeed", "Speculation", "StoreHistory",
           "request_block_hashes"]


def request_block_hashes(ids: Sequence[int], block_size: int, salt: str | None = None,
                         seed: str | None = None) -> list[int]:
    """The event ints of vLLM's hashes of the full blocks of ``ids``."""
    hashes = chained_block_hashes([int(t) for t in ids], block_size, none_hash(seed),
                                  cached_vllm_sha256, salt)
    return [external_block_hash(bytes(h)) for h in hashes]


# ---------------------------------------------------------------- the index


class StoreHistory:
    """Block hash -> the replica that most recently stored it, kept after removal.

    ``capacity``: hashes remembered (0: none); past it the least recently stored go
    first. ``home(hashes)``: the replica that last stored the deepest of ``hashes`` it
    remembers (None: none remembered).
    """

    def __init__(self, capacity: int = 1 << 20) -> None:
        check_int("capacity", capacity, 0)
        self.capacity = capacity
        self._last: OrderedDict[int | bytes, int] = OrderedDict()

    def stored(self, replica: int, hashes: Sequence[int | bytes]) -> None:
        if not self.capacity:
            return
        for h in hashes:
            self._last[h] = replica
            self._last.move_to_end(h)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def home(self, hashes: Sequence[int | bytes]) -> int | None:
        for h in reversed(hashes):
            replica = self._last.get(h)
            if replica is not None:
                return replica
        return None

    def __len__(self) -> int:
        return len(self._last)


class Speculation:
    """Blocks a router expects replicas to hold: those of the requests it routed there,
    held already or to be stored by their prefill. One goes when the replica's
    ``BlockStored`` confirms it (``confirm``), or when no request of this router is in
    flight there any more or the replica was cleared (``drop``). ``extend(runs, hashes)``:
    each replica's run of ``hashes`` continued through its expected blocks."""

    def __init__(self, num_replicas: int) -> None:
        self._sets: list[set[int | bytes]] = [set() for _ in range(num_replicas)]

    def add(self, replica: int, hashes: Sequence[int | bytes]) -> None:
        self._sets[replica].update(hashes)

    def confirm(self, replica: int, hashes: Sequence[int | bytes]) -> None:
        self._sets[replica].difference_update(hashes)

    def drop(self, replica: int) -> None:
        self._sets[replica].clear()

    def extend(self, runs: Sequence[int], hashes: Sequence[int | bytes]) -> list[int]:
        out = []
        for replica, run in enumerate(runs):
            expected = self._sets[replica]
            while run < len(hashes) and hashes[run] in expected:
                run += 1
            out.append(run)
        return out

    def size(self, replica: int) -> int:
        return len(self._sets[replica])


class BlockIndex:
    """Block hash -> {replica: how many blocks with that hash it holds}; ``history``: a
    ``StoreHistory`` of ``history_size`` hashes, fed by ``stored``; ``speculation``: the
    blocks its router expects (``Speculation``), confirmed by ``stored``, dropped by
    ``clear``."""

    def __init__(self, num_replicas: int, history_size: int = 1 << 20) -> None:
        check_int("num_replicas", num_replicas, 1)
        self.num_replicas = num_replicas
        self._where: dict[int | bytes, Counter[int]] = {}
        self._held: list[Counter[int | bytes]] = [Counter() for _ in range(num_replicas)]
        self.unknown_removals = 0
        self.history = StoreHistory(history_size)
        self.speculation = Speculation(num_replicas)

    def _check(self, replica: int) -> None:
        if isinstance(replica, bool) or not isinstance(replica, int) \
                or not 0 <= replica < self.num_replicas:
            raise RouterError(f"replica must be an int in [0, {self.num_replicas}), "
                              f"got {replica!r}")

    def stored(self, replica: int, hashes: Sequence[int | bytes]) -> None:
        self._check(replica)
        for h in hashes:
            self._held[replica][h] += 1
            self._where.setdefault(h, Counter())[replica] += 1
        self.history.stored(replica, hashes)
        self.speculation.confirm(replica, hashes)

    def removed(self, replica: int, hashes: Sequence[int | bytes]) -> None:
        """Drop one block per hash; a hash the replica does not hold is counted, ignored."""
        self._check(replica)
        for h in hashes:
            if self._held[replica][h] <= 0:
                self.unknown_removals += 1
                continue
            self._held[replica][h] -= 1
            where = self._where[h]
            where[replica] -= 1
            if not self._held[replica][h]:
                del self._held[replica][h]
                del where[replica]
                if not where:
                    del self._where[h]

    def clear(self, replica: int) -> None:
        """Forget everything ``replica`` holds."""
        self._check(replica)
        for h in list(self._held[replica]):
            where = self._where[h]
            del where[replica]
            if not where:
                del self._where[h]
        self._held[replica].clear()
        self.speculation.drop(replica)

    def held(self, replica: int) -> Counter:
        """A copy of the hashes ``replica`` holds, counted."""
        self._check(replica)
        return Counter(self._held[replica])

    def match(self, hashes: Sequence[int | bytes]) -> list[int]:
        """Per replica, how many of ``hashes`` it holds in a row from the first."""
        runs = [0] * self.num_replicas
        alive = set(range(self.num_replicas))
        for i, h in enumerate(hashes):
            where = self._where.get(h, {})
            for r in [r for r in alive if r not in where]:
                runs[r] = i
                alive.discard(r)
            if not alive:
                return runs
        for r in alive:
            runs[r] = len(hashes)
        return runs

    def __len__(self) -> int:
        return len(self._where)


# ---------------------------------------------------------------- the feed


@dataclass
class FeedStats:
    """What one replica's feed did (counts)."""

    batches: int = 0
    events: int = 0
    bad_batches: int = 0
    bad_events: int = 0
    ignored_events: int = 0  # another medium or block size
    duplicates: int = 0
    gaps: int = 0
    late_starts: int = 0
    restarts: int = 0
    disconnects: int = 0  # the replica's connection closed (its index was dropped)
    replays: int = 0
    drops: int = 0
    partial_rebuilds: int = 0


@dataclass
class ReplicaFeed:
    """One replica's place in its event stream: the last batch applied and received."""

    applied: int | None = None   # the last sequence number applied to the index
    received: int | None = None  # the last one received on the SUB socket
    stats: FeedStats = field(default_factory=FeedStats)


@dataclass(frozen=True)
class EventSource:
    """Where a replica publishes: its PUB ``endpoint``, replay endpoint, topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


Replay = Callable[[int, int], list[tuple[int, bytes]] | None]


class KVEventSubscriber:
    """Feeds a ``BlockIndex`` from every replica's events (see the module).

    ``receive(replica, seq, payload)`` is the whole sequence logic and needs no socket;
    ``poll`` reads the SUB sockets and calls it. ``replay(replica, start)`` asks the
    replica's replay socket for the batches from ``start`` on (None: it has none, or it
    did not answer within ``replay_timeout_ms``). ``block_size``: the only block size
    indexed (None: any); ``medium``: the only medium indexed (None counts as it).
    """

    def __init__(self, index: BlockIndex, sources: Sequence[EventSource] = (), *,
                 block_size: int | None = None, medium: str = MEDIUM_GPU,
                 replay_timeout_ms: int = 1000, context: Any = None) -> None:
        self.index = index
        self.block_size, self.medium = block_size, medium
        self.feeds = [ReplicaFeed() for _ in range(index.num_replicas)]
        self.replay_timeout_ms = replay_timeout_ms
        self.sources = list(sources)
        self._subs: list[Any] = []
        self._monitors: list[Any] = []  # each SUB socket's monitor (its disconnects)
        self._ctx = context
        if self.sources:
            if len(self.sources) != index.num_replicas:
                raise RouterError(f"{len(self.sources)} event sources for "
                                  f"{index.num_replicas} replicas")
            import zmq
            from zmq.utils.monitor import recv_monitor_message

            self._zmq, self._recv_monitor = zmq, recv_monitor_message
            self._ctx = context or zmq.Context.instance()
            self._poller = zmq.Poller()
            for source in self.sources:
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode("utf-8"))
                monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                sub.connect(source.endpoint)
                self._poller.register(sub, zmq.POLLIN)
                self._poller.register(monitor, zmq.POLLIN)
                self._subs.append(sub)
                self._monitors.append(monitor)

    # ------------------------------------------------------------ the sequence logic

    def receive(self, replica: int, seq: int, payload: bytes) -> None:
        """Take batch ``seq`` of ``replica`` as it arrived on the SUB socket."""
        feed = self.feeds[replica]
        if feed.received is not None and seq <= feed.received:
            feed.stats.restarts += 1  # numbers start over: a new publisher
            self._drop(replica)
        feed.received = seq
        if feed.applied is not None and seq <= feed.applied:
            feed.stats.duplicates += 1  # already applied from a replay
            return
        expected = 0 if feed.applied is None else feed.applied + 1
        if seq > expected:
            if feed.applied is None:
                feed.stats.late_starts += 1
            else:
                feed.stats.gaps += 1
            self._catch_up(replica, expected, seq)
        self._apply(replica, seq, payload)

    def disconnected(self, replica: int) -> None:
        """The connection carrying ``replica``'s events closed: drop its index now (its
        process may have ended with its cache); its next batch starts it again."""
        self.feeds[replica].stats.disconnects += 1
        self._drop(replica)
        self.feeds[replica].received = None

    def _drop(self, replica: int) -> None:
        self.index.clear(replica)
        self.feeds[replica].applied = None
        self.feeds[replica].stats.drops += 1

    def _catch_up(self, replica: int, start: int, upto: int) -> None:
        """Apply batches ``start .. upto - 1`` from the replay socket, or rebuild."""
        feed = self.feeds[replica]
        frames = self.replay(replica, start)
        if frames is not None:
            feed.stats.replays += 1
            wanted = [(s, p) for s, p in frames if start <= s < upto]
            if [s for s, _ in wanted] == list(range(start, upto)):
                for s, p in wanted:
                    self._apply(replica, s, p)
                return
        if feed.applied is not None or start > 0:  # what is missing cannot be recovered
            self._drop(replica)
        if frames is not None and start > 0:
            frames = self.replay(replica, 0)
        if frames is not None:
            kept = sorted((s, p) for s, p in frames if s < upto)
            if not kept or kept[0][0] != 0:
                feed.stats.partial_rebuilds += 1
            for s, p in kept:
                self._apply(replica, s, p)
        feed.applied = upto - 1  # the next batch applies; the index knows what it saw

    def _apply(self, replica: int, seq: int, payload: bytes) -> None:
        feed = self.feeds[replica]
        feed.applied = seq
        try:
            batch = decode_batch(payload)
        except KVEventError:
            feed.stats.bad_batches += 1
            return
        feed.stats.batches += 1
        feed.stats.bad_events += batch.bad_events
        for event in batch.events:
            self.apply_event(replica, event)

    def apply_event(self, replica: int, event: KVCacheEvent) -> None:
        """One event into the index, unless it is for another medium or block size."""
        stats = self.feeds[replica].stats
        stats.events += 1
        if isinstance(event, AllBlocksCleared):
            self.index.clear(replica)
            return
        medium_ok = event.medium is None or event.medium == self.medium
        if isinstance(event, BlockStored):
            if not medium_ok or (self.block_size is not None
                                 and event.block_size != self.block_size):
                stats.ignored_events += 1
                return
            self.index.stored(replica, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            if not medium_ok:
                stats.ignored_events += 1
                return
            self.index.removed(replica, event.block_hashes)

    # ------------------------------------------------------------ the sockets

    def replay(self, replica: int, start: int) -> list[tuple[int, bytes]] | None:
        """Batches ``(seq, payload)`` from ``start`` on, from the replica's replay socket."""
        if not self.sources or self.sources[replica].replay_endpoint is None:
            return None
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.sources[replica].replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            while True:
                if not dealer.poll(self.replay_timeout_ms):
                    return None
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    self.feeds[replica].stats.bad_batches += 1
                    continue
                if frames[2] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close()

    def poll(self, timeout_ms: int = 0) -> int:
        """Read every batch and disconnect waiting (waiting up to ``timeout_ms`` for the
        first); returns how many batches arrived. On a disconnect the replica's socket is
        drained first, so that what its old connection delivered is applied, then dropped."""
        if not self._subs:
            return 0
        zmq, recv_monitor_message = self._zmq, self._recv_monitor
        count = 0
        wait = timeout_ms
        while True:
            ready = dict(self._poller.poll(wait))
            if not ready:
                return count
            for replica, (sub, monitor) in enumerate(zip(self._subs, self._monitors,
                                                          strict=True)):
                if sub in ready:
                    count += self._drain(replica)
                while monitor in ready:
                    try:
                        event = recv_monitor_message(monitor, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        count += self._drain(replica)  # what the old connection delivered
                        self.disconnected(replica)
            wait = 0

    def _drain(self, replica: int) -> int:
        """Take every batch waiting on ``replica``'s SUB socket; returns how many."""
        zmq, sub = self._zmq, self._subs[replica]
        count = 0
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return count
            count += 1
            if len(frames) != 3 or len(frames[1]) != 8:
                self.feeds[replica].stats.bad_batches += 1
                continue
            self.receive(replica, int.from_bytes(frames[1], "big"), frames[2])

    def sync(self, seqs: Sequence[int], timeout_ms: int = 5000) -> bool:
        """Poll until each replica's last batch received is ``seqs[r] - 1`` (``seqs``: each
        publisher's count of batches sent; 0: nothing to wait for); False on timeout.
        Equality, not >=: a restarted publisher's count starts again from 0."""
        import time

        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if all(n == 0 or (f.received == n - 1 and f.applied is not None)
                   for f, n in zip(self.feeds, seqs, strict=True)):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(int(min(left, 0.05) * 1000))

    def close(self) -> None:
        for sub, monitor in zip(self._subs, self._monitors, strict=True):
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
        self._subs, self._monitors = [], []

    def totals(self) -> FeedStats:
        """Every feed's counts added up."""
        total = FeedStats()
        for feed in self.feeds:
            for name in vars(total):
                setattr(total, name, getattr(total, name) + getattr(feed.stats, name))
        return total


# ---------------------------------------------------------------- the routers


class _RuleRouter(Router):
    """Chapter 09a's decision rule over a per-replica count of matched prompt tokens,
    with the affinity and speculation steps (see the module)."""

    imbalanced = CacheAwareRouter.imbalanced

    def __init__(self, num_replicas: int, tokenize: Callable[[str], Sequence[int]] | None,
                 cache_threshold: float, balance_abs_threshold: int,
                 balance_rel_threshold: float, affinity: bool, speculative: bool) -> None:
        super().__init__(num_replicas)
        check_number("cache_threshold", cache_threshold, 0.0, 1.0)
        check_int("balance_abs_threshold", balance_abs_threshold, 0)
        check_number("balance_rel_threshold", balance_rel_threshold, 1.0)
        for name, flag in (("affinity", affinity), ("speculative", speculative)):
            if not isinstance(flag, bool):
                raise RouterError(f"{name} must be a bool, got {flag!r}")
        self.tokenize = tokenize
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.affinity, self.speculative = affinity, speculative
        self.history: StoreHistory = StoreHistory()
        self.speculation = Speculation(num_replicas)
        self.salt: str | None = None
        self._memo: tuple[tuple[int, ...], list[int]] | None = None

    def block_size_of(self) -> int:
        raise NotImplementedError

    def hashes(self, ids: list[int]) -> list[int]:
        """The request's block hashes (over ``ids`` but the last token), memoized."""
        key = tuple(ids)
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, request_block_hashes(ids[:-1], self.block_size_of(), self.salt))
        return self._memo[1]

    def held(self, ids: list[int]) -> list[int]:
        """Per replica, the leading blocks of ``ids`` it holds (what the router knows)."""
        raise NotImplementedError

    def matched(self, ids: list[int]) -> list[int]:
        """Prompt tokens each replica holds, or will once what was routed there is
        stored (``speculative``), at the start of ``ids``."""
        runs = self.held(ids)
        if self.speculative:
            runs = self.speculation.extend(runs, self.hashes(ids))
        return [run * self.block_size_of() for run in runs]

    def _pick(self, text: str, session: str | None) -> Decision:
        if self.tokenize is None:
            raise RouterError(f"{type(self).__name__} routes token ids: give it a tokenize "
                              "function or call route_ids")
        return self._pick_ids([int(t) for t in self.tokenize(text)])

    def route_ids(self, ids: Sequence[int]) -> int:
        """Choose a replica for a prompt of token ``ids``; counts it as in flight there."""
        if isinstance(ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RouterError("route_ids takes a sequence of int token ids")
        decision = self._pick_ids(list(ids))
        self._routed(decision.replica, list(ids))
        self.decisions.append(decision)
        return decision.replica

    def _routed(self, replica: int, ids: list[int]) -> None:
        self.loads[replica] += 1
        if self.speculative:
            hashes = self.hashes(ids)
            self.speculation.add(replica, hashes)

    def done(self, replica: int) -> None:
        super().done(replica)
        if self.speculative and self.loads[replica] == 0:
            self.speculation.drop(replica)  # nothing routed there can still be stored

    def _pick_ids(self, ids: list[int]) -> Decision:
        loads = tuple(self.loads)
        healthy = self._healthy()
        if self.imbalanced():
            return Decision(self._least_loaded(), "imbalanced", loads)
        matched = self.matched(ids)
        best = max(matched[i] for i in healthy)
        rate = best / len(ids) if ids else 0.0
        if rate > self.cache_threshold:
            replica = min((i for i in healthy if matched[i] == best),
                          key=lambda i: (self.loads[i], i))
            return Decision(replica, "cache_hit", loads, rate)
        if self.affinity:
            home = self.history.home(self.hashes(ids))
            if home is not None and self.healthy[home]:
                return Decision(home, "affinity", loads, rate)
        return Decision(self._least_loaded(), "low_match", loads, rate)


class PreciseRouter(_RuleRouter):
    """Routes by the replicas' own KV events (see the module). ``block_size``: the
    replicas' block (page) size; ``salt``: the cache_salt the replicas' requests carry;
    ``subscriber``: polled before every decision (None: feed ``index`` yourself);
    ``affinity``, ``speculative``: the two steps beyond chapter 09a's rule (both off: that
    rule exactly)."""

    name = "precise"

    def __init__(self, num_replicas: int, block_size: int, *,
                 tokenize: Callable[[str], Sequence[int]] | None = None,
                 subscriber: KVEventSubscriber | None = None, salt: str | None = None,
                 cache_threshold: float = DEFAULTS["cache_threshold"],
                 balance_abs_threshold: int = DEFAULTS["balance_abs_threshold"],
                 balance_rel_threshold: float = DEFAULTS["balance_rel_threshold"],
                 affinity: bool = False, speculative: bool = True) -> None:
        super().__init__(num_replicas, tokenize, cache_threshold, balance_abs_threshold,
                         balance_rel_threshold, affinity, speculative)
        check_int("block_size", block_size, 1)
        self.block_size, self.salt = block_size, salt
        self.subscriber = subscriber
        self.index = subscriber.index if subscriber is not None else BlockIndex(num_replicas)
        if self.index.num_replicas != num_replicas:
            raise RouterError(f"the index covers {self.index.num_replicas} replicas, "
                              f"the router {num_replicas}")
        self.history, self.speculation = self.index.history, self.index.speculation

    def block_size_of(self) -> int:
        return self.block_size

    def held(self, ids: list[int]) -> list[int]:
        if self.subscriber is not None:
            self.subscriber.poll(0)
        return self.index.match(self.hashes(ids))


class OracleRouter(_RuleRouter):
    """The same rule reading each replica's cache (``caches[i].peek_prefix_len``); its
    history and speculation follow ``observe(replica, events)``, each cache's own events
    (what a replica stored in the past is in no cache)."""

    name = "oracle"

    def __init__(self, caches: Sequence[Any], *,
                 tokenize: Callable[[str], Sequence[int]] | None = None,
                 salt: str | None = None,
                 cache_threshold: float = DEFAULTS["cache_threshold"],
                 balance_abs_threshold: int = DEFAULTS["balance_abs_threshold"],
                 balance_rel_threshold: float = DEFAULTS["balance_rel_threshold"],
                 affinity: bool = False, speculative: bool = True,
                 history_size: int = 1 << 20) -> None:
        super().__init__(len(caches), tokenize, cache_threshold, balance_abs_threshold,
                         balance_rel_threshold, affinity, speculative)
        self.caches = list(caches)
        self.salt = salt
        self.history = StoreHistory(history_size)

    def block_size_of(self) -> int:
        cache = self.caches[0]
        return getattr(cache, "page_size", None) or cache.block_size

    def observe(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """Follow ``events`` (one cache's, in order): where blocks were stored (history,
        confirmed speculation), and clears."""
        self._check_replica(replica)
        for event in events:
            if isinstance(event, BlockStored):
                self.history.stored(replica, event.block_hashes)
                self.speculation.confirm(replica, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.speculation.drop(replica)

    def held(self, ids: list[int]) -> list[int]:
        import torch

        prompt = torch.tensor(ids[:-1], dtype=torch.int64)
        size = self.block_size_of()
        return [cache.peek_prefix_len(prompt) // size for cache in self.caches]


register_policy("precise", PreciseRouter)  # router.make_router("precise", n, block_size=...)
