"""A real vLLM CPU server's KV events, recorded by ``make peer-vllm``
(``benchmarks/kv_routing.py --vllm`` writes ``benchmarks/kv_routing_vllm.json``), replayed
into minirt's precise-router index without vLLM: its bytes decode, every full block of
every prompt is found under the hashes minirt computes for the prompt's token ids, the
stored token ids are the prompt's, and ``AllBlocksCleared`` empties the index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minirt.kv_events import AllBlocksCleared, BlockStored, decode_batch
from minirt.precise_router import BlockIndex, KVEventSubscriber, request_block_hashes

RECORD = Path(__file__).resolve().parent.parent / "benchmarks" / "kv_routing_vllm.json"


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


def _replay(record: dict) -> tuple[KVEventSubscriber, set, list]:
    """Apply the recorded batches in order; returns the subscriber, the hashes held just
    before the batch that cleared everything, and every event."""
    sub = KVEventSubscriber(BlockIndex(1), block_size=record["block_size"])
    before_clear: set = set()
    events = []
    for seq, payload in record["frames"]:
        batch = decode_batch(bytes.fromhex(payload))
        events.extend(batch.events)
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            before_clear = set(sub.index.held(0))
        sub.receive(0, seq, bytes.fromhex(payload))
    return sub, before_clear, events


def test_vllm_events_feed_the_index_under_minirt_hashes(record):
    sub, before_clear, events = _replay(record)
    stats = sub.feeds[0].stats
    assert stats.batches == len(record["frames"]) > 0
    assert stats.bad_batches == stats.bad_events == stats.ignored_events == stats.gaps == 0
    assert len(record["prompts"]) >= 2
    for ids, row in zip(record["prompts"], record["rows"], strict=True):
        hashes = request_block_hashes(ids, record["block_size"])
        assert len(hashes) == row["full_blocks"] == len(ids) // record["block_size"]
        assert set(hashes) <= before_clear, "a block vLLM stored is missing under minirt's hash"
        assert row["found"] == row["full_blocks"]
    assert len(sub.index) == 0 == record["indexed_after_reset"]
    assert record["reset"] == {"success": True}


def test_the_tokens_vllm_stored_are_the_prompts(record):
    _, _, events = _replay(record)
    size = record["block_size"]
    blocks = {}
    for ids in record["prompts"]:
        for h, i in zip(request_block_hashes(ids, size), range(0, len(ids), size), strict=False):
            blocks[h] = ids[i:i + size]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.block_size == size for e in stored)
    seen = set()
    for e in stored:
        chunks = [e.token_ids[i:i + size] for i in range(0, len(e.token_ids), size)]
        for h, chunk in zip(e.block_hashes, chunks, strict=True):
            if h in blocks:
                assert blocks[h] == chunk
                seen.add(h)
    assert seen == set(blocks)  # every block of every prompt, stored with its own tokens


def test_other_block_sizes_or_salts_would_not_match(record):
    _, before_clear, _ = _replay(record)
    ids = record["prompts"][0]
    assert not set(request_block_hashes(ids, 16)) & before_clear
    assert not set(request_block_hashes(ids, record["block_size"], salt="tenant-a")) & before_clear
