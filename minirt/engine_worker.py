"""The engine thread behind ``minirt.serve``: one thread owns the ``Engine``, others queue to it.

``EngineWorker`` runs ``Engine.step()`` while any request is pending, on one thread
(``start()`` a background one, ``run()`` the calling one, as ``python -m minirt.serve``
does). HTTP handlers, on the event loop's thread, hand it requests and cancellations
through a queue (``submit``, ``cancel``), and it streams text back to each request's
``Stream`` as tokens are produced. Prompts are tokenized (chat template included) by
``encode`` on a third thread with its own copy of the tokenizer, so a long prompt never
stalls the steps of the others. ``TextDeltas`` turns a request's growing tokens into text
that is safe to send (no half character, no part of a stop string), ``sent_text`` is a
finished request's text as clients get it, and ``metrics_text`` the counters
``/metrics`` serves.

Where it sits (BOOK.md s.4's layers): above the engine and below ``minirt.serve``'s HTTP
layer; it knows nothing of HTTP (no app, no request bodies, no status codes).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .engine import Engine
from .errors import MinirtError, RequestError
from .request import Request, RequestResult, chat_prompt_ids

__all__ = ["EngineWorker", "Stream", "TextDeltas", "sent_text"]


class TextDeltas:
    """Turns a growing list of tokens into text pieces that are safe to send now.

    Holds back an incomplete UTF-8 character (the tokenizer shows it as U+FFFD) and any
    tail that could be the start of a stop string, and never sends a stop string itself.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.sent = 0

    def _safe_end(self, text: str) -> int:
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            return min(cuts)
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1
        for s in self.stop:  # a tail that might grow into a stop string waits
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[end - k:end] == s[:k]:
                    end -= k
                    break
        return end

    def push(self, token: int) -> str:
        """The text that ``token`` makes safe to send (maybe empty)."""
        self.ids.append(token)
        text = self.decode(self.ids)
        end = self._safe_end(text)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece

    def flush(self, final_text: str) -> str:
        """What remains of the final (stop-trimmed) text once the request is done."""
        piece, self.sent = final_text[self.sent:], len(final_text)
        return piece


def sent_text(text: str) -> str:
    """A finished request's text as clients get it: without a trailing U+FFFD, the
    tokenizer's mark for a UTF-8 character whose last bytes were never generated. vLLM
    never sends one either: its detokenizer yields whole characters only (vllm 0.32.0
    `v1/engine/detokenizer.py: FastIncrementalDetokenizer`, on tokenizers' DecodeStream)."""
    return text.rstrip("\ufffd")


# ---------------------------------------------------------------- the engine thread


@dataclass(eq=False)
class Stream:
    """One HTTP request's view of its engine request: events arrive on ``events``.

    Events: ``("delta", text)`` while it runs, then ``("done", RequestResult)`` or
    ``("error", message)``.
    """

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: str = ""
    deltas: TextDeltas | None = None  # None: the client wants the whole answer only
    finished: bool = False

    def put(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    """Runs an ``Engine`` on one thread; everything else talks to it by queue.

    ``start()`` runs it on a background thread, ``run()`` on the calling one (what
    ``main`` does, see the module docstring). The engine (and its tokenizer) are only ever
    touched by that thread, so nothing in minirt needs locks. Prompts are encoded before
    they get here, by ``encode`` on a thread of its own with a copy of the tokenizer.
    Counters for ``/metrics`` are plain ints it updates.
    """

    def __init__(self, engine: Engine, step_log: str | os.PathLike | None = None) -> None:
        self.engine = engine
        self.step_log = step_log  # a JSON line per step, written here (``--step-log``)
        self._log = open(step_log, "w", buffering=1) if step_log else None  # fails here, early
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, Stream] = {}
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
                         "finished": 0, "cancelled": 0, "rejected": 0, "failed": 0}
        self.gauges = {"running": 0, "waiting": 0, **engine.lifecycle.counters()}
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._tokenizer = copy.deepcopy(engine.tokenizer)  # the encoding thread's own
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="minirt-tokenize")
        self._thread: threading.Thread | None = None  # the thread running the loop
        self._exited = threading.Event()  # the loop has returned

    def start(self) -> EngineWorker:
        """Run the engine loop on a new background thread; return once it is ready."""
        thread = threading.Thread(target=self.run, name="minirt-engine", daemon=True)
        thread.start()
        self.ready.wait()
        return self

    def run(self) -> None:
        """Run the engine loop on the calling thread until ``stop()``."""
        self._thread = threading.current_thread()
        try:
            self._run()
        finally:
            if self._log is not None:
                self._log.close()
            self._exited.set()

    def stop(self) -> None:
        """End the loop (from any thread) and wait for it, unless this is its own thread."""
        self._stop.set()
        self.inbox.put(("wake",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._exited.wait(timeout=30)
        self._encoder.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and not self._exited.is_set() and not self._stop.is_set()

    # -------------------------------------------------- called from the event loop
    async def encode(self, prompt: str | list[int] | None = None,
                     messages: list[dict[str, str]] | None = None) -> list[int]:
        """The prompt's token ids, computed off the engine thread (chat template for
        ``messages``). Raises RequestError if the template or tokenizer rejects it."""
        if messages is None and not isinstance(prompt, str):
            return list(prompt)

        def run() -> list[int]:
            try:
                if messages is not None:
                    return chat_prompt_ids(self._tokenizer, messages)
                return self._tokenizer(prompt)["input_ids"]
            except RequestError:
                raise
            except Exception as exc:  # a tokenizer failure we did not foresee
                raise RequestError(f"cannot tokenize the prompt: {type(exc).__name__}: "
                                   f"{exc}") from exc
        return await asyncio.get_running_loop().run_in_executor(self._encoder, run)

    async def submit(self, request: Request, arrival: float, stop: tuple[str, ...] = (),
                     deltas: bool = True) -> Stream:
        """Queue ``request`` (token ids, from ``encode``); ``deltas``: stream its text.

        Raises RequestError if the engine rejects it.
        """
        loop = asyncio.get_running_loop()
        stream = Stream(loop)
        accepted = loop.create_future()
        self.inbox.put(("submit", request, arrival, stop, deltas, stream, accepted))
        await accepted
        return stream

    def cancel(self, stream: Stream) -> None:
        """Cancel ``stream``'s request if it is still pending (safe to call twice)."""
        if not stream.finished:
            self.inbox.put(("cancel", stream.rid))

    # -------------------------------------------------- the engine thread
    def _reply(self, future: asyncio.Future, error: BaseException | None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        future.get_loop().call_soon_threadsafe(settle)

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "submit":
            _, request, arrival, stop, deltas, stream, accepted = cmd
            try:
                handle = self.engine.submit(request, arrival=arrival)
            except RequestError as exc:
                self.counters["rejected"] += 1
                self._reply(accepted, exc)
                return
            except Exception as exc:  # a failure we did not foresee: this request's alone
                self.counters["rejected"] += 1
                self._reply(accepted, RequestError(f"{type(exc).__name__}: {exc}"))
                return
            stream.rid = handle.rid
            stream.deltas = TextDeltas(self._decode, stop) if deltas else None
            self.streams[handle.rid] = stream
            self._reply(accepted, None)
        elif cmd[0] == "cancel":
            stream = self.streams.pop(cmd[1], None)
            if stream is not None and not stream.finished:
                stream.finished = True
                self.engine.cancel(cmd[1])
                self.counters["cancelled"] += 1

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def _on_token(self, rid: str, token: int) -> None:
        self.counters["generation_tokens"] += 1
        stream = self.streams.get(rid)
        if stream is not None and stream.deltas is not None:
            piece = stream.deltas.push(token)
            if piece:
                stream.put(("delta", piece))

    def _done(self, result: RequestResult) -> None:
        stream = self.streams.pop(result.rid, None)
        failed = result.finish_reason == "error"  # its own sampling failed, nobody else's
        self.counters["failed" if failed else "finished"] += 1
        if stream is not None:
            stream.finished = True
            if failed:
                stream.put(("error", f"request failed: {result.error}"))
                return
            piece = stream.deltas.flush(sent_text(result.text)) if stream.deltas else ""
            if piece:
                stream.put(("delta", piece))
            stream.put(("done", result))

    def _fail_all(self, exc: BaseException) -> None:
        """An engine step raised: tell every client (HTTP 500 / an error event), drop all."""
        for rid, stream in list(self.streams.items()):
            stream.finished = True
            stream.put(("error", f"engine failure: {type(exc).__name__}: {exc}"))
            try:
                self.engine.cancel(rid)
            except MinirtError:
                pass
            self.counters["failed"] += 1
        self.streams.clear()

    def _run(self) -> None:
        self.ready.set()
        origin = time.perf_counter()
        while not self._stop.is_set():
            commands = []
            try:
                if not self.engine.has_work:
                    commands.append(self.inbox.get(timeout=0.5))
                while True:
                    commands.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for cmd in commands:
                self._command(cmd)
            if self.engine.has_work:
                running, start = len(self.engine.running), time.perf_counter()
                try:
                    out = self.engine.step(on_token=self._on_token)
                except Exception as exc:  # pragma: no cover - a bug, not a bad request
                    self._fail_all(exc)
                    continue
                if self._log is not None:
                    self._log.write(json.dumps({
                        "start": round(start - origin, 6),
                        "step_s": round(time.perf_counter() - start, 6),
                        "admit_s": round(out.admit_s, 6), "forward_s": round(out.forward_s, 6),
                        "running": running, "admitted": len(out.admitted),
                        "prefill_tokens": sum(n for _, n in out.prefilled),
                        "finished": len(out.finished), "tokens": out.num_tokens}) + "\n")
                for handle in out.admitted:
                    self.counters["prompt_tokens"] += int(handle.lc.prompt.numel())
                    self.counters["cached_tokens"] += handle.cached_tokens
                for handle in out.finished:
                    self._done(handle.result)
            self.gauges = {"running": len(self.engine.running),
                           "waiting": len(self.engine.waiting),
                           **self.engine.lifecycle.counters()}

    def metrics_text(self) -> str:
        """The counters in Prometheus' text exposition format."""
        c, g = dict(self.counters), dict(self.gauges)
        lines = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, int]]) -> None:
            lines.extend([f"# HELP minirt_{name} {doc}", f"# TYPE minirt_{name} {kind}"])
            lines.extend(f"minirt_{name}{labels} {value}" for labels, value in samples)

        metric("prefix_cache_queries_total", "counter",
               "Prompt tokens of admitted requests (looked up in the prefix cache).",
               [("", c["prompt_tokens"])])
        metric("prefix_cache_hits_total", "counter",
               "Prompt tokens found in the prefix cache at admission.",
               [("", c["cached_tokens"])])
        metric("generation_tokens_total", "counter", "Tokens generated.",
               [("", c["generation_tokens"])])
        metric("requests_total", "counter", "Requests by outcome.",
               [(f'{{outcome="{k}"}}', c[k])
                for k in ("finished", "cancelled", "rejected", "failed")])
        metric("requests", "gauge", "Requests in the engine now.",
               [('{state="running"}', g["running"]), ('{state="waiting"}', g["waiting"])])
        metric("kv_slots", "gauge", "KV pool slots by owner.",
               [(f'{{owner="{k}"}}', g[k]) for k in ("free", "evictable", "protected",
                                                      "private")])
        return "\n".join(lines) + "\n"
