"""Checkers for chapter 12: where two rendered conversations part, a system prompt fixed so
its stream shares, the loss of whole blocks, and the reply that re-tokenizes.

Each checker runs the reader's function on several inputs, compares with a reference
computed here, and names the first input that disagrees (input, expected, got); a
repeated failure adds a hint toward the idea, never the algorithm. The tokenizer is the
book's (SmolLM2's, from the local model cache), loaded once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import cache

from ..workloads import default_tokenizer
from ._common import (
    call_reader,
    checker,
    expect,
    expect_per_request,
    lcp,
    passed,
    same_int,
)

__all__ = [
    "FIX_QUESTIONS",
    "FIX_STAMPS",
    "FIX_SYSTEM",
    "check_block_loss",
    "check_part_at",
    "check_retokenized_at",
    "check_stable_messages",
    "volatile_messages",
]


@cache
def _tokenizer():
    return default_tokenizer()


def _render(tokenizer, messages: list[dict]) -> list[int]:
    """``messages`` through the tokenizer's chat template, assistant prompt appended, as ids."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _short(messages: list[dict], width: int = 50) -> str:
    """A one-line view of a conversation for a failure message."""
    parts = []
    for m in messages:
        text = m["content"] if len(m["content"]) <= width else m["content"][:width] + "..."
        parts.append(f"{m['role']}: {text!r}")
    return "[" + "; ".join(parts) + "]"


# --------------------------------------------------------------------------- 12.1

_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_PAIRS: list[tuple[list[dict], list[dict]]] = [
    ([{"role": "user", "content": "What is 12 times 7?"}],
     [{"role": "user", "content": "What is 12 times 8?"}]),
    # the template writes its default system prompt when none is given
    ([{"role": "system", "content": _DEFAULT_SYSTEM},
      {"role": "user", "content": "Name a yellow fruit."}],
     [{"role": "user", "content": "Name a yellow fruit."}]),
    ([{"role": "system", "content": "Current time: 09:14:37. Be brief."},
      {"role": "user", "content": "Hi"}],
     [{"role": "system", "content": "Current time: 09:21:14. Be brief."},
      {"role": "user", "content": "Hi"}]),
    # one conversation continues the other: they part only after the shorter one ends
    ([{"role": "user", "content": "Say hello in French."}],
     [{"role": "user", "content": "Say hello in French."},
      {"role": "assistant", "content": "Bonjour!"},
      {"role": "user", "content": "And in Italian?"}]),
    # the same words, one with a trailing space in the reply
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
      {"role": "user", "content": "Thanks"}],
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there "},
      {"role": "user", "content": "Thanks"}]),
    ([{"role": "user", "content": "Summarise: the cat sat on the mat."}],
     [{"role": "user", "content": "Summarise: the cat sat on the hat."}]),
]


@checker("12.1", "Compare token ids, not characters, and compare the prompts the server "
                 "would see: everything the template writes around and before the messages.")
def check_part_at(part_at: Callable[..., int]) -> None:
    """Exercise 12.1: ``part_at(tokenizer, messages_a, messages_b) -> int``, the number of
    leading token ids the two rendered prompts (assistant prompt appended) share."""
    tokenizer = _tokenizer()
    for a, b in _PAIRS:
        want = lcp(_render(tokenizer, a), _render(tokenizer, b))
        for x, y in ((a, b), (b, a)):
            got = call_reader(f"part_at(tokenizer, {_short(x)}, {_short(y)})",
                              part_at, tokenizer, x, y)
            expect(same_int(got, want),
                   f"part_at(tokenizer, {_short(x)}, {_short(y)}) returned {got!r}; the two "
                   f"rendered prompts share their first {want} token ids.")
    passed("12.1", f"{len(_PAIRS)} pairs of conversations, both ways round")


# --------------------------------------------------------------------------- 12.2

FIX_SYSTEM = ("You are the support assistant of Northwind Outfitters, an online shop for "
              "hiking gear. Answer in two sentences. Returns are accepted within 30 days "
              "of delivery; shipping is free above 50 euros.")
FIX_STAMPS = ["2026-05-01 09:14:37", "2026-05-01 09:21:14", "2026-05-01 10:02:51",
              "2026-05-02 08:45:03", "2026-05-02 11:30:40", "2026-05-03 16:07:22"]
FIX_QUESTIONS = ["Can I return a tent I slept in once?", "How long does delivery take?",
                 "Is shipping free for 45 euros?", "My boots are the wrong size.",
                 "Do you sell gas canisters?", "When will I get my refund?"]


def volatile_messages(stamp: str, question: str) -> list[dict]:
    """The request as the client of exercise 12.2 sends it: the time first."""
    return [{"role": "system", "content": f"Current time: {stamp}.\n{FIX_SYSTEM}"},
            {"role": "user", "content": question}]


@checker("12.2", "Which tokens are the same in every request, and which change? Put "
                 "everything that never changes before the first thing that does.")
def check_stable_messages(stable_messages: Callable[[str, str], list[dict]]) -> None:
    """Exercise 12.2: ``stable_messages(stamp, question) -> messages`` carrying the stamp,
    the question and ``FIX_SYSTEM`` word for word, every request sharing the whole system
    message ``FIX_SYSTEM`` (its end-of-turn marker included) with the first."""
    tokenizer = _tokenizer()
    system_ids = _render(tokenizer, [{"role": "system", "content": FIX_SYSTEM}])
    # the rendered system message: everything up to the end of its first <|im_end|>\n
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    system_ids = system_ids[: system_ids.index(end) + 2]
    prompts = []
    for stamp, question in zip(FIX_STAMPS, FIX_QUESTIONS, strict=True):
        what = f"stable_messages({stamp!r}, {question!r})"
        messages = call_reader(what, stable_messages, stamp, question)
        expect(isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages),
            f"{what} returned {messages!r}; expected a list of {{'role', 'content'}} dicts.")
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        for name, part in (("the stamp", stamp), ("the question", question),
                           ("FIX_SYSTEM", FIX_SYSTEM)):
            expect(part in text, f"{what}: the rendered prompt lacks {name} ({part[:40]!r}); "
                                 "the fix must keep every piece of information.",
                   nudge="Move the time, do not drop it: the model still needs it.")
        prompts.append(_render(tokenizer, messages))
    first = prompts[0]
    for i, ids in enumerate(prompts):
        shared = lcp(first, ids) if i else len(ids)
        whole = ids[:len(system_ids)] == system_ids
        expect(whole and shared >= len(system_ids),
               f"stable_messages({FIX_STAMPS[i]!r}, {FIX_QUESTIONS[i]!r}) shares {shared} leading "
               f"token ids with the first request, and its prompt "
               f"{'begins' if whole else 'does not begin'} with the rendered system message "
               f"of FIX_SYSTEM ({len(system_ids)} tokens, its end-of-turn marker included); "
               "every request should share all of that message.")
    passed("12.2", f"{len(prompts)} requests share their {len(system_ids)}-token system message")


# --------------------------------------------------------------------------- 12.3


def _block_loss(requests: Sequence[Sequence[int]], block_size: int) -> list[int]:
    out = []
    for i, ids in enumerate(requests):
        hit = max((lcp(ids, requests[j]) for j in range(i)), default=0)
        out.append(hit - hit // block_size * block_size)
    return out


def _block_traces() -> list[tuple[list[list[int]], int]]:
    rng = random.Random(12)
    traces = [
        ([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 99], [1, 2, 3, 4, 5, 6, 7, 8,
                                                                       9, 10, 11, 12]], 4),
        # the second request shares more with the first than the third does with it
        ([list(range(100, 140)), list(range(100, 120)) + [7] * 5, list(range(100, 137))], 16),
        ([[5] * 3, [5] * 3, [5] * 7], 4),
    ]
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(5, 70))] for _ in range(4)]
    stream = []
    for _ in range(12):
        stem = rng.choice(stems)
        cut = rng.randrange(len(stem) + 1)
        stream.append(stem[:cut] + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))])
    traces += [(stream, 16), (stream, 8), (stream, 1)]
    return traces


@checker("12.3", "A whole-block cache keeps only the full blocks of what it shares. With "
                 "which earlier request does a request share the most?")
def check_block_loss(block_loss: Callable[[list[list[int]], int], list[int]]) -> None:
    """Exercise 12.3: ``block_loss(requests, block_size) -> list[int]``, per request the
    tokens an unlimited token-granular cache hits that whole blocks cannot."""
    for requests, block_size in _block_traces():
        shown = requests if len(requests) <= 3 else f"<{len(requests)} requests>"
        what = f"block_loss({shown}, {block_size})"
        got = call_reader(what, block_loss, [list(r) for r in requests], block_size)
        expect_per_request(what, got, _block_loss(requests, block_size), requests, "loses",
                           " to the block boundary")
    passed("12.3", "every request's loss on six streams")


# --------------------------------------------------------------------------- 12.4


def _retokenized_at(tokenizer, question: str, reply_ids: Sequence[int]) -> int | None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = _render(tokenizer, [{"role": "user", "content": question}])
    text = tokenizer.decode([t for t in reply_ids if t != end])
    second = _render(tokenizer, [{"role": "user", "content": question},
                                 {"role": "assistant", "content": text},
                                 {"role": "user", "content": "Thanks."}])
    generated = first + [t for t in reply_ids if t != end] + [end]
    n = lcp(generated, second)
    return None if n == len(generated) else n


def _retok_cases(tokenizer) -> list[tuple[str, list[int]]]:
    def enc(text: str) -> list[int]:
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    split = [i for t in ("Il", " Cor", "io", "b", "ella", ",", " Italy", ".") for i in enc(t)]
    return [
        ("What is the capital of Italy?", split + [end]),  # a word split two ways
        ("What is 2+2?", enc("The answer is 4.") + [end]),  # survives the round trip
        ("Say hello.", enc("\n") + enc("\n") + enc("Hello!") + [end]),  # merges with the template
        ("Say hello.", enc("H") + enc("ello there") + [end]),  # an unusual first split
        ("Count to three.", enc("1, 2, 3.")),  # stopped by length: no end-of-turn token
    ]


@checker("12.4", "The server saw the reply's ids one by one; the next request carries its "
                 "text inside the template. Tokenize what the next request really is.")
def check_retokenized_at(retokenized_at: Callable[..., int | None]) -> None:
    """Exercise 12.4: ``retokenized_at(tokenizer, question, reply_ids) -> int | None``: the
    position where the next turn's prompt stops repeating what the server cached (the
    first turn's prompt, then the reply's ids); None if it repeats all of it."""
    tokenizer = _tokenizer()
    for question, reply in _retok_cases(tokenizer):
        what = f"retokenized_at(tokenizer, {question!r}, {reply})"
        got = call_reader(what, retokenized_at, tokenizer, question, list(reply))
        want = _retokenized_at(tokenizer, question, reply)
        ok = got is None if want is None else same_int(got, want)
        expect(ok, f"{what} returned {got!r}; expected {want!r} "
                   f"(the reply's text is {tokenizer.decode(reply)!r}).")
    passed("12.4", "five replies, split and unsplit")
