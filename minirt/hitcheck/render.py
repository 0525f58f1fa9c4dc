"""From a logged request to the token ids a server would cache: template, tokenizer, reply.

A chat request is rendered through the tokenizer's chat template with the generation
prompt (the assistant header the model continues from) and tokenized without adding
special tokens, as ``transformers``' ``apply_chat_template`` does; a completions prompt's
text is tokenized with the special tokens the tokenizer adds (a BOS for many models), and
its ids are taken as sent. Those are vLLM's server's defaults (vllm 0.32.0
`entrypoints/openai/completion/protocol.py: CompletionRequest.add_special_tokens`; vllm
0.32.0 `entrypoints/openai/chat_completion/protocol.py:
ChatCompletionRequest.add_special_tokens`); a request's own ``add_special_tokens`` wins.

After the prompt, hitcheck assumes the server caches what it generated: the reply's token
ids if the log has them; for a reply logged as text, the ids its text gets inside the
template's rendering of an assistant turn (the tokenizer's own tokenization, which a
model usually generates), followed by the end-of-sequence token. So only a log with the
generated token ids can show re-tokenization (ids the model generated that the same text,
sent back, does not get).

Speed: a fast tokenizer splits its input at its added tokens (``<|im_start|>`` and the
like) before anything else, so the ids of a rendered prompt are the ids of its pieces
between added tokens, joined. Conversations resend their history and share system
prompts, so ``render_all`` keeps each piece's ids in a memo and tokenizes only the new
pieces, in batches on every core. Tokenizers whose added tokens strip spaces or are
normalized do not split cleanly; for them it tokenizes whole prompts.
"""

from __future__ import annotations

import itertools
import re
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from .load import HitcheckInputError, LoggedRequest

__all__ = [
    "PARALLEL_FROM", "PROCESSES", "Rendered", "load_tokenizer", "render", "render_all",
    "render_stream", "tokenizer_name",
]


@dataclass
class Rendered:
    """A request's prompt ids and text, and the ids the server cached after the prompt."""

    ids: array  # prompt token ids
    text: str  # the rendered prompt ("" when the prompt came as ids)
    reply_ids: array  # the reply as cached after the prompt (empty without a reply)

    @property
    def cached(self) -> array:
        """Prompt and reply: everything the server holds once the request is done."""
        return self.ids + self.reply_ids if self.reply_ids else self.ids


def tokenizer_name(tokenizer) -> str:
    """The name a report shows for ``tokenizer``."""
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def load_tokenizer(name: str | None = None):
    """A Hugging Face tokenizer by hub id or local folder; None for the book's model's,
    read offline from minirt's model cache (``minirt.model.fetch_default_model``)."""
    from transformers import AutoTokenizer

    try:
        if name is None:
            from ..model import fetch_default_model

            return AutoTokenizer.from_pretrained(str(fetch_default_model()))
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # transformers raises OSError, ValueError, HF errors, ...
        shown = "the book's default" if name is None else repr(name)
        raise HitcheckInputError(
            f"cannot load tokenizer {shown}: {type(exc).__name__}: {str(exc)[:300]} (give a "
            "local folder holding tokenizer files, or a Hugging Face id that is cached or "
            "reachable)", field="--tokenizer") from None


class _Template:
    """The tokenizer's chat template, compiled once and rendered with what
    ``apply_chat_template`` passes it (special tokens, tools, reasoning aliases), without
    its per-call overhead; ``apply_chat_template`` itself where that cannot be done."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.compiled: dict[bool, object] = {}
        try:
            from transformers.utils.chat_template_utils import (
                _alias_reasoning_fields,
                _compile_jinja_template,
            )

            self.alias, self.compile = _alias_reasoning_fields, _compile_jinja_template
            self.special = dict(tokenizer.special_tokens_map)
        except (ImportError, AttributeError):  # another transformers: the slow, sure path
            self.compile = None

    def _template(self, with_tools: bool):
        if with_tools not in self.compiled:
            text = self.tokenizer.get_chat_template(None, [{}] if with_tools else None)
            self.compiled[with_tools] = self.compile(text)
        return self.compiled[with_tools]

    def render(self, messages: list[dict], tools: list | None = None,
               generation_prompt: bool = True) -> str:
        if self.compile is None:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=generation_prompt)
        messages = self.alias([{k: v for k, v in m.items() if v is not None}
                               for m in messages])
        return self._template(bool(tools)).render(
            messages=messages, tools=tools or None, documents=None,
            add_generation_prompt=generation_prompt, **self.special)

    def text(self, request: LoggedRequest) -> str:
        try:
            return self.render(request.messages, request.tools)
        except Exception as exc:
            raise HitcheckInputError(f"the chat template cannot render this request: "
                                     f"{type(exc).__name__}: {str(exc)[:300]}", request.line,
                                     "messages") from None

    def reply_frame(self, split: re.Pattern | None) -> tuple[str, str] | None:
        """The text around an assistant message's content inside its piece (between added
        tokens), as this template renders history: ``("assistant\\n", "")`` for ChatML.
        None if the template does not render the content as it is."""
        probe = "hitcheck probe 7f3a"
        try:
            text = self.render([{"role": "user", "content": "u"},
                                {"role": "assistant", "content": probe}],
                               generation_prompt=False)
        except Exception:
            return None
        at = text.find(probe)
        if at < 0 or text.count(probe) != 1:
            return None
        start, stop = 0, len(text)
        for m in split.finditer(text) if split is not None else ():
            if m.end() <= at:
                start = m.end()
            elif m.start() >= at + len(probe):
                stop = m.start()
                break
        return text[start:at], text[at + len(probe):stop]


MEMO_PIECES = 200_000  # pieces of text whose ids render_all remembers


class _Encoder:
    """Text to ids with a memo of the pieces between added tokens (see the module doc)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.fast = getattr(tokenizer, "_tokenizer", None)
        self.memo: dict[str, array] = {}
        self._specials: tuple[list[int], list[int]] | None = None
        self.split = None
        if self.fast is not None:
            added = self.fast.get_added_tokens_decoder().values()
            if all(not (a.lstrip or a.rstrip or a.single_word or a.normalized) for a in added):
                self.added_ids = {a.content: self.fast.token_to_id(a.content) for a in added}
                names = sorted(self.added_ids, key=len, reverse=True)
                if names:
                    self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")")

    def specials(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds before and after a text with ``add_special_tokens``
        (a BOS for many models; nothing for SmolLM2's)."""
        if self._specials is None:
            bare = self.tokenizer.encode("x", add_special_tokens=False)
            full = self.tokenizer.encode("x", add_special_tokens=True)
            at = next((k for k in range(len(full) - len(bare) + 1)
                       if full[k:k + len(bare)] == bare), 0)
            self._specials = (list(full[:at]), list(full[at + len(bare):]))
        return self._specials

    def _encode_plain(self, texts: list[str]) -> list[list[int]]:
        if self.fast is not None:  # encode_batch_fast: no character offsets, a fifth faster
            batch = getattr(self.fast, "encode_batch_fast", self.fast.encode_batch)
            return [e.ids for e in batch(texts, add_special_tokens=False)]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def encode_many(self, texts: Sequence[str]) -> list[array]:
        if self.split is None:
            return [array("q", ids) for ids in self._encode_plain(list(texts))]
        if len(self.memo) > MEMO_PIECES:  # forget the older half (before this batch's lookups)
            for piece in list(itertools.islice(self.memo, len(self.memo) // 2)):
                del self.memo[piece]
        pieces_of = [self.split.split(t) for t in texts]
        missing = {p for pieces in pieces_of for i, p in enumerate(pieces)
                   if i % 2 == 0 and p and p not in self.memo}
        if missing:
            order = list(missing)
            for piece, ids in zip(order, self._encode_plain(order), strict=True):
                self.memo[piece] = array("q", ids)
        out = []
        for pieces in pieces_of:
            ids = array("q")
            for i, piece in enumerate(pieces):
                if i % 2:
                    ids.append(self.added_ids[piece])
                elif piece:
                    ids.extend(self.memo[piece])
            out.append(ids)
        return out


def _reply_ids(request: LoggedRequest, tokenizer, text_ids) -> array:
    reply = request.reply
    if reply is None:
        return array("q")
    if reply.token_ids is not None:
        return array("q", reply.token_ids)
    ids = array("q", text_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    return ids


def _reply_text(request: LoggedRequest) -> str | None:
    reply = request.reply
    if reply is None or reply.token_ids is not None:
        return None
    text = reply.text or ""
    if reply.reasoning:  # generated before the answer; a reasoning model writes its tags
        text = f"<think>\n{reply.reasoning}\n</think>\n\n{text}"
    return text


class _Replies:
    """Reply texts to ids as the model would have generated them: the ids the text gets
    inside its piece of the history (``frame``), which is also the piece the next turn
    renders, so the memo tokenizes it once. Text holding an added token, or a template
    that does not render content as it is, falls back to the text's ids on their own."""

    def __init__(self, encoder: _Encoder, template: _Template) -> None:
        self.encoder = encoder
        self.frame = template.reply_frame(encoder.split) if encoder.split is not None else None
        if self.frame is not None:
            before, after = self.frame
            self.before = encoder.encode_many([before])[0] if before else array("q")
            self.after = encoder.encode_many([after])[0] if after else array("q")

    def encode_many(self, texts: list[str]) -> list[array]:
        if self.frame is None:
            return self.encoder.encode_many(texts)
        before, after = self.frame
        framed = [t is not None and not self.encoder.split.search(t) for t in texts]
        pieces = self.encoder.encode_many([before + t + after if f else t
                                           for t, f in zip(texts, framed, strict=True)])
        out, nb, na = [], len(self.before), len(self.after)
        for text, ids, f in zip(texts, pieces, framed, strict=True):
            if f and ids[:nb] == self.before and (not na or ids[len(ids) - na:] == self.after):
                out.append(ids[nb:len(ids) - na])
            else:  # the frame's tokens merged with the text's: the text on its own
                out.append(self.encoder.encode_many([text])[0] if f else ids)
        return out


def _render_batches(batches: Iterable[Sequence[LoggedRequest]],
                    tokenizer) -> Iterator[list[Rendered]]:
    encoder = _Encoder(tokenizer)
    template = _Template(tokenizer)
    replies_encoder = _Replies(encoder, template)
    for part in batches:
        if not part:
            yield []
            continue
        texts, replies = [], []
        for r in part:
            if r.endpoint == "chat":
                texts.append(template.text(r))
            else:
                texts.append(r.prompt if isinstance(r.prompt, str) else "")
            replies.append(_reply_text(r))
        encoded = encoder.encode_many(texts)
        wanted = [t for t in replies if t is not None]
        reply_encoded = iter(replies_encoder.encode_many(wanted)) if wanted else iter(())
        out = []
        for r, text, ids, reply_text in zip(part, texts, encoded, replies, strict=True):
            if r.endpoint == "completions" and not isinstance(r.prompt, str):
                ids = array("q", r.prompt)  # ids as sent
            elif r.body.get("add_special_tokens", r.endpoint == "completions") is True:
                before, after = encoder.specials()
                if before or after:
                    ids = array("q", before) + ids + array("q", after)
            if not ids:
                raise HitcheckInputError("renders to an empty prompt", r.line,
                                         "messages" if r.endpoint == "chat" else "prompt")
            text_ids = next(reply_encoded) if reply_text is not None else ()
            out.append(Rendered(ids, text, _reply_ids(r, tokenizer, text_ids)))
        yield out


def _child(requests, owners, worker: int, tokenizer, batch: int, conn) -> None:
    """A rendering process: of every batch, the requests that are ``worker``'s, down the
    pipe; then None (or the error)."""
    try:
        mine = ([r for r, o in zip(requests[k:k + batch], owners[k:k + batch], strict=True)
                 if o == worker] for k in range(0, len(requests), batch))
        for out in _render_batches(mine, tokenizer):
            conn.send(out)
        conn.send(None)
    except HitcheckInputError as exc:
        conn.send(("error", exc.message, exc.line, exc.field))
    except Exception as exc:  # pragma: no cover - a bug: say what it was
        conn.send(("error", f"{type(exc).__name__}: {exc}", None, None))
    finally:
        conn.close()


PARALLEL_FROM = 5000  # logs this long render in other processes (where fork exists)
PROCESSES = 2  # rendering processes: each tokenizes its own conversations' pieces


def _owner(request: LoggedRequest, processes: int) -> int:
    """Which rendering process takes ``request``: by conversation (else by its first
    message or prompt), so a conversation's history is in one process's memo."""
    if request.conversation is not None:
        key = request.conversation
    elif request.messages:
        key = request.messages[0]["content"][:200]
    else:
        key = str(request.prompt)[:200]
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % processes


def render_stream(requests: Sequence[LoggedRequest], tokenizer, batch: int = 2048,
                  parallel: bool | None = None) -> Iterator[list[Rendered]]:
    """``render_all`` in batches, in order. With ``parallel`` (default: for logs of at least
    ``PARALLEL_FROM`` requests, where the platform can fork) ``PROCESSES`` forked processes
    render and tokenize, each its own conversations, while the caller works on the batches
    already done: the template and the assembly of ids are Python, one core each."""
    import multiprocessing as mp

    if parallel is None:
        parallel = len(requests) >= PARALLEL_FROM
    ranges = (requests[k:k + batch] for k in range(0, len(requests), batch))
    if not parallel or "fork" not in mp.get_all_start_methods():
        yield from _render_batches(ranges, tokenizer)
        return
    ctx = mp.get_context("fork")
    owners = [_owner(r, PROCESSES) for r in requests]
    pipes, children = [], []
    for worker in range(PROCESSES):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, daemon=True,
                            args=(requests, owners, worker, tokenizer, batch, send))
        child.start()
        send.close()
        pipes.append(receive)
        children.append(child)
    try:
        for k in range(0, len(requests), batch):
            parts = []
            for receive, child in zip(pipes, children, strict=True):
                try:
                    got = receive.recv()
                except EOFError:
                    raise HitcheckInputError("a rendering process ended without an answer "
                                             f"(exit code {child.exitcode})") from None
                if isinstance(got, tuple):
                    raise HitcheckInputError(got[1], got[2], got[3])
                parts.append(iter(got))
            yield [next(parts[o]) for o in owners[k:k + batch]]
        for receive in pipes:  # each process's closing None
            receive.recv()
    finally:
        for receive, child in zip(pipes, children, strict=True):
            receive.close()
            child.join(timeout=5)
            if child.is_alive():
                child.terminate()
                child.join()


def render_all(requests: Sequence[LoggedRequest], tokenizer, batch: int = 2048,
               parallel: bool | None = False) -> list[Rendered]:
    """``render`` for every request, tokenizing each distinct piece of text once."""
    return [r for part in render_stream(requests, tokenizer, batch, parallel) for r in part]


def render(request: LoggedRequest, tokenizer) -> Rendered:
    """One request's prompt ids and text, and the reply ids its server cached after it."""
    return render_all([request], tokenizer)[0]
