"""The precise router: its index against a reference, the feed's sequence logic (gaps,
restarts, late starts, replay, bad batches and events), the whole path over ZMQ from
event caches, and its decisions against the oracle's and chapter 09a's rule."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt.errors import RouterError
from minirt.kv_event_caches import EventRadixCache
from minirt.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    encode_batch,
    external_block_hash,
    packb,
    vllm_block_hashes,
)
from minirt.precise_router import (
    BlockIndex,
    EventSource,
    KVEventSubscriber,
    OracleRouter,
    PreciseRouter,
    StoreHistory,
    request_block_hashes,
)


def stored(*hashes, block_size=1, medium="GPU"):
    return BlockStored(list(hashes), None, [0] * (block_size * len(hashes)), block_size, None,
                       medium, None)


def payload(*events):
    return encode_batch(KVEventBatch(1.0, list(events), 0))


# ---------------------------------------------------------------- the index


_index_ops = st.lists(st.tuples(st.sampled_from(["stored", "removed", "clear"]),
                                st.integers(0, 2), st.lists(st.integers(0, 5), max_size=4)),
                      max_size=40)


@settings(max_examples=150, deadline=None)
@given(_index_ops, st.lists(st.integers(0, 5), max_size=6))
def test_index_against_a_reference(ops, query):
    index = BlockIndex(3)
    ref = [Counter() for _ in range(3)]
    unknown = 0
    for op, replica, hashes in ops:
        if op == "stored":
            index.stored(replica, hashes)
            ref[replica].update(hashes)
        elif op == "removed":
            index.removed(replica, hashes)
            for h in hashes:
                if ref[replica][h] > 0:
                    ref[replica][h] -= 1
                else:
                    unknown += 1
                ref[replica] = +ref[replica]
        else:
            index.clear(replica)
            ref[replica].clear()
        assert [index.held(r) for r in range(3)] == ref
    assert index.unknown_removals == unknown
    assert len(index) == len(set().union(*ref))
    expect = []
    for r in range(3):
        run = 0
        while run < len(query) and ref[r][query[run]] > 0:
            run += 1
        expect.append(run)
    assert index.match(query) == expect


def test_index_refuses_bad_replicas():
    index = BlockIndex(2)
    for bad in (2, -1, True, "0"):
        with pytest.raises(RouterError, match="replica"):
            index.stored(bad, [1])
    with pytest.raises(RouterError, match="num_replicas"):
        BlockIndex(0)
    assert index.match([]) == [0, 0] and len(index) == 0


# ---------------------------------------------------------------- the feed


class FakeReplay:
    """A publisher's replay buffer without sockets: ``frames[replica]``, None = no socket."""

    def __init__(self, frames):
        self.frames = frames
        self.asked = []

    def __call__(self, replica, start):
        self.asked.append((replica, start))
        buf = self.frames[replica]
        return None if buf is None else [(s, p) for s, p in buf if s >= start]


def feed(replays, n=1, **kwargs):
    sub = KVEventSubscriber(BlockIndex(n), **kwargs)
    sub.replay = FakeReplay(replays)
    return sub


def test_in_order_batches_apply():
    sub = feed([None])
    sub.receive(0, 0, payload(stored(1, 2)))
    sub.receive(0, 1, payload(BlockRemoved([1], "GPU")))
    assert sub.index.held(0) == Counter({2: 1})
    s = sub.feeds[0].stats
    assert (s.batches, s.events, s.gaps, s.restarts, s.drops) == (2, 2, 0, 0, 0)


def test_gap_filled_from_replay():
    batches = [(0, payload(stored(1))), (1, payload(stored(2))), (2, payload(stored(3))),
               (3, payload(stored(4)))]
    sub = feed([batches])
    sub.receive(0, 0, batches[0][1])
    sub.receive(0, 3, batches[3][1])  # 1 and 2 lost
    assert sub.index.held(0) == Counter({1: 1, 2: 1, 3: 1, 4: 1})
    assert sub.replay.asked == [(0, 1)]
    s = sub.feeds[0].stats
    assert (s.gaps, s.replays, s.drops, s.partial_rebuilds) == (1, 1, 0, 0)
    sub.receive(0, 4, payload(stored(5)))
    assert sub.index.held(0)[5] == 1


def test_gap_the_buffer_lost_drops_and_rebuilds_from_what_it_holds():
    kept = [(2, payload(BlockRemoved([1], "GPU"))), (3, payload(stored(9)))]
    sub = feed([kept])
    sub.receive(0, 0, payload(stored(1, 7)))
    sub.receive(0, 3, kept[1][1])  # 1 is gone from the buffer
    assert sub.replay.asked == [(0, 1), (0, 0)]
    s = sub.feeds[0].stats
    assert (s.gaps, s.drops, s.partial_rebuilds) == (1, 1, 1)
    assert sub.index.held(0) == Counter({9: 1})  # 7 was dropped with the stale index
    assert sub.index.unknown_removals == 1  # the replayed removal of 1


def test_gap_without_replay_drops_and_continues():
    sub = feed([None])
    sub.receive(0, 0, payload(stored(1)))
    sub.receive(0, 5, payload(stored(2)))
    assert sub.index.held(0) == Counter({2: 1})
    s = sub.feeds[0].stats
    assert (s.gaps, s.drops, s.replays) == (1, 1, 0)
    sub.receive(0, 6, payload(stored(3)))
    assert sub.feeds[0].applied == 6


def test_restart_drops_the_replica_and_rebuilds():
    new_life = [(0, payload(stored(5))), (1, payload(stored(6)))]
    sub = feed([new_life, None], n=2)
    sub.receive(1, 0, payload(stored(42)))
    for seq in range(3):
        sub.receive(0, seq, payload(stored(100 + seq)))
    sub.receive(0, 1, new_life[1][1])  # numbers went back: the replica restarted
    assert sub.index.held(0) == Counter({5: 1, 6: 1})
    assert sub.index.held(1) == Counter({42: 1})  # the other replica is untouched
    s = sub.feeds[0].stats
    assert (s.restarts, s.drops, s.late_starts) == (1, 1, 1)


def test_a_disconnect_drops_the_replica_and_its_next_batch_starts_it_again():
    new_life = [(0, payload(stored(5)))]  # the new process has published one batch so far
    sub = feed([new_life, None], n=2)
    sub.receive(1, 0, payload(stored(42)))
    for seq in range(3):
        sub.receive(0, seq, payload(stored(100 + seq)))
    sub.disconnected(0)  # before any batch of the new process
    assert sub.index.held(0) == Counter() and sub.index.held(1) == Counter({42: 1})
    assert sub.feeds[0].received is None and sub.feeds[0].applied is None
    sub.receive(0, 1, payload(stored(6)))  # its second batch: a late start, caught up
    assert sub.index.held(0) == Counter({5: 1, 6: 1})
    s = sub.feeds[0].stats
    assert (s.disconnects, s.restarts, s.late_starts, s.drops) == (1, 0, 1, 1)
    assert sub.feeds[1].stats.disconnects == 0


def test_late_start_catches_up_from_replay_and_skips_duplicates():
    history = [(i, payload(stored(i))) for i in range(4)]
    sub = feed([history])
    sub.receive(0, 3, history[3][1])
    assert sub.index.held(0) == Counter({0: 1, 1: 1, 2: 1, 3: 1})
    assert sub.feeds[0].stats.late_starts == 1 and sub.feeds[0].stats.drops == 0
    late = feed([history[2:]])
    late.receive(0, 3, history[3][1])
    assert late.feeds[0].stats.partial_rebuilds == 1
    assert late.index.held(0) == Counter({2: 1, 3: 1})


def test_bad_batches_and_events_are_counted_and_ignored():
    sub = feed([None], block_size=16)
    sub.receive(0, 0, b"\xc1 not msgpack")
    sub.receive(0, 1, packb([1.0, [{"type": "Nope"}, {"type": "BlockRemoved"}], 0]))
    sub.receive(0, 2, payload(stored(1, block_size=16), stored(2, block_size=16, medium="CPU"),
                              stored(3, block_size=4), BlockRemoved([9], "GPU"),
                              BlockRemoved([1], "CPU")))
    s = sub.feeds[0].stats
    assert (s.bad_batches, s.batches, s.bad_events, s.ignored_events) == (1, 2, 2, 3)
    assert sub.index.held(0) == Counter({1: 1}) and sub.index.unknown_removals == 1
    assert sub.feeds[0].applied == 2  # a bad batch still takes its number
    sub.receive(0, 3, payload(AllBlocksCleared()))
    assert sub.index.held(0) == Counter()


# ---------------------------------------------------------------- over ZMQ


def _wait(sub, pubs):
    for pub in pubs:
        pub.flush()
    assert sub.sync([p.seq for p in pubs])


def _contents(cache):
    held = Counter()
    for node in cache.nodes():
        path, walk = [], node
        while walk.parent is not None:
            path.append(list(walk.key))
            walk = walk.parent
        tokens = [t for part in reversed(path) for t in part]
        n = node.length // cache.page_size
        held.update(external_block_hash(h) for h in vllm_block_hashes(tokens, cache.page_size)[-n:])
    return held


def test_the_index_follows_two_replicas_over_zmq_and_a_late_router_catches_up():
    tag = uuid.uuid4().hex
    caches = [EventRadixCache(4), EventRadixCache(4)]
    pubs = [ZmqEventPublisher(f"inproc://pub{r}-{tag}", f"inproc://replay{r}-{tag}",
                              topic=f"r{r}") for r in range(2)]
    sources = [EventSource(p.endpoint, p.replay_endpoint, p.topic) for p in pubs]
    sub = KVEventSubscriber(BlockIndex(2), sources, block_size=4)
    late = None
    try:
        time.sleep(0.05)
        slot = 0
        for step in range(12):
            r = step % 2
            ids = torch.tensor([step % 3] * 8 + list(range(step, step + 9)))
            caches[r].insert_prefix(ids, torch.arange(slot, slot + len(ids)))
            slot += len(ids)
            if step % 4 == 3:
                caches[r].evict(min(8, caches[r].evictable_size))
            pubs[r].publish_events(caches[r].take_events())
            if step == 6:
                for p in pubs:
                    p.flush()  # sent before the late router connects: it never sees them
                late = KVEventSubscriber(BlockIndex(2), sources, block_size=4)
        _wait(sub, pubs)
        assert [sub.index.held(r) for r in range(2)] == [_contents(c) for c in caches]
        caches[0].insert_prefix(torch.tensor(list(range(50, 58))), torch.arange(900, 908))
        pubs[0].publish_events(caches[0].take_events())
        _wait(late, pubs)
        assert [late.index.held(r) for r in range(2)] == [_contents(c) for c in caches]
        assert late.totals().late_starts >= 1 and late.totals().replays >= 1
        assert sub.totals().gaps == 0 and sub.totals().bad_batches == 0
    finally:
        sub.close()
        if late is not None:
            late.close()
        for p in pubs:
            p.close()


def _rebind(port, replay_port):
    """A publisher on the ports a closed one held (ZMQ closes sockets in the background)."""
    for _ in range(50):
        try:
            return ZmqEventPublisher(f"tcp://*:{port}", f"tcp://*:{replay_port}")
        except zmq.ZMQError:
            time.sleep(0.05)
    raise AssertionError(f"ports {port}, {replay_port} stayed busy")


def test_a_restarted_replica_is_dropped_when_its_connection_closes_and_rebuilt_over_tcp():
    """The old publisher's socket closing drops the replica's index before any batch of
    the new one; the new publisher numbers from 0 again, and the router rebuilds from its
    batches (those lost while the SUB socket reconnects come from the replay socket)."""
    cache = EventRadixCache(2)
    pub = ZmqEventPublisher("tcp://*:0", "tcp://*:0")
    port = pub.endpoint.rsplit(":", 1)[1]
    replay_port = pub.replay_endpoint.rsplit(":", 1)[1]
    source = EventSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    sub = KVEventSubscriber(BlockIndex(1), [source])
    try:
        time.sleep(0.2)
        for i in range(10):
            cache.insert_prefix(torch.tensor([i, i, 7, 7]), torch.arange(4 * i, 4 * i + 4))
            pub.publish_events(cache.take_events())
        _wait(sub, [pub])
        assert sub.index.held(0) == _contents(cache) and len(sub.index) == 20
        pub.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not sub.feeds[0].stats.disconnects:
            sub.poll(100)
        assert sub.feeds[0].stats.disconnects == 1, "the closed connection was not seen"
        assert len(sub.index) == 0 and sub.feeds[0].received is None  # before any new batch
        cache = EventRadixCache(2)  # the replica comes back empty
        pub = _rebind(port, replay_port)
        deadline = time.monotonic() + 5
        i = 0
        while time.monotonic() < deadline and not (
                sub.feeds[0].stats.batches > 10 and sub.index.held(0) == _contents(cache)):
            i += 1
            assert pub.seq < 10, "the router saw none of the new publisher's first batches"
            cache.insert_prefix(torch.tensor([50 + i, 8]), torch.arange(2 * i, 2 * i + 2))
            pub.publish_events(cache.take_events())
            pub.flush()
            sub.poll(100)
        stats = sub.feeds[0].stats
        assert stats.disconnects == 1 and stats.restarts == 0 and stats.batches > 10
        assert sub.index.held(0) == _contents(cache)  # the old life's 20 blocks are gone
        assert not set(sub.index.held(0)) & {external_block_hash(h) for h in
                                              vllm_block_hashes([0, 0, 7, 7], 2)}
    finally:
        sub.close()
        pub.close()


def test_subscriber_needs_one_source_per_replica():
    with pytest.raises(RouterError, match="2 event sources for 3 replicas"):
        KVEventSubscriber(BlockIndex(3), [EventSource("inproc://a"), EventSource("inproc://b")])


# ---------------------------------------------------------------- the routers


def _fill(cache, ids):
    slots = torch.arange(len(ids), dtype=torch.int64) + 10_000 * len(list(cache.nodes()))
    cache.insert_prefix(torch.tensor(ids, dtype=torch.int64), slots)


def test_precise_router_follows_the_longest_run_and_the_balance_rule():
    router = PreciseRouter(3, 4, balance_abs_threshold=2, balance_rel_threshold=1.5,
                           speculative=False)
    prompt = list(range(100, 133))
    hashes = request_block_hashes(prompt[:-1], 4)
    router.index.stored(1, hashes[:2])
    router.index.stored(2, hashes[:6])
    assert router.route_ids(prompt) == 2
    d = router.decisions[-1]
    assert d.reason == "cache_hit" and d.match_rate == 24 / 33
    assert router.route_ids(list(range(500, 540))) == 0  # no match: least loaded
    assert router.decisions[-1].reason == "low_match"
    router.loads = [0, 0, 5]  # 5 - 0 > 2 and 5 > 1.5 * 0: imbalanced
    assert router.route_ids(prompt) == 0 and router.decisions[-1].reason == "imbalanced"
    router.loads = [0, 3, 3]
    router.index.stored(1, hashes[2:6])  # replicas 1 and 2 tie: least loaded, then index
    router.loads = [0, 2, 1]
    assert router.route_ids(prompt) == 2
    router.index.removed(2, hashes[3:4])
    assert router.route_ids(prompt) == 1


@pytest.mark.parametrize("affinity", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_precise_and_oracle_agree_when_the_index_is_exact(affinity, speculative):
    caches = [EventRadixCache(4) for _ in range(3)]
    flags = {"affinity": affinity, "speculative": speculative}
    precise = PreciseRouter(3, 4, **flags)
    oracle = OracleRouter(caches, **flags)
    sub = KVEventSubscriber(precise.index, block_size=4)
    rng = torch.Generator().manual_seed(53)
    prompts = [[t] * 12 + torch.randint(0, 50, (20,), generator=rng).tolist() for t in range(4)]
    for step in range(40):
        prompt = prompts[step % 4][: 14 + step % 18]
        a, b = precise.route_ids(prompt), oracle.route_ids(prompt)
        assert a == b, step
        _fill(caches[a], prompt)
        if step % 7 == 6:
            caches[a].evict(min(12, caches[a].evictable_size))
        for r, cache in enumerate(caches):
            events = cache.take_events()
            oracle.observe(r, events)
            for event in events:
                sub.apply_event(r, event)
        precise.done(a)
        oracle.done(b)
    reasons = {d.reason for d in precise.decisions}
    assert reasons >= {"cache_hit", "low_match"} and ("affinity" in reasons) == affinity
    assert [d.reason for d in precise.decisions] == [d.reason for d in oracle.decisions]


def test_store_history_keeps_the_last_holder_of_the_deepest_block():
    history = StoreHistory(capacity=4)
    history.stored(0, [1, 2, 3])
    history.stored(1, [1, 2])
    assert history.home([1, 2, 3, 9]) == 0  # 3 is the deepest remembered: replica 0
    assert history.home([1, 2, 9]) == 1     # 2 was stored last by replica 1
    assert history.home([9]) is None and history.home([]) is None
    history.stored(2, [5, 6])               # 5 entries > 4: the least recently stored (3) go
    assert len(history) == 4 and history.home([1, 2, 3]) == 1
    off = StoreHistory(capacity=0)
    off.stored(0, [1])
    assert off.home([1]) is None and len(off) == 0
    with pytest.raises(RouterError, match="capacity"):
        StoreHistory(capacity=-1)


def test_a_prefix_gone_everywhere_goes_back_where_it_was_last_stored():
    prompt = list(range(100, 133))
    hashes = request_block_hashes(prompt[:-1], 4)
    for affinity in (True, False):
        router = PreciseRouter(3, 4, affinity=affinity, speculative=False,
                               balance_abs_threshold=2)
        router.index.stored(2, hashes[:6])
        router.index.removed(2, hashes[:6])  # evicted: nothing held anywhere
        assert router.index.match(hashes) == [0, 0, 0] and len(router.index) == 0
        router.loads = [0, 1, 1]
        chosen = router.route_ids(prompt)
        reason = router.decisions[-1].reason
        assert (chosen, reason) == ((2, "affinity") if affinity else (0, "low_match"))
    router = PreciseRouter(3, 4, affinity=True, speculative=False, balance_abs_threshold=2)
    router.index.stored(1, hashes[:2])
    router.index.stored(2, hashes[:1])  # replica 2 stored the first block last, 1 the deeper
    router.index.clear(1)
    router.index.clear(2)
    assert router.route_ids(prompt) == 1 and router.decisions[-1].reason == "affinity"
    router.loads = [0, 4, 0]  # imbalanced comes first, as in chapter 09a
    assert router.route_ids(prompt) == 0 and router.decisions[-1].reason == "imbalanced"
    router.loads = [0, 0, 0]
    router.set_healthy(1, False)  # an unhealthy home: least loaded
    assert router.route_ids(prompt) == 0 and router.decisions[-1].reason == "low_match"
    router.set_healthy(1, True)
    router.index.stored(0, hashes[:6])  # held again: the cache hit wins over the history
    assert router.route_ids(prompt) == 0 and router.decisions[-1].reason == "cache_hit"
    with pytest.raises(RouterError, match="affinity"):
        PreciseRouter(3, 4, affinity=1)
    with pytest.raises(RouterError, match="speculative"):
        PreciseRouter(3, 4, speculative="yes")


def test_speculation_credits_what_was_routed_until_the_events_confirm_it():
    prompt = list(range(100, 133))
    hashes = request_block_hashes(prompt[:-1], 4)  # 8 blocks
    router = PreciseRouter(3, 4)  # speculative by default, affinity off
    router.index.stored(1, hashes[:2])
    assert router.route_ids(prompt) == 0  # 2 blocks = 8/33 tokens: a low match
    assert router.index.speculation.size(0) == 8  # all 8 blocks expected on replica 0
    assert router.route_ids(prompt) == 0 and router.decisions[-1].reason == "cache_hit"
    assert router.route_ids(prompt[:20] + [7] * 13) == 0  # its first 5 blocks expected on 0
    assert router.index.speculation.size(0) == 11  # and its last 3 are new
    assert router.index.match(hashes) == [0, 2, 0]  # the index itself is unchanged
    router.index.stored(0, hashes[:5])  # the prefill's events: 5 confirmed, 6 still expected
    assert router.index.speculation.size(0) == 6
    router.index.removed(0, hashes[4:5])  # evicted after it was confirmed: not credited
    assert router.matched(prompt) == [16, 8, 0]
    for _ in range(2):
        router.done(0)
    assert router.index.speculation.size(0) == 6  # one request still in flight there
    router.done(0)
    assert router.index.speculation.size(0) == 0  # none: nothing more can be stored
    assert router.matched(prompt) == [16, 8, 0]
    router.route_ids(prompt)  # goes to 0 (16 tokens > 0.3 * 33): all 8 blocks expected,
    assert router.index.speculation.size(0) == 8  # the 4 it holds too
    router.index.removed(0, hashes[:2])  # evicted while the request waits for its prefill:
    assert router.matched(prompt) == [32, 8, 0]  # still credited where the request went
    router.index.clear(0)  # a restart or AllBlocksCleared drops them too
    assert router.index.speculation.size(0) == 0 and router.matched(prompt) == [0, 8, 0]
    off = PreciseRouter(3, 4, speculative=False)
    off.route_ids(prompt)
    assert off.index.speculation.size(0) == 0 and off.matched(prompt) == [0, 0, 0]


def test_router_arguments_and_text():
    with pytest.raises(RouterError, match="block_size"):
        PreciseRouter(2, 0)
    with pytest.raises(RouterError, match="cache_threshold"):
        PreciseRouter(2, 4, cache_threshold=1.5)
    with pytest.raises(RouterError, match="covers 3 replicas"):
        PreciseRouter(2, 4, subscriber=KVEventSubscriber(BlockIndex(3)))
    router = PreciseRouter(2, 4)
    with pytest.raises(RouterError, match="tokenize"):
        router.route("hello")
    for bad in ("abc", [1, "2"], [True]):
        with pytest.raises(RouterError, match="token ids"):
            router.route_ids(bad)
    assert router.loads == [0, 0] and router.decisions == []
    words = PreciseRouter(2, 1, tokenize=lambda text: [ord(c) for c in text])
    words.index.stored(1, request_block_hashes([ord(c) for c in "hello"], 1))
    assert words.route("hello!") == 1


def test_make_router_builds_the_precise_router():
    from minirt.router import make_router, register_policy

    router = make_router("precise", 3, block_size=4, affinity=False)
    assert isinstance(router, PreciseRouter) and router.block_size == 4
    assert not router.affinity and router.num_replicas == 3
    with pytest.raises(RouterError, match="bad settings for 'precise'"):
        make_router("precise", 3)  # no block size
    with pytest.raises(RouterError, match="unknown routing policy 'nope'.*precise"):
        make_router("nope", 2)
    with pytest.raises(RouterError, match="taken"):
        register_policy("precise", OracleRouter)
    with pytest.raises(RouterError, match="taken"):
        register_policy("round_robin", PreciseRouter)
    with pytest.raises(RouterError, match="callable"):
        register_policy("other", 3)
    with pytest.raises(RouterError, match="non-empty str"):
        register_policy("", PreciseRouter)
    register_policy("precise", PreciseRouter)  # the same factory again changes nothing
    assert isinstance(make_router("precise", 2, block_size=1), PreciseRouter)
