"""Token ids as the prefix cache takes them: checked once, packed once, and back to a tensor.

Every request reaches the cache as token ids, a list, an array or a tensor. Before the
tree compares a single token, the ids are checked (one dimension, integers, none
negative; anything else is an ``InvalidIdsError`` naming what was wrong) and copied
once into a read-only ``Tokens`` view, which every later step compares and slices with
no tensor op per tree level. ``TokenIds`` is that check and copy done once per request,
for a server that matches a request and later inserts it; ``as_ids`` gives the checked
ids as a tensor, for the forward pass; ``slots_tensor`` is the way back, the tree's slot
views joined into one int64 tensor where a caller asks for one.

Where it sits (BOOK.md s.4's layers): above the radix tree's nodes (``radix``, whose
``Tokens`` it packs into) and below the prefix cache (``cache``) and everything that
hands a cache ids: the block-hash cache, the tiers, the lifecycle and the engine. It
knows nothing of trees, pools or models.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .errors import InvalidIdsError
from .radix import Tokens

__all__ = ["IdsLike", "TokenIds", "as_ids", "as_token_view", "slots_tensor"]

_HOST = torch.device("cpu")  # the tree's own bookkeeping lives in host memory
_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64} | {
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)}
_NO_SLOTS = torch.empty(0, dtype=torch.int64)

IdsLike = torch.Tensor | Sequence[int]


class TokenIds:
    """Token ids checked once (1-D, integers, none negative) and packed as ``Tokens``.

    The cache checks ids on every call that takes them, a few microseconds for a
    thousand tokens; a ``TokenIds`` it takes as it is, since it was checked when it was
    made and its buffer is read-only. A server makes one per request as the request
    arrives and hands it to both ``match_prefix`` and ``insert_prefix``. A slice is a
    ``TokenIds`` too, and copies nothing.
    """

    __slots__ = ("_tokens",)

    def __init__(self, ids: IdsLike | TokenIds, what: str = "ids") -> None:
        self._tokens = as_token_view(ids, what)

    @property
    def tokens(self) -> Tokens:
        """The checked ids as a read-only int64 view."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, part: slice) -> TokenIds:
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise TypeError(f"TokenIds take contiguous slices only, got {part!r}")
        view = object.__new__(TokenIds)  # a slice of checked ids needs no check
        view._tokens = self._tokens[part]
        return view

    def tolist(self) -> list[int]:
        return self._tokens.tolist()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenIds) and self._tokens == other._tokens

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        ids = self.tolist()
        shown = ids if len(ids) <= 8 else [*ids[:6], "...", ids[-1]]
        return f"TokenIds({shown}, len={len(ids)})"


def as_ids(x: IdsLike | TokenIds, what: str = "ids") -> torch.Tensor:
    """``x`` (a list, tuple, array or tensor of non-negative ints) as a 1-D int64 CPU tensor.

    Raises InvalidIdsError naming ``what`` for anything else: wrong rank, a float or bool
    dtype, negative entries, or values that are not integers at all.
    """
    if type(x) is TokenIds:  # checked already: one copy into a tensor of its own
        if not len(x):
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(x.tokens), dtype=torch.int64)
    t = _int64_tensor(x, what)
    _check_non_negative(t.numpy().tobytes(), what)
    return t


def as_token_view(x: IdsLike | TokenIds, what: str = "ids") -> Tokens:
    """``x`` checked as by ``as_ids`` and copied once into ``Tokens``: the one conversion
    a request's ids (or slots) go through per call. A ``TokenIds`` was checked when it
    was made: its view is returned as it is.

    Every later step compares and slices this view, with no tensor op per tree level.
    """
    if type(x) is TokenIds:
        return x._tokens
    if type(x) is array and x.typecode == "q":
        packed = x.tobytes()  # int64 already: no tensor needed
    else:
        packed = _packed(x, what)
    _check_non_negative(packed, what)
    return memoryview(packed).cast("q")


def _packed(x: IdsLike, what: str) -> bytes:
    """``x`` as packed int64 bytes. A list or tuple of Python ints goes through ``array``,
    several times faster than building a tensor; anything else, and any list ``array``
    refuses (a float, a string, a nested list, a value past int64), goes through
    ``_int64_tensor``, whose error names the problem."""
    if isinstance(x, (list, tuple)) and x and type(x[0]) is int:
        try:
            return array("q", x).tobytes()
        except (TypeError, OverflowError):
            pass
    return _int64_tensor(x, what).numpy().tobytes()


def _int64_tensor(x: IdsLike, what: str) -> torch.Tensor:
    """``x`` as a 1-D int64 CPU tensor, if it has that rank and an integer type."""
    if isinstance(x, torch.Tensor):
        if x.dtype is torch.int64 and x.dim() == 1 and x.is_cpu:
            return x  # the common case: nothing to convert
        t = x
    elif isinstance(x, (list, tuple)) and len(x) == 0:
        return torch.empty(0, dtype=torch.int64)
    else:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidIdsError(f"{what} must be a 1-D sequence of ints, got {x!r:.80}") from exc
    if t.dim() != 1:
        raise InvalidIdsError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        raise InvalidIdsError(f"{what} must have an integer dtype, got {t.dtype}")
    if t.dtype is not torch.int64 or not t.is_cpu:
        t = t.to(device=_HOST, dtype=torch.int64)
    return t


_SIGN_BYTE = 7 if sys.byteorder == "little" else 0  # where an int64's top byte sits
_NUMPY_FROM = 8 * 4096  # bytes: 4,096 ids, where numpy's call overhead is paid back


def _check_non_negative(packed: bytes, what: str) -> None:
    """Raise unless every int64 packed in ``packed`` is >= 0.

    A negative int64 has its sign bit set, so its top byte is >= 0x80: the ids are all
    non-negative exactly when their top bytes, taken together, are ASCII. One pass in C,
    cheaper than a tensor reduction on short inputs; from ``_NUMPY_FROM`` bytes on,
    numpy's minimum is cheaper still (5 against 16 microseconds at 12,400 ids).
    """
    if len(packed) >= _NUMPY_FROM:
        ok = bool(np.frombuffer(packed, dtype=np.int64).min() >= 0)
    else:
        ok = packed[_SIGN_BYTE::8].isascii()
    if not ok:
        ids = memoryview(packed).cast("q")
        bad = next(i for i, v in enumerate(ids) if v < 0)
        raise InvalidIdsError(f"{what} must be non-negative, got {ids[bad]} at position {bad}")


def slots_tensor(runs: Iterable[Tokens]) -> torch.Tensor:
    """Slot runs joined into one new int64 tensor: where the tree's views become a tensor."""
    joined = bytearray().join(runs)
    return torch.frombuffer(joined, dtype=torch.int64) if joined else _NO_SLOTS
