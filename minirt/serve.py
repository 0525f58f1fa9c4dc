"""An OpenAI-compatible HTTP server over minirt's online engine. A teaching server.

    python -m minirt.serve [--port 8000] [--host 127.0.0.1] [--model NAME]
                           [--capacity 8192] [--page-size 1] [--token-budget 2048]
                           [--no-chunked-prefill] [--step-log FILE]
                           [--speculative-config '{"num_speculative_tokens": 4}']

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``
(with and without ``stream``), ``GET /metrics`` (Prometheus text: prefix-cache hit and
query tokens, requests, slots), ``GET /health`` and ``GET /get_model_info`` (what
SGLang's router asks a replica). Requests take ``max_tokens``, ``temperature``,
``top_k``, ``seed``, ``stop``, ``ignore_eos``, ``cache_salt`` (vLLM's field: only requests
with the same salt share cached K/V) and ``stream_options.include_usage``;
``usage`` carries ``prompt_tokens_details.cached_tokens`` as vLLM reports it. Unknown
fields are ignored (a router adds its own); known OpenAI fields whose effect minirt
does not implement (``n`` > 1, ``logprobs``, ``top_p`` < 1, penalties, tools, ...) get
HTTP 400 instead of being silently dropped.

The engine runs with chunked prefill (``Engine(chunked_prefill=True)``), as vLLM's does by
default for a model that supports it (vllm 0.32.0 `engine/arg_utils.py:
EngineArgs._set_default_chunked_prefill_and_prefix_caching_args`): a step's
``--token-budget`` of prompt tokens is filled by cutting the prompt that would overflow it.
vLLM's budget (``max_num_batched_tokens``, 2,048 for its CPU server: vllm 0.32.0
`engine/arg_utils.py: EngineArgs.get_batch_defaults`) counts the running requests' decode
tokens too; minirt's counts prompt tokens only.

HTTP runs on uvicorn with uvloop's event loop and httptools' parser, the stack vLLM's
server runs on (it starts its server with ``uvloop.run``: vllm 0.32.0
`entrypoints/launchers/api_server/entry.py: main`), so that a side-by-side comparison
times the engines and not two HTTP stacks.

One thread owns the ``Engine``, ``minirt.engine_worker.EngineWorker``; HTTP handlers, on
the event loop's thread, hand it requests and cancellations through a queue and get text
back as tokens are produced. ``python -m minirt.serve`` runs the engine
on the main thread, the thread that loaded the model, and HTTP beside it: torch's
OpenMP pool then belongs to one thread. A second thread running torch gets a second
pool, and with more OpenMP threads than cores, GNU OpenMP stops spin-waiting between
parallel regions, so every small matrix product of a decode step pays a wake-up (1.4x
a decode step on 2 cores). vLLM likewise runs its engine loop on its engine process's
main thread (vllm 0.32.0 `v1/engine/core.py: EngineCoreProc.run_busy_loop`).

No request can hurt another: every failure gets an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` (404 and 405 included) and the
others are unaffected. A body that is not JSON (or nests too deep, or holds an integer
too long for Python) gets 400; a Content-Type other than ``application/json`` (or
``+json``), missing included, gets 415, since a browser page can send ``text/plain``
and form bodies to a local server without asking (a CORS "simple" request); a body over
``--max-body-bytes`` (1 MiB) gets 413. Chat roles follow OpenAI's rule: ``system``,
``developer``, ``user`` and ``assistant``, anything else is 400 (vLLM renders any role
string into the template:
vllm 0.32.0 `renderers/chat_utils.py: CustomChatCompletionMessageParam`). A positive
``temperature`` below 0.01 runs at 0.01, as in vLLM (``minirt.request.MIN_TEMPERATURE``),
and a request whose sampling still fails fails alone (the engine isolates it). A client
that disconnects, streaming or not, cancels its request within a token or so, which
frees its pool slots.

What it does not do: authentication, TLS, more than one model, several prompts or
choices per request, log-probabilities, tool calls, structured output, rate limits,
request timeouts, or protection against a client that asks for the whole pool. Put it
on 127.0.0.1 (the default) and use vLLM or SGLang for anything real.

Where it sits (BOOK.md s.4's layers): the HTTP layer, the top of the serving stack: request
parsing, the app (``build_app``), ``main`` and ``launch``, over the engine thread
(``minirt.engine_worker``) and the engine; the router and the replay sit above it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine
from .engine_worker import EngineWorker, Stream, sent_text
from .errors import RequestError
from .request import SEED_RANGE, Request, RequestResult

__all__ = ["ServerProcess", "build_app", "launch", "main"]

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 128}
MAX_BODY_BYTES = 1 << 20  # far above a full context (8,192 tokens as text or as ids)
CHAT_ROLES = ("system", "developer", "user", "assistant")  # OpenAI's, minus tools

# OpenAI request fields minirt knows but does not implement: allowed only at their neutral
# value (or null), so that a client relying on them hears so instead of getting other output.
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0),
           "top_logprobs": (0,), "top_p": (1, 1.0), "presence_penalty": (0, 0.0),
           "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "suffix": ("",),
           "tools": ([],), "functions": ([],), "logit_bias": ({},),
           "response_format": ({"type": "text"},)}


class BadRequest(RequestError):
    """A request body the server cannot turn into an engine request (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int = 400) -> dict:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------- request parsing


def _number(body: dict, name: str, default: Any, kind: type, low: float | None = None,
            high: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok_types = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise BadRequest(f"'{name}' must be {'a number' if kind is float else 'an integer'}, "
                         f"got {value!r}", name)
    if high is not None and not low <= value <= high:
        raise BadRequest(f"'{name}' must be an integer in [{low}, {high}], got {value!r}",
                         name)
    if low is not None and value < low:
        raise BadRequest(f"'{name}' must be >= {low}, got {value!r}", name)
    return kind(value)


def sampling_options(body: dict, endpoint: str) -> dict:
    """The engine ``Request`` fields that the body's sampling parameters ask for."""
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise BadRequest(f"minirt.serve does not support '{name}' = {body[name]!r} "
                             f"(only {neutral[0]!r})", name)
    max_tokens = body.get("max_tokens")
    if max_tokens is None and endpoint == "chat":
        max_tokens = body.get("max_completion_tokens")
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens",
                         DEFAULT_MAX_TOKENS[endpoint], int, 1)
    temperature = _number(body, "temperature", 1.0, float, 0)
    top_k = _number(body, "top_k", 0, int, -1)
    seed = _number(body, "seed", None, int, *SEED_RANGE)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a string or a list of non-empty strings, got "
                         f"{body.get('stop')!r}", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"'ignore_eos' must be a boolean, got {ignore_eos!r}", "ignore_eos")
    # a non-empty string, as vLLM checks it first (it also caps the length):
    # vllm 0.32.0 `entrypoints/generate/base/protocol.py: validate_cache_salt`
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise BadRequest(f"'cache_salt' must be a non-empty string, got {salt!r}", "cache_salt")
    return {"max_new_tokens": max_tokens, "temperature": temperature,
            "top_k": max(top_k, 0), "seed": seed, "stop": tuple(stop),
            "stop_on_eos": not ignore_eos, "cache_salt": salt}


def chat_messages(body: dict) -> list[dict[str, str]]:
    """``messages`` as role/content strings (text parts of a content list are joined).

    Roles follow OpenAI's rule (``CHAT_ROLES``); any other role is a 400.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        if m["role"] not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role {m['role']!r} is not one of "
                             f"{', '.join(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                 "messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text "
                             "parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def completion_prompt(body: dict) -> str | list[int]:
    """``prompt``: a string or a list of token ids (or a one-element list of either)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or list of token ids (one prompt "
                     "per request)", "prompt")


# ---------------------------------------------------------------- the app


def _usage(result: RequestResult) -> dict:
    m = result.metrics
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.output_tokens,
            "total_tokens": m.prompt_tokens + m.output_tokens,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}


def _finish_reason(result: RequestResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<something>+json``, parameters allowed."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


async def _read_body(http: HttpRequest, limit: int) -> bytes | None:
    """The request body, or None as soon as it is known to exceed ``limit`` bytes."""
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return None
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(worker: EngineWorker, model_name: str, model_path: str,
              server_id: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application serving ``worker``'s engine as ``model_name``.

    ``server_id``: sent as ``system_fingerprint`` in every completion and chunk, so a
    client behind a router can tell which replica answered (omitted when None).
    ``max_body_bytes``: a larger request body gets 413 before it is parsed.
    """
    app = FastAPI(title="minirt.serve", version="0.1",
                  description="A teaching server: OpenAI-compatible, one model, no auth.")
    context = worker.engine.max_positions

    def bad(message: str, param: str | None = None, status: int = 400,
            kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(error_body(message, kind, param, status), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HttpRequest, exc: StarletteHTTPException):
        """404, 405 and the like in the OpenAI shape; ``type`` is the status phrase, as in
        vllm 0.32.0 `entrypoints/serve/exception_handling/handlers/http.py: http_exception_handler`
        """
        from http import HTTPStatus
        phrase = HTTPStatus(exc.status_code).phrase
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        message = f"{detail}: {http.method} {http.url.path}"
        return JSONResponse(error_body(message, phrase, None, exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health():
        if worker.alive:
            return PlainTextResponse("ok")
        return PlainTextResponse("engine not running", status_code=503)

    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "minirt",
            "root": model_path,
            "max_model_len": worker.engine.max_positions}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.metrics_text(),
                                 media_type="text/plain; version=0.0.4")

    async def handle(http: HttpRequest, endpoint: str):
        arrival = time.perf_counter()
        content_type = http.headers.get("content-type", "")
        if not _is_json(content_type):
            return bad(f"Content-Type must be application/json, got {content_type or 'none'!r}",
                       status=415)
        raw = await _read_body(http, max_body_bytes)
        if raw is None:
            return bad(f"the request body exceeds {max_body_bytes} bytes", status=413)
        try:
            body = json.loads(raw)
        except RecursionError:
            return bad("the request body is not valid JSON: it nests too deep")
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a too long integer
            return bad(f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return bad("the request body must be a JSON object")
        if body.get("model") not in (None, model_name, model_path):
            return bad(f"The model '{body['model']}' does not exist; this server serves "
                       f"'{model_name}'", "model", 404, "NotFoundError")
        try:
            options = sampling_options(body, endpoint)
            if endpoint == "chat":
                messages, prompt = chat_messages(body), None
            else:
                messages, prompt = None, completion_prompt(body)
            stream_flag = body.get("stream", False)
            if not isinstance(stream_flag, bool):
                raise BadRequest(f"'stream' must be a boolean, got {stream_flag!r}", "stream")
            stream_opts = body.get("stream_options") or {}
            if not isinstance(stream_opts, dict):
                raise BadRequest("'stream_options' must be an object", "stream_options")
            include_usage = bool(stream_opts.get("include_usage", False))
            ids = await worker.encode(prompt, messages)
            n, m = len(ids), options["max_new_tokens"]
            if context and n + m > context:  # the engine says the same; no need to queue it
                raise RequestError(f"prompt ({n}) + max_new_tokens ({m}) exceeds the model's "
                                   f"context of {context} positions")
            stream = await worker.submit(Request(prompt=ids, **options), arrival,
                                         options["stop"], deltas=stream_flag)
        except BadRequest as exc:
            return bad(str(exc), exc.param)
        except RequestError as exc:
            return bad(str(exc))
        created = int(time.time())
        ident = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{stream.rid}-" \
                f"{uuid.uuid4().hex[:8]}"
        if stream_flag:
            events = _sse(worker, stream, endpoint, ident, created, model_name, include_usage,
                          server_id)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _complete(worker, stream, http, endpoint, ident, created, model_name,
                               server_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await handle(http, "chat")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await handle(http, "completions")

    return app


async def _client_gone(http: HttpRequest) -> None:
    """Returns when the client hangs up. Once the body is read, the server's next ASGI
    message is ``http.disconnect``: the same signal Starlette's ``StreamingResponse``
    listens for, so whole answers are cancelled exactly as streams are."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _outcome(stream: Stream) -> tuple[str, Any]:
    while True:
        kind, value = await stream.events.get()
        if kind != "delta":
            return kind, value


async def _complete(worker: EngineWorker, stream: Stream, http: HttpRequest, endpoint: str,
                    ident: str, created: int, model_name: str, server_id: str | None = None):
    """Wait for the whole answer, cancelling it the moment the client goes away."""
    gone = asyncio.ensure_future(_client_gone(http))
    outcome = asyncio.ensure_future(_outcome(stream))
    try:
        await asyncio.wait((gone, outcome), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not outcome.done():
            worker.cancel(stream)
        gone.cancel()
        outcome.cancel()
    if not outcome.done() or outcome.cancelled():
        return JSONResponse(error_body("client disconnected"), status_code=499)
    kind, result = outcome.result()
    if kind == "error":
        return JSONResponse(error_body(result, "server_error", code=500), status_code=500)
    content = sent_text(result.text)
    if endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "finish_reason": _finish_reason(result), "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": content, "finish_reason": _finish_reason(result),
                  "logprobs": None}
        obj = "text_completion"
    out = {"id": ident, "object": obj, "created": created, "model": model_name,
           "choices": [choice], "usage": _usage(result)}
    if server_id is not None:
        out["system_fingerprint"] = server_id
    return out


async def _sse(worker: EngineWorker, stream: Stream, endpoint: str, ident: str,
               created: int, model_name: str, include_usage: bool,
               server_id: str | None = None) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``.

    If the client disconnects, the response task is cancelled and ``finally`` cancels the
    engine request, which frees its slots.
    """
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

    def chunk(piece: str | None, finish: str | None, usage: dict | None = None) -> str:
        if endpoint == "chat":
            delta = {} if piece is None else {"content": piece}
            if piece == "" and finish is None:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish,
                      "logprobs": None}
        data = {"id": ident, "object": obj, "created": created, "model": model_name,
                "choices": [] if usage is not None else [choice]}
        if usage is not None:
            data["usage"] = usage
        if server_id is not None:
            data["system_fingerprint"] = server_id
        return f"data: {json.dumps(data)}\n\n"

    try:
        first = True
        while True:
            kind, value = await stream.events.get()
            if first and endpoint == "chat":  # the role comes with the first token, as in vLLM
                yield chunk("", None)
            first = False
            if kind == "delta":
                yield chunk(value, None)
            elif kind == "error":
                yield f"data: {json.dumps(error_body(value, 'server_error', code=500))}\n\n"
                break
            else:
                yield chunk(None, _finish_reason(value))
                if include_usage:
                    yield chunk(None, None, _usage(value))
                break
        yield "data: [DONE]\n\n"
    finally:
        worker.cancel(stream)  # a no-op once it finished


# ---------------------------------------------------------------- running it


def make_worker(model: str | None = None, capacity: int = 8192, page_size: int = 1,
                token_budget: int = 2048, policy: str = "lru", device: str | None = None,
                deterministic: bool = False, step_log: str | None = None,
                chunked_prefill: bool = True,
                speculative: dict | None = None) -> tuple[EngineWorker, str, str]:
    """Load the model (float32 on CPU) and make its worker, not started: (worker, name,
    path)."""
    import torch

    from .model import DEFAULT_MODEL, load_model

    m, tok = load_model(model, device=device, dtype=torch.float32)
    path = str(m.name_or_path)
    name = str(model or os.environ.get("MINIRT_MODEL") or DEFAULT_MODEL)
    engine = Engine(m, tok, capacity=capacity, page_size=page_size, token_budget=token_budget,
                    policy=policy, deterministic=deterministic,
                    chunked_prefill=chunked_prefill, speculative=speculative)
    return EngineWorker(engine, step_log), name, path


def main(argv: list[str] | None = None) -> None:
    """``python -m minirt.serve``: load the model, serve HTTP on a second thread, and run
    the engine loop on this one until SIGINT or SIGTERM."""
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m minirt.serve", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--model", default=None, help="model name or path (default: the book's)")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models reports")
    p.add_argument("--capacity", type=int, default=8192, help="KV pool slots (tokens)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--token-budget", type=int, default=2048,
                   help="uncached prompt tokens prefilled per step")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="cut the prompt that would overflow the budget to fill it, the rest "
                        "in the next steps (default on; --no-chunked-prefill admits whole "
                        "prompts only)")
    p.add_argument("--policy", default="lru", help="eviction policy")
    p.add_argument("--device", default=None)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--deterministic", action="store_true",
                   help="same bits whatever is cached or batched (chapter 10)")
    p.add_argument("--server-id", default=None,
                   help="sent as system_fingerprint, to tell replicas apart behind a router")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 1 MiB)")
    p.add_argument("--step-log", default=None, metavar="PATH",
                   help="write a JSON line per engine step here: when it began, its seconds "
                        "in admission and in its forward pass, requests running, "
                        "admitted and finished (benchmarks/step_log.py sums them up)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\""
                        ": true, \"endpoint\": \"tcp://*:5557\"}' (minirt.kv_events)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding with prompt-lookup drafts (chapter 13), e.g. "
                        "'{\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}': "
                        "minirt.speculative.SpeculativeConfig's fields, vLLM's flag and names "
                        "(vllm 0.32.0 `engine/arg_utils.py: EngineArgs.speculative_config`)")
    args = p.parse_args(argv)
    if args.step_log and not Path(args.step_log).resolve().parent.is_dir():
        p.error(f"--step-log {args.step_log}: no such directory")  # before the model loads
    kv_events = None
    if args.kv_events_config is not None:
        from .kv_events import KVEventError, parse_kv_events_config

        try:
            kv_events = parse_kv_events_config(args.kv_events_config)
        except KVEventError as exc:
            p.error(str(exc))
    speculative = None
    if args.speculative_config is not None:  # checked before the model loads
        from .errors import MinirtError
        from .speculative import check_speculative

        try:
            speculative = json.loads(args.speculative_config)
            check_speculative(speculative)
        except (ValueError, TypeError, MinirtError) as exc:
            p.error(f"--speculative-config: {exc}")

    worker, name, path = make_worker(args.model, args.capacity, args.page_size,
                                     args.token_budget, args.policy, args.device,
                                     args.deterministic, args.step_log, args.chunked_prefill,
                                     speculative)
    name = args.served_model_name or name
    publisher = None
    if kv_events is not None:
        from .kv_event_caches import publish_engine_events

        publisher = publish_engine_events(worker.engine, kv_events)
    app = build_app(worker, name, path, args.server_id, args.max_body_bytes)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them
    host, port = sock.getsockname()[:2]
    print(f"minirt.serve: {name} listening on http://{host}:{port}/v1 (a teaching server: "
          "no auth, one model)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, loop="uvloop",
                                           http="httptools", timeout_graceful_shutdown=2))

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])  # off the main thread, uvicorn leaves signals alone
        finally:
            worker.stop()  # no HTTP, no engine

    def on_signal(signum: int, frame) -> None:
        worker.stop()  # the loop returns after the step it is in

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    http = threading.Thread(target=serve_http, name="minirt-http")
    http.start()
    try:
        worker.run()
    finally:
        server.should_exit = True  # open requests get uvicorn's 2 s, then are cancelled
        http.join(timeout=10)
        if publisher is not None:
            publisher.close()


@dataclass
class ServerProcess:
    """A ``python -m minirt.serve`` child process; ``stop()`` ends it by its pid."""

    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT/v1
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")

    def stop(self, timeout: float = 20.0) -> int:
        """Terminate the server (SIGTERM, then SIGKILL) and wait; returns its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(*args: str, timeout: float = 180.0, env: dict | None = None) -> ServerProcess:
    """Start ``python -m minirt.serve --port 0 ARGS`` and wait until ``/health`` says ok.

    Its output goes to a temporary log file (a pipe nobody reads could fill and stall it).
    """
    import httpx

    log = Path(tempfile.mkstemp(prefix="minirt-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "minirt.serve", "--port", "0", *args]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    server = None
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"minirt.serve exited with {process.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
            found = re.search(r"listening on (http://\S+/v1)", log.read_text())
            if found and server is None:
                server = ServerProcess(process, found.group(1), log)
            if server is not None:
                try:
                    if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                        return server
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"minirt.serve not ready after {timeout} s:\n"
                           f"{log.read_text()[-3000:]}")
    except BaseException:
        process.kill()
        process.wait()
        raise


if __name__ == "__main__":
    main()
