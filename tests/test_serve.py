"""minirt.serve on a free local port with the real model, driven by httpx and the official
``openai`` client: chat with and without streaming, cached tokens as the engine counts
them, 400 on bad input with the others unaffected, a disconnect freeing its slots; and
minirt.replay against it. The server is one child process, stopped by its pid."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from script_loader import load_script

from minirt.engine import Engine
from minirt.engine_worker import TextDeltas
from minirt.model import load_model
from minirt.replay import arrival_times, main, replay
from minirt.request import Request
from minirt.serve import launch

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    srv = launch("--capacity", "4096", "--token-budget", "512")
    try:
        yield srv
    finally:
        # SIGTERM, by its pid: the engine loop (the main thread) and HTTP end cleanly
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def local():
    """The same model in this process: what the server's engine should compute."""
    model, tokenizer = load_model(dtype=torch.float32)
    return model, tokenizer


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_models_health_and_model_info(server, http):
    assert http.get("/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server.base + "/health").status_code == 200
    info = httpx.get(server.base + "/get_model_info").json()
    assert info["is_generation"] is True and MODEL in info["model_path"]
    names = metrics(server)
    assert "minirt_prefix_cache_hits_total" in names
    assert "minirt_prefix_cache_queries_total" in names


def test_a_character_cut_off_at_max_tokens_is_not_sent(http, local):
    """Three greedy tokens end inside a Japanese character (the tokenizer decodes its first
    bytes as U+FFFD): streamed and whole, the text is the engine's up to the last whole
    character, as vLLM sends it."""
    model, tokenizer = local
    prompt = "Translate to Japanese: Good morning, how are you?\nJapanese:"
    ids = tokenizer(prompt)["input_ids"]
    engine = Engine(model, tokenizer, capacity=4096)
    want = engine.generate([Request(prompt=ids, max_new_tokens=3, stop_on_eos=False)],
                           progress=False)[0]
    assert want.text.endswith("\ufffd")  # the case this test is about
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    whole = http.post("/completions", json=body).json()["choices"][0]["text"]
    pieces = []
    with http.stream("POST", "/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert whole == "".join(pieces) == want.text.rstrip("\ufffd") != ""


def test_chat_stream_and_not_and_cached_tokens_as_the_engine_counts(server, local):
    """Two requests sharing a system prompt: the second one's cached_tokens is what a
    local Engine counts for the same pair; streamed and whole answers are the engine's."""
    model, tokenizer = local
    system = f"You are a helpful assistant of shop {uuid.uuid4().hex}. Answer briefly."
    first, second = chat(system, "Name a fruit."), chat(system, "Name a colour.")
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    before = metrics(server)
    a = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8,
                                       temperature=0)
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=second, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"unknown_field": 1}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    after = metrics(server)

    engine = Engine(model, tokenizer, capacity=4096)
    want = engine.generate([Request(messages=first, max_new_tokens=8)], progress=False)[0]
    want2 = engine.generate([Request(messages=second, max_new_tokens=8)], progress=False)[0]
    assert a.choices[0].message.content == want.text
    assert a.usage.prompt_tokens == want.metrics.prompt_tokens
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert "".join(pieces) == want2.text and len(pieces) > 1
    assert usage.prompt_tokens == want2.metrics.prompt_tokens
    assert usage.completion_tokens == want2.metrics.output_tokens
    assert usage.prompt_tokens_details.cached_tokens == want2.metrics.cached_tokens > 20
    hits = after["minirt_prefix_cache_hits_total"] - before["minirt_prefix_cache_hits_total"]
    assert hits == want2.metrics.cached_tokens


def test_cache_salt_isolates_requests_and_a_bad_salt_is_refused(http):
    """vLLM's cache_salt: a request shares cached K/V only with requests of the same salt;
    a salt that is not a non-empty string gets 400 and changes nothing."""
    prompt = f"Shop {uuid.uuid4().hex}: the opening hours are nine to five, every weekday."

    def cached(**extra) -> int:
        r = http.post("/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                            "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="team-a") == 0
    assert cached(cache_salt="team-b") == 0          # another salt: nothing shared
    assert cached() == 0                             # no salt is a namespace of its own
    assert cached(cache_salt="team-a") > 10          # the same salt shares
    for bad in ("", 7, ["team-a"]):
        r = http.post("/completions", json={"model": MODEL, "prompt": prompt,
                                            "max_tokens": 1, "cache_salt": bad})
        assert r.status_code == 400 and "cache_salt" in r.text, (bad, r.text)
    assert cached(cache_salt="team-b") > 10


def test_completions_with_token_ids_stop_and_seed(http, local):
    _, tokenizer = local
    ids = tokenizer("The capital of France is")["input_ids"]
    r = http.post("/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 6,
                                        "temperature": 0, "stop": ["."]}).json()
    text = r["choices"][0]["text"]
    assert "." not in text and r["choices"][0]["finish_reason"] in ("stop", "length")
    assert r["usage"]["prompt_tokens"] == len(ids)
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.2, "top_k": 50}
    one = http.post("/completions", json={**body, "seed": 3}).json()["choices"][0]["text"]
    two = http.post("/completions", json={**body, "seed": 3}).json()["choices"][0]["text"]
    assert one == two


BAD = [
    (b"{not json", "not valid JSON"),
    (b'{"messages": []}', "'messages' must be a non-empty list"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "'n'"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}',
     "context"),
]


def test_bad_input_gets_400_and_others_are_unaffected(server, http):
    msgs = chat("You are terse.", "Count to five.")
    alone = http.post("/chat/completions", json={"messages": msgs, "max_tokens": 24,
                                                 "temperature": 0}).json()
    got = {}

    def stream_good():
        pieces = []
        with httpx.stream("POST", server.url + "/chat/completions", timeout=120,
                          json={"messages": msgs, "max_tokens": 24, "temperature": 0,
                                "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    delta = httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"]
                    pieces.append(delta.get("content") or "")
        got["text"] = "".join(pieces)

    t = threading.Thread(target=stream_good)
    t.start()
    for body, words in BAD:
        r = http.post("/chat/completions", content=body,
                      headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error"
    r = http.post("/completions", json={"prompt": [1, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = http.post("/chat/completions", json={"model": "gpt-9", "messages": msgs})
    assert r.status_code == 404
    t.join(timeout=120)
    assert got["text"] == alone["choices"][0]["message"]["content"]


def test_disconnect_mid_stream_cancels_and_frees_slots(server):
    before = metrics(server)
    msgs = chat("You are a storyteller.", "Tell me a very long story about a lighthouse.")
    with httpx.stream("POST", server.url + "/chat/completions", timeout=120,
                      json={"messages": msgs, "max_tokens": 400, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        seen = [next(lines) for _ in range(6)]  # a few chunks, then hang up
    assert any('"content"' in x for x in seen)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = metrics(server)
        cancelled = m['minirt_requests_total{outcome="cancelled"}'] \
            - before['minirt_requests_total{outcome="cancelled"}']
        if cancelled == 1 and m['minirt_requests{state="running"}'] == 0:
            break
        time.sleep(0.2)
    assert cancelled == 1
    assert m['minirt_kv_slots{owner="private"}'] == 0
    assert m['minirt_kv_slots{owner="protected"}'] == 0
    generated = m["minirt_generation_tokens_total"] - before["minirt_generation_tokens_total"]
    assert generated < 400  # stopped early, not run to max_tokens


def test_text_deltas_hold_back_stop_prefixes_and_partial_characters():
    vocab = {1: "ab", 2: "c", 3: "X", 4: "Y", 5: "\ufffd", 6: "é"}

    def decode(ids):
        text = "".join(vocab[i] for i in ids)
        return text.replace("\ufffdé", "é")  # 5 then 6: one character in two tokens

    d = TextDeltas(decode, ("XYZ",))
    assert [d.push(t) for t in (1, 2, 3, 4)] == ["ab", "c", "", ""]  # "XY" may become XYZ
    assert d.flush("abcXY") == "XY"
    d = TextDeltas(decode, ("cX",))
    assert [d.push(t) for t in (1, 5, 6, 2)] == ["ab", "", "é", ""]
    assert d.push(3) == "" and d.flush("abé") == ""  # the stop string is never sent


def test_replay_chat_few_shot_and_jsonl_against_the_server(server, local, tmp_path, capsys):
    _, tokenizer = local
    hooked = []

    async def hook(rec):  # runs before the request is sent: nothing has come back yet
        hooked.append((rec.index, rec.ttft, rec.latency, rec.server))

    report = replay(server.url, "chat", rate=0, conversations=2, turns=2, system_tokens=120,
                    max_tokens=4, seed=5, tokenizer=tokenizer, hook=hook)
    assert len(report.records) == 4 and not [r for r in report.records if r.error]
    assert sorted(hooked) == [(i, None, None, None) for i in range(4)]
    for r in report.records:
        assert r.prompt_tokens == len(r.prompt_ids) and 0 < r.ttft <= r.latency
    for c in (0, 1):
        t1, t2 = (r for r in report.records if r.conversation == c)
        assert t2.prompt_ids[:len(t1.prompt_ids)] == t1.prompt_ids
        assert t2.cached_tokens >= len(t1.prompt_ids)  # the whole previous turn was cached
    assert report.hit_rate == report.cached_tokens / report.prompt_tokens > 0.5
    assert report.unique_bound == len(set(
        tuple(r.prompt_ids[:k]) for r in report.records for k in range(1, len(r.prompt_ids) + 1)))

    lines = [{"messages": chat("You answer in one word.", q), "max_tokens": 3}
             for q in ("Sky colour?", "Grass colour?", "Snow colour?")]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    main(["--base-url", server.url, "--workload", str(path), "--rate", "20",
          "--arrivals", "uniform", "--quiet"])
    out = capsys.readouterr().out
    assert "3 requests, 0 failed" in out and "unique-token bound" in out

    shots = replay(server.url, "few-shot", rate=0, num_requests=4, max_tokens=2,
                   tokenizer=tokenizer)
    assert [r.prompt_tokens for r in shots.records] == [len(r.prompt_ids) for r in shots.records]
    assert not [r for r in shots.records if r.error] and shots.cached_tokens > 0


def test_arrival_times():
    assert arrival_times(3, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(3, 2, "uniform") == [0.0, 0.5, 1.0]
    t = arrival_times(2000, 4.0, seed=1)
    assert t == sorted(t) and 2000 / t[-1] == pytest.approx(4.0, rel=0.1)
    with pytest.raises(ValueError, match="poisson"):
        arrival_times(2, 1.0, "bursty")


# ------------------------------------------------ issue 27: no request hurts another


def _stream_text(server, body: dict, seen: list | None = None) -> str:
    """A streamed chat answer's text; ``seen`` gets the arrival time of every chunk."""
    pieces = []
    with httpx.stream("POST", server.url + "/chat/completions", timeout=120,
                      json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                pieces.append(data["choices"][0]["delta"].get("content") or "")
                if seen is not None:
                    seen.append(time.perf_counter())
    return "".join(pieces)


def test_a_tiny_temperature_runs_at_vllms_floor_and_fails_nobody(server, http):
    """temperature 1e-38 once overflowed fp32 logits to inf and failed every request in the
    step; now it runs at 0.01 (vLLM's floor) and the greedy stream beside it is unchanged."""
    body = {"messages": chat("You are terse.", "Name three rivers."), "max_tokens": 20,
            "temperature": 0, "ignore_eos": True}
    alone = http.post("/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    got = {}
    t = threading.Thread(target=lambda: got.update(text=_stream_text(server, body)))
    t.start()
    tiny = [http.post("/chat/completions", json={**body, "temperature": t, "max_tokens": 6})
            for t in (1e-38, 1e-45, 5e-324)]
    t.join(timeout=120)
    for r in tiny:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    assert got["text"] == alone


class CharTokenizer:
    """id = ord(char): enough to decode tiny_model's outputs (ids < 128) as text."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """minirt.serve's app over tiny_model in this process, with a step log: tokens come
    every few ms, so a gap of 0.5 s without one never happens (the old disconnect check
    waited for one)."""
    import socket

    import uvicorn

    from minirt.engine_worker import EngineWorker
    from minirt.model import tiny_model
    from minirt.serve import build_app

    worker = EngineWorker(Engine(tiny_model(0), CharTokenizer(), capacity=2048),
                          step_log=tmp_path_factory.mktemp("serve") / "steps.jsonl").start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(worker, "tiny", "tiny"),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started:
        time.sleep(0.05)
    try:
        yield base, worker
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        worker.stop()


def test_disconnect_cancels_a_whole_answer_request_whatever_the_token_rate(tiny_server):
    """A non-stream client that hangs up is cancelled within a few tokens, as a stream is,
    though tokens keep flowing (it used to run on to max_tokens and count as finished)."""
    base, worker = tiny_server
    body = {"prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()  # how long the whole answer takes here: hang up at a fifth
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
    hang_up = (time.perf_counter() - start) / 5
    before = dict(worker.counters)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=hang_up))
    at_hang_up = worker.counters["generation_tokens"]
    deadline = time.monotonic() + 60
    while worker.counters["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.counters["cancelled"] - before["cancelled"] == 1
    assert worker.counters["finished"] == before["finished"]
    assert worker.counters["generation_tokens"] - at_hang_up <= 8
    time.sleep(0.6)  # one idle turn of the engine loop refreshes the gauges
    assert worker.gauges["running"] == 0 and worker.gauges["private"] == 0
    r = httpx.post(base + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_the_step_log_accounts_for_every_request_and_token(tiny_server):
    """--step-log: a JSON line per engine step; over two requests sent together, the lines
    admit both once, carry every token they were sent, and time each part of the step."""
    from pathlib import Path

    base, worker = tiny_server
    time.sleep(0.6)  # the engine idle: no step of an earlier test is still being written
    lines_before = len(Path(worker.step_log).read_text().splitlines())
    bodies = [{"prompt": [1, 2, 3 + i], "max_tokens": 5 + i, "temperature": 0,
               "ignore_eos": True} for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda b: httpx.post(base + "/v1/completions", json=b,
                                                      timeout=60), bodies))
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [5, 6]
    time.sleep(0.2)
    steps = [json.loads(line) for line in
             Path(worker.step_log).read_text().splitlines()[lines_before:]]
    assert sum(s["admitted"] for s in steps) == 2
    cached = sum(a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert sum(s["prefill_tokens"] for s in steps) == 3 + 3 - cached
    assert sum(s["finished"] for s in steps) == 2
    assert sum(s["tokens"] for s in steps) == 5 + 6
    assert all(s["admit_s"] > 0 and s["forward_s"] > 0 for s in steps)
    assert all(s["admit_s"] + s["forward_s"] <= s["step_s"] for s in steps)
    assert all(b["start"] >= a["start"] + a["step_s"]
               for a, b in zip(steps, steps[1:], strict=False))
    step_log = load_script("benchmarks/step_log.py", "step_log")
    assert step_log.bursts(steps, gap=60.0) == [steps]
    rows = {what: (n, seconds) for what, n, seconds in step_log.summary(steps)}
    admitting = [s for s in steps if s["admitted"]]
    n, seconds = rows["admission"]
    assert n == len(admitting) and seconds == pytest.approx(sum(s["admit_s"] for s in admitting))
    mixed, alone = (rows[f"prefill passes, {w}"] for w in ("requests running (mixed)",
                                                          "none running"))
    assert mixed[0] + alone[0] == len(admitting)
    assert mixed[1] + alone[1] == pytest.approx(sum(s["forward_s"] for s in admitting))
    assert rows["decode-only steps"][0] == len(steps) - len(admitting)


def test_a_step_log_that_cannot_be_written_fails_at_once(tmp_path, capsys):
    """An unwritable --step-log is refused before the model loads, and an EngineWorker
    given one raises when made (it used to die on its thread, and start() waited forever)."""
    from minirt.engine_worker import EngineWorker
    from minirt.model import tiny_model
    from minirt.serve import main as serve_main

    missing = tmp_path / "no such folder" / "steps.jsonl"
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--step-log", str(missing)])
    assert exit_.value.code == 2 and "--step-log" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        EngineWorker(Engine(tiny_model(0), CharTokenizer(), capacity=64), step_log=missing)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_malformed_bodies_content_types_roles_routes_and_seeds(server, http):
    msgs = [{"role": "user", "content": "hi"}]
    json_header = {"content-type": "application/json"}
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    long_int = b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}"
    for raw in (deep, long_int):
        err = _error(http.post("/chat/completions", content=raw, headers=json_header), 400)
        assert "not valid JSON" in err["message"]
    good = json.dumps({"messages": msgs, "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  None):
        headers = {"content-type": ctype} if ctype else {}
        r = http.post("/chat/completions", content=good, headers=headers)
        assert "application/json" in _error(r, 415)["message"]
    r = http.post("/chat/completions", content=good,
                  headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    err = _error(http.post("/chat/completions", json={"messages": [
        {"role": "robot", "content": "beep"}]}), 400)
    assert "'robot'" in err["message"] and err["param"] == "messages"
    assert _error(http.get("/nothing/here"), 404)["type"] == "Not Found"
    assert _error(http.get("/completions"), 405)["type"] == "Method Not Allowed"
    for seed in (10**30, -2**63 - 1):
        err = _error(http.post("/chat/completions", json={"messages": msgs, "seed": seed,
                                                          "temperature": 1}), 400)
        assert err["param"] == "seed" and str(2**63 - 1) in err["message"]
    ok = http.post("/chat/completions", json={"messages": msgs, "seed": 2**63 - 1,
                                              "temperature": 1, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_huge_prompt_is_refused_by_size_and_tokenized_off_the_engine_thread(server, http):
    """A body over 1 MiB gets 413 unread; one under it is tokenized on another thread, so
    the stream beside it keeps getting tokens while it is (count-based, not timed)."""
    err = _error(http.post("/completions", json={"prompt": "x" * (2 << 20)}), 413)
    assert "exceeds" in err["message"]
    body = {"messages": chat("You are a storyteller.", "Tell a story."), "max_tokens": 120,
            "temperature": 0, "ignore_eos": True}
    seen: list[float] = []
    t = threading.Thread(target=_stream_text, args=(server, body, seen))
    t.start()
    while len(seen) < 3:
        time.sleep(0.01)
    prompt = " ".join(f"w{i % 977}" for i in range(150_000))  # about 1 MB, 300k tokens
    start = time.perf_counter()
    r = http.post("/completions", json={"prompt": prompt, "max_tokens": 1})
    end = time.perf_counter()
    t.join(timeout=120)
    assert "context" in _error(r, 400)["message"]
    during = [x for x in seen if start < x < end]
    assert len(during) >= 3, (len(during), end - start)
