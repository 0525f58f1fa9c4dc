"""vLLM's n-gram speculator beside minirt's, from the stored run (``benchmarks/
speculative_vllm.json``, written by ``benchmarks/speculative_vllm.py`` in ``.venv-vllm``; no
vLLM needed here): the prompts are the ones ``benchmarks/speculative.py`` serves, vLLM's
counters add up, and vLLM's greedy outputs, with speculation and without, are minirt's
greedy outputs on the same prompts (fp32)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STORED = Path(os.environ.get("MINIRT_SPECULATIVE_VLLM_JSON",
                             ROOT / "benchmarks" / "speculative_vllm.json"))


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(STORED.read_text())


@pytest.fixture(scope="module")
def smol():
    from minirt.model import load_model

    return load_model(device="cpu", dtype=torch.float32)


def test_the_record_is_vllms_ngram_run_on_the_benchmarks_prompts(record, smol):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from speculative import workloads
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert record["vllm_version"] == "0.32.0" and record["error"] is None
    assert record["speculative_config"]["method"] == "ngram"
    built = workloads(smol[1], list(record["prompts"]))
    for name, prompts in record["prompts"].items():
        assert prompts == [list(p) for p in built[name][:len(prompts)]], name
    assert {(c["workload"], c["batch"]) for c in record["cells"]} == {
        (w, b) for w in record["prompts"] for b in record["batches"]}


def test_vllms_counters_add_up(record):
    k = record["speculative_config"]["num_speculative_tokens"]
    for c in record["cells"]:
        ng = c["ngram"]
        assert 0 <= ng["num_accepted_tokens"] <= ng["num_draft_tokens"] <= k * ng["num_drafts"]
        assert sum(ng["accepted_per_pos"]) == ng["num_accepted_tokens"]
        assert ng["accepted_per_pos"] == sorted(ng["accepted_per_pos"], reverse=True)
        if ng["num_draft_tokens"]:
            assert ng["acceptance_rate"] == pytest.approx(
                ng["num_accepted_tokens"] / ng["num_draft_tokens"])
        n = record["max_new_tokens"]
        for side in ("plain", "ngram"):
            assert len(c[side]["outputs"]) == c["batch"]
            assert all(len(o) == n for o in c[side]["outputs"])
        assert c["same"] == sum(a == b for a, b in zip(c["plain"]["outputs"],
                                                       ng["outputs"], strict=True))


def test_vllms_outputs_are_minirts_greedy_outputs(record, smol):
    """minirt without speculation, every stored prompt in one batch, fp32: every output
    vLLM stored, with and without its speculator, at every batch size, is minirt's."""
    from minirt.engine import Engine
    from minirt.request import Request

    model, tokenizer = smol
    n = record["max_new_tokens"]
    keys = [(name, i) for name, ps in record["prompts"].items() for i in range(len(ps))]
    engine = Engine(model, tokenizer, capacity=64 * 1024, page_size=16)
    outs = engine.generate([Request(prompt=record["prompts"][w][i], max_new_tokens=n,
                                    stop_on_eos=False) for w, i in keys], progress=False).outputs
    ours = dict(zip(keys, outs, strict=True))
    for c in record["cells"]:
        for side in ("plain", "ngram"):
            for i, out in enumerate(c[side]["outputs"]):
                assert out == ours[c["workload"], i], f"{c['workload']} B={c['batch']} {side} {i}"
