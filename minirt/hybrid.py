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
K/V (the *tail window*) and whose full K/V are all there. ``HybridSpec`` says which layers
of a model slide (``has_window_layers``, ``with_sliding_window``); ``minirt.window_lifecycle``
runs a model through the tree, its full and window layers' K/V in two pools.

Where minirt differs from SGLang: tokens, not pages (page size 1); a lock protects the
window K/V of its whole path (SGLang locks only the window: ``release_window_lock``); one
LRU order over nodes, found by a scan (SGLang keeps one LRU list per component).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count

import torch

from .cache import CacheStats
from .errors import (
    HandleError,
    InvalidIdsError,
    OutOfMemoryError,
    PoolError,
    StaleHandleError,
)
from .token_ids import as_ids

__all__ = ["FULL", "NO_SLOT", "WINDOW", "HybridSpec", "WindowHandle", "WindowInsert",
           "WindowMatch", "WindowNode", "WindowRadixCache", "greedy_uncached", "has_window_layers",
           "with_sliding_window"]

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


def has_window_layers(model) -> bool:
    """True if ``model``'s config has sliding-window layers (``layer_types``)."""
    config = model.config.get_text_config(decoder=True)
    return WINDOW in (getattr(config, "layer_types", None) or ())


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
