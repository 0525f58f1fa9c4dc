"""minirt.kv_events against vLLM 0.32 itself: block hashes and event bytes recorded from
vLLM's own code (tests/fixtures/vllm_kv_events.json, made by the script beside it), the
msgpack subset against a reference, bad payloads and events, and the ZMQ publisher's
frames, sequence numbers and replay."""

from __future__ import annotations

import json
import struct
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from minirt import kv_events as ke
from minirt.errors import RequestError
from minirt.hashcache import HashCache
from minirt.kv_event_caches import EventHashCache, EventRadixCache, use_event_cache
from minirt.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventError,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    external_block_hash,
    none_hash,
    packb,
    unpackb,
    vllm_block_hashes,
    vllm_sha256,
)

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_kv_events.json").read_text())


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def _unplain(obj):
    if isinstance(obj, dict) and set(obj) == {"hex"}:
        return bytes.fromhex(obj["hex"])
    if isinstance(obj, list):
        return [_unplain(x) for x in obj]
    return obj


def _event(spec: dict):
    spec = dict(spec)
    cls = ke.EVENT_TYPES[spec.pop("type")]
    kwargs = {k: _unplain(v) for k, v in spec.items()}
    if kwargs.get("extra_keys"):
        kwargs["extra_keys"] = [None if k is None else tuple(k) for k in kwargs["extra_keys"]]
    return cls(**kwargs)


# ---------------------------------------------------------------- hashes


def test_none_hash_is_vllms():
    assert none_hash().hex() == FIXTURE["none_hash"]


@pytest.mark.parametrize("case", FIXTURE["hashes"], ids=lambda c: c["name"])
def test_block_hashes_equal_vllms(case):
    lora = tuple(case["lora"]) if case["lora"] else None
    hashes = vllm_block_hashes(case["tokens"], case["block_size"], salt=case["salt"], lora=lora)
    assert [h.hex() for h in hashes] == case["hashes"]
    assert [external_block_hash(h) for h in hashes] == case["external"]
    assert len(hashes) == len(case["tokens"]) // case["block_size"]


def test_hash_cache_with_vllms_function_and_seed_computes_vllms_hashes():
    case = FIXTURE["hashes"][0]
    cache = HashCache(block_size=case["block_size"], hash_fn=vllm_sha256, seed=none_hash())
    assert [h.hex() for h in cache.hashes(case["tokens"])] == case["hashes"]
    salted = next(c for c in FIXTURE["hashes"] if c["name"] == "salted")
    cache = HashCache(block_size=salted["block_size"], hash_fn=vllm_sha256, seed=none_hash())
    assert [h.hex() for h in cache.hashes(salted["tokens"], salt="tenant-a")] == salted["hashes"]


def test_what_changes_the_hashes():
    """A router that hashes with another salt, adapter, block size or seed finds nothing."""
    case = FIXTURE["hashes"][0]
    tokens, b = case["tokens"], case["block_size"]
    base = vllm_block_hashes(tokens, b)
    assert vllm_block_hashes(tokens, b, salt="x") != base
    salted = vllm_block_hashes(tokens, b, salt="x")
    assert all(s != h for s, h in zip(salted, base, strict=True))  # the chain carries it
    assert vllm_block_hashes(tokens, b, lora=("a", "/p")) != vllm_block_hashes(
        tokens, b, lora=("a", "/q"))
    assert not set(vllm_block_hashes(tokens, 2 * b)) & set(base)
    assert vllm_block_hashes(tokens, b, seed="0")[0] != base[0]


def test_python_hash_seed_changes_none_hash_as_in_vllm(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash() == vllm_sha256("0") != vllm_sha256(ke.VLLM_NONE_HASH_SEED)


def test_hash_arguments_are_checked():
    with pytest.raises(KVEventError, match="block_size"):
        vllm_block_hashes([1, 2], 0)
    with pytest.raises(KVEventError, match="lora"):
        vllm_block_hashes([1, 2], 1, lora=("only-a-name",))
    with pytest.raises(KVEventError, match="bytes"):
        external_block_hash(5)
    with pytest.raises(KVEventError, match="str"):
        none_hash(7)
    assert vllm_block_hashes([1, 2, 3], 4) == []
    assert external_block_hash(b"\x01" * 8 + b"\x00" * 7 + b"\x05") == 5


# ---------------------------------------------------------------- event bytes


@pytest.mark.parametrize("index", range(len(FIXTURE["batches"])))
def test_encoding_equals_msgspecs_bytes(index):
    rec = FIXTURE["batches"][index]
    batch = KVEventBatch(rec["ts"], [_event(e) for e in rec["events"]], rec["data_parallel_rank"])
    assert encode_batch(batch).hex() == rec["payload"]


@pytest.mark.parametrize("index", range(len(FIXTURE["batches"])))
def test_decoding_msgspecs_bytes(index):
    rec = FIXTURE["batches"][index]
    batch = decode_batch(bytes.fromhex(rec["payload"]))
    assert batch.bad_events == 0
    assert batch.ts == rec["ts"] and batch.data_parallel_rank == rec["data_parallel_rank"]
    assert [type(e).__name__ for e in batch.events] == [e["type"] for e in rec["events"]]
    for got, spec in zip(batch.events, rec["events"], strict=True):
        for name, value in spec.items():
            if name == "type":
                continue
            value = _unplain(value)
            have = getattr(got, name)
            if name == "extra_keys" and have is not None:
                have = [None if k is None else list(k) for k in have]
            assert have == value, name
    assert encode_batch(batch).hex() == rec["payload"]


_objects = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False) | st.text(max_size=300) | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=20)
    | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(_objects)
def test_msgpack_round_trip(obj):
    assert unpackb(packb(obj)) == obj


def test_msgpack_shortest_forms():
    """The boundaries where msgpack changes form, byte by byte."""
    assert packb(127) == b"\x7f" and packb(128) == b"\xcc\x80"
    assert packb(-32) == b"\xe0" and packb(-33) == b"\xd0\xdf"
    assert packb(65535) == b"\xcd\xff\xff" and packb(65536) == b"\xce\x00\x01\x00\x00"
    assert packb((1 << 64) - 1) == b"\xcf" + b"\xff" * 8
    assert packb("a" * 31)[:1] == b"\xbf" and packb("a" * 32)[:2] == b"\xd9\x20"
    assert packb(b"x")[:2] == b"\xc4\x01"
    assert packb(list(range(15)))[:1] == b"\x9f" and packb(list(range(16)))[:3] == b"\xdc\x00\x10"
    assert packb(1.5) == b"\xcb" + struct.pack(">d", 1.5)
    assert packb((1, 2)) == packb([1, 2])


@pytest.mark.parametrize("bad", [1 << 64, -(1 << 63) - 1, object(), {1, 2}])
def test_msgpack_refuses_what_it_cannot_encode(bad):
    with pytest.raises(KVEventError):
        packb(bad)


@pytest.mark.parametrize("payload, match", [
    (b"", "malformed"), (b"\x93\xcb", "malformed"), (packb([1.0, []]) + b"\x00", "after"),
    (b"\xc1", "type byte"), (b"\xd4\x01\x02", "type byte"), ("text", "bytes")])
def test_malformed_msgpack(payload, match):
    with pytest.raises(KVEventError, match=match):
        unpackb(payload)


@pytest.mark.parametrize("raw", [{"a": 1}, [1.0], [1.0, [], 0, 9], ["now", []], [1.0, {}],
                                 [1.0, [], "rank"], [True, []]])
def test_not_a_batch(raw):
    with pytest.raises(KVEventError, match="batch"):
        decode_batch(packb(raw))


def test_bad_and_unknown_events_are_counted_and_skipped():
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    events = [
        good,
        {"type": "BlockMoved", "block_hashes": [2]},                 # unknown type
        {"block_hashes": [3], "medium": None},                       # no type
        {"type": "BlockStored", "block_hashes": [4]},                # missing fields
        {"type": "BlockRemoved", "block_hashes": "5", "medium": None},  # wrong field type
        {"type": "BlockStored", "block_hashes": [6], "parent_block_hash": None,
         "token_ids": [1], "block_size": 0, "lora_id": None, "medium": None,
         "lora_name": None},                                         # block size 0
        7,                                                           # not a map
        {"type": "AllBlocksCleared", "future_field": 1},             # unknown field: fine
    ]
    batch = decode_batch(packb([2.0, events, None]))
    assert batch.bad_events == 6
    assert batch.events == [BlockRemoved([1], "GPU"), AllBlocksCleared()]


def test_encode_refuses_non_events():
    with pytest.raises(KVEventError, match="KVEventBatch"):
        encode_batch([1.0, []])
    with pytest.raises(KVEventError, match="not a KV cache event"):
        encode_batch(KVEventBatch(1.0, ["BlockStored"]))


def test_defaults_are_omitted_and_required_fields_kept():
    stored = BlockStored([1], None, [9], 1, None, None, None)
    raw = unpackb(encode_batch(KVEventBatch(0.0, [stored])))[1][0]
    assert list(raw) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                         "block_size", "lora_id", "medium", "lora_name"]


# ---------------------------------------------------------------- the publisher


def _endpoints():
    name = uuid.uuid4().hex
    return f"inproc://kv-{name}", f"inproc://kv-replay-{name}"


def _recv(sock, timeout_ms=2000):
    assert sock.poll(timeout_ms), "no message"
    return sock.recv_multipart()


def test_publisher_frames_sequence_and_replay():
    ctx = zmq.Context.instance()
    endpoint, replay = _endpoints()
    pub = ZmqEventPublisher(endpoint, replay, buffer_steps=3, topic="kv@r0")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@r0")
    sub.connect(endpoint)
    time.sleep(0.05)  # ZMQ's slow joiner: a SUB sees only what is sent after it joins
    try:
        batches = [KVEventBatch(float(i), [BlockRemoved([i], "GPU")]) for i in range(5)]
        for b in batches:
            pub.publish(b)
        pub.flush()
        assert pub.seq == 5
        for i in range(5):
            topic, seq, payload = _recv(sub)
            assert topic == b"kv@r0" and int.from_bytes(seq, "big") == i
            got = decode_batch(payload)
            assert got.events == batches[i].events and got.data_parallel_rank == 0
        pub.publish_events([])  # nothing to send: no batch, no sequence number
        pub.flush()
        assert pub.seq == 5
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            frames = _recv(dealer)
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
            assert frames[1] == b"kv@r0"
            assert decode_batch(frames[3]).events == batches[seqs[-1]].events
        assert seqs == [2, 3, 4]  # the buffer keeps the last buffer_steps batches
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.close()
    with pytest.raises(KVEventError, match="closed"):
        pub.publish(KVEventBatch(0.0, []))


def test_publisher_checks_its_arguments():
    with pytest.raises(KVEventError, match="buffer_steps"):
        ZmqEventPublisher(_endpoints()[0], buffer_steps=0)
    with pytest.raises(KVEventError, match="topic"):
        ZmqEventPublisher(_endpoints()[0], topic=b"kv")
    with ZmqEventPublisher(_endpoints()[0]) as pub:
        with pytest.raises(KVEventError, match="KVEventBatch"):
            pub.publish([BlockRemoved([1], None)])
        with pytest.raises(KVEventError, match="not a KV cache event"):
            pub.publish(KVEventBatch(0.0, [1]))
        assert pub.seq == 0


# ---------------------------------------------------------------- the caches publish


def _contents(cache) -> Counter:
    """The external hashes the cache holds, counted, read from the cache itself."""
    held: Counter = Counter()
    if isinstance(cache, EventHashCache):
        for block in cache.units():
            held[external_block_hash(block.block_hash)] += 1
        return held
    for node in cache.nodes():
        path, walk = [], node
        while walk.parent is not None:
            path.append(list(walk.key))
            walk = walk.parent
        tokens = [t for part in reversed(path) for t in part]
        salt = getattr(node.key_fn, "salt", None)
        mine = vllm_block_hashes(tokens, cache.page_size, salt=salt)[-(node.length //
                                                                        cache.page_size):]
        held.update(external_block_hash(h) for h in mine)
    return held


def _apply(events, held: Counter) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert held[h] > 0, "removal of a hash the events never stored"
                held[h] -= 1
                if not held[h]:
                    del held[h]
        else:
            held.clear()


_ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), min_size=0, max_size=14),
              st.sampled_from([None, "a"])),
    st.tuples(st.just("evict"), st.integers(1, 12), st.none()),
    st.tuples(st.just("reset"), st.none(), st.none())), max_size=25)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["radix", "hash"]), st.sampled_from([1, 2, 4]), _ops)
def test_events_replayed_equal_the_cache(kind, page, ops):
    """Whatever happens to the cache, its events applied in order give what it holds."""
    cache = EventRadixCache(page) if kind == "radix" else EventHashCache(page)
    held: Counter = Counter()
    next_page = 0
    for op, arg, salt in ops:
        if op == "insert":
            n = len(arg)
            pages = -(-n // page)
            slots = torch.arange(next_page * page, next_page * page + n, dtype=torch.int64)
            next_page += pages
            cache.insert_prefix(torch.tensor(arg, dtype=torch.int64), slots, salt=salt)
            events = cache.take_events()
            expect = {external_block_hash(h) for h in vllm_block_hashes(arg, page, salt=salt)}
            for event in events:
                assert isinstance(event, BlockStored) and event.block_size == page
                assert set(event.block_hashes) <= expect
                assert len(event.token_ids) == page * len(event.block_hashes)
                assert len(event.extra_keys) == len(event.block_hashes)
        elif op == "evict":
            cache.evict(min(arg, cache.evictable_size))
            events = cache.take_events()
            assert all(isinstance(e, BlockRemoved) for e in events)
        else:
            cache.reset()
            events = cache.take_events()
            assert events == [AllBlocksCleared()]
        _apply(events, held)
        assert held == _contents(cache)
        decoded = decode_batch(encode_batch(KVEventBatch(0.0, events)))
        assert decoded.events == events and decoded.bad_events == 0


def test_salted_store_carries_the_bare_salt_on_the_first_block_only():
    cache = EventRadixCache(2)
    cache.insert_prefix(torch.tensor([1, 2, 3, 4]), torch.arange(4), salt="t")
    (event,) = cache.take_events()
    assert event.extra_keys == [("t",), None] and event.parent_block_hash is None
    cache.insert_prefix(torch.tensor([1, 2, 3, 4, 5, 6]), torch.arange(6), salt="t")
    (event,) = cache.take_events()
    assert event.extra_keys == [None] and event.token_ids == [5, 6]
    assert event.parent_block_hash == external_block_hash(
        vllm_block_hashes([1, 2, 3, 4], 2, salt="t")[-1])


def test_match_and_split_say_nothing():
    cache = EventRadixCache(2)
    cache.insert_prefix(torch.tensor([1, 2, 3, 4, 5, 6]), torch.arange(6))
    cache.take_events()
    cache.match_prefix(torch.tensor([1, 2, 3, 4, 9, 9]))  # splits the node at 4
    assert cache.take_events() == []
    assert cache.num_nodes == 2


def test_use_event_cache_swaps_a_fresh_engines_cache(tiny64):
    from minirt.engine import Engine
    from minirt.request import Request

    for kind in ("radix", "hash"):
        engine = Engine(tiny64, capacity=256, page_size=4, cache=kind)
        cache = use_event_cache(engine)
        assert engine.cache is cache is engine.lifecycle.cache
        engine.generate([Request(list(range(1, 14)), max_new_tokens=3)], progress=False)
        stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
        assert stored and stored[0].block_hashes[:3] == [
            external_block_hash(h) for h in vllm_block_hashes(list(range(1, 13)), 4)]
        with pytest.raises(RequestError, match="already holds"):
            use_event_cache(engine)
    engine = Engine(tiny64, capacity=256, page_size=4, host_capacity=512)
    with pytest.raises(RequestError, match="host tier"):
        use_event_cache(engine)


# ---------------------------------------------------------------- the config and the server


def test_kv_events_config_as_vllm_reads_it():
    config = ke.parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config["publisher"] == "zmq" and config["endpoint"] == "tcp://*:5557"
    assert config["buffer_steps"] == 10_000 and config["replay_endpoint"] is None
    assert ke.parse_kv_events_config("{}")["publisher"] == "null"
    for text, match in [("{bad", "not JSON"), ("[1]", "JSON object"),
                        ('{"enable": true}', "unknown"), ('{"publisher": "kafka"}', "zmq")]:
        with pytest.raises(KVEventError, match=match):
            ke.parse_kv_events_config(text)


def test_serve_refuses_a_bad_config_before_loading_the_model(capsys):
    from minirt import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--kv-events-config", '{"enable_kv_cache_events": 1, "port": 5}'])
    assert exc.value.code == 2 and "unknown --kv-events-config fields" in capsys.readouterr().err


def test_an_engine_publishes_each_steps_events(tiny64):
    from minirt.engine import Engine
    from minirt.kv_event_caches import publish_engine_events
    from minirt.request import Request

    endpoint, replay = _endpoints()
    engine = Engine(tiny64, capacity=256, page_size=4)
    assert publish_engine_events(engine, ke.parse_kv_events_config("{}")) is None
    pub = publish_engine_events(engine, ke.parse_kv_events_config(
        json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint,
                    "replay_endpoint": replay})))
    try:
        engine.generate([Request(list(range(1, 14)), max_new_tokens=2)], progress=False)
        pub.flush()
        assert pub.seq >= 1
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        events = []
        while (frames := _recv(dealer))[2] != END_SEQ:
            events += decode_batch(frames[3]).events
        dealer.close(linger=0)
        held = Counter()
        _apply(events, held)
        assert held == _contents(engine.cache) and held
    finally:
        pub.close()
