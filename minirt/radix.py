"""The radix tree node: a run of token ids and the pool slots that hold their K/V.

A path from the root to a node spells a token sequence (the concatenation of the
``key`` runs on the way) and, in the same order, the pool slots of its K/V (the
concatenation of the ``value`` runs). A node stands for a whole run of tokens that
no request has ever split, which is what makes a radix tree smaller than a per-token
trie. ``split_at`` cuts a run in two when a new request diverges inside it.

Keys and values are ``Tokens``: read-only ``memoryview`` objects over packed 64-bit
ints (format ``"q"``), 8 bytes a token, the layout of an int64 tensor. Two runs are
compared in C, one call a comparison (a ``memcmp`` on a request's bytes), not one Python
step per token; slicing a view is O(1) and shares its buffer, so both halves of a
split are views of the old buffer: no token id, slot number or K/V moves. Tensors
appear only at the cache's boundary (``RadixCache`` returns slot indices as tensors).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Hashable, Sequence

import torch

__all__ = [
    "KeyFn", "PageKey", "RadixNode", "Tokens", "as_tokens", "common_prefix_len", "page_key",
    "token_key",
]

Tokens = memoryview  # 1-D, format "q" (int64), read-only: a node's key or value
KeyFn = Callable[..., Hashable]

_node_ids = itertools.count()
_EMPTY: Tokens = memoryview(b"").cast("q")


def as_tokens(x: Tokens | torch.Tensor | Sequence[int]) -> Tokens:
    """``x`` as ``Tokens``: a memoryview of format "q" is kept as is (a view shares its
    buffer); a 1-D integer tensor, list, tuple or array is copied once into a new buffer.

    Structural conversion only: ``RadixCache`` validates request ids (``as_ids``) first.
    """
    if isinstance(x, memoryview):
        if x.format != "q" or x.ndim != 1:
            raise ValueError(f"a token view must be 1-D of format 'q', got {x.format!r}")
        return x
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.is_floating_point() or x.dtype == torch.bool:
            raise ValueError(f"expected a 1-D integer tensor, got {x.dtype} {tuple(x.shape)}")
        return memoryview(x.to("cpu", torch.int64).numpy().tobytes()).cast("q")
    return memoryview(array("q", x).tobytes()).cast("q")


def token_key(tokens: Tokens | Sequence[int], pos: int = 0) -> int:
    """Child key for page_size 1: the token at ``pos`` (a child's key starts there)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return tokens[pos]


class PageKey:
    """Child key for page_size > 1: the page starting at ``pos``, as a tuple of token ids.

    Two children of one node never share their first page, because a split happens
    only at a page boundary; so the first page picks the child to descend into.
    """

    def __init__(self, page_size: int) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size

    def __call__(self, tokens: Tokens | Sequence[int], pos: int = 0) -> tuple[int, ...]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        return tuple(tokens[pos : pos + self.page_size])

    def __repr__(self) -> str:
        return f"page_key({self.page_size})"


token_key.page_size = 1  # type: ignore[attr-defined]


def page_key(page_size: int) -> KeyFn:
    """The key function for ``page_size``: ``token_key`` for 1, else a first-page ``PageKey``.

    The one place that says which dict key a child is filed under: ``key_fn(tokens, pos)``
    for the child whose key begins at ``tokens[pos]``.
    """
    return token_key if page_size == 1 else PageKey(page_size)


def common_prefix_len(a: Tokens | Sequence[int], b: Tokens | Sequence[int], start: int = 0) -> int:
    """How many leading entries ``a`` shares with ``b[start:]``.

    Every comparison is one call in C. One settles the common case, a full match.
    After a mismatch, gallop (windows of 1, 2, 4, ... tokens) to the window that holds
    it, then bisect that window: O(log n) comparisons, never a Python loop over tokens.
    Where ``b`` spans the whole ``bytes`` object it views (a request's checked ids), a
    comparison is ``bytes.startswith`` on ``b``'s bytes at the window's offset: a
    ``memcmp``, eight bytes a token, several times cheaper than ``==`` on two views,
    which compares token by token.
    """
    a, b = as_tokens(a), as_tokens(b)
    n = min(len(a), len(b) - start)
    if n <= 0:
        return 0
    raw = b.obj
    if type(raw) is not bytes or b.nbytes != len(raw):  # not a whole bytes object
        return _common_prefix_len_views(a, b, start, n)
    at = 8 * start  # byte offset of b[start]
    if raw.startswith(a[:n], at):
        return n
    lo, hi, step = 0, 1, 1
    while raw.startswith(a[lo:hi], at + 8 * lo):  # a[:hi] matches: gallop on
        lo, step = hi, 2 * step
        hi = min(lo + step, n)
    while hi - lo > 1:  # a[:lo] matches, a[:hi] does not
        mid = (lo + hi) // 2
        if raw.startswith(a[lo:mid], at + 8 * lo):
            lo = mid
        else:
            hi = mid
    return lo


def _common_prefix_len_views(a: Tokens, b: Tokens, start: int, n: int) -> int:
    """``common_prefix_len`` for any two views, with ``==`` on slices."""
    if a[:n] == b[start : start + n]:
        return n
    lo, hi, step = 0, 1, 1
    while a[lo:hi] == b[start + lo : start + hi]:
        lo, step = hi, 2 * step
        hi = min(lo + step, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixNode:
    """One edge of the radix tree: ``key`` (token ids) and ``value`` (pool slots), same length.

    ``length`` is that length, a plain int. ``children`` maps ``key_fn(child.key)`` (the
    child's first token, or first page) to the child. ``ref_count`` counts the requests
    that use this node (a node with ref_count > 0 must not be evicted); ``last_access``,
    ``hit_count``, ``created`` and ``priority`` feed the eviction policies;
    ``last_access`` and ``created`` are logical clock ticks. ``key`` and ``value`` may be
    given as tensors or lists (copied once) or as ``Tokens`` views (kept as they are).
    """

    __slots__ = (
        "key_fn", "page_size", "key", "value", "length", "children", "parent", "ref_count",
        "last_access", "hit_count", "created", "priority", "id", "__weakref__",
    )

    def __init__(
        self,
        key_fn: KeyFn,
        key: Tokens | torch.Tensor | Sequence[int] | None = None,
        value: Tokens | torch.Tensor | Sequence[int] | None = None,
        tick: int = 0,
    ) -> None:
        key = _EMPTY if key is None else as_tokens(key)
        value = _EMPTY if value is None else as_tokens(value)
        if len(key) != len(value):
            raise ValueError(
                f"key and value must have equal lengths, got {len(key)} and {len(value)}"
            )
        self.key_fn = key_fn
        self.page_size: int = getattr(key_fn, "page_size", 1)
        self.key: Tokens = key
        self.value: Tokens = value
        self.length = len(key)
        self.children: dict[Hashable, RadixNode] = {}
        self.parent: RadixNode | None = None
        self.ref_count = 0
        self.last_access = tick
        self.hit_count = 0
        self.created = tick
        self.priority = 0
        self.id = next(_node_ids)

    def is_root(self) -> bool:
        """The root holds no tokens and has no parent."""
        return self.parent is None and self.length == 0

    def is_leaf(self) -> bool:
        """A node without children (the only kind eviction may remove)."""
        return not self.children

    def get_match_len(self, ids: Tokens | torch.Tensor | Sequence[int], start: int = 0) -> int:
        """Longest common prefix of ``key`` and ``ids[start:]``, rounded down to whole pages."""
        n = common_prefix_len(self.key, ids, start)
        return n - n % self.page_size

    def split_at(self, pos: int) -> RadixNode:
        """Cut this node at ``pos``; return the new parent holding ``key[:pos]``.

        ``self`` keeps ``key[pos:]`` (so handles to it stay valid) and hangs under the new
        parent, which takes its place among the old parent's children. Both halves are
        views of the old buffers (``upper.key.obj is self.key.obj``): only metadata
        changes, no token id, slot or K/V is copied. The new parent inherits
        ``ref_count`` (every lock through ``self`` also runs through it) and the access
        statistics.
        """
        if not 0 < pos < self.length or pos % self.page_size:
            raise ValueError(
                f"split position {pos} must lie strictly inside the node (length "
                f"{self.length}) on a page boundary (page_size {self.page_size})"
            )
        upper = RadixNode(self.key_fn, self.key[:pos], self.value[:pos], self.created)
        upper.ref_count = self.ref_count
        upper.last_access = self.last_access
        upper.hit_count = self.hit_count
        upper.priority = self.priority
        parent = self.parent
        if parent is not None:
            parent.children[self.key_fn(self.key)] = upper
        upper.parent = parent
        self.key, self.value, self.length = self.key[pos:], self.value[pos:], self.length - pos
        upper.children[self.key_fn(self.key)] = self
        self.parent = upper
        return upper

    def __repr__(self) -> str:
        ids = self.key.tolist()
        shown = ids if len(ids) <= 8 else ids[:6] + ["..."] + ids[-1:]
        return f"RadixNode(id={self.id}, key={shown}, len={len(ids)}, ref={self.ref_count})"
