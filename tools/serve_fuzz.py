"""Try an OpenAI-compatible server the way a careless or hostile client would.

    python tools/serve_fuzz.py --base-url http://127.0.0.1:8000/v1   # any such server
    python tools/serve_fuzz.py --launch [-- minirt.serve options]   # starts minirt.serve

Four checks, each bounded in count and time, against a server on this machine only (the
host must be a loopback address):

1. *bad input*: malformed bodies, wrong Content-Types, bad fields, unknown routes and
   methods. Each must get a 4xx within ``--timeout`` with an OpenAI-style body
   ``{"error": {"message": ...}}``; a 5xx, a hang or another shape is a failure.
2. *isolation*: a greedy stream runs while requests with a tiny positive temperature
   and other odd settings arrive; its text must equal the same request run alone.
3. *disconnects*: a stream and a whole-answer request whose clients hang up early;
   the server must stop them (no request left running, per its ``/metrics``: minirt's
   ``minirt_requests{state="running"}`` or vLLM's ``vllm:num_requests_running``).
4. *load*: ``--concurrency`` requests at once all succeed, and a greedy answer is the
   same before and after.

Prints one line per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

CHAT = "/chat/completions"
GOOD_MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@dataclass
class Check:
    name: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
        return ok


def bad_inputs(model: str) -> list[tuple[str, str, str, bytes, dict]]:
    """(label, method, path, body, headers): requests that must each get a 4xx."""
    js = {"content-type": "application/json"}

    def body(**fields) -> bytes:
        return json.dumps({"model": model, "messages": GOOD_MESSAGES, "max_tokens": 4,
                           **fields}).encode()

    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    cases = [
        ("not JSON", "POST", CHAT, b"{not json", js),
        ("truncated JSON", "POST", CHAT, body()[:-3], js),
        ("invalid UTF-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', js),
        ("a JSON array", "POST", CHAT, b"[1, 2, 3]", js),
        ("nested 100,000 deep", "POST", CHAT, deep, js),
        ("a 5,000-digit integer", "POST", CHAT,
         b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", js),
        ("empty body", "POST", CHAT, b"", js),
        ("text/plain body", "POST", CHAT, body(), {"content-type": "text/plain"}),
        ("form-urlencoded body", "POST", CHAT, body(),
         {"content-type": "application/x-www-form-urlencoded"}),
        ("no messages", "POST", CHAT, json.dumps({"model": model}).encode(), js),
        ("empty messages", "POST", CHAT, body(messages=[]), js),
        ("message not an object", "POST", CHAT, body(messages=["hi"]), js),
        ("content a number", "POST", CHAT, body(messages=[{"role": "user", "content": 5}]),
         js),
        ("max_tokens a string", "POST", CHAT, body(max_tokens="x"), js),
        ("max_tokens 0", "POST", CHAT, body(max_tokens=0), js),
        ("max_tokens past the context", "POST", CHAT, body(max_tokens=10**7), js),
        ("temperature -1", "POST", CHAT, body(temperature=-1), js),
        ("temperature a string", "POST", CHAT, body(temperature="hot"), js),
        ("top_p 2", "POST", CHAT, body(top_p=2), js),
        ("n 0", "POST", CHAT, body(n=0), js),
        ("seed 10**30", "POST", CHAT, body(seed=10**30, temperature=1), js),
        ("stream a string", "POST", CHAT, body(stream="yes"), js),
        ("stop a number", "POST", CHAT, body(stop=5), js),
        ("unknown model", "POST", CHAT, body(model="no-such-model"), js),
        ("prompt missing", "POST", "/completions",
         json.dumps({"model": model}).encode(), js),
        ("token id past the vocabulary", "POST", "/completions",
         json.dumps({"model": model, "prompt": [1, 10**9], "max_tokens": 2}).encode(), js),
        ("negative token id", "POST", "/completions",
         json.dumps({"model": model, "prompt": [-5], "max_tokens": 2}).encode(), js),
        ("unknown route", "GET", "/no/such/route", b"", {}),
        ("GET on a POST route", "GET", CHAT, b"", {}),
    ]
    return cases


def _openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def check_bad_input(client: httpx.Client, model: str, timeout: float) -> Check:
    check = Check("bad input")
    cases = bad_inputs(model)
    good = 0
    for label, method, path, body, headers in cases:
        start = time.perf_counter()
        try:
            r = client.request(method, path, content=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            check.failures.append(f"{label}: {type(exc).__name__}")
            continue
        took = time.perf_counter() - start
        ok = 400 <= r.status_code < 500 and _openai_error(r)
        if check.expect(ok, f"{label}: {r.status_code} {r.text[:120]!r}"):
            good += 1
        check.notes.append(f"{r.status_code} {took:.2f}s {label}")
    check.notes.insert(0, f"{good} of {len(cases)} got a 4xx with an OpenAI-style body")
    return check


def chat_once(client: httpx.Client, model: str, max_tokens: int = 16, **extra) -> str:
    r = client.post(CHAT, json={"model": model, "messages": GOOD_MESSAGES,
                                "max_tokens": max_tokens, "temperature": 0, **extra})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def stream_chat(base: str, model: str, max_tokens: int, hang_up_after: int | None = None,
                timeout: float = 120) -> str:
    """A streamed chat answer's text (or the first chunks, hanging up after some)."""
    pieces, chunks = [], 0
    with httpx.stream("POST", base + CHAT, timeout=timeout, json={
            "model": model, "messages": GOOD_MESSAGES, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        s.raise_for_status()
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"error event: {data['error']}")
            if data.get("choices"):
                pieces.append(data["choices"][0].get("delta", {}).get("content") or "")
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                break
    return "".join(pieces)


def check_isolation(client: httpx.Client, base: str, model: str) -> Check:
    check = Check("isolation")
    alone = stream_chat(base, model, 16)
    got: dict[str, str | BaseException] = {}

    def beside() -> None:
        try:
            got["text"] = stream_chat(base, model, 16)
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["text"] = exc

    t = threading.Thread(target=beside)
    t.start()
    odd = [{"temperature": 1e-38}, {"temperature": 5e-324}, {"temperature": 1e-45, "seed": 3},
           {"temperature": 100.0}, {"temperature": 1, "top_k": 1}]
    for extra in odd:
        r = client.post(CHAT, json={"model": model, "messages": GOOD_MESSAGES,
                                    "max_tokens": 4, "ignore_eos": True, **extra})
        check.expect(r.status_code < 500, f"{extra}: {r.status_code} {r.text[:120]!r}")
        check.notes.append(f"{r.status_code} {extra}")
    t.join(timeout=180)
    check.expect(got.get("text") == alone,
                 f"the stream beside them changed: {got.get('text')!r} != {alone!r}")
    return check


def running_requests(client: httpx.Client, base_root: str) -> float | None:
    """Requests running now, from the server's Prometheus metrics (None: not exposed)."""
    try:
        text = client.get(base_root + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    total = None
    for line in text.splitlines():
        if line.startswith(('minirt_requests{state="running"}', "vllm:num_requests_running")):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def check_disconnects(client: httpx.Client, base: str, model: str, wait: float) -> Check:
    check = Check("disconnects")
    root = base.removesuffix("/v1")
    seen = stream_chat(base, model, 400, hang_up_after=4)
    check.notes.append(f"stream hung up after 4 chunks ({len(seen)} chars)")
    try:
        httpx.post(base + CHAT, timeout=httpx.Timeout(60, read=1.5), json={
            "model": model, "messages": GOOD_MESSAGES, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True})
        check.failures.append("the whole-answer request of 400 tokens came back in 1.5 s; "
                              "nothing to cancel")
    except httpx.ReadTimeout:
        check.notes.append("whole-answer client hung up after 1.5 s")
    deadline = time.monotonic() + wait
    running = running_requests(client, root)
    while running and time.monotonic() < deadline:
        time.sleep(0.2)
        running = running_requests(client, root)
    if running is None:
        check.notes.append("no running-requests gauge in /metrics: not checked")
    else:
        check.expect(running == 0, f"{running:g} requests still running {wait:g} s after "
                                   "their clients left")
    return check


def check_load(client: httpx.Client, model: str, concurrency: int) -> Check:
    check = Check("load")
    before = chat_once(client, model)

    def one(i: int) -> int:
        r = client.post(CHAT, timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 8, "temperature": 0})
        return r.status_code

    with ThreadPoolExecutor(concurrency) as pool:
        codes = list(pool.map(one, range(concurrency)))
    ok = sum(c == 200 for c in codes)
    check.notes.append(f"{ok} of {concurrency} concurrent requests succeeded")
    check.expect(ok == concurrency, f"statuses {sorted(set(codes))}")
    check.expect(chat_once(client, model) == before, "greedy answer changed after the load")
    return check


def _loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def fuzz(base_url: str, timeout: float = 2.0, concurrency: int = 16, wait: float = 30.0,
         out: Callable[[str], None] = print, verbose: bool = False) -> bool:
    """Run the four checks against ``base_url`` (``http://host:port/v1``); True if all pass."""
    base = base_url.rstrip("/")
    if not _loopback(base):
        raise SystemExit(f"serve_fuzz: {base} is not on this machine (loopback only)")
    with httpx.Client(base_url=base, timeout=120) as client:
        model = client.get("/models").json()["data"][0]["id"]
        runs = [lambda: check_bad_input(client, model, timeout),
                lambda: check_isolation(client, base, model),
                lambda: check_disconnects(client, base, model, wait),
                lambda: check_load(client, model, concurrency)]
        checks = []
        for run in runs:
            start = time.perf_counter()
            checks.append(run())
            checks[-1].seconds = time.perf_counter() - start
    for c in checks:
        out(f"{'ok  ' if not c.failures else 'FAIL'} {c.name} ({c.seconds:.1f} s): "
            f"{c.notes[0] if c.notes else ''}")
        for note in c.notes[1:] if verbose else []:
            out(f"       {note}")
        for f in c.failures:
            out(f"       failed: {f}")
    return not any(c.failures for c in checks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", help="the server's OpenAI base, http://127.0.0.1:PORT/v1")
    p.add_argument("--launch", action="store_true",
                   help="start minirt.serve (options after --) and fuzz it")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds a bad request may take to get its 4xx")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--wait", type=float, default=30.0,
                   help="seconds a hung-up request may take to stop")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per request")
    args, serve_args = p.parse_known_args(argv)
    serve_args = [a for a in serve_args if a != "--"]
    if args.launch == bool(args.base_url):
        p.error("give exactly one of --base-url and --launch")
    start = time.perf_counter()
    if args.launch:
        from minirt.serve import launch
        with launch(*serve_args) as server:
            print(f"serve_fuzz: minirt.serve up in {time.perf_counter() - start:.0f} s")
            ok = fuzz(server.url, args.timeout, args.concurrency, args.wait,
                      verbose=args.verbose)
    else:
        ok = fuzz(args.base_url, args.timeout, args.concurrency, args.wait,
                  verbose=args.verbose)
    print(f"serve_fuzz: {'all checks passed' if ok else 'FAILED'} in "
          f"{time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
