"""``python -m minirt.hitcheck --base-url`` against a live minirt.serve (the book's model):
what the server cached, request by request, beside what hitcheck says was possible."""

from __future__ import annotations

import json

import pytest

from minirt.hitcheck import main
from minirt.serve import launch


@pytest.fixture(scope="module")
def server():
    srv = launch("--capacity", "4096", "--token-budget", "512")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def test_the_server_caches_what_hitcheck_says_was_possible(server, tmp_path, capsys):
    system = "You are a support assistant. Current time: 2024-05-01 10:00:0{}."
    chats = [
        [("system", system.format(1)), ("user", "How do I reset my password?")],
        [("system", system.format(1)), ("user", "How do I reset my password?"),
         ("assistant", "Open Settings."), ("user", "And my username?")],
        [("system", system.format(7)), ("user", "How do I reset my password?")],
    ]
    log = tmp_path / "log.jsonl"
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns], "conversation": k,
             "reply": "Open Settings."} for k, turns in enumerate(chats)]
    rows.append({"prompt": "Translate to French: good morning"})
    rows.append({"prompt": "Translate to French: good evening", "max_tokens": 50})
    rows.append({"messages": [{"role": "robot", "content": "x"}]})
    log.write_text("\n".join(json.dumps(r) for r in rows[:-1]) + "\n")
    assert main([str(log), "--base-url", server.url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    live = data["live"]
    assert [x["error"] for x in live] == [None] * 5
    assert [x["prompt_tokens"] for x in live] == [x["expected_prompt_tokens"] for x in live]
    possible = [x["possible"] for x in live]
    assert possible[0] == 0 and 0 < possible[2] < live[2]["expected_prompt_tokens"]
    assert possible[2] == data["requests"][2]["shared"]  # the prompts part at the time stamp
    for x in live:  # minirt.serve keeps everything here: it caches exactly what was possible
        assert x["cached_tokens"] == x["possible"], x
    # the table form prints the side-by-side table
    assert main([str(log), "--base-url", server.url]) == 0
    out = capsys.readouterr().out
    assert "live server: cached tokens beside what was possible" in out
    # a request the server refuses is a record, not the end of the replay
    log.write_text(json.dumps({"prompt": "hi", "n": 1, "logprobs": 5}) + "\n"
                   + json.dumps({"prompt": "hi there"}) + "\n")
    assert main([str(log), "--base-url", server.url, "--json"]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert live[0]["error"].startswith("HTTP 400") and live[1]["error"] is None


def test_an_unreachable_server_is_a_clear_error(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert main([str(log), "--base-url", "http://127.0.0.1:9/v1"]) == 2
    assert "cannot list the models of http://127.0.0.1:9/v1" in capsys.readouterr().err
