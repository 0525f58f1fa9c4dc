"""The names hitcheck gives to why a request's prompt stops sharing, and how each is told.

A request *parts* from its *partner* (the earlier cached sequence it shares most tokens
with) at one token position. What lies on both sides of that position names the cause:
a volatile value (a date, a time, an id), the same blocks or tools in another order, a
history the template renders differently from how the model generated it, or the same
text under other token ids. ``ISOLATION``, ``BLOCK`` and ``CAPACITY`` are losses on top of
that: tokens shared with an earlier prompt that a cache still cannot serve.

Everything here works on text and plain records; the trees live in ``analyze``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BLOCK", "CAPACITY", "CAUSES", "COLD", "CONTENT", "DIVERGENCE_CAUSES", "EXTENDS", "HIT",
    "ISOLATION", "LOSS_CAUSES", "REASONING_TAGS", "REORDERED", "RETOKENIZATION", "TEMPLATE",
    "VOLATILE", "VOLATILE_PATTERN", "blocks_of", "digest", "message_print", "reasoning_of",
    "tool_prints", "volatile_span",
]

# Where a request parts from its partner.
COLD = "cold"  # shares nothing with any earlier prompt
HIT = "hit"  # the whole prompt was shared
EXTENDS = "extends"  # continues the partner's whole cached sequence (prompt and reply)
CONTENT = "content"  # other content (another question): no cache could share it
VOLATILE = "volatile"  # a timestamp, date, request id, uuid or long number differs
REORDERED = "reordered"  # the same tools or documents in another order
TEMPLATE = "template"  # history rendered differently from how it was generated
RETOKENIZATION = "retokenization"  # the same text under other token ids

# Losses counted on top of the divergence.
ISOLATION = "isolation"  # an earlier prompt shares more, under another isolation key
BLOCK = "block"  # tokens below a page or block boundary; prompts shorter than a block
CAPACITY = "capacity"  # shared at unlimited capacity, evicted before reuse at this one

DIVERGENCE_CAUSES = (COLD, HIT, EXTENDS, CONTENT, VOLATILE, REORDERED, TEMPLATE, RETOKENIZATION)
LOSS_CAUSES = (VOLATILE, REORDERED, TEMPLATE, RETOKENIZATION, ISOLATION, BLOCK, CAPACITY)
CAUSES = DIVERGENCE_CAUSES + (ISOLATION, BLOCK, CAPACITY)

# Values that change from request to request although the text around them does not.
VOLATILE_PATTERN = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # uuid
    r"|\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
    r"|\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?"  # a time of day
    r"|\d{1,2}/\d{1,2}/\d{2,4}"  # 05/01/2024
    r"|(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? \d{1,2} [A-Z][a-z]+ \d{4}"
    r"|(?:January|February|March|April|May|June|July|August|September|October|November"
    r"|December) \d{1,2},? \d{4}"
    r"|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"  # hex ids
    r"|\b[A-Za-z]+[-_][A-Za-z0-9]*\d[A-Za-z0-9]{3,}\b"  # req_8f3k2a, id-12345
    r"|\d{5,}"  # epoch seconds, counters, request numbers
)

_DIGIT = re.compile(r"\d")  # every volatile value holds a digit: text without one has none

# Reasoning blocks as reasoning models write them (Qwen3's and DeepSeek-R1's tags).
REASONING_TAGS = (("<think>", "</think>"),)


def digest(value: Any) -> bytes:
    """A short, stable fingerprint of a JSON-able value (8 bytes of sha256)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8]


def blocks_of(text: str) -> list[str]:
    """The blocks a reorder would move: paragraphs if the text has blank lines, else lines."""
    parts = re.split(r"\n\s*\n", text) if re.search(r"\n\s*\n", text) else text.split("\n")
    return [p.strip() for p in parts if p.strip()]


def message_print(role: str, content: str) -> tuple[str, bytes, bytes, bytes]:
    """What the cause rules need of one message, without keeping its text:
    ``(role, digest of content, digest with volatile values masked, digest of its sorted
    blocks)``. Remembered per (role, content): a conversation resends its history."""
    key = (role, content)
    found = _PRINTS.get(key)
    if found is None:
        masked = VOLATILE_PATTERN.sub("\0", content) if _DIGIT.search(content) else content
        found = (role, digest(content), digest(masked), digest(sorted(blocks_of(content))))
        if len(_PRINTS) >= _PRINTS_MAX:
            _PRINTS.clear()
        _PRINTS[key] = found
    return found


_PRINTS: dict[tuple[str, str], tuple[str, bytes, bytes, bytes]] = {}
_PRINTS_MAX = 200_000


def tool_prints(tools: Sequence[Any] | None) -> tuple[bytes, ...]:
    """One digest per tool, in the order the request lists them."""
    return tuple(digest(t) for t in tools or ())


def reasoning_of(text: str | None) -> str:
    """The reasoning block of a reply's text (between the first pair of reasoning tags)."""
    if not text:
        return ""
    for start, end in REASONING_TAGS:
        i = text.find(start)
        if i >= 0:
            j = text.find(end, i + len(start))
            return text[i + len(start): j if j >= 0 else len(text)].strip()
    return ""


def volatile_span(before: str, ours: str, theirs: str) -> tuple[str, str] | None:
    """The volatile values on both sides of a divergence, if the texts part inside one.

    ``before`` is the shared text just before the divergence; ``ours`` and ``theirs`` the
    two texts after it. Each side's text around the boundary is searched for a volatile
    value that covers the boundary; both must have one.
    """
    found = []
    for after in (ours, theirs):
        text = before + after
        cut = len(before)
        hit = None
        for m in VOLATILE_PATTERN.finditer(text, max(0, cut - 40), min(len(text), cut + 80)):
            if m.start() <= cut < m.end() or (m.start() == cut and m.end() > cut):
                hit = m.group(0)
                break
        if hit is None:
            return None
        found.append(hit)
    return found[0], found[1]
