"""The radix tree of a request log's prompts, the hit rates it allows, and why each request
stops sharing where it does.

Requests are taken in the order they arrived. Each one is looked up, read only, in the
tree of everything cached before it (each earlier prompt, then the reply the server
generated for it), a minirt ``RadixCache`` at page size 1 whose slot values are the token
ids themselves (no K/V):

- ignoring isolation keys, the longest match names the request's *partner* (the earlier
  request it shares most with; among equals, the latest of its own conversation, else the
  latest of all) and the position where the two part (``shared``);
- keeping requests with different ``IsolationKey`` apart, as a server does with
  ``cache_salt``, the longest match is the *bound* at unlimited capacity and page size 1:
  each node records the keys of the sequences that passed through it, and the bound ends
  at the deepest node on the match's path that a sequence with this key passed whole;
  rounded down to whole pages, it is the bound at ``page_size`` (``paged``). ``paged`` and the
  capacity replay stop one token short of the whole prompt, as every server's lookup does:
  the last prompt token is always computed, for its logits (vllm 0.32.0
  `v1/core/kv_cache_manager.py: KVCacheManager.get_computed_blocks`; sglang 0.5.23
  `srt/managers/schedule_batch.py: Req._compute_max_prefix_len`; minirt matches
  ``prompt[:-1]``). That token is no loss a log can avoid, so no cause counts it.

With ``capacity``, a second ``RadixCache`` of that many tokens, at ``page_size``, evicting
by ``policy`` (any of ``minirt.eviction.POLICIES``, with SGLang's settings in
``policy_config``) and keyed by salt, replays the log as a server would (match, lock, evict,
insert, unlock) and counts the tokens it actually hits. The losses between the four
numbers are the causes ``ISOLATION`` (shared > bound), ``BLOCK`` (servable > paged) and
``CAPACITY`` (paged > hit); the divergence itself is named by ``classify``.

The analysis streams: a batch of requests is rendered, analysed and dropped, and the
tree keeps the only copy of the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cache import RadixCache
from ..eviction import POLICIES, EvictionPolicy, make_policy_from_config
from ..radix import RadixNode
from ..token_ids import TokenIds
from .causes import (
    BLOCK,
    CAPACITY,
    CAUSES,
    COLD,
    CONTENT,
    EXTENDS,
    HIT,
    ISOLATION,
    REORDERED,
    RETOKENIZATION,
    TEMPLATE,
    VOLATILE,
    digest,
    message_print,
    reasoning_of,
    tool_prints,
    volatile_span,
)
from .load import HitcheckInputError, IsolationKey, LoggedRequest
from .render import Rendered, render_stream, tokenizer_name

__all__ = ["Divergence", "RequestReport", "Report", "analyze", "hit_rate_curve"]

WINDOW = 16  # tokens of text shown on each side of a divergence


@dataclass
class Divergence:
    """Where a request parts from its partner, and why."""

    partner: int | None  # index of the earlier request it shares most with (None: none)
    partner_line: int | None
    position: int  # the token position where they part: the tokens they share
    before: str  # the shared text just before the position
    ours: str  # this request's text from the position
    theirs: str  # the partner's cached text (prompt, then reply) from the position
    cause: str
    detail: str = ""


@dataclass
class RequestReport:
    """One request's numbers. Token counts of its prompt: ``shared`` with any earlier
    cached sequence (isolation keys ignored), ``bound`` at unlimited capacity and page 1,
    ``paged`` at the page size, ``hit`` in the capacity replay (None without one)."""

    index: int
    line: int
    conversation: str | None
    prompt_tokens: int
    shared: int
    bound: int
    paged: int
    hit: int | None
    divergence: Divergence
    causes: tuple[str, ...]
    lost: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    """Everything hitcheck found in one log."""

    requests: list[RequestReport]
    tokenizer: str
    page_size: int
    capacity: int | None
    policy: str
    prompt_tokens: int
    unique_tokens: int  # prompt tokens a cache computes at least once (unlimited capacity)
    bound_tokens: int
    paged_tokens: int
    hit_tokens: int | None
    tree_tokens: int  # tokens in the tree of every cached sequence (prompts, replies) at the end
    cause_counts: dict[str, int]
    cause_tokens: dict[str, int]
    curve: list[tuple[int, float]] = field(default_factory=list)
    live: list | None = None

    @property
    def bound_rate(self) -> float:
        """The unique-token bound: hit rate at unlimited capacity, page size 1."""
        return self.bound_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def paged_rate(self) -> float:
        return self.paged_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float | None:
        if self.hit_tokens is None:
            return None
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        """A plain dict (``json.dumps`` takes it): totals, rates, cause counts, requests."""
        from dataclasses import asdict

        out = {k: v for k, v in asdict(self).items() if k not in ("requests", "live")}
        out.update(bound_rate=self.bound_rate, paged_rate=self.paged_rate,
                   hit_rate=self.hit_rate, requests=[asdict(r) for r in self.requests])
        out["live"] = None if self.live is None else [asdict(x) for x in self.live]
        return out


@dataclass
class _Seen:
    """What later requests need of an analysed one (its tokens stay in the trees only)."""

    line: int
    conversation: str | None
    key: IsolationKey
    prompt_len: int
    cached_len: int
    end: RadixNode  # the open tree's node that ends at its cached sequence
    tools: tuple[bytes, ...]
    messages: tuple[tuple[str, bytes, bytes, bytes], ...]
    reply_print: bytes | None  # digest of the reply's text as the client would send it back
    reasoning: str  # the reply's reasoning block, if any


def _seen(request: LoggedRequest, rendered: Rendered, end: RadixNode) -> _Seen:
    messages: tuple = ()
    if request.messages is not None:
        messages = tuple(message_print(m["role"], m["content"]) for m in request.messages)
    elif isinstance(request.prompt, str):
        messages = (message_print("prompt", request.prompt),)
    reply, reply_print, reasoning = request.reply, None, ""
    if reply is not None and reply.text is not None:
        reasoning = reply.reasoning or reasoning_of(reply.text)
        answer = reply.text.split("</think>")[-1].strip() if "</think>" in reply.text \
            else reply.text.strip()
        reply_print = digest(answer)
    return _Seen(request.line, request.conversation, request.key, len(rendered.ids),
                 len(rendered.cached), end, tool_prints(request.tools), messages, reply_print,
                 reasoning)


def _path_tokens(node: RadixNode) -> memoryview:
    """The token ids a path spells, root to ``node``."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return memoryview(b"".join(k.tobytes() for k in reversed(keys))).cast("q")


def _passes_through(end: RadixNode, node: RadixNode) -> bool:
    while end is not None:
        if end is node:
            return True
        end = end.parent
    return False


class _Decoder:
    def __init__(self, tokenizer) -> None:
        fast = getattr(tokenizer, "_tokenizer", None)
        self.decode = (lambda ids: fast.decode(ids, skip_special_tokens=False)) if fast \
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        if fast is not None:
            self.special |= {i for i, a in fast.get_added_tokens_decoder().items() if a.special}

    def text(self, ids) -> str:
        try:
            return self.decode(list(ids))
        except Exception:  # ids outside the vocabulary (a log from another tokenizer)
            return " ".join(map(str, ids))


def classify(request: LoggedRequest, rendered: Rendered, me: _Seen, partner: _Seen | None,
             theirs_ids, position: int, decoder: _Decoder) -> tuple[str, str, str, str, str]:
    """``(cause, detail, before, ours, theirs)`` for a request that shares ``position`` tokens
    with ``partner``'s cached sequence ``theirs_ids`` (prompt, then reply)."""
    ids = rendered.ids
    p = position
    before = decoder.text(ids[max(0, p - WINDOW):p])
    ours = decoder.text(ids[p:p + WINDOW])
    theirs = decoder.text(theirs_ids[p:p + WINDOW]) if theirs_ids is not None else ""
    if partner is None or p == 0:
        return COLD, "shares no token with any earlier prompt", before, ours, theirs
    if p == len(ids):
        return HIT, "the whole prompt was cached", before, ours, theirs
    if p == len(theirs_ids):
        what = "prompt and reply" if partner.cached_len > partner.prompt_len else "prompt"
        return EXTENDS, f"continues line {partner.line}'s whole {what}", before, ours, theirs
    if p >= partner.prompt_len:  # inside what the server generated for the partner
        cause, detail = _in_reply(request, rendered, partner, theirs_ids, p, ours, theirs,
                                  decoder)
        return cause, detail, before, ours, theirs
    cause, detail = _in_prompt(me, partner, before, ours, theirs)
    return cause, detail, before, ours, theirs


def _in_reply(request: LoggedRequest, rendered: Rendered, partner: _Seen, theirs_ids, p: int,
              ours: str, theirs: str, decoder: _Decoder) -> tuple[str, str]:
    mine, gen = rendered.ids[p], theirs_ids[p]
    if gen in decoder.special or mine in decoder.special:
        return TEMPLATE, (f"end-of-turn marker: the reply ended with "
                          f"{decoder.text([gen])!r}, the history renders "
                          f"{decoder.text([mine])!r}")
    if partner.reasoning and partner.reasoning not in rendered.text:
        return TEMPLATE, ("reasoning dropped: the template leaves line "
                          f"{partner.line}'s reasoning out of the history")
    common = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        common += 1
    if common:
        return RETOKENIZATION, (f"same text, other ids: generated {int(gen)}, the text sent "
                                f"back tokenizes to {int(mine)}")
    sent = {digest(m["content"].strip()) for m in request.messages or ()
            if m["role"] == "assistant"}
    if partner.reply_print is not None and partner.reply_print in sent:
        return TEMPLATE, "the reply sent back renders differently from how it was generated"
    return CONTENT, f"the history differs from line {partner.line}'s reply"


def _in_prompt(me: _Seen, partner: _Seen, before: str, ours: str,
               theirs: str) -> tuple[str, str]:
    values = volatile_span(before, ours, theirs)
    if values is not None:
        return VOLATILE, f"{values[0]!r} here, {values[1]!r} in line {partner.line}"
    if me.tools != partner.tools and sorted(me.tools) == sorted(partner.tools):
        return REORDERED, "the same tools in another order"
    for k, (a, b) in enumerate(zip(me.messages, partner.messages, strict=False)):
        if a == b:
            continue
        if a[0] == b[0] and a[2] == b[2]:
            return VOLATILE, f"messages[{k}] differs only in dates, times or ids"
        if a[0] == b[0] and a[3] == b[3]:
            return REORDERED, f"messages[{k}] holds the same blocks in another order"
        return CONTENT, f"messages[{k}] differs"
    if me.tools != partner.tools:
        return CONTENT, "other tools"
    if me.messages and partner.messages:
        return TEMPLATE, "the same messages render differently"
    return CONTENT, "the prompts differ"


def _keyed_bound(node: RadixNode, depth: int, shared: int, salt: str | None,
                 keys: dict[RadixNode, set]) -> int:
    """The longest match among earlier sequences with the same isolation key, read off the
    open tree: the deepest node on the match's path that a sequence with this key passes
    through whole (an insert splits a node where a sequence leaves or ends inside it, so a
    node's edge is passed whole or not at all)."""
    pos = shared
    while node.parent is not None:
        if salt in keys.get(node, ()):
            return pos
        pos -= depth
        node = node.parent
        depth = node.length
    return 0


def _add_key(node: RadixNode, salt: str | None, keys: dict[RadixNode, set]) -> None:
    """Mark ``node`` as passed by a sequence with ``salt``; a node new from a split starts
    with the keys of its children (they passed through its tokens)."""
    found = keys.get(node)
    if found is None:
        found = set()
        for child in node.children.values():
            found |= keys.get(child, set())
        keys[node] = found
    found.add(salt)


class _Replay:
    """A capacity-limited cache replaying the log as a server would."""

    def __init__(self, capacity: int, page_size: int, policy: EvictionPolicy) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise HitcheckInputError(f"capacity must be a positive int, got {capacity!r}",
                                     field="--capacity")
        self.cache = RadixCache(page_size=page_size, policy=policy)
        self.capacity, self.page = capacity, page_size
        self.hits = 0

    def step(self, prompt: TokenIds, cached: TokenIds, salt: str | None) -> int:
        cache = self.cache
        match = cache.match_prefix(prompt[:-1], salt=salt)  # the last token is computed
        keep = min(len(cached), self.capacity) // self.page * self.page
        cache.lock(match.handle)
        need = keep - match.cached_len
        if need > 0:
            overflow = cache.total_size + need - self.capacity
            if overflow > 0:
                cache.evict(overflow)
            part = cached[:keep]
            cache.insert_prefix(part, part, salt=salt)
        cache.unlock(match.handle)
        self.hits += match.cached_len
        return match.cached_len


def _check(page_size: int, policy: str, policy_config: dict | None) -> EvictionPolicy:
    """Refuse a bad page size or policy before anything is read; return one policy (a
    stateful policy serves one cache: call again for each)."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise HitcheckInputError(f"page size must be a positive int, got {page_size!r}",
                                 field="--page-size")
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise HitcheckInputError(f"unknown policy {policy!r} ({', '.join(POLICIES)})",
                                 field="--policy")
    try:
        return make_policy_from_config(policy, policy_config)
    except (TypeError, ValueError) as exc:
        raise HitcheckInputError(f"--policy-config: {exc}", field="--policy-config") from None


def analyze(requests: Sequence[LoggedRequest], tokenizer=None, *, page_size: int = 1,
            capacity: int | None = None, policy: str = "lru",
            policy_config: dict | None = None,
            rendered: Sequence[Rendered] | None = None, batch: int = 2048,
            parallel: bool | None = None) -> Report:
    """Analyse a log (``load_requests``) with ``tokenizer`` (None: the book's model's).

    ``rendered``, if given, is ``render_all(requests, tokenizer)`` done already; else the
    log is rendered batch by batch as the analysis goes (``render_stream``: in other
    processes for long logs unless ``parallel`` is False).
    """
    from .render import load_tokenizer

    evict_by = _check(page_size, policy, policy_config)
    if tokenizer is None:
        tokenizer = load_tokenizer()
    decoder = _Decoder(tokenizer)
    keyed = len({r.key.salt() for r in requests}) > 1
    open_tree = RadixCache()
    keys: dict[RadixNode, set] = {}  # node -> the isolation keys of the sequences through it
    replay = _Replay(capacity, page_size, evict_by) if capacity is not None else None
    last: dict[RadixNode, int] = {}  # node -> latest request whose cached sequence runs through
    latest_in: dict[str, int] = {}  # conversation -> its latest request
    seen: list[_Seen] = []
    reports: list[RequestReport] = []
    batches = render_stream(requests, tokenizer, batch, parallel) if rendered is None \
        else (rendered[k:k + batch] for k in range(0, len(rendered), batch))
    for start, done in zip(range(0, len(requests), batch), batches, strict=True):
        part = requests[start:start + batch]
        for request, r in zip(part, done, strict=True):
            i = len(seen)
            held = TokenIds(r.cached)  # checked once; one buffer for keys and values
            prompt = held[:len(r.ids)]
            node, depth, shared = open_tree.peek_position(prompt)
            partner = None
            if shared:
                partner = last[node]
                own = latest_in.get(request.conversation) if request.conversation else None
                if own is not None and own != partner and _passes_through(seen[own].end, node):
                    partner = own
            salt = request.key.salt()
            bound = _keyed_bound(node, depth, shared, salt, keys) if keyed and shared \
                else shared
            servable = min(bound, len(r.ids) - 1)  # a server computes the last token
            paged = max(servable, 0) // page_size * page_size
            hit = replay.step(prompt, held, salt) if replay is not None else None
            end = open_tree.insert_prefix(held, held).handle.node
            walk = end
            while walk.parent is not None:
                last[walk] = i
                if keyed:
                    _add_key(walk, salt, keys)
                walk = walk.parent
            me = _seen(request, r, end)
            other = seen[partner] if partner is not None else None
            theirs = _path_tokens(other.end) if other is not None else None
            cause, detail, before, ours, theirs_text = classify(
                request, r, me, other, theirs, shared, decoder)
            div = Divergence(partner, other.line if other else None, shared, before, ours,
                             theirs_text, cause, detail)
            causes, lost = [cause], {}
            if shared > bound:
                lost[ISOLATION] = shared - bound
                causes.append(ISOLATION)
                if other is not None and other.key != request.key:
                    div.detail += f"; isolation key differs ({request.key.differs(other.key)})"
            if servable > paged:
                lost[BLOCK] = servable - paged
                causes.append(BLOCK)
            if hit is not None and paged > hit:
                lost[CAPACITY] = paged - hit
                causes.append(CAPACITY)
            reports.append(RequestReport(i, request.line, request.conversation, len(r.ids),
                                         shared, bound, paged, hit, div, tuple(causes), lost))
            seen.append(me)
            if request.conversation:
                latest_in[request.conversation] = i
    counts = dict.fromkeys(CAUSES, 0)
    tokens = dict.fromkeys((ISOLATION, BLOCK, CAPACITY), 0)
    for rep in reports:
        for c in rep.causes:
            counts[c] += 1
        for c, n in rep.lost.items():
            tokens[c] += n
    prompt_tokens = sum(r.prompt_tokens for r in reports)
    bound_tokens = sum(r.bound for r in reports)
    return Report(reports, tokenizer_name(tokenizer), page_size, capacity, policy,
                  prompt_tokens, prompt_tokens - bound_tokens, bound_tokens,
                  sum(r.paged for r in reports), replay.hits if replay else None,
                  open_tree.total_size, counts, tokens)


def hit_rate_curve(requests: Sequence[LoggedRequest], rendered: Sequence[Rendered],
                   capacities: Sequence[int], *, page_size: int = 1,
                   policy: str = "lru",
                   policy_config: dict | None = None) -> list[tuple[int, float]]:
    """``(capacity, hit rate)`` for each capacity: the log replayed through a cache that
    small (at ``page_size``, evicting by ``policy``), all capacities in one pass."""
    _check(page_size, policy, policy_config)
    replays = [_Replay(c, page_size, _check(page_size, policy, policy_config))
               for c in capacities]
    total = 0
    for request, r in zip(requests, rendered, strict=True):
        cached = TokenIds(r.cached)
        prompt = cached[:len(r.ids)]
        salt = request.key.salt()
        total += len(prompt)
        for rp in replays:
            rp.step(prompt, cached, salt)
    return [(c, rp.hits / total if total else 0.0)
            for c, rp in zip(capacities, replays, strict=True)]
