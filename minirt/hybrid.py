"""A window-aware prefix cache for models that mix full-attention and sliding-window layers.

A full-attention layer reads every earlier position, so a cached prefix is usable only if
*all* its K/V are resident. A sliding-window layer with window ``W`` (it attends to the
``W`` positions ending at the query, itself included) reads only the last ``W - 1`` cached
positions when it continues a prefix. So the tree keeps two kinds of K/V per token:

* full K/V (``node.value``): kept for the whole path, as in ``RadixCache``;
* window K/V (``node.window_value``): kept only where a continuation can still read them.
  A node whose window K/V were freed while its full K/V stay is a *tombstone*
  (``window_value is None``), SGLang's word (sglang 0.5.23
  `srt/mem_cache/unified_cache/components/swa.py: SWAComponent`).

``match_prefix`` returns the longest prefix whose last ``W - 1`` tokens have their window
K/V (the *tail window*) and whose full K/V are all there. ``WindowLifecycle`` is chapter
04's lifecycle on it, over two ``KVPool``s (full layers', window layers'), with
``forward.forward_windowed`` as its forward: a request frees its own window K/V as soon as
they leave its window (vLLM's ``remove_skipped_blocks``), keeps them where a later request
may branch, and inserts the rest as tombstones. ``Engine(cache="window")`` serves through
it (chosen by itself for a model whose config has sliding layers); ``WindowRunner`` runs
one request at a time through it, for the chapter.

Where minirt differs from SGLang: tokens, not pages (page size 1); a lock protects the
window K/V of its whole path (SGLang locks only the window: ``release_window_lock``); one
LRU order over nodes, found by a scan (SGLang keeps one LRU list per component).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count

import torch

from .cache import CacheStats, as_ids
from .errors import (
    HandleError,
    InvalidIdsError,
    OutOfMemoryError,
    PoolError,
    RequestError,
    StaleHandleError,
)
from .forward import LayerKV, forward_windowed
from .lifecycle import Lifecycle, Request, _greedy_picks, greedy_token
from .pool import KVPool, PageTable

__all__ = ["FULL", "WINDOW", "HybridSpec", "WindowHandle", "WindowInsert", "WindowMatch",
           "WindowLifecycle", "WindowNode", "WindowRadixCache", "WindowRunner", "greedy_uncached",
           "has_window_layers", "with_sliding_window"]

FULL, WINDOW = "full_attention", "sliding_attention"  # transformers' layer_types names
NO_SLOT = -1  # a position whose window K/V are not held


# ---------------------------------------------------------------- the model's layer kinds

@dataclass(frozen=True)
class HybridSpec:
    """Which layers are full attention and which slide, and the window ``W``.

    ``need`` = ``W - 1``: the cached positions a window layer reads to continue a prefix.
    """

    layer_types: tuple[str, ...]
    window: int

    def __post_init__(self) -> None:
        bad = sorted(set(self.layer_types) - {FULL, WINDOW})
        if bad:
            raise ValueError(f"layer types must be {FULL!r} or {WINDOW!r}, got {bad}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive int, got {self.window!r}")

    @property
    def need(self) -> int:
        return self.window - 1

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def window_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == WINDOW)

    @classmethod
    def from_config(cls, config) -> HybridSpec:
        """From a transformers config with ``layer_types`` and ``sliding_window``."""
        types = tuple(getattr(config, "layer_types", None) or
                      [FULL] * config.num_hidden_layers)
        window = getattr(config, "sliding_window", None) or 0
        if WINDOW in types and window < 1:
            raise ValueError("a config with sliding layers needs a positive sliding_window")
        return cls(types, window or 1)

    @classmethod
    def interleaved(cls, num_layers: int, window: int, full_every: int) -> HybridSpec:
        """Gemma-3-style: every ``full_every``-th layer is full attention, the rest slide
        (``full_every=6``: five window layers to one full)."""
        return cls(tuple(FULL if (i + 1) % full_every == 0 else WINDOW
                         for i in range(num_layers)), window)


def with_sliding_window(model, spec: HybridSpec):
    """The Llama ``model``'s weights in transformers' Qwen2 with ``spec``'s sliding layers.

    Qwen2 is Llama plus q/k/v biases (set to zero here), and its config takes
    ``layer_types`` and ``sliding_window``, so transformers itself applies the window mask:
    this is the same network with a window added, not a model trained with one. The
    weights are shared with ``model`` (no copy).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    c = model.config
    if len(spec.layer_types) != c.num_hidden_layers:
        raise ValueError(f"spec has {len(spec.layer_types)} layer types for a model with "
                         f"{c.num_hidden_layers} layers")
    config = Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None), max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
        tie_word_embeddings=c.tie_word_embeddings, hidden_act=c.hidden_act,
        use_sliding_window=True, sliding_window=spec.window, layer_types=list(spec.layer_types),
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, attn_implementation="sdpa")
    with torch.device("meta"):
        windowed = Qwen2ForCausalLM(config)
    state = dict(model.state_dict())
    param = next(model.parameters())
    for name, tensor in windowed.state_dict().items():
        if name not in state:  # the q/k/v biases Llama does not have
            state[name] = torch.zeros(tensor.shape, dtype=param.dtype, device=param.device)
    windowed.load_state_dict(state, strict=True, assign=True)
    windowed.model.rotary_emb = Qwen2RotaryEmbedding(config).to(param.device)
    if c.tie_word_embeddings:
        windowed.lm_head.weight = windowed.model.embed_tokens.weight
    return windowed.eval()


@torch.no_grad()
def greedy_uncached(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers alone: its own forward, masks and per-request cache
    (which keeps a window layer's last ``W - 1`` positions), nothing shared between
    requests and no minirt code on the path. The reference."""
    device = next(model.parameters()).device
    step = model(torch.tensor([list(prompt)], device=device), use_cache=True)
    out = [int(step.logits[0, -1].argmax())]
    while len(out) < max_new_tokens:
        step = model(torch.tensor([[out[-1]]], device=device),
                     cache=step.cache, use_cache=True)
        out.append(int(step.logits[0, -1].argmax()))
    return out


# ---------------------------------------------------------------- the tree

_ids = count(1)


class WindowNode:
    """A radix node with two slot runs: ``value`` (full K/V) and ``window_value`` (window
    K/V, or None for a tombstone). ``ref_count`` counts the locks through it."""

    __slots__ = ("key", "value", "window_value", "children", "parent", "ref_count",
                 "last_access", "id")

    def __init__(self, key: list[int], value: list[int], window_value: list[int] | None,
                 tick: int = 0) -> None:
        self.key, self.value, self.window_value = key, value, window_value
        self.children: dict[int, WindowNode] = {}
        self.parent: WindowNode | None = None
        self.ref_count = 0
        self.last_access = tick
        self.id = next(_ids)

    @property
    def length(self) -> int:
        return len(self.key)

    @property
    def tombstone(self) -> bool:
        return self.window_value is None and self.parent is not None

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        kind = "tombstone" if self.tombstone else "live"
        return f"WindowNode(id={self.id}, len={self.length}, {kind}, ref={self.ref_count})"


@dataclass(frozen=True)
class WindowHandle:
    """Where a match or insert ended: ``node`` and the prefix length it spells."""

    node: WindowNode
    cached_len: int


@dataclass(frozen=True)
class WindowMatch:
    """``match_prefix``'s answer.

    ``cached_len``: the usable prefix (full K/V all there, tail window intact);
    ``full_len``: the longest prefix with full K/V alone (what a cache keeping every
    layer's K/V would have matched had it kept the same tokens); ``full``: the usable
    prefix's full slots; ``window``: its window slots, ``NO_SLOT`` where none are held.
    """

    handle: WindowHandle
    cached_len: int
    full_len: int
    full: list[int] = field(repr=False)
    window: list[int] = field(repr=False)


@dataclass(frozen=True)
class WindowInsert:
    """``insert_prefix``'s answer: the caller's duplicate slots to free, and the handle."""

    handle: WindowHandle
    cached_len: int
    free_full: list[int]
    free_window: list[int]


class WindowRadixCache:
    """A radix tree of full and window K/V slots, with tombstones (see the module docstring).

    ``window`` is the model's sliding window ``W``. ``window=None`` keeps no tail rule:
    every prefix with full K/V matches (a model without window layers).
    """

    page_size = 1  # tokens, not pages

    def __init__(self, window: int | None) -> None:
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        self.window = window
        self.need = 0 if window is None else window - 1
        self.reset()

    def reset(self) -> None:
        self.root = WindowNode([], [], [])
        self._locks: dict[int, tuple[WindowNode, int]] = {}  # node id -> (node, count)
        self._tick = 0
        self._queries = self._query_tokens = self._hit_tokens = self._full_hit_tokens = 0
        self.tombstoned_tokens = 0  # window tokens freed from inner nodes by eviction

    # ------------------------------------------------------------ match

    def _walk(self, ids: list[int]) -> Iterator[tuple[WindowNode, int, int]]:
        """(node, depth at its start, tokens of ``ids`` it matches) down the path."""
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                return
            m = 0
            while m < child.length and pos + m < len(ids) and child.key[m] == ids[pos + m]:
                m += 1
            yield child, pos, m
            if m < child.length:
                return
            node, pos = child, pos + m

    def usable_length(self, ids: Sequence[int]) -> tuple[int, int]:
        """(usable prefix length, full-K/V prefix length) of ``ids``, read only.

        A position ``d`` can be continued when the live (non-tombstone) run of tokens
        ending at it covers ``min(d, need)``: the tail window is intact.
        """
        ids = as_ids(ids).tolist()
        best, run, full = 0, 0, 0
        for node, start, m in self._walk(ids):
            full = start + m
            if node.window_value is None:
                run = 0  # every position inside a tombstone has an empty run
                if self.need == 0:
                    best = start + m
                continue
            run += m
            if run >= min(start + m, self.need):
                best = start + m
        return best, full

    def peek_prefix_len(self, ids: Sequence[int], salt: None = None) -> int:
        """The usable prefix length, read only (``salt``: None only; no salts here)."""
        if salt is not None:
            raise InvalidIdsError("the window cache keeps no cache salts")
        return self.usable_length(ids)[0]

    def path_slots(self, handle: WindowHandle) -> tuple[list[int], list[int]]:
        """The full and window slots of the prefix ``handle`` spells (``NO_SLOT`` inside
        tombstones); StaleHandleError if its node left the tree."""
        self._check_handle(handle)
        path, node = [], handle.node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        full: list[int] = []
        window: list[int] = []
        for n in reversed(path):
            full += n.value
            window += n.window_value or [NO_SLOT] * n.length
        return full, window

    def match_prefix(self, ids: Sequence[int]) -> WindowMatch:
        """The longest usable prefix of ``ids``: handle, lengths, slots.

        Splits the node the usable prefix ends inside, so the handle's node ends exactly
        there (metadata only). Stamps the matched path as used; updates the statistics.
        Does not lock.
        """
        ids = as_ids(ids).tolist()
        best, full_len = self.usable_length(ids)
        self._tick += 1
        node, full, window = self.root, [], []
        for child, _start, m in self._walk(ids[:best]):
            if m < child.length:
                child = self._split(child, m)
            full.extend(child.value)
            window.extend(child.window_value or [NO_SLOT] * child.length)
            node = child
        self._touch(node)
        self._queries += 1
        self._query_tokens += len(ids)
        self._hit_tokens += best
        self._full_hit_tokens += full_len
        return WindowMatch(WindowHandle(node, best), best, full_len, full, window)

    def _touch(self, node: WindowNode) -> None:
        while node.parent is not None:
            node.last_access = self._tick
            node = node.parent

    def _split(self, node: WindowNode, pos: int) -> WindowNode:
        """Cut ``node`` after ``pos`` tokens; return the new upper half (keeps the locks)."""
        upper = WindowNode(node.key[:pos], node.value[:pos],
                           None if node.window_value is None else node.window_value[:pos],
                           node.last_access)
        upper.ref_count, upper.parent = node.ref_count, node.parent
        node.parent.children[upper.key[0]] = upper
        node.key, node.value = node.key[pos:], node.value[pos:]
        if node.window_value is not None:
            node.window_value = node.window_value[pos:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # ------------------------------------------------------------ insert

    def insert_prefix(self, ids: Sequence[int], full: Sequence[int],
                      window: Sequence[int]) -> WindowInsert:
        """Cache ``ids`` with full K/V in ``full`` and window K/V in ``window``
        (``NO_SLOT`` where the caller holds none: those tokens become tombstones).

        Where the tree already holds a token's K/V, the caller's slot is a duplicate to
        free (listed in the result). Where the tree holds a tombstone and the caller has
        window K/V, the tree adopts them (SGLang recovers a tombstone the same way).
        """
        ids = as_ids(ids).tolist()
        full = as_ids(full, "full slots").tolist()
        window = [int(s) for s in torch.as_tensor(list(window), dtype=torch.int64).tolist()]
        if not len(ids) == len(full) == len(window):
            raise InvalidIdsError(f"ids, full and window slots must have the same length, got "
                                  f"{len(ids)}, {len(full)} and {len(window)}")
        if any(s < NO_SLOT for s in window):
            raise InvalidIdsError("window slots must be >= 0, or -1 for none held")
        self._tick += 1
        free_full: list[int] = []
        free_window: list[int] = []
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            m = 0
            while m < child.length and pos + m < len(ids) and child.key[m] == ids[pos + m]:
                m += 1
            if m < child.length:
                child = self._split(child, m)
            incoming = window[pos:pos + m]
            if child.window_value is None and any(s != NO_SLOT for s in incoming):
                held = [s != NO_SLOT for s in incoming]
                cut = next((j for j in range(1, m) if held[j] != held[0]), m)
                if cut < m:  # adopt (or skip) one uniform run; the rest is handled next
                    child, m = self._split(child, cut), cut
                    incoming = incoming[:cut]
                if held[0]:
                    child.window_value = list(incoming)
                    incoming = []
            elif child.window_value is not None:
                free_window += [s for s, t in zip(incoming, child.window_value, strict=True)
                                if s != NO_SLOT and s != t]
            free_full += [s for s, t in zip(full[pos:pos + m], child.value, strict=True) if s != t]
            child.last_access = self._tick
            node, pos = child, pos + m
        cached = pos
        while pos < len(ids):  # the new tail: one node per run of held / not-held window K/V
            held = window[pos] != NO_SLOT
            end = next((j for j in range(pos + 1, len(ids)) if (window[j] != NO_SLOT) != held),
                       len(ids))
            leaf = WindowNode(ids[pos:end], full[pos:end],
                              window[pos:end] if held else None, self._tick)
            leaf.parent = node
            node.children[leaf.key[0]] = leaf
            node, pos = leaf, end
        self._touch(node)
        return WindowInsert(WindowHandle(node, len(ids)), cached, free_full, free_window)

    # ------------------------------------------------------------ lock and unlock

    def lock(self, handle: WindowHandle) -> None:
        """Protect the handle's path (both kinds of K/V) from eviction."""
        self._check_handle(handle)
        self._shift(handle.node, +1)
        held = self._locks.get(handle.node.id, (handle.node, 0))[1]
        self._locks[handle.node.id] = (handle.node, held + 1)

    def unlock(self, handle: WindowHandle) -> None:
        """Undo one ``lock(handle)``; HandleError (nothing changes) without one."""
        self._check_handle(handle)
        held = self._locks.get(handle.node.id, (handle.node, 0))[1]
        if held == 0:
            raise HandleError(f"unlock without a matching lock: {handle}")
        self._shift(handle.node, -1)
        if held == 1:
            del self._locks[handle.node.id]
        else:
            self._locks[handle.node.id] = (handle.node, held - 1)

    def _check_handle(self, handle: WindowHandle) -> None:
        if not isinstance(handle, WindowHandle):
            raise HandleError(f"expected a WindowHandle, got {type(handle).__name__}")
        node, depth = handle.node, 0
        while node.parent is not None:
            depth += node.length
            node = node.parent
        if node is not self.root:
            raise StaleHandleError(f"stale handle: its node was evicted or the cache reset "
                                   f"({handle})")
        if depth != handle.cached_len:
            raise HandleError(f"handle claims {handle.cached_len} tokens but its node ends at "
                              f"{depth}")

    @staticmethod
    def _shift(node: WindowNode, delta: int) -> None:
        while node.parent is not None:
            node.ref_count += delta
            node = node.parent

    # ------------------------------------------------------------ eviction

    def evict(self, full: int = 0, window: int = 0) -> tuple[list[int], list[int]]:
        """Free >= ``full`` full-K/V slots and >= ``window`` window-K/V slots.

        Window first: the least recently used unlocked node holding window K/V loses them;
        an inner node becomes a tombstone (its full K/V still serve its descendants), a
        leaf goes entirely (nothing can continue inside a tombstoned leaf). Then full:
        least recently used unlocked leaves go, both kinds, and a parent left childless
        may go next. Returns (freed full slots, freed window slots). OutOfMemoryError,
        with nothing evicted, if the evictable tokens of either kind are too few.
        """
        for name, n in (("full", full), ("window", window)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise PoolError(f"{name} must be a non-negative int, got {n!r}")
        ev_full, ev_window = self.evictable_full, self.evictable_window
        if full > ev_full or window > ev_window:
            raise OutOfMemoryError(
                f"cannot evict {full} full and {window} window tokens: only {ev_full} and "
                f"{ev_window} are evictable (the rest are locked by running requests)")
        freed_full: list[int] = []
        freed_window: list[int] = []
        while len(freed_window) < window:
            victim = self._oldest(lambda n: n.window_value is not None and n.ref_count == 0)
            if victim.is_leaf():
                self._remove_leaf(victim, freed_full, freed_window)
            else:
                freed_window += victim.window_value
                self.tombstoned_tokens += victim.length
                victim.window_value = None
        while len(freed_full) < full:
            victim = self._oldest(lambda n: n.is_leaf() and n.ref_count == 0)
            self._remove_leaf(victim, freed_full, freed_window)
        return freed_full, freed_window

    def _oldest(self, eligible) -> WindowNode:
        """The least recently used eligible node. A path touched at once counts its parent
        as older than its child (SGLang stamps decreasing times up the path), so a window
        eviction tombstones a shared inner node before the leaf last used through it."""
        best, best_key = None, None
        stack = [(c, c.length) for c in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            if eligible(node) and (best_key is None or (node.last_access, depth) < best_key):
                best, best_key = node, (node.last_access, depth)
            stack.extend((c, depth + c.length) for c in node.children.values())
        assert best is not None, "evictable tokens counted but no eligible node"
        return best

    def _remove_leaf(self, node: WindowNode, freed_full: list[int],
                     freed_window: list[int]) -> None:
        """Detach an unlocked leaf; a parent left a childless tombstone goes with it."""
        while True:
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            freed_full += node.value
            freed_window += node.window_value or []
            if parent is self.root or parent.children or parent.ref_count or \
                    parent.window_value is not None:
                return
            node = parent

    # ------------------------------------------------------------ sizes and inspection

    def nodes(self) -> Iterator[WindowNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _count(self, window: bool, locked: bool | None) -> int:
        return sum(n.length for n in self.nodes()
                   if (not window or n.window_value is not None)
                   and (locked is None or (n.ref_count > 0) == locked))

    @property
    def full_tokens(self) -> int:
        """Tokens whose full K/V the tree holds."""
        return self._count(False, None)

    total_size = full_tokens  # the name the engine's other caches use

    @property
    def window_tokens(self) -> int:
        """Tokens whose window K/V the tree holds (tombstones excluded)."""
        return self._count(True, None)

    @property
    def evictable_full(self) -> int:
        return self._count(False, False)

    @property
    def evictable_window(self) -> int:
        return self._count(True, False)

    @property
    def num_tombstones(self) -> int:
        return sum(1 for n in self.nodes() if n.window_value is None)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queries, self._query_tokens, self._hit_tokens)

    @property
    def full_hit_tokens(self) -> int:
        """Matched tokens had every prefix with full K/V counted (the tail rule ignored)."""
        return self._full_hit_tokens

    def all_slots(self) -> tuple[list[int], list[int]]:
        """Every full slot and every window slot the tree owns."""
        full: list[int] = []
        window: list[int] = []
        for n in self.nodes():
            full += n.value
            window += n.window_value or []
        return full, window

    def snapshot(self) -> tuple:
        """Every node as (path, full, window, ref_count), for ``==`` (splits count)."""
        rows, stack = [], [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.key)
            if node is not self.root:
                rows.append((path, tuple(node.value), None if node.window_value is None
                             else tuple(node.window_value), node.ref_count))
            stack.extend((c, path) for c in node.children.values())
        return tuple(sorted(rows))

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (both kinds of K/V)."""
        def require(cond: bool, what: str, node: WindowNode) -> None:
            if not cond:
                raise AssertionError(f"window cache invariant broken: {what} (at {node})")

        root = self.root
        require(root.parent is None and not root.key and root.window_value == [],
                "root is empty, parentless and not a tombstone", root)
        refs: dict[int, int] = {}
        for node, held in self._locks.values():
            require(held > 0, "lock counts are positive", node)
            n = node
            while n.parent is not None:
                refs[n.id] = refs.get(n.id, 0) + held
                n = n.parent
            require(n is root, "a locked node is in the tree", node)
        full, window = self.all_slots()
        for node in self.nodes():
            require(node.length > 0, "no empty node besides the root", node)
            require(node.parent.children.get(node.key[0]) is node,
                    "children keyed by their first token, parent points back", node)
            require(len(node.value) == node.length, "len(value) == length", node)
            require(node.window_value is None or len(node.window_value) == node.length,
                    "a live node's window_value has its length", node)
            require(node.ref_count == refs.get(node.id, 0),
                    "ref_count counts the locks through the node", node)
        require(len(set(full)) == len(full), "every full slot owned once", root)
        require(len(set(window)) == len(window), "every window slot owned once", root)

    def __repr__(self) -> str:
        return (f"WindowRadixCache(window={self.window}, full_tokens={self.full_tokens}, "
                f"window_tokens={self.window_tokens}, tombstones={self.num_tombstones})")


# ---------------------------------------------------------------- running a model through it

def has_window_layers(model) -> bool:
    """True if ``model``'s config has sliding-window layers (``layer_types``)."""
    config = model.config.get_text_config(decoder=True)
    return WINDOW in (getattr(config, "layer_types", None) or ())


class WindowLifecycle(Lifecycle):
    """Chapter 04's request lifecycle for a model with window layers, over two ``KVPool``s.

    Full layers keep K/V in ``pools["full"]`` (``capacity`` tokens, also ``self.pool``),
    window layers in ``pools["window"]`` (``window_capacity``, default ``capacity``); the
    cache is a ``WindowRadixCache``; each request has a page table per pool (the window
    one in ``window_tables``, ``NO_SLOT`` where it holds nothing). The forward is
    ``forward.forward_windowed``: window layers read only their last ``W - 1`` positions.
    Page size 1 (tokens); no cache salts; greedy or sampled picks as the base class.

    After each forward a request frees its own window K/V that left its window (vLLM's
    ``remove_skipped_blocks``), except the *branching range* just before its longest
    full-K/V hit, where a later request may branch (SGLang's ``swa_branching_seqlen``);
    what it inserts (its prompt at prefill, everything at ``finish``) has tombstones where
    it freed. ``window_aware=False`` is the baseline keeping every layer's K/V of every
    cached token: no early frees, so no tombstones but those eviction makes.
    """

    mixes = False  # ``step`` runs its prefill and its decode as two ``forward_windowed``s

    def __init__(self, model, capacity: int, window_capacity: int | None = None,
                 window_aware: bool = True) -> None:
        if not has_window_layers(model):
            raise PoolError("the window cache serves models with sliding-window layers "
                            "(config.layer_types); this one has none: use cache='radix'")
        spec = HybridSpec.from_config(model.config.get_text_config(decoder=True))
        c = model.config.get_text_config(decoder=True)
        kv_heads = c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        param = next(model.parameters())
        self.pools = {
            kind: KVPool(max(1, len(layers)), kv_heads, head_dim, cap,
                         dtype=param.dtype, device=param.device)
            for kind, layers, cap in (
                ("full", spec.full_layers, capacity),
                ("window", spec.window_layers,
                 capacity if window_capacity is None else window_capacity))}
        where = {i: (kind, j) for kind, layers in (("full", spec.full_layers),
                                                  ("window", spec.window_layers))
                 for j, i in enumerate(layers)}
        self.layers = [LayerKV(self.pools[where[i][0]], where[i][1], int(where[i][0] == "window"),
                               spec.window if where[i][0] == "window" else None)
                       for i in range(len(spec.layer_types))]
        super().__init__(model, self.pools["full"], WindowRadixCache(spec.window))
        self.spec, self.window_aware = spec, window_aware
        self.window_tables: dict[str, list[int]] = {}
        self._branch: dict[str, range] = {}
        self.evicted_tokens = self.evictions = 0  # full tokens evicted by make_room
        self.peak_window_used = 0  # the window pool's most used slots after a forward

    # -------------------------------------------------- requests and memory
    def _extra_window(self, max_new_tokens: int) -> int:
        """Window slots a request needs past its prompt's: its decode steps' own K/V, of
        which at most ``need + 1`` are held at once when window-aware."""
        extra = max_new_tokens - 1
        return min(extra, self.spec.need + 1) if self.window_aware else extra

    def new_request(self, prompt, max_new_tokens: int = 1, rid: str | None = None,
                    eos_token_id: int | None = None, next_token=greedy_token,
                    salt: str | bytes | None = None) -> Request:
        """The base class's, and RequestError for a salt or a request the window pool can
        never hold (its prompt's window K/V are all written at prefill)."""
        if salt is not None:
            raise RequestError("the window cache keeps no cache salts: every request shares")
        req = super().new_request(prompt, max_new_tokens, rid, eos_token_id, next_token)
        need = req.prompt.numel() + self._extra_window(max_new_tokens)
        if need > self.pools["window"].capacity:
            del self.requests[req.rid]
            raise RequestError(f"the request needs up to {need} window-pool slots but the "
                               f"window pool holds only {self.pools['window'].capacity}")
        return req

    def make_room(self, num_tokens: int, window: int = 0) -> torch.Tensor:
        """Evict until ``num_tokens`` full and ``window`` window slots are free (full first:
        a leaf takes both kinds with it); returns the evicted full slots. OutOfMemoryError,
        nothing evicted, if free + evictable of either kind is not enough."""
        short_f = num_tokens - self.pools["full"].num_free
        short_w = window - self.pools["window"].num_free
        if short_f > self.cache.evictable_full or short_w > self.cache.evictable_window:
            raise OutOfMemoryError(
                f"need {num_tokens} full and {window} window slots: free "
                f"{self.pools['full'].num_free} and {self.pools['window'].num_free}, "
                f"evictable {self.cache.evictable_full} and {self.cache.evictable_window}")
        freed: list[int] = []
        if short_f > 0:
            freed += self._evict(full=short_f)
        short_w = window - self.pools["window"].num_free  # a removed leaf freed some
        if short_w > 0:
            freed += self._evict(window=short_w)
        if freed:
            self.evictions += 1
            self.evicted_tokens += len(freed)
        return torch.tensor(freed, dtype=torch.int64)

    def _evict(self, full: int = 0, window: int = 0) -> list[int]:
        freed_full, freed_window = self.cache.evict(full=full, window=window)
        for kind, slots in (("full", freed_full), ("window", freed_window)):
            if slots:
                self.pools[kind].free(torch.tensor(slots, dtype=torch.int64))
        return freed_full

    def flush(self) -> int:
        """Evict every unlocked cached token; returns how many full tokens went."""
        return len(self._evict(full=self.cache.evictable_full))

    def fits(self, req: Request, match: WindowMatch, running: Sequence[Request]) -> bool:
        """Can both pools hold ``req`` to its last token beside ``running``? (The engine's
        admission test: each running request keeps a reservation for what its remaining
        steps may need, and locking the match pins its unlocked part.)"""
        def left(r: Request) -> int:  # full slots its remaining steps still take
            return r.prompt.numel() + r.max_new_tokens - 1 - r.cached_len - r.private.numel()

        def held(r: Request) -> int:  # its own window slots that stay its own
            if r.kv_len == r.cached_len:  # admitted, not prefilled: the gap's slots go to
                return 0                  # the tree or back to the pool after prefill
            return sum(s != NO_SLOT for s in self.window_tables[r.rid][r.cached_len:])

        res_f = sum(left(r) for r in running)
        res_w = sum(min(left(r), max(0, self.spec.need + 1 - held(r))) if self.window_aware
                    else left(r) for r in running)
        pin_f = pin_w = 0
        node = match.handle.node
        while node.parent is not None:
            if node.ref_count == 0:
                pin_f += node.length
                pin_w += node.length if node.window_value is not None else 0
            node = node.parent
        gap = req.prompt.numel() - match.cached_len
        cache, pools = self.cache, self.pools
        return (gap + req.max_new_tokens - 1 + pin_f
                <= pools["full"].num_free + cache.evictable_full - res_f
                and gap + self._extra_window(req.max_new_tokens) + pin_w
                <= pools["window"].num_free + cache.evictable_window - res_w)

    # -------------------------------------------------- steps 1-4
    def match(self, req: Request) -> WindowMatch:
        """Step 1: the longest usable prefix of all but the last prompt token."""
        self._require(req, "waiting")
        req.match = self.cache.match_prefix(req.prompt[:-1])
        return req.match

    def _start_tables(self, req: Request) -> None:
        """Step 3's page tables (``Lifecycle.lock`` calls this): both start with the match's
        slots; the branching range is noted."""
        m = req.match
        req.page_table = PageTable(m.full)
        self.window_tables[req.rid] = list(m.window)
        self._branch[req.rid] = range(max(m.cached_len, m.full_len - self.spec.need), m.full_len)

    def allocate(self, req: Request) -> torch.Tensor:
        """Step 4: full and window slots for the uncached gap (evicting if short)."""
        self._require(req, "locked")
        gap = req.prompt.numel() - req.cached_len
        self.make_room(gap, gap)
        slots = self.pools["full"].alloc(gap)
        self.window_tables[req.rid] += self.pools["window"].alloc(gap).tolist()
        req.private = slots
        req.page_table.append(slots)
        req.state = "running"
        return slots

    def _unlock_back_to_waiting(self, req: Request) -> None:
        super()._unlock_back_to_waiting(req)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self.window_tables.pop(req.rid, None)
        self._branch.pop(req.rid, None)

    # -------------------------------------------------- the model
    def _tables(self, req: Request) -> list[torch.Tensor]:
        return [req.page_table.slots, torch.tensor(self.window_tables[req.rid])]

    def _left_window(self, req: Request) -> None:
        """Free ``req``'s own window K/V that no later position of it reads (positions
        before ``kv_len - need``), but for its branching range."""
        self.peak_window_used = max(self.peak_window_used, self.pools["window"].num_used)
        if not self.window_aware:
            return
        table, branch = self.window_tables[req.rid], self._branch[req.rid]
        dead = [p for p in range(req.cached_len, max(req.cached_len, req.kv_len - self.spec.need))
                if table[p] != NO_SLOT and p not in branch]
        if dead:
            self.pools["window"].free(torch.tensor([table[p] for p in dead]))
            for p in dead:
                table[p] = NO_SLOT

    def prefill_batch(self, reqs: Sequence[Request], all_logits: bool = False,
                      chunks: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Prefill several requests (``chunks`` of their prompts, as the base class's) in
        one ``forward_windowed`` (last logits only), then free what left each one's window."""
        if all_logits:
            raise RequestError("the window lifecycle returns last-position logits only")
        reqs, ends = self._prefill_ready(reqs, chunks)
        logits = forward_windowed(self.model, self.layers,
                                  [[t[:e] for t in self._tables(r)]
                                   for r, e in zip(reqs, ends, strict=True)],
                                  [r.prompt[r.kv_len:e] for r, e in zip(reqs, ends, strict=True)])
        self._prefilled(reqs, logits, ends)
        for req in reqs:
            self._left_window(req)
        return logits

    def decode(self, reqs: Sequence[Request]) -> list[torch.Tensor]:
        """One decode step for a batch: a full and a window slot each (OutOfMemoryError
        before anything changes if they cannot be found), the forward, the frees."""
        reqs = self._decode_ready(reqs)
        n = len(reqs)
        self.make_room(n, n)
        full, window = self.pools["full"].alloc(n), self.pools["window"].alloc(n).tolist()
        for r, f, w in zip(reqs, full, window, strict=True):
            r.private = torch.cat([r.private, f.view(1)])
            r.page_table.append(f.view(1))
            self.window_tables[r.rid].append(w)
        logits = forward_windowed(self.model, self.layers, [self._tables(r) for r in reqs],
                                  [torch.tensor([r.output[-1]]) for r in reqs])
        for r, lg, token in zip(reqs, logits, _greedy_picks(reqs, logits), strict=True):
            r.kv_len += 1
            r.output.append(r.next_token(lg) if token is None else token)
            self._left_window(r)
        return logits

    # -------------------------------------------------- insert, finish, abort
    def _insert(self, req: Request):
        """Insert the tokens with K/V, both kinds; re-point both tables at the tree's
        slots, then free this request's duplicates (the base class's order)."""
        n, table = req.kv_len, self.window_tables[req.rid]
        res = self.cache.insert_prefix(req.tokens[:n], req.page_table.slots[:n], table[:n])
        tree_full, tree_window = self.cache.path_slots(res.handle)
        req.page_table.repoint(tree_full)                # 1. re-point first ...
        table[:n] = tree_window
        self.pools["full"].free(torch.tensor(res.free_full, dtype=torch.int64))  # 2. ... free
        self.pools["window"].free(torch.tensor(res.free_window, dtype=torch.int64))
        req.private = req.private[n - req.cached_len:]   # the tree owns the rest now
        return res, n

    def finish(self, req: Request) -> None:
        super().finish(req)
        self._forget(req)

    def abort(self, req: Request) -> None:
        self._require(req, "locked", "running")
        mine = [s for s in self.window_tables[req.rid][req.cached_len:] if s != NO_SLOT]
        self.pools["window"].free(torch.tensor(mine, dtype=torch.int64))
        super().abort(req)
        self._forget(req)

    # -------------------------------------------------- invariants
    def check_integrity(self) -> None:
        """The tree's invariants for both kinds; every used slot of each pool owned once,
        by the tree or one running request, none free; each running request's tables
        start with its handle's path and hold every window K/V its next token reads;
        every lock is a running request's."""
        def require(cond: bool, what: str) -> None:
            if not cond:
                raise AssertionError(f"window integrity: {what}")

        self.cache.check_integrity()
        owned = dict(zip(("full", "window"), self.cache.all_slots(), strict=True))
        locks: dict[int, int] = {}
        for r in self.running:
            table = self.window_tables[r.rid]
            require(len(table) == len(r.page_table), f"{r.rid}: two tables of one length")
            try:
                full, window = self.cache.path_slots(r.handle)
            except StaleHandleError:
                raise AssertionError(f"window integrity: {r.rid}'s handle is stale") from None
            # (another request's insert may have refilled a tombstone on the path since)
            require(r.page_table.slots[:r.cached_len].tolist() == full
                    and all(s in (t, NO_SLOT) for s, t in zip(table, window, strict=False)),
                    f"{r.rid}: its tables do not start with its handle's tree slots")
            require(r.page_table.slots[r.cached_len:].tolist() == r.private.tolist(),
                    f"{r.rid}: full table past the cached prefix is not its private slots")
            reads = table[max(0, r.kv_len - self.spec.need):r.kv_len]
            require(NO_SLOT not in reads, f"{r.rid} lost window K/V its next token reads")
            owned["full"] += r.private.tolist()
            owned["window"] += [s for s in table[r.cached_len:] if s != NO_SLOT]
            locks[r.handle.node.id] = locks.get(r.handle.node.id, 0) + 1
        for kind, slots in owned.items():
            pool = self.pools[kind]
            require(len(set(slots)) == len(slots), f"a {kind} slot is owned twice")
            require(not slots or not bool(pool.is_free(torch.tensor(slots)).any()),
                    f"a {kind} slot the tree or a request owns is free")
            require(pool.num_used == len(slots),
                    f"{kind} pool: {pool.num_used} used, {len(slots)} owned (leaked)")
        require(locks == {i: held for i, (_, held) in self.cache._locks.items()},
                "the tree's locks are the running requests' handles")


class WindowRunner:
    """One request at a time through a ``WindowLifecycle``: the chapter's runner.

    ``model``: a Llama-shaped transformers model whose config has ``layer_types`` and
    ``sliding_window`` (``with_sliding_window`` makes one); ``full_capacity`` and
    ``window_capacity``: the two pools' slots. ``window_aware=False`` is the baseline that
    keeps every layer's K/V of every cached token: run both on one trace to see the memory
    saved and the hits lost. ``check``: the integrity check after every step.
    """

    def __init__(self, model, full_capacity: int, window_capacity: int,
                 window_aware: bool = True, check: bool = False) -> None:
        self.lifecycle = WindowLifecycle(model, full_capacity, window_capacity, window_aware)
        self.model, self.spec, self.check = model, self.lifecycle.spec, check
        self.cache, self.pools = self.lifecycle.cache, self.lifecycle.pools

    @property
    def peak_window_used(self) -> int:
        return self.lifecycle.peak_window_used

    def bytes_per_token(self, kind: str) -> int:
        layers = self.spec.full_layers if kind == "full" else self.spec.window_layers
        pool = self.pools[kind]
        return 2 * len(layers) * pool.kv_heads * pool.head_dim * pool.k.element_size()

    @property
    def cached_bytes(self) -> int:
        """Bytes of K/V the tree holds: full tokens at the full layers' cost, window tokens
        at the window layers' (the baseline holds window K/V for every token)."""
        return (self.cache.full_tokens * self.bytes_per_token("full")
                + self.cache.window_tokens * self.bytes_per_token("window"))

    def _step(self, fn, *args) -> None:
        fn(*args)
        if self.check:
            self.lifecycle.check_integrity()

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy ``max_new_tokens`` tokens for ``prompt``, with the prefix cache. On an
        error the request's slots and lock are given back (the tree keeps its state)."""
        lc = self.lifecycle
        req = lc.new_request(prompt, max_new_tokens)
        try:
            self._step(lc.admit, req)
            self._step(lc.prefill, req)
            self._step(lc.insert_running, req)
            while not req.done:
                self._step(lc.decode, [req])
            self._step(lc.finish, req)
        except BaseException:
            if req.state in ("locked", "running"):
                lc.abort(req)
            raise
        finally:
            lc.requests.pop(req.rid, None)
        return list(req.output)

    def check_integrity(self) -> None:
        self.lifecycle.check_integrity()

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return [self.generate(p, max_new_tokens) for p in prompts]
