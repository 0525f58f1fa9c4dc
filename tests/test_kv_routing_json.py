"""``benchmarks/kv_routing.json``, the recorded run of ``benchmarks/kv_routing.py`` that
chapter 09c reads: the schema its docstring gives, each row consistent with itself, and
the claims benchmarks/README.md makes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "kv_routing.json"
ROW = {"prompt_tokens", "hit_tokens", "computed", "hit_rate", "ttft_mean", "ttft_p90",
       "spread", "outputs_equal", "requests", "reasons", "stale_credits", "removed_blocks",
       "window", "feed"}


@pytest.fixture(scope="module")
def table() -> dict:
    return json.loads(RECORD.read_text())


def test_the_schema(table):
    assert table["schema"] == 1
    assert table["command"].startswith("python benchmarks/kv_routing.py")
    assert {"model", "replicas", "capacity", "page", "requests", "tenants", "prompt_tokens",
            "concurrency", "max_new_tokens", "balance_abs", "balance_rel", "cache_threshold",
            "seed"} == set(table["settings"])
    assert set(table["workloads"]) == {"eviction", "restart", "two_routers"}
    assert table["policies"][0] == "round_robin"
    assert {"approx", "precise_09a", "precise", "oracle"} <= set(table["policies"])
    for rows in table["workloads"].values():
        assert list(rows) == table["policies"]
        for row in rows.values():
            assert set(row) == ROW
    staleness = table["staleness"]
    assert set(staleness["precise"]["transport_ms"]) == {"batches", "p50", "p90", "max"}
    assert staleness["approx"]["evictions_seen"] is False


def test_each_row_adds_up(table):
    n = table["settings"]["requests"]
    for workload, rows in table["workloads"].items():
        for policy, row in rows.items():
            where = f"{workload}/{policy}"
            assert row["computed"] == row["prompt_tokens"] - row["hit_tokens"], where
            assert abs(row["hit_rate"] - row["hit_tokens"] / row["prompt_tokens"]) < 1e-4, where
            assert row["requests"] == row["outputs_equal"] == n, where
            assert sum(row["reasons"].values()) == n, where
            assert (row["feed"] is not None) == policy.startswith("precise"), where
            if row["feed"] is not None:
                assert row["feed"]["gaps"] == row["feed"]["bad_batches"] == 0, where
                assert row["feed"]["restarts"] == 0, where
                assert row["feed"]["disconnects"] == (workload == "restart"), where


def test_the_claims_the_readme_makes(table):
    rows = table["workloads"]
    for workload in ("eviction", "restart"):
        assert rows[workload]["precise"]["hit_tokens"] > rows[workload]["approx"]["hit_tokens"]
        assert rows[workload]["precise"]["hit_tokens"] > rows[workload]["precise_09a"]["hit_tokens"]
    for workload in rows:  # the same knowledge routes the same
        assert rows[workload]["precise"]["hit_tokens"] == rows[workload]["oracle"]["hit_tokens"]
    for workload in rows:
        assert rows[workload]["approx"]["stale_credits"] > 0
        assert rows[workload]["round_robin"]["removed_blocks"] > 0
