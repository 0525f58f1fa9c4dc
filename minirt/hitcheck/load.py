"""Reading a request log: one OpenAI request per line, in the order the requests arrived.

A line is a JSON object: an OpenAI chat body (``{"messages": [...]}``), a completions
body (``{"prompt": "..."}`` or a list of token ids), or a batch-file line that carries
the body under ``"body"``. Two optional fields of hitcheck's own sit at the top level:
``"conversation"`` (a string or integer id) and ``"reply"``, what the server answered:
its text, its token ids (a list of ints), or an object with ``"text"``, ``"token_ids"``
and ``"reasoning"`` (a reasoning block the server returned apart from the text, as
``reasoning_content``).

The request fields that keep requests apart in a server's cache are read into an
``IsolationKey``: ``cache_salt`` (vllm 0.32.0
`entrypoints/openai/chat_completion/protocol.py: ChatCompletionRequest.cache_salt`;
sglang 0.5.23 `srt/entrypoints/openai/protocol.py: ChatCompletionRequest.cache_salt`),
SGLang's ``extra_key`` and ``lora_path`` (sglang 0.5.23
`srt/entrypoints/openai/protocol.py: ChatCompletionRequest.extra_key,
ChatCompletionRequest.lora_path`), and ``model``, by which vLLM picks a LoRA adapter
(vllm 0.32.0 `entrypoints/serve/engine/serving.py: BaseServing._maybe_get_adapters`).
vLLM hashes the salt into a prompt's first block and the adapter into every block (vllm
0.32.0 `v1/core/kv_cache_utils.py: generate_block_hash_extra_keys`); SGLang appends the
adapter's id to the extra key (sglang 0.5.23 `srt/managers/schedule_batch.py:
Req.__init__`) and starts every child key of the tree with the extra key and the salt
(sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.child_key_at`). hitcheck treats
requests that differ in any of the four fields as never sharing; two ``model`` names
that a server maps to one model (aliases) would in fact share.

Every error names the line and the field (``HitcheckInputError``, a ``TraceError``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TraceError

__all__ = [
    "CHAT_ROLES", "HitcheckInputError", "IsolationKey", "LoggedRequest", "Reply",
    "load_requests", "parse_line",
]

# OpenAI's roles, plus "tool" (a tool's result) and "function" (its older name).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class HitcheckInputError(TraceError):
    """A request log hitcheck cannot read; names the line (1-based) and the field."""

    def __init__(self, message: str, line: int | None = None, field: str | None = None):
        where = ""
        if line is not None:
            where = f"line {line}" + (f", field {field!r}" if field else "") + ": "
        super().__init__(where + message)
        self.message, self.line, self.field = message, line, field


@dataclass(frozen=True)
class Reply:
    """The server's reply to a logged request, as far as the log kept it."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class IsolationKey:
    """Request fields under which a server keeps cache entries apart: two requests whose
    keys differ never share a cached token, whatever their prompts."""

    cache_salt: str | None = None
    extra_key: str | None = None
    lora: str | None = None
    model: str | None = None

    def salt(self) -> str | None:
        """One string for ``RadixCache``'s ``salt`` (None when every field is None)."""
        if self == _NO_KEY:
            return None
        return json.dumps([self.cache_salt, self.extra_key, self.lora, self.model])

    def differs(self, other: IsolationKey) -> str:
        """The fields in which the two keys differ, comma-separated ("" if none)."""
        names = ("cache_salt", "extra_key", "lora", "model")
        return ", ".join(n for n in names if getattr(self, n) != getattr(other, n))


_NO_KEY = IsolationKey()


@dataclass
class LoggedRequest:
    """One line of the log. ``body`` is the request as sent (``--base-url`` sends it again)."""

    line: int
    endpoint: str  # "chat" or "completions"
    body: dict = field(repr=False)
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    tools: list | None = None
    conversation: str | None = None
    reply: Reply | None = None
    key: IsolationKey = _NO_KEY


def _text_of(content: Any, line: int, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                raise HitcheckInputError(
                    f"content part {k} must be a string or an object with a string 'text' "
                    f"(hitcheck reads text only), got {part!r:.80}", line, where)
        return "".join(out)
    raise HitcheckInputError(f"content must be a string, null or a list of text parts, got "
                             f"{type(content).__name__}", line, where)


def _messages(raw: Any, line: int) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise HitcheckInputError("must be a non-empty list of messages", line, "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HitcheckInputError(f"must be an object, got {m!r:.80}", line, where)
        role = m.get("role")
        if not isinstance(role, str):
            raise HitcheckInputError("needs a string 'role'", line, where + ".role")
        if role not in CHAT_ROLES:
            raise HitcheckInputError(f"unknown role {role!r} (known: {', '.join(CHAT_ROLES)})",
                                     line, where + ".role")
        message = dict(m)
        message["content"] = _text_of(m.get("content"), line, where + ".content")
        for extra in ("reasoning_content", "reasoning"):
            if extra in m and m[extra] is not None and not isinstance(m[extra], str):
                raise HitcheckInputError("must be a string", line, f"{where}.{extra}")
        out.append(message)
    return out


def _ids(raw: Any, line: int, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        raise HitcheckInputError("must be a list of non-negative integer token ids", line,
                                 where)
    return raw


def _reply(raw: Any, line: int) -> Reply | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return Reply(text=raw)
    if isinstance(raw, list):
        return Reply(token_ids=tuple(_ids(raw, line, "reply")))
    if isinstance(raw, dict):
        text, ids, reasoning = raw.get("text"), raw.get("token_ids"), raw.get("reasoning")
        if text is not None and not isinstance(text, str):
            raise HitcheckInputError("must be a string", line, "reply.text")
        if reasoning is not None and not isinstance(reasoning, str):
            raise HitcheckInputError("must be a string", line, "reply.reasoning")
        if ids is not None:
            ids = tuple(_ids(ids, line, "reply.token_ids"))
        if text is None and ids is None:
            raise HitcheckInputError("needs 'text' or 'token_ids'", line, "reply")
        return Reply(text=text, token_ids=ids, reasoning=reasoning)
    raise HitcheckInputError("must be a string, a list of token ids or an object with 'text' "
                             "and/or 'token_ids'", line, "reply")


def _optional_str(body: dict, name: str, line: int) -> str | None:
    value = body.get(name)
    if value is None or value == "":
        return None
    # SGLang's protocol takes a list too, one item a request:
    # sglang 0.5.23 `srt/entrypoints/openai/protocol.py: CompletionRequest.cache_salt`
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise HitcheckInputError(f"must be a string, got {value!r:.80}", line, name)
    return value


def parse_line(text: str, line: int) -> LoggedRequest:
    """One line of the log as a ``LoggedRequest``; ``HitcheckInputError`` naming the field."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise HitcheckInputError(f"not JSON ({exc})", line) from None
    if not isinstance(obj, dict):
        raise HitcheckInputError(f"must be a JSON object, got {type(obj).__name__}", line)
    body = obj.get("body", obj)
    if not isinstance(body, dict):
        raise HitcheckInputError("must be an object (the request body)", line, "body")
    conversation = obj.get("conversation", obj.get("conversation_id"))
    if conversation is not None:
        if isinstance(conversation, bool) or not isinstance(conversation, (str, int)):
            raise HitcheckInputError("must be a string or an integer", line, "conversation")
        conversation = str(conversation)
    reply = _reply(obj.get("reply"), line)
    key = IsolationKey(_optional_str(body, "cache_salt", line),
                       _optional_str(body, "extra_key", line),
                       _optional_str(body, "lora_path", line),
                       _optional_str(body, "model", line))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise HitcheckInputError("must be a list", line, "tools")
    if "messages" in body:
        return LoggedRequest(line, "chat", body, messages=_messages(body["messages"], line),
                             tools=tools, conversation=conversation, reply=reply, key=key)
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            prompt = _ids(prompt, line, "prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise HitcheckInputError("must be a non-empty string or list of token ids (one "
                                     "prompt per request)", line, "prompt")
        return LoggedRequest(line, "completions", body, prompt=prompt, tools=tools,
                             conversation=conversation, reply=reply, key=key)
    raise HitcheckInputError("a request needs 'messages' (chat) or 'prompt' (completions)",
                             line)


def load_requests(source: str | os.PathLike | Iterable[str]) -> list[LoggedRequest]:
    """Every request of a JSONL log (a path, or an iterable of lines), blank lines skipped."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            with open(path, encoding="utf-8") as f:
                return load_requests(list(f))
        except OSError as exc:
            raise HitcheckInputError(f"cannot read {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise HitcheckInputError(f"{str(path)!r} is not UTF-8 text: {exc}") from None
    out = []
    for n, text in enumerate(source, 1):
        if text.strip():
            out.append(parse_line(text, n))
    if not out:
        raise HitcheckInputError("the log holds no request")
    return out
