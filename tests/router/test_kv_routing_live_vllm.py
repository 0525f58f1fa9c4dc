"""benchmarks/kv_routing_live.py --vllm-replica: the same side by side with vLLM's CPU
server as the last replica, publishing its own KV events (``make kv-routing-live-vllm``;
needs ``.venv-router`` and ``.venv-vllm``).

Runs the script once on a shorter workload and checks: the JSON is what ``main``
returns; the vLLM replica's log shows the KV blocks the script asked for
(``--num-gpu-blocks-override``, fewer than it profiled) and the capacity the minirt
replicas have; every response named a known replica (vLLM's ``system_fingerprint``
set to its name); every policy's prompt tokens equal (the script also checks each
response's against the ids the client hashed); outputs equal round robin's, within and
across the kinds of replica; the precise router's feed clean, with exactly one late
start per subscriber (the vLLM server is kept across policies and its events number on,
so a new subscriber catches up from its replay socket; two_routers has two subscribers)
and no partial rebuild; the vLLM server emptied before every run; a request the precise
router sent to the vLLM replica on the strength of that replica's own events found
those tokens cached; and no process outlives the run. Which policy finds more cached
depends on timing and is not asserted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PYTHON = os.environ.get("ROUTER_PYTHON", str(ROOT / ".venv-router" / "bin" / "python"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REQUESTS = 18


@pytest.fixture(scope="module")
def run(live, tmp_path_factory):
    if not Path(ROUTER_PYTHON).exists():
        pytest.fail(f"no router venv at {ROUTER_PYTHON}: run `make kv-routing-live-vllm`")
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: run `make kv-routing-live-vllm`")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    path = tmp_path_factory.mktemp("live") / "live_vllm.json"
    table = live.main(["--router-python", ROUTER_PYTHON, "--requests", str(REQUESTS),
                       "--vllm-replica", "--json", str(path)])
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    return table, json.loads(path.read_text()), after - before


def test_the_json_is_what_main_returns(live, run):
    table, written, _ = run
    assert written == table
    assert written["policies"] == list(live.POLICIES)
    assert set(written["workloads"]) == set(written["outputs_by_kind"]) == set(live.SCENARIOS)
    for rows in written["workloads"].values():
        for row in rows.values():
            assert len(row["per_request"]) == REQUESTS
            assert row["outputs_same_kind"][1] <= REQUESTS


def test_the_vllm_replica_got_the_blocks_asked_for(run):
    settings = run[0]["settings"]
    vllm = settings["vllm_replica"]
    blocks = settings["capacity"] // settings["page"] + 1  # + the null block
    assert vllm["name"] == f"r{settings['replicas'] - 1}" and vllm["block_size"] == 32
    assert vllm["num_gpu_blocks_override"] == blocks
    log = vllm["log"]
    assert log["override_blocks"] == blocks < log["profiled_blocks"]
    assert log["kv_cache_tokens"] == blocks * settings["page"]
    assert vllm["resets"] == len(run[0]["policies"]) * len(run[0]["workloads"])


def test_every_response_named_a_replica_and_counted_the_same_prompt(run):
    table = run[0]
    names = {f"r{i}" for i in range(table["settings"]["replicas"])}
    for scenario, rows in table["workloads"].items():
        assert len({row["prompt_tokens"] for row in rows.values()}) == 1, scenario
        for policy, row in rows.items():
            assert {x["replica"] for x in row["per_request"]} <= names, (scenario, policy)
            assert sum(row["per_replica"]) == REQUESTS, (scenario, policy)
            assert 0 <= row["hit_tokens"] <= row["prompt_tokens"], (scenario, policy)
        assert rows["round_robin"]["per_replica"] == [REQUESTS // 3] * 3  # dealt in turn


def test_outputs_equal_within_and_across_kinds(run):
    table = run[0]
    for scenario, rows in table["workloads"].items():
        for policy, row in rows.items():
            equal, compared = row["outputs_same_kind"]
            assert equal == compared, (scenario, policy)
            assert row["outputs_equal"] == REQUESTS, (scenario, policy, table["outputs_by_kind"])
        kinds = table["outputs_by_kind"][scenario]
        assert kinds["differ_within_kind"] == {"minirt": 0, "vllm": 0}, scenario
        assert kinds["answered_by_both"] > 0, scenario  # round robin alone ensures it


def test_the_precise_router_read_vllms_events(run):
    table = run[0]
    vllm = table["settings"]["vllm_replica"]["name"]
    confirmed = 0
    for scenario, rows in table["workloads"].items():
        feed = rows["precise"]["feed"]
        assert feed["bad_batches"] == feed["bad_events"] == feed["gaps"] == 0, scenario
        assert feed["ignored_events"] == 0, scenario  # no other block size or medium
        subscribers = 2 if scenario == "two_routers" else 1  # each starts late on vLLM's
        assert feed["late_starts"] == subscribers and feed["partial_rebuilds"] == 0, scenario
        assert feed["disconnects"] == (scenario == "restart"), scenario
        confirmed += sum(x["replica"] == vllm and x["indexed"] and x["cached"] >= x["indexed"]
                         for x in rows["precise"]["per_request"])
    assert confirmed > 0  # vLLM's own events, under minirt's hashes, credited what it had


def test_no_process_outlives_the_run(run):
    assert run[2] == set()
