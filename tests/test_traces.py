"""minirt.traces: the shipped traces load with their checksums; bad input names its line and
field; synthesized token ids share exactly the blocks whose hash ids are shared; the
unique-token bound against a brute-force count of distinct prefixes."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest
from script_loader import load_script

from minirt.errors import MinirtError, TraceError
from minirt.traces import (
    DATA_DIR,
    TRACE_BLOCK,
    TRACES,
    Trace,
    TraceRequest,
    iter_requests,
    load_trace,
    trace_path,
)


def _line(timestamp=0, input_length=600, output_length=5, hash_ids=(1, 2), **extra) -> str:
    obj = {"timestamp": timestamp, "input_length": input_length,
           "output_length": output_length, "hash_ids": list(hash_ids), **extra}
    return json.dumps(obj)


def _trace(*requests: dict) -> Trace:
    return Trace("t", tuple(iter_requests([_line(**r) for r in requests])))


# ------------------------------------------------------------------ the shipped files


@pytest.mark.parametrize("name", sorted(TRACES))
def test_shipped_trace_loads_offline_with_its_checksum(name):
    raw = gzip.decompress(trace_path(name).read_bytes())
    assert hashlib.sha256(raw).hexdigest() == TRACES[name].sha256
    trace = load_trace(name)
    assert len(trace) == TRACES[name].requests == raw.count(b"\n")
    times = [r.timestamp_ms for r in trace]
    assert times == sorted(times)
    for r in trace:  # the shape the docstring promises: one id per 512 tokens
        assert len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK)
    assert 0 < trace.ceiling() < 1


def test_shipped_traces_partial_last_blocks_as_the_docstring_counts():
    whole = sum(r.input_length % TRACE_BLOCK == 0 for name in TRACES for r in load_trace(name))
    assert whole == 26 and sum(t.requests for t in TRACES.values()) == 16024


def test_licence_and_notice_ship_beside_the_traces():
    notice = (DATA_DIR / "NOTICE").read_text()
    assert "github.com/kvcache-ai/Mooncake" in notice
    for t in TRACES.values():
        assert t.sha256 in notice and t.filename.removesuffix(".gz") in notice
    assert "Apache License" in (DATA_DIR / "LICENSE").read_text()


def test_checksum_mismatch_is_a_trace_error(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    good = (_line() + "\n").encode()
    path.write_bytes(gzip.compress(good))
    digest = hashlib.sha256(good).hexdigest()
    assert len(load_trace(path, sha256=digest)) == 1
    assert len(load_trace(path, sha256=digest.upper())) == 1
    path.write_bytes(gzip.compress(good.replace(b"600", b"601")))
    with pytest.raises(TraceError, match="sha256"):
        load_trace(path, sha256=digest)
    plain = tmp_path / "t.jsonl"
    plain.write_bytes(good)  # uncompressed works too, same digest
    assert len(load_trace(plain, sha256=digest)) == 1


def test_a_shipped_trace_is_checked_even_under_its_name(monkeypatch, tmp_path):
    fake = tmp_path / TRACES["synthetic"].filename
    fake.write_bytes(gzip.compress((_line() + "\n").encode()))
    monkeypatch.setattr("minirt.traces.DATA_DIR", tmp_path)
    with pytest.raises(TraceError, match="synthetic: sha256"):
        load_trace("synthetic")


def test_unknown_trace_name():
    with pytest.raises(ValueError, match="conversation"):
        trace_path("toolagent")


# ------------------------------------------------------------------ bad lines


@pytest.mark.parametrize("lines, where", [
    (["{not json"], "line 1: not JSON"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([_line(), json.dumps({"timestamp": 1, "input_length": 5, "hash_ids": [9]})],
     "line 2: field 'output_length' is missing"),
    ([_line(timestamp=-1)], "line 1: field 'timestamp' must be an int >= 0"),
    ([_line(input_length=0, hash_ids=())], "line 1: field 'input_length' must be an int >= 1"),
    ([_line(input_length=True)], "field 'input_length' must be an int"),
    ([_line(output_length=2.5)], "field 'output_length' must be an int"),
    ([_line(hash_ids=(1,))], "line 1: field 'hash_ids' must list 2 ids"),
    ([_line(hash_ids=(1, 2, 3))], "field 'hash_ids' must list 2 ids"),
    ([_line(hash_ids=(1, -2))], r"field 'hash_ids'\[1\] must be an int >= 0"),
    ([_line(hash_ids=(1, "2"))], r"field 'hash_ids'\[1\] must be an int"),
    ([_line(timestamp=5), "", _line(timestamp=4, hash_ids=(1, 3))],
     "line 3: field 'timestamp' 4 is before"),
    # equal ids must mean equal prefixes: same position, same predecessor, same length
    ([_line(hash_ids=(1, 2)), _line(hash_ids=(2, 3))], r"line 2: field 'hash_ids'\[0\] = 2"),
    ([_line(hash_ids=(1, 2)), _line(hash_ids=(7, 2))], r"line 2: field 'hash_ids'\[1\] = 2"),
    ([_line(hash_ids=(1, 2)), _line(input_length=700, hash_ids=(1, 2))],
     r"line 2: field 'hash_ids'\[1\] = 2 .* of 188 tokens, but earlier .* of 88 tokens"),
])
def test_malformed_line_names_line_and_field(lines, where):
    with pytest.raises(TraceError, match=where) as info:
        list(iter_requests(lines))
    assert isinstance(info.value, MinirtError) and isinstance(info.value, ValueError)


def test_malformed_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(_line() + "\n" + _line(hash_ids=(1,)) + "\n")
    with pytest.raises(TraceError, match="mine.jsonl line 2: field 'hash_ids'"):
        load_trace(path)


def test_stream_yields_requests_before_a_bad_line():
    stream = iter_requests([_line(), "oops"])
    assert next(stream) == TraceRequest(0, 600, 5, (1, 2))
    with pytest.raises(TraceError, match="line 2"):
        next(stream)


def test_block_size_must_fit_the_trace():
    r = TraceRequest(0, 600, 5, (1, 2))
    for bad in (0, 513, 1.0, True):
        with pytest.raises(ValueError, match="block_size"):
            r.token_ids(bad)


# ------------------------------------------------------------------ synthesis


def test_token_ids_at_the_trace_block_size():
    r = TraceRequest(1500, 600, 5, (3, 7))
    ids = r.token_ids()
    assert len(ids) == r.input_length == 600
    assert ids[:512] == list(range(3 * 512, 4 * 512))
    assert ids[512:] == list(range(7 * 512, 7 * 512 + 88))
    assert r.arrival_s == 1.5
    assert r.block_lengths() == [512, 88]


@pytest.mark.parametrize("block_size, last", [(1, 1), (2, 1), (16, 3), (64, 11), (512, 88)])
def test_partial_last_block_keeps_its_share_rounded_up(block_size, last):
    r = TraceRequest(0, 512 * 3 + 88, 1, (0, 1, 2, 3))
    assert r.block_lengths(block_size) == [block_size] * 3 + [last]  # ceil(88 * b / 512)
    assert len(r.token_ids(block_size)) == 3 * block_size + last


@pytest.mark.parametrize("block_size", [1, 4, 512])
def test_requests_share_exactly_the_blocks_whose_hash_ids_they_share(block_size):
    a, b, c = _trace(
        {"input_length": 4 * 512, "hash_ids": (5, 6, 7, 8)},
        {"input_length": 2 * 512 + 10, "hash_ids": (5, 6, 9)},
        {"input_length": 2 * 512, "hash_ids": (10, 11)},
    )
    ta, tb, tc = (r.token_ids(block_size) for r in (a, b, c))
    # common prefix: exactly the two shared blocks
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert common == 2 * block_size
    # shared tokens anywhere: exactly those of the shared hash ids, none of the others
    assert set(ta) & set(tb) == set(ta[:2 * block_size])
    assert not set(ta) & set(tc) and not set(tb) & set(tc)
    # every block is distinct within a request too
    for ids in (ta, tb, tc):
        assert len(set(ids)) == len(ids)


def test_a_repeated_partial_block_is_shared_whole():
    a, b = _trace({"input_length": 600, "hash_ids": (1, 2)},
                  {"timestamp": 3, "input_length": 600, "hash_ids": (1, 2)})
    assert a.token_ids(16) == b.token_ids(16)


# ------------------------------------------------------------------ the ceiling


def _reference_unique(prompts: list[list[int]]) -> int:
    """Distinct token prefixes, by brute force."""
    return len({tuple(p[:i + 1]) for p in prompts for i in range(len(p))})


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_unique_tokens_and_ceiling_against_brute_force(block_size):
    trace = _trace(
        {"timestamp": 0, "input_length": 1024 + 100, "hash_ids": (0, 1, 2)},
        {"timestamp": 1, "input_length": 1024 + 100, "hash_ids": (0, 1, 2)},  # a repeat
        {"timestamp": 2, "input_length": 1024 + 512, "hash_ids": (0, 1, 3)},
        {"timestamp": 2, "input_length": 300, "hash_ids": (4,)},
        {"timestamp": 9, "input_length": 512 + 1, "hash_ids": (0, 5)},
        {"timestamp": 9, "input_length": 1, "hash_ids": (6,)},
    )
    prompts = trace.token_ids(block_size)
    unique = _reference_unique(prompts)
    total = sum(map(len, prompts))
    assert trace.unique_tokens(block_size) == unique
    assert trace.total_tokens(block_size) == total
    assert trace.ceiling(block_size) == pytest.approx(1 - unique / total)


def test_ceiling_of_a_trace_without_repeats_is_zero_and_of_an_empty_trace_too():
    trace = _trace({"input_length": 700, "hash_ids": (1, 2)},
                   {"input_length": 700, "hash_ids": (3, 4)})
    assert trace.ceiling() == 0.0 and trace.ceiling(1) == 0.0
    assert Trace("empty", ()).ceiling() == 0.0


def test_unique_tokens_of_the_shipped_trace_against_brute_force_on_its_head():
    head = Trace("head", load_trace("synthetic").requests[:200])
    prompts = head.token_ids(2)
    assert head.unique_tokens(2) == _reference_unique(prompts)
    assert head.block_lookups == sum(len(r.hash_ids) for r in head)


# ------------------------------------------------------------------ benchmarks/traces.py


def _bench():
    return load_script("benchmarks/traces.py", "bench_traces")


@pytest.mark.parametrize("name", sorted(TRACES))
def test_benchmark_table_on_the_head_of_each_trace_never_beats_belady(name):
    bench = _bench()
    head = Trace(name, load_trace(name).requests[:60])
    rows, tails, failures = bench.policy_table(head)
    assert failures == []
    assert len(rows) == len(tails) == len(bench.FRACTIONS)
    assert all(r.startswith(name) for r in rows + tails)
    assert {"slru", "tlru"} <= set(bench.COLUMNS)  # every policy SGLang's flag names
    assert bench.policy("tlru").threshold == bench.TLRU_THRESHOLD
    # each tail cell is a P90 (whole blocks) and a share in %
    cells = tails[0].split()[3:]
    assert len(cells) == 2 * len(bench.POLICIES)
    assert all(0.0 <= float(c) <= 100.0 for c in cells[1::2])


def test_benchmark_reports_a_policy_above_belady(monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "belady_hit_rate", lambda prompts, cap: 0.0)
    head = Trace("conversation", load_trace("conversation").requests[:60])
    _, _, failures = bench.policy_table(head)
    assert any("lru" in f and "above Belady" in f for f in failures)
    assert not any("Belady fell" in f for f in failures)  # 0.0 every time: not a fall
