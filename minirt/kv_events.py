"""KV cache events in vLLM 0.32's format: what an engine says it stored and removed.

A router that knows what each replica caches, instead of guessing from the text it
routed, needs the replicas to say so. vLLM publishes three events from its block pool
(vllm 0.32.0 `distributed/kv_events.py: BlockStored, BlockRemoved, AllBlocksCleared`):

* ``BlockStored``: full blocks entered the prefix cache: their ``block_hashes``, the hash
  of the block before the first of them (``parent_block_hash``, None at the prompt's
  start), their ``token_ids`` and ``block_size``
  (vllm 0.32.0 `v1/core/block_pool.py: BlockPool.cache_full_blocks`);
* ``BlockRemoved``: blocks left it, one event per evicted block
  (vllm 0.32.0 `v1/core/block_pool.py: BlockPool._emit_block_removed_events`);
* ``AllBlocksCleared``: the prefix cache was reset
  (vllm 0.32.0 `v1/core/block_pool.py: BlockPool.reset_prefix_cache`).

The scheduler takes a step's events and publishes them as one ``KVEventBatch`` stamped
with the time (vllm 0.32.0 `v1/core/sched/scheduler.py: Scheduler.update_from_output`).
The wire format is msgpack via msgspec: a batch is an array ``[ts, events,
data_parallel_rank]`` (``array_like=True``; msgspec writes a None rank as nil), each
event a map whose first key ``"type"`` names its class (``tag=True``), and an event's
fields left at their default are omitted (``omit_defaults=True``)
(vllm 0.32.0 `distributed/kv_events.py: EventBatch, KVCacheEvent`).
minirt writes that subset of msgpack itself (``packb``/``unpackb``, about 100 lines)
rather than depend on msgspec; tests/fixtures/vllm_kv_events.json holds bytes msgspec
produced from vLLM's own classes, and the tests require byte equality both ways.

Transport (vllm 0.32.0 `distributed/kv_events.py: ZmqEventPublisher`): a ZMQ PUB
socket sends three frames per batch, ``(topic, seq, payload)``, ``seq`` an 8-byte
big-endian counter from 0 per publisher; an optional ROUTER socket answers a replay
request (8-byte big-endian start seq) with every buffered batch from that seq on, then
an end marker whose seq frame is -1. The config is ``--kv-events-config`` /
``KVEventsConfig`` (vllm 0.32.0 `config/kv_events.py: KVEventsConfig`: endpoint
``tcp://*:5557``, replay_endpoint None, buffer_steps 10000, hwm 100000, topic "").

Block hashes (vllm 0.32.0 `v1/core/kv_cache_utils.py: hash_block_tokens`): block i's
hash is ``hash_fn((parent, tuple(block_tokens), extra_keys))``, parent the previous
block's hash or ``NONE_HASH`` for the first. The default algorithm is "sha256"
(vllm 0.32.0 `config/cache.py: CacheConfig.prefix_caching_hash_algo`): SHA-256 of the
pickled tuple (vllm 0.32.0 `utils/hashing.py: sha256`). ``NONE_HASH`` is the hash of
the string "vllm-none-hash", or of ``PYTHONHASHSEED`` when set (vllm 0.32.0
`v1/core/kv_cache_utils.py: resolve_none_hash_seed, init_none_hash`). Events carry each
hash cut to its low 64 bits as an int (vllm 0.32.0
`v1/core/kv_cache_utils.py: maybe_convert_block_hash`, on by default through
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). Extra keys are, in order, the LoRA adapter
``("lora", name, path)`` on every block and ``("cache_salt", salt)`` on the first
(vllm 0.32.0 `v1/core/kv_cache_utils.py: generate_block_hash_extra_keys`); minirt has no
multimodal inputs or prompt embeddings, the other two kinds.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .errors import MinirtError
from .hashcache import block_hashes as chained_block_hashes

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "END_SEQ",
    "KVEventBatch",
    "KVEventError",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "VLLM_NONE_HASH_SEED",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
    "none_hash",
    "packb",
    "parse_kv_events_config",
    "unpackb",
    "vllm_block_hashes",
    "vllm_sha256",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
VLLM_NONE_HASH_SEED = "vllm-none-hash"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventError(MinirtError, ValueError):
    """A KV event or batch that cannot be encoded or decoded."""


# ---------------------------------------------------------------- msgpack (the subset used)


def packb(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (None, bool, int, float, str, bytes, list/tuple, dict),
    each in its shortest form, floats as float64: what msgspec's encoder writes."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        _pack_int(obj, out)
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _pack_len(len(raw), out, fix=(0xA0, 32), codes=(0xD9, 0xDA, 0xDB))
        out += raw
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        _pack_len(len(raw), out, fix=None, codes=(0xC4, 0xC5, 0xC6))
        out += raw
    elif isinstance(obj, (list, tuple)):
        _pack_len(len(obj), out, fix=(0x90, 16), codes=(None, 0xDC, 0xDD))
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        _pack_len(len(obj), out, fix=(0x80, 16), codes=(None, 0xDE, 0xDF))
        for key, value in obj.items():
            _pack(key, out)
            _pack(value, out)
    else:
        raise KVEventError(f"cannot encode {type(obj).__name__} as msgpack")


def _pack_int(n: int, out: bytearray) -> None:
    if 0 <= n < 0x80:
        out.append(n)
    elif -32 <= n < 0:
        out.append(n & 0xFF)
    elif n >= 0:
        for code, fmt, bound in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16),
                                 (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64)):
            if n < bound:
                out.append(code)
                out += struct.pack(fmt, n)
                return
        raise KVEventError(f"int {n} does not fit msgpack's 64 bits")
    else:
        for code, fmt, bound in ((0xD0, ">b", 1 << 7), (0xD1, ">h", 1 << 15),
                                 (0xD2, ">i", 1 << 31), (0xD3, ">q", 1 << 63)):
            if n >= -bound:
                out.append(code)
                out += struct.pack(fmt, n)
                return
        raise KVEventError(f"int {n} does not fit msgpack's 64 bits")


def _pack_len(n: int, out: bytearray, fix: tuple[int, int] | None,
              codes: tuple[int | None, int, int]) -> None:
    if fix is not None and n < fix[1]:
        out.append(fix[0] | n)
    elif codes[0] is not None and n < 1 << 8:
        out += bytes((codes[0], n))
    elif n < 1 << 16:
        out.append(codes[1])
        out += struct.pack(">H", n)
    else:
        out.append(codes[2])
        out += struct.pack(">I", n)


def unpackb(data: bytes) -> Any:
    """The object msgpack ``data`` holds (arrays as lists); KVEventError if malformed or
    if bytes are left over. Extension types are refused: vLLM's events use none."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KVEventError(f"unpackb takes bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        obj, pos = _unpack(data, 0)
    except (IndexError, struct.error, UnicodeDecodeError, RecursionError) as exc:
        raise KVEventError(f"malformed msgpack: {exc}") from exc
    if pos != len(data):
        raise KVEventError(f"malformed msgpack: {len(data) - pos} bytes after the object")
    return obj


_FIXED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h",
          0xD2: ">i", 0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}


def _take(data: bytes, pos: int, n: int) -> bytes:
    if pos + n > len(data):
        raise IndexError(f"needs {n} bytes at offset {pos}, has {len(data) - pos}")
    return data[pos:pos + n]


def _unpack(data: bytes, pos: int) -> tuple[Any, int]:
    code = _take(data, pos, 1)[0]
    pos += 1
    if code < 0x80:
        return code, pos
    if code >= 0xE0:
        return code - 0x100, pos
    if 0xA0 <= code <= 0xBF:
        return _take(data, pos, code & 0x1F).decode("utf-8"), pos + (code & 0x1F)
    if 0x90 <= code <= 0x9F:
        return _unpack_items(data, pos, code & 0x0F)
    if 0x80 <= code <= 0x8F:
        return _unpack_map(data, pos, code & 0x0F)
    if code in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[code], pos
    if code in _FIXED:
        fmt = _FIXED[code]
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, _take(data, pos, size))[0], pos + size
    lengths = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4,
               0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
    if code not in lengths:
        raise KVEventError(f"malformed msgpack: type byte 0x{code:02x} at offset {pos - 1} "
                           "is not one vLLM's events use")
    width = lengths[code]
    n = int.from_bytes(_take(data, pos, width), "big")
    pos += width
    if code in (0xD9, 0xDA, 0xDB):
        return _take(data, pos, n).decode("utf-8"), pos + n
    if code in (0xC4, 0xC5, 0xC6):
        return _take(data, pos, n), pos + n
    if code in (0xDC, 0xDD):
        return _unpack_items(data, pos, n)
    return _unpack_map(data, pos, n)


def _unpack_items(data: bytes, pos: int, n: int) -> tuple[list, int]:
    items = []
    for _ in range(n):
        item, pos = _unpack(data, pos)
        items.append(item)
    return items, pos


def _unpack_map(data: bytes, pos: int, n: int) -> tuple[dict, int]:
    out: dict = {}
    for _ in range(n):
        key, pos = _unpack(data, pos)
        if isinstance(key, list):
            raise KVEventError("malformed msgpack: a map key is an array")
        out[key], pos = _unpack(data, pos)
    return out, pos


# ---------------------------------------------------------------- the events

ExternalBlockHash = int | bytes


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the cache (vLLM's fields, in its order; see the module)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the cache."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type] = {cls.__name__: cls
                                for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass
class KVEventBatch:
    """One engine step's events: ``ts`` (seconds since the epoch) and the events in order.

    Decoding keeps going past an event it cannot read: such events are left out of
    ``events`` and counted in ``bad_events`` (unknown ``type``, missing or wrong fields).
    """

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
    bad_events: int = field(default=0, compare=False)


def _event_map(event: KVCacheEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.default is MISSING or value != f.default:  # omit_defaults
            out[f.name] = value
    return out


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM's publisher sends for ``batch`` (msgspec's bytes)."""
    if not isinstance(batch, KVEventBatch):
        raise KVEventError(f"encode_batch takes a KVEventBatch, got {type(batch).__name__}")
    for event in batch.events:
        if type(event) not in EVENT_TYPES.values():
            raise KVEventError(f"not a KV cache event: {event!r}")
    # array_like structs keep every field, defaults included (msgspec writes a nil rank)
    return packb([float(batch.ts), [_event_map(e) for e in batch.events],
                  batch.data_parallel_rank])


def _is_hash(h: Any) -> bool:
    return (isinstance(h, int) and not isinstance(h, bool)) or isinstance(h, bytes)


def _check_event(event: KVCacheEvent) -> None:
    """KVEventError unless the fields have the types vLLM declares for them."""
    if isinstance(event, (BlockStored, BlockRemoved)):
        if not isinstance(event.block_hashes, list) \
                or not all(_is_hash(h) for h in event.block_hashes):
            raise KVEventError(f"block_hashes must be a list of ints or bytes: {event!r}")
    if isinstance(event, BlockStored):
        if event.parent_block_hash is not None and not _is_hash(event.parent_block_hash):
            raise KVEventError(f"bad parent_block_hash: {event.parent_block_hash!r}")
        if not isinstance(event.token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in event.token_ids):
            raise KVEventError("token_ids must be a list of ints")
        if isinstance(event.block_size, bool) or not isinstance(event.block_size, int) \
                or event.block_size < 1:
            raise KVEventError(f"block_size must be a positive int, got {event.block_size!r}")


def _decode_event(raw: Any) -> KVCacheEvent:
    if not isinstance(raw, dict) or "type" not in raw:
        raise KVEventError(f"an event is a map with a 'type' key, got {raw!r:.80}")
    cls = EVENT_TYPES.get(raw["type"])
    if cls is None:
        raise KVEventError(f"unknown event type {raw['type']!r}")
    names = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in raw.items() if k in names}  # msgspec ignores unknown fields
    keys = kwargs.get("extra_keys")
    if isinstance(keys, list):  # typed list[tuple | None]: msgspec decodes tuples
        kwargs["extra_keys"] = [tuple(k) if isinstance(k, list) else k for k in keys]
    try:
        event = cls(**kwargs)
    except TypeError as exc:
        raise KVEventError(f"{raw['type']}: {exc}") from exc
    _check_event(event)
    return event


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in a publisher's payload. KVEventError if the payload is not a batch;
    events inside it that cannot be read are skipped and counted (``bad_events``)."""
    raw = unpackb(payload)
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise KVEventError(f"a batch is an array [ts, events, dp_rank?], got {raw!r:.80}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not isinstance(events, list) \
            or (rank is not None and (isinstance(rank, bool) or not isinstance(rank, int))):
        raise KVEventError(f"a batch is [float, list, int?], got {raw!r:.80}")
    good: list[KVCacheEvent] = []
    bad = 0
    for item in events:
        try:
            good.append(_decode_event(item))
        except KVEventError:
            bad += 1
    return KVEventBatch(float(ts), good, rank, bad)


# ---------------------------------------------------------------- vLLM's block hashes


def vllm_sha256(obj: Any) -> bytes:
    """vLLM's default block hash function: SHA-256 of the pickled object
    (vllm 0.32.0 `utils/hashing.py: sha256`)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The first block's parent: ``vllm_sha256(seed)``, seed ``PYTHONHASHSEED`` if set,
    else "vllm-none-hash", as vLLM resolves it for SHA-256."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", VLLM_NONE_HASH_SEED)
    if not isinstance(seed, str):
        raise KVEventError(f"none_hash's seed must be a str, got {seed!r}")
    return vllm_sha256(seed)


def external_block_hash(block_hash: bytes) -> int:
    """The int an event carries for a block hash: its low 64 bits, big-endian."""
    if not isinstance(block_hash, bytes):
        raise KVEventError(f"a block hash is bytes, got {type(block_hash).__name__}")
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def vllm_block_hashes(tokens: Sequence[int], block_size: int, *, salt: str | None = None,
                      lora: tuple[str, str] | None = None,
                      seed: str | None = None) -> list[bytes]:
    """vLLM's hashes of the full blocks of ``tokens``: 32-byte SHA-256 digests.

    ``salt``: the request's cache_salt; ``lora``: its adapter's (name, path). Without a
    LoRA adapter this is chapter 08's ``hashcache.block_hashes`` with vLLM's hash
    function and ``NONE_HASH`` as the first parent.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KVEventError(f"block_size must be a positive int, got {block_size!r}")
    ids = [int(t) for t in tokens]
    if lora is None:
        return [bytes(h) for h in chained_block_hashes(ids, block_size, none_hash(seed),
                                                         vllm_sha256, salt or None)]
    if not (isinstance(lora, tuple) and len(lora) == 2 and all(isinstance(x, str) for x in lora)):
        raise KVEventError(f"lora is a (name, path) pair of str, got {lora!r}")
    out: list[bytes] = []
    parent = none_hash(seed)
    for i in range(len(ids) // block_size):
        keys: list[tuple] = [("lora", lora[0], lora[1])]
        if i == 0 and salt:
            keys.append(("cache_salt", salt))
        parent = vllm_sha256((parent, tuple(ids[i * block_size:(i + 1) * block_size]),
                              tuple(keys)))
        out.append(parent)
    return out


# ---------------------------------------------------------------- the config

KV_EVENTS_CONFIG: dict[str, Any] = {
    "enable_kv_cache_events": False, "publisher": None, "endpoint": "tcp://*:5557",
    "replay_endpoint": None, "buffer_steps": 10_000, "hwm": 100_000,
    "max_queue_size": 100_000, "topic": ""}
"""vLLM's ``KVEventsConfig`` fields and defaults (``publisher`` None means "zmq" when
events are enabled, else "null")."""


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """``--kv-events-config``'s JSON, as vLLM takes it, with the defaults filled in.
    KVEventError for bad JSON, an unknown field, or a publisher other than zmq/null."""
    import json

    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KVEventError(f"--kv-events-config is not JSON: {exc}") from exc
    if not isinstance(given, dict):
        raise KVEventError(f"--kv-events-config is a JSON object, got {text!r}")
    unknown = sorted(set(given) - set(KV_EVENTS_CONFIG))
    if unknown:
        raise KVEventError(f"unknown --kv-events-config fields {unknown}; known: "
                           f"{sorted(KV_EVENTS_CONFIG)}")
    config = {**KV_EVENTS_CONFIG, **given}
    if config["publisher"] is None:
        config["publisher"] = "zmq" if config["enable_kv_cache_events"] else "null"
    if config["publisher"] not in ("zmq", "null"):
        raise KVEventError(f"publisher must be 'zmq' or 'null', got {config['publisher']!r}")
    return config


# ---------------------------------------------------------------- the publisher


class ZmqEventPublisher:
    """vLLM's publisher: PUB socket, sequence numbers, replay buffer on a ROUTER socket.

    ``publish`` queues a batch; a thread stamps it with the next sequence number, sends
    ``(topic, seq, payload)`` on the PUB socket, keeps it in a buffer of the last
    ``buffer_steps`` batches, and answers replay requests on ``replay_endpoint``.
    ``endpoint``: a ``*`` or ipc/inproc address is bound, any other connected, as vLLM
    does. ``seq`` is the number the next batch will get (how many were sent).
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "",
                 data_parallel_rank: int = 0, context: Any = None) -> None:
        import zmq

        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVEventError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(topic, str):
            raise KVEventError(f"topic must be a str, got {topic!r}")
        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = replay_endpoint
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            try:
                self._replay.bind(replay_endpoint)
            except zmq.ZMQError:  # leave no socket holding the PUB address
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self.seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` for sending (its rank set to this publisher's if None)."""
        if not self._running:
            raise KVEventError("publisher is closed")
        if not isinstance(batch, KVEventBatch):
            raise KVEventError(f"publish takes a KVEventBatch, got {type(batch).__name__}")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        encode_batch(batch)  # refuse a bad batch here, in the caller's thread
        self._queue.put(batch)

    def publish_events(self, events: Sequence[KVCacheEvent]) -> None:
        """Publish ``events`` as one batch stamped now; nothing if there are none."""
        if events:
            self.publish(KVEventBatch(time.time(), list(events)))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued batch is sent."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._service_replay()
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                self._queue.task_done()
                break
            payload = encode_batch(batch)
            seq = self.seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.seq = seq + 1
            self._queue.task_done()

    def _service_replay(self) -> None:
        """Answer one replay request: buffered batches from its start seq, then END_SEQ."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if not self._running:
            return
        self._queue.put(None)
        self._running = False
        self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
