"""Mooncake's public request traces as request streams, token ids made from their block hashes.

Mooncake's FAST'25 release publishes request traces (the conversation trace sampled from
one hour of online requests; the synthetic one built from public datasets, its arrivals
drawn from a Poisson process) as JSON lines, one request a line: ``timestamp`` (arrival,
in milliseconds from the trace's start), ``input_length`` and ``output_length`` (tokens),
and ``hash_ids``, one id per 512-token block of the prompt (``FAST25-release/README.md``
of github.com/kvcache-ai/Mooncake). The text itself is not published; equal hash ids mean
equal prefixes, so a prefix cache can be replayed on the ids alone. minirt ships two of
the traces, gzip-compressed, in ``minirt/data/traces/`` (``NOTICE`` there names the source
commit; ``LICENSE`` is the source's licence), and checks each file's SHA-256 on every
load, so a replay needs no network and cannot silently read a different file.

Token ids are synthesized: hash id ``h`` becomes the block ``h * block_size, h * block_size
+ 1, ...``, so distinct ids give disjoint blocks and two requests share exactly the
tokens of the blocks whose hash ids they share. ``block_size`` is 512, the traces' own,
or smaller to replay a trace faster at the same shape (``block_size=1`` makes each block
one token: a cache then counts blocks).

The last block is usually partial (``input_length`` is a multiple of 512 in 26 of the
16,024 requests). It keeps its share of the block, rounded up: ``ceil(r * block_size /
512)`` tokens for ``r`` tokens of 512, which is exactly ``r`` at ``block_size=512`` (so a
request has exactly ``input_length`` tokens) and never empty at a smaller size. Its
tokens are the first ones of its hash id's block, so it is a prefix of that block and
shares tokens with another request only where the two share its hash id. In the
published traces a hash id always names a block of one length (the loader checks it),
so a partial block is shared whole or not at all. A page-aligned cache (a radix cache
with ``page_size=block_size``, the hash cache) never caches it, as a 512-token-block
system would not; a token-granular radix cache does.

No model and no torch: token ids are lists of ints.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import TraceError

__all__ = [
    "TRACE_BLOCK",
    "TRACES",
    "Trace",
    "TraceFile",
    "TraceRequest",
    "iter_requests",
    "load_trace",
    "trace_path",
]

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces (FAST25-release/README.md)
DATA_DIR = Path(__file__).parent / "data" / "traces"


@dataclass(frozen=True)
class TraceFile:
    """A trace shipped with minirt: its file in ``DATA_DIR`` and what the file must be."""

    name: str
    filename: str
    sha256: str  # of the uncompressed JSON lines, as published
    requests: int


TRACES: dict[str, TraceFile] = {
    t.name: t for t in (
        TraceFile("conversation", "conversation_trace.jsonl.gz",
                  "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 12031),
        TraceFile("synthetic", "synthetic_trace.jsonl.gz",
                  "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 3993),
    )
}


def _block_len(request_len: int, index: int, blocks: int, block_size: int) -> int:
    """Synthesized tokens of block ``index`` of a request of ``request_len`` trace tokens."""
    if index < blocks - 1:
        return block_size
    r = request_len - TRACE_BLOCK * (blocks - 1)  # 1..512 trace tokens in the last block
    return -(-r * block_size // TRACE_BLOCK)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) \
            or not 1 <= block_size <= TRACE_BLOCK:
        raise ValueError(f"block_size must be an int from 1 to {TRACE_BLOCK}, got {block_size!r}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrived, how long it is, and its blocks' hash ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000

    def block_lengths(self, block_size: int = TRACE_BLOCK) -> list[int]:
        """Synthesized tokens per block: ``block_size`` each, the last one's share rounded up."""
        _check_block_size(block_size)
        n = len(self.hash_ids)
        return [_block_len(self.input_length, i, n, block_size) for i in range(n)]

    def token_ids(self, block_size: int = TRACE_BLOCK) -> list[int]:
        """The prompt as token ids: block ``h`` is ``h * block_size`` onward, cut to its length."""
        ids: list[int] = []
        for h, length in zip(self.hash_ids, self.block_lengths(block_size), strict=True):
            ids.extend(range(h * block_size, h * block_size + length))
        return ids


def _field(obj: dict, key: str, where: str, minimum: int) -> int:
    value = obj.get(key)
    if value is None:
        raise TraceError(f"{where}: field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: field {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def iter_requests(lines: Iterable[str | bytes], name: str = "trace") -> Iterator[TraceRequest]:
    """Parse JSON lines into requests, one at a time, checking each as it comes.

    TraceError naming the line (1-based) and the field if a line is not a JSON object, a
    field is missing or not a non-negative int (``input_length`` and ``output_length`` at
    least 1), ``hash_ids`` is not ``ceil(input_length / 512)`` non-negative ints, a
    timestamp goes back in time, or a hash id names another block than before (another
    position, predecessor or length): equal ids must mean equal prefixes. Blank lines
    are skipped.
    """
    seen: dict[int, tuple[int, int, int]] = {}  # hash id -> (position, predecessor, length)
    last_time = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise TraceError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        time = _field(obj, "timestamp", where, 0)
        length = _field(obj, "input_length", where, 1)
        output = _field(obj, "output_length", where, 1)
        if time < last_time:
            raise TraceError(f"{where}: field 'timestamp' {time} is before the previous "
                             f"request's {last_time}")
        ids = obj.get("hash_ids")
        blocks = -(-length // TRACE_BLOCK)
        if not isinstance(ids, list) or len(ids) != blocks:
            raise TraceError(f"{where}: field 'hash_ids' must list {blocks} ids (one per "
                             f"{TRACE_BLOCK} tokens of input_length {length}), got {ids!r:.80}")
        prev = -1
        for i, h in enumerate(ids):
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise TraceError(f"{where}: field 'hash_ids'[{i}] must be an int >= 0, got {h!r}")
            block = (i, prev, _block_len(length, i, blocks, TRACE_BLOCK))
            if seen.setdefault(h, block) != block:
                raise TraceError(
                    f"{where}: field 'hash_ids'[{i}] = {h} names a block at position "
                    f"{block[0]} after id {block[1]} of {block[2]} tokens, but earlier one at "
                    f"position {seen[h][0]} after id {seen[h][1]} of {seen[h][2]} tokens")
            prev = h
        last_time = time
        yield TraceRequest(time, length, output, tuple(ids))


@dataclass(frozen=True)
class Trace:
    """A whole trace, requests in arrival order; iterating it yields the requests."""

    name: str
    requests: tuple[TraceRequest, ...]

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def token_ids(self, block_size: int = TRACE_BLOCK) -> list[list[int]]:
        """Every request's synthesized prompt, in order (the input ``minirt.simulate`` takes)."""
        return [r.token_ids(block_size) for r in self.requests]

    @property
    def block_lookups(self) -> int:
        """Blocks requested over the whole trace (one lookup per hash id)."""
        return sum(len(r.hash_ids) for r in self.requests)

    def total_tokens(self, block_size: int = TRACE_BLOCK) -> int:
        return sum(sum(r.block_lengths(block_size)) for r in self.requests)

    def unique_tokens(self, block_size: int = TRACE_BLOCK) -> int:
        """Distinct token prefixes in the trace: what any cache must compute at least once.

        Each block is a node of the trace's prefix tree, named by the path of hash ids
        leading to it; a node holds the longest of its occurrences (a partial block is a
        prefix of the full one).
        """
        longest: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> tokens
        nodes: dict[tuple[int, int], int] = {}    # (parent node, hash id) -> node number
        for r in self.requests:
            parent = -1
            for h, length in zip(r.hash_ids, r.block_lengths(block_size), strict=True):
                key = (parent, h)
                parent = nodes.setdefault(key, len(nodes))
                longest[key] = max(longest.get(key, 0), length)
        return sum(longest.values())

    def ceiling(self, block_size: int = TRACE_BLOCK) -> float:
        """The trace's best possible token hit rate: an unbounded cache that keeps everything,
        ``1 - unique_tokens / total_tokens``. No policy and no capacity does better."""
        total = self.total_tokens(block_size)
        return 1 - self.unique_tokens(block_size) / total if total else 0.0


def trace_path(name: str) -> Path:
    """Where the shipped trace ``name`` ("conversation" or "synthetic") lies."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; the shipped ones are {sorted(TRACES)}")
    return DATA_DIR / TRACES[name].filename


def load_trace(source: str | Path = "conversation", *, sha256: str | None = None) -> Trace:
    """A trace, its file's SHA-256 checked first: a shipped one by name, or a file by path.

    A shipped trace is always checked against ``TRACES``; a file given by path (JSON lines,
    gzip-compressed or not) is checked against ``sha256`` when one is given. The digest is
    of the uncompressed bytes, so it matches the file as published. TraceError on a
    mismatch, or on the first malformed line (``iter_requests``).
    """
    if isinstance(source, str) and source in TRACES:
        path, name = trace_path(source), source
        sha256 = TRACES[source].sha256 if sha256 is None else sha256
    else:
        path = Path(source)
        name = path.name
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256.lower():
        raise TraceError(f"{name}: sha256 {digest} does not match the expected {sha256}; "
                         "the file is not the trace it claims to be")
    return Trace(name, tuple(iter_requests(raw.decode("utf-8").splitlines(), name)))
