"""benchmarks/kv_routing_live.py: round robin, SGLang's real router and the precise router
fed by live KV events, in front of real minirt.serve replicas (``make test-router``;
needs ``.venv-router``).

Runs the script once on a shorter workload and checks what it returns and writes: the
JSON's shape, every policy's outputs equal round robin's, hit tokens within the prompt
tokens, the same prompt tokens for every policy, round robin dealing requests in turn,
the precise router's feed clean and, in the restart workload, the restart seen by its
feed; in the two_routers workload, two SGLang routers started alike (the same workers
and settings, each on its own port) and two precise routers, each with its own
subscriber and index, each deciding every other request; and that no process outlives
the run. The numbers themselves (which policy finds more cached) depend on timing and
are not asserted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PYTHON = os.environ.get("ROUTER_PYTHON", str(ROOT / ".venv-router" / "bin" / "python"))
REQUESTS = 18


@pytest.fixture(scope="module")
def run(live, tmp_path_factory):
    if not Path(ROUTER_PYTHON).exists():
        pytest.fail(f"no router venv at {ROUTER_PYTHON}: run `make test-router`")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    path = tmp_path_factory.mktemp("live") / "live.json"
    made: list[tuple[str, str, object]] = []  # (scenario, "sglang" | "precise", what)
    scenario = {}
    originals = live.run, live.start_router, live.PreciseRouter

    def run_policy(policy, name, *args, **kwargs):
        scenario["now"] = name
        return originals[0](policy, name, *args, **kwargs)

    def start_router(python, urls, policy, **kwargs):
        router = originals[1](python, urls, policy, **kwargs)
        made.append((scenario["now"], "sglang", (urls, policy, kwargs, router.url)))
        return router

    class Precise(originals[2]):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((scenario["now"], "precise", self))

    live.run, live.start_router, live.PreciseRouter = run_policy, start_router, Precise
    try:
        table = live.main(["--router-python", ROUTER_PYTHON, "--requests", str(REQUESTS),
                           "--json", str(path)])
    finally:
        live.run, live.start_router, live.PreciseRouter = originals
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    return table, json.loads(path.read_text()), after - before, made


def test_the_json_is_what_main_returns_and_has_every_row(live, run):
    table, written = run[0], run[1]
    assert written == table
    assert written["schema"] == 1 and written["policies"] == list(live.POLICIES)
    assert set(written["workloads"]) == set(live.SCENARIOS)
    assert written["settings"]["requests"] == REQUESTS
    keys = {"prompt_tokens", "hit_tokens", "hit_rate", "ttft_ms_median", "ttft_ms_p90",
            "per_replica", "spread_mean", "spread_max", "outputs_equal", "requests",
            "seconds", "feed", "reasons", "credited_but_gone", "restart_seconds",
            "per_request"}
    for rows in written["workloads"].values():
        assert set(rows) == set(live.POLICIES)
        for row in rows.values():
            assert set(row) == keys
            assert [r["cached"] for r in row["per_request"]] and \
                sum(r["cached"] for r in row["per_request"]) == row["hit_tokens"]


def test_outputs_equal_and_hits_within_the_prompt(run):
    table = run[0]
    for scenario, rows in table["workloads"].items():
        prompts = {row["prompt_tokens"] for row in rows.values()}
        assert len(prompts) == 1 and prompts.pop() > 0, scenario
        for policy, row in rows.items():
            assert row["requests"] == REQUESTS, (scenario, policy)
            assert row["outputs_equal"] == REQUESTS, (scenario, policy)
            assert 0 <= row["hit_tokens"] <= row["prompt_tokens"], (scenario, policy)
            assert sum(row["per_replica"]) == REQUESTS, (scenario, policy)
            assert 0 < row["ttft_ms_median"] <= row["ttft_ms_p90"], (scenario, policy)
            assert (row["restart_seconds"] is not None) == (scenario == "restart")
        assert rows["round_robin"]["per_replica"] == [REQUESTS // 3] * 3  # dealt in turn


def test_the_precise_router_read_a_clean_feed(run):
    table = run[0]
    for scenario, rows in table["workloads"].items():
        feed = rows["precise"]["feed"]
        assert feed["batches"] > 0 and feed["events"] > 0, scenario
        assert feed["bad_batches"] == feed["bad_events"] == feed["gaps"] == 0, scenario
        # a restart is seen as the old process's connection closing; the new publisher
        # then starts a fresh stream, so no number goes back (two_routers: no restart,
        # and neither of its two subscribers sees a disconnect)
        assert feed["disconnects"] == (scenario == "restart"), scenario
        if scenario != "restart":  # every subscriber there before the first batch
            assert feed["late_starts"] == 0, scenario
        assert feed["restarts"] == 0, scenario
        assert sum(rows["precise"]["reasons"].values()) == REQUESTS
        assert rows["round_robin"]["feed"] is rows["sglang"]["feed"] is None


def test_two_routers_of_each_policy_share_the_requests(live, run):
    made = run[3]
    for scenario in live.SCENARIOS:
        n = 2 if scenario == "two_routers" else 1
        for kind in ("sglang", "precise"):
            assert sum(s == scenario and k == kind for s, k, _ in made) == n, (scenario, kind)
    (urls_a, policy_a, kwargs_a, url_a), (urls_b, policy_b, kwargs_b, url_b) = [
        x for s, k, x in made if s == "two_routers" and k == "sglang"]
    assert (urls_a, policy_a, kwargs_a) == (urls_b, policy_b, kwargs_b)  # started alike
    assert url_a != url_b  # two processes
    a, b = [x for s, k, x in made if s == "two_routers" and k == "precise"]
    assert a.subscriber is not b.subscriber and a.index is not b.index
    assert len(a.decisions) == len(b.decisions) == REQUESTS // 2  # request k: router k % 2
    for router in (a, b):  # each subscriber read the replicas' events itself
        assert router.subscriber.totals().batches > 0


def test_no_process_outlives_the_run(run):
    assert run[2] == set()


def test_spreads_count_what_is_in_flight_at_each_start(live):
    def sent(replica, start, end):
        return live.Sent("x", replica=replica, start=start, end=end)

    requests = [sent("r0", 0, 10), sent("r0", 1, 2), sent("r1", 3, 4), sent("r0", 10, 11)]
    # at 0: r0 1; at 1: r0 2; at 3: r0 1 (the first), r1 1; at 10: r0 1 (the first ended)
    assert live.spreads(requests, ["r0", "r1", "r2"]) == [1, 2, 1, 1]
