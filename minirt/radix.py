"""The radix tree node: a run of token ids and the pool slots that hold their K/V.

A path from the root to a node spells a token sequence (the concatenation of the
``key`` tensors on the way) and, in the same order, the pool slots of its K/V (the
concatenation of the ``value`` tensors). A node stands for a whole run of tokens that
no request has ever split, which is what makes a radix tree smaller than a per-token
trie. ``split_at`` cuts a run in two when a new request diverges inside it; both
halves are views of the old tensors, so no token id and no K/V moves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

import torch

__all__ = ["KeyFn", "PageKey", "RadixNode", "common_prefix_len", "page_key", "token_key"]

KeyFn = Callable[[torch.Tensor], Hashable]

_node_ids = itertools.count()
_EMPTY = torch.empty(0, dtype=torch.int64)


def token_key(key: torch.Tensor) -> int:
    """Child key for page_size 1: the first token id of ``key``."""
    return int(key[0])


class PageKey:
    """Child key for page_size > 1: the first page of ``key`` as a tuple of token ids.

    Two children of one node never share their first page, because a split happens
    only at a page boundary; so the first page picks the child to descend into.
    """

    def __init__(self, page_size: int) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size

    def __call__(self, key: torch.Tensor) -> tuple[int, ...]:
        return tuple(key[: self.page_size].tolist())

    def __repr__(self) -> str:
        return f"page_key({self.page_size})"


token_key.page_size = 1  # type: ignore[attr-defined]


def page_key(page_size: int) -> KeyFn:
    """The key function for ``page_size``: ``token_key`` for 1, else a first-page ``PageKey``."""
    return token_key if page_size == 1 else PageKey(page_size)


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading entries ``a`` and ``b`` share (1-D tensors, any lengths)."""
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return n if differ.numel() == 0 else int(differ[0, 0])


class RadixNode:
    """One edge of the radix tree: ``key`` (token ids) and ``value`` (pool slots), same length.

    ``children`` maps ``key_fn(child.key)`` (the child's first token, or first page) to the
    child. ``ref_count`` counts the requests that use this node (a node with ref_count > 0
    must not be evicted); ``last_access``, ``hit_count``, ``created`` and ``priority`` feed
    the eviction policies; ``last_access`` and ``created`` are logical clock ticks.
    """

    __slots__ = (
        "key_fn", "page_size", "key", "value", "children", "parent", "ref_count",
        "last_access", "hit_count", "created", "priority", "id", "__weakref__",
    )

    def __init__(
        self,
        key_fn: KeyFn,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        tick: int = 0,
    ) -> None:
        key = _EMPTY if key is None else key
        value = _EMPTY if value is None else value
        if key.shape != value.shape or key.dim() != 1:
            raise ValueError(
                f"key and value must be 1-D and of equal length, got shapes "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        self.key_fn = key_fn
        self.page_size: int = getattr(key_fn, "page_size", 1)
        self.key: torch.Tensor = key
        self.value: torch.Tensor = value
        self.children: dict[Hashable, RadixNode] = {}
        self.parent: RadixNode | None = None
        self.ref_count = 0
        self.last_access = tick
        self.hit_count = 0
        self.created = tick
        self.priority = 0
        self.id = next(_node_ids)

    @property
    def length(self) -> int:
        """Number of tokens on this edge."""
        return self.key.numel()

    def is_root(self) -> bool:
        """The root holds no tokens and has no parent."""
        return self.parent is None and self.key.numel() == 0

    def is_leaf(self) -> bool:
        """A node without children (the only kind eviction may remove)."""
        return not self.children

    def get_match_len(self, ids: torch.Tensor) -> int:
        """Longest common prefix of ``key`` and ``ids``, rounded down to whole pages."""
        n = common_prefix_len(self.key, ids)
        return n - n % self.page_size

    def split_at(self, pos: int) -> RadixNode:
        """Cut this node at ``pos``; return the new parent holding ``key[:pos]``.

        ``self`` keeps ``key[pos:]`` (so handles to it stay valid) and hangs under the new
        parent, which takes its place among the old parent's children. Both halves are
        views of the old tensors: only metadata changes, no K/V is copied. The new parent
        inherits ``ref_count`` (every lock through ``self`` also runs through it) and the
        access statistics.
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
        self.key = self.key[pos:]
        self.value = self.value[pos:]
        upper.children[self.key_fn(self.key)] = self
        self.parent = upper
        return upper

    def __repr__(self) -> str:
        ids = self.key.tolist()
        shown = ids if len(ids) <= 8 else ids[:6] + ["..."] + ids[-1:]
        return f"RadixNode(id={self.id}, key={shown}, len={len(ids)}, ref={self.ref_count})"
