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
K/V (the *tail window*) and whose full K/V are all there. ``WindowRunner`` runs a model
through the cache: it frees a request's own window K/V as soon as they leave its window
(vLLM's ``remove_skipped_blocks``), keeps them where a later request may branch, and
inserts the rest as tombstones.

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
from .errors import HandleError, InvalidIdsError, OutOfMemoryError, PoolError, StaleHandleError
from .forward import llama_forward
from .pool import KVPool

__all__ = ["FULL", "WINDOW", "HybridSpec", "WindowHandle", "WindowInsert", "WindowMatch",
           "WindowNode", "WindowRadixCache", "WindowRunner", "greedy_uncached",
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

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        return self.usable_length(ids)[0]

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

class WindowRunner:
    """Greedy generation through a ``WindowRadixCache`` and two ``KVPool``s.

    ``model``: a Llama-shaped transformers model whose config has ``layer_types`` and
    ``sliding_window`` (``with_sliding_window`` makes one). Full layers keep K/V in
    ``full_pool``, window layers in ``window_pool``. ``window_aware=False`` is the
    baseline that keeps every layer's K/V of every cached token (no early frees, no
    tombstones): run both on one trace to see the memory saved and the hits lost.

    One request at a time. While it runs, its window K/V that left its window are freed
    at once, except those just before the longest full-K/V hit (``full_len``), where a
    later request may branch (SGLang's ``swa_branching_seqlen``); at the end the request's
    tokens are inserted, its freed window positions as tombstones.
    """

    def __init__(self, model, full_capacity: int, window_capacity: int,
                 window_aware: bool = True, check: bool = False) -> None:
        self.model, self.spec = model, HybridSpec.from_config(model.config)
        c = model.config
        kv_heads = c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        param = next(model.parameters())
        self._layer = {i: (k, j) for k, layers in (("full", self.spec.full_layers),
                                                   ("window", self.spec.window_layers))
                       for j, i in enumerate(layers)}
        self.pools = {
            kind: KVPool(max(1, len(layers)), kv_heads, head_dim, cap,
                         dtype=param.dtype, device=param.device)
            for kind, layers, cap in (("full", self.spec.full_layers, full_capacity),
                                      ("window", self.spec.window_layers, window_capacity))}
        self.cache = WindowRadixCache(self.spec.window)
        self.window_aware, self.check = window_aware, check
        self._private: dict[str, list[int]] = {"full": [], "window": []}
        self.peak_window_used = 0

    # -------------------------------------------------- memory
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

    def _alloc(self, kind: str, n: int) -> list[int]:
        pool = self.pools[kind]
        short = n - pool.num_free
        if short > 0:
            freed_full, freed_window = self.cache.evict(**{kind: short})
            for k, slots in (("full", freed_full), ("window", freed_window)):
                if slots:
                    self.pools[k].free(torch.tensor(slots))
        slots = pool.alloc(n).tolist()
        self._private[kind] += slots
        return slots

    def _release(self, kind: str, slots: list[int]) -> None:
        if slots:
            gone = set(slots)
            self._private[kind] = [s for s in self._private[kind] if s not in gone]
            self.pools[kind].free(torch.tensor(slots))

    # -------------------------------------------------- the request
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy ``max_new_tokens`` tokens for ``prompt``, with the prefix cache."""
        prompt = as_ids(prompt, "prompt").tolist()
        if not prompt or max_new_tokens < 1:
            raise InvalidIdsError("need a non-empty prompt and max_new_tokens >= 1")
        match = self.cache.match_prefix(prompt[:-1])  # at least one token to compute
        self.cache.lock(match.handle)
        try:
            return self._run(prompt, max_new_tokens, match)
        except BaseException:  # give back what this request held; the tree keeps its state
            for kind, slots in self._private.items():
                if slots:
                    self.pools[kind].free(torch.tensor(slots))
            self._private = {"full": [], "window": []}
            if self.cache._locks.get(match.handle.node.id):
                self.cache.unlock(match.handle)
            raise

    def _run(self, prompt: list[int], max_new_tokens: int, match: WindowMatch) -> list[int]:
        need, start = self.spec.need, match.cached_len
        full, window = list(match.full), list(match.window)
        # window K/V a later request may continue from: just before the longest full hit
        branch = range(max(start, match.full_len - need), match.full_len)
        ids, out = list(prompt), []
        new = ids[start:]
        while True:
            pos = len(full)
            full += self._alloc("full", len(new))
            window += self._alloc("window", len(new)) if self.spec.window_layers \
                else [NO_SLOT] * len(new)
            logits = self._forward(new, pos, full, window)
            self.peak_window_used = max(self.peak_window_used,
                                        self.pools["window"].num_used)
            out.append(int(logits[0].argmax()))
            if self.window_aware:  # free what left the window of the next position
                done = len(full) - need
                dead = [p for p in range(start, max(start, done))
                        if window[p] != NO_SLOT and p not in branch]
                self._release("window", [window[p] for p in dead])
                for p in dead:
                    window[p] = NO_SLOT
            if self.check:
                self.check_integrity()
            if len(out) == max_new_tokens:
                break
            ids.append(out[-1])
            new = [out[-1]]
        n = len(full)  # tokens with K/V: prompt + all outputs but the last
        res = self.cache.insert_prefix(ids[:n], full, window)
        self._private = {"full": [], "window": []}
        self.pools["full"].free(torch.tensor(res.free_full, dtype=torch.int64))
        self.pools["window"].free(torch.tensor(res.free_window, dtype=torch.int64))
        self.cache.unlock(match.handle)
        if self.check:
            self.check_integrity()
        return out

    def _forward(self, new: list[int], pos: int, full: list[int],
                 window: list[int]) -> torch.Tensor:
        device = self.pools["full"].device
        t, need, win = len(new), self.spec.need, self.spec.window
        ids = torch.tensor([new], device=device)
        positions = torch.arange(pos, pos + t, device=device).unsqueeze(0)
        lo = max(0, pos - need)  # window layers read from here on
        slot_rows = {"full": torch.tensor(full), "window": torch.tensor(window[lo:])}
        q_pos = positions[0].unsqueeze(1)
        masks = {}
        for kind, first in (("full", 0), ("window", lo)):
            k_pos = torch.arange(first, pos + t, device=device).unsqueeze(0)
            ok = k_pos <= q_pos
            if kind == "window":
                ok &= (q_pos - k_pos) < win
            masks[kind] = ok

        def attend(layer: int, q, k, v, scale: float) -> torch.Tensor:
            kind, j = self._layer[layer]
            pool = self.pools[kind]
            rows = slot_rows[kind]
            pool.write(j, rows[-t:], k[0].transpose(0, 1), v[0].transpose(0, 1))
            keys, values = pool.gather(j, rows)
            keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            rep = q.shape[1] // keys.shape[1]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                attn_mask=masks[kind], scale=scale)
            return o.transpose(1, 2).reshape(1, t, -1)

        return llama_forward(self.model, ids, positions, attend)

    def check_integrity(self) -> None:
        """The tree's invariants, and every used slot of each pool owned exactly once:
        by the tree or by the running request."""
        self.cache.check_integrity()
        tree = dict(zip(("full", "window"), self.cache.all_slots(), strict=True))
        for kind, pool in self.pools.items():
            owned = tree[kind] + self._private[kind]
            if len(set(owned)) != len(owned):
                raise AssertionError(f"a {kind} slot is owned twice")
            if owned and bool(pool.is_free(torch.tensor(owned)).any()):
                raise AssertionError(f"a {kind} slot the tree or request owns is free")
            if pool.num_used != len(owned):
                raise AssertionError(f"{kind} pool: {pool.num_used} used, {len(owned)} owned")

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return [self.generate(p, max_new_tokens) for p in prompts]
