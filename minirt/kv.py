"""Per-layer K/V of a causal LM as plain tensors: prefill, extend, decode, slice, splice, compare.

Chapter 01 uses these helpers to check on the real model which K/V two requests can
share. A :class:`KV` holds, for every layer, the keys and values of one sequence as
tensors of shape ``[kv_heads, seq, head_dim]`` (no batch dimension). The model runs
unmodified: K/V go in and come out through transformers' ``DynamicCache``.

Works with full-attention causal LMs (Llama-style: the default model, ``tiny_model``)
on any device and dtype; sliding-window layers would drop old K/V and are not handled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .errors import InvalidIdsError, KVMismatchError, RequestError

__all__ = [
    "KV",
    "KVDiff",
    "as_ids",
    "bytes_per_token",
    "check_fits",
    "compare",
    "decode_step",
    "extend",
    "greedy",
    "kv_geometry",
    "model_device",
    "prefill",
    "splice",
]

IdsLike = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class KV:
    """The K/V of one sequence: ``keys[l]`` and ``values[l]`` are ``[kv_heads, seq, head_dim]``.

    Keys are stored after the rotary position embedding (RoPE) was applied, exactly as
    the attention layer caches them; values carry no position.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise KVMismatchError(
                f"KV needs the same, non-zero number of key and value layers; "
                f"got {len(self.keys)} key and {len(self.values)} value layers")
        shape = tuple(self.keys[0].shape)
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            for name, t in (("keys", k), ("values", v)):
                if t.dim() != 3 or tuple(t.shape) != shape:
                    raise KVMismatchError(
                        f"KV {name}[{layer}] has shape {tuple(t.shape)}; every layer's keys and "
                        f"values must be [kv_heads, seq, head_dim] = {shape} (no batch dimension)")
                if t.dtype != self.keys[0].dtype or t.device != self.keys[0].device:
                    raise KVMismatchError(
                        f"KV {name}[{layer}] is {t.dtype} on {t.device}, layer 0 keys are "
                        f"{self.keys[0].dtype} on {self.keys[0].device}: all must agree")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def kv_heads(self) -> int:
        return self.keys[0].shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def nbytes(self) -> int:
        """Bytes these K/V occupy: ``len(self) * bytes_per_token`` of the model that made them."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values, strict=True))

    def __len__(self) -> int:
        """The number of token positions held."""
        return self.keys[0].shape[1]

    def slice(self, start: int, stop: int | None = None) -> KV:
        """Positions ``start:stop`` of every layer (views, nothing copied)."""
        return KV([k[:, start:stop] for k in self.keys], [v[:, start:stop] for v in self.values])

    def __getitem__(self, item: slice) -> KV:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError(f"KV supports only contiguous slices like kv[a:b], got {item!r}")
        return self.slice(item.start or 0, item.stop)

    def to_cache(self, model) -> DynamicCache:
        """A fresh ``DynamicCache`` holding these K/V, for ``model``'s forward (checked first)."""
        check_fits(model, self)
        device = model_device(model)
        return DynamicCache(
            ddp_cache_data=[(k.unsqueeze(0).to(device), v.unsqueeze(0).to(device))
                            for k, v in zip(self.keys, self.values, strict=True)],
            config=model.config,
        )

    @classmethod
    def from_cache(cls, cache) -> KV:
        """Read the K/V of batch row 0 out of a transformers cache (one tensor pair per layer)."""
        layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
        if len(layers) != len(cache.layers):
            raise KVMismatchError("the cache has layers without K/V (not a full-attention model?)")
        return cls([layer.keys[0] for layer in layers], [layer.values[0] for layer in layers])


@dataclass(frozen=True)
class KVDiff:
    """Per-layer maximum absolute difference of two KVs' keys and values."""

    keys: list[float]
    values: list[float]

    @property
    def max(self) -> float:
        """The largest difference over all layers, keys and values."""
        return max(self.keys + self.values)

    def first_layer_over(self, tol: float) -> int | None:
        """The first layer whose keys or values differ by more than ``tol`` (None: none does)."""
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k > tol or v > tol:
                return layer
        return None


def model_device(model) -> torch.device:
    """The device of the model's weights (where its inputs must go)."""
    return next(model.parameters()).device


def kv_geometry(model) -> tuple[int, int, int]:
    """``(num_layers, kv_heads, head_dim)`` of the K/V ``model`` caches, read from its config."""
    cfg = model.config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def bytes_per_token(model) -> int:
    """Bytes of K and V one token occupies in ``model``'s cache: 2 x layers x heads x dim x size."""
    layers, heads, dim = kv_geometry(model)
    itemsize = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    return 2 * layers * heads * dim * itemsize


def check_fits(model, kv: KV) -> None:
    """Raise ``KVMismatchError`` unless ``kv`` fits the model: layers, heads, head_dim, dtype."""
    layers, heads, dim = kv_geometry(model)
    got = (kv.num_layers, kv.kv_heads, kv.head_dim)
    if got != (layers, heads, dim):
        raise KVMismatchError(
            f"K/V with (layers, kv_heads, head_dim) = {got} do not fit this model, which "
            f"expects {(layers, heads, dim)}: were they made by another model?")
    dtype = next(model.parameters()).dtype
    if kv.dtype != dtype:
        raise KVMismatchError(f"K/V are {kv.dtype} but the model computes in {dtype}")


def as_ids(model, ids: IdsLike) -> torch.Tensor:
    """Validate token ids and return them as a ``[1, n]`` long tensor on the model's device.

    Accepts a list of ints, a 1-D integer tensor, or a ``[1, n]`` tensor (one sequence).
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidIdsError(f"token ids must be integers, got a {ids.dtype} tensor")
        t = ids.detach()
    else:
        try:
            values = list(ids)
        except TypeError:
            raise InvalidIdsError(f"token ids must be a sequence of ints, got {ids!r}") from None
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
            raise InvalidIdsError(f"token ids must be ints, got {values[:8]!r}...")
        t = torch.tensor(values, dtype=torch.long)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise InvalidIdsError(
                f"ids have batch dimension {t.shape[0]}; minirt.kv handles one sequence at a "
                "time: pass a 1-D tensor or shape [1, n]")
        t = t[0]
    if t.dim() != 1:
        raise InvalidIdsError(f"ids must be 1-D (or [1, n]), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise InvalidIdsError("ids are empty: a forward pass needs at least one token")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = int(t.min()), int(t.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise InvalidIdsError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
    return t.to(device=model_device(model), dtype=torch.long).unsqueeze(0)


@torch.no_grad()
def _forward(model, ids: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, KV]:
    """Run ``ids`` ([1, n]) at positions ``start..start+n-1`` after ``cache`` (or none)."""
    n = ids.shape[1]
    positions = torch.arange(start, start + n, device=ids.device).unsqueeze(0)
    if cache is None:
        cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return out.logits[0], KV.from_cache(out.cache)


def prefill(model, ids: IdsLike, *, start: int = 0) -> tuple[torch.Tensor, KV]:
    """One forward pass over ``ids``; returns ``(logits [n, vocab], KV of all n positions)``.

    The causal mask lets position i attend to positions 0..i only. ``start`` shifts the
    positions RoPE sees (default 0); chapter 01 uses it to show that keys depend on position.
    """
    if start < 0:
        raise InvalidIdsError(f"start position must be >= 0, got {start}")
    return _forward(model, as_ids(model, ids), start, None)


def extend(model, prefix_kv: KV, ids: IdsLike) -> tuple[torch.Tensor, KV]:
    """Continue a prefix's K/V with ``ids``: returns ``(logits [m, vocab], KV of prefix + ids)``.

    The new tokens get positions ``len(prefix_kv)`` onwards and attend to the given K/V
    as if they had been computed in the same pass. ``prefix_kv`` itself is not modified.
    """
    t = as_ids(model, ids)
    if len(prefix_kv) == 0:
        check_fits(model, prefix_kv)
        return _forward(model, t, 0, None)
    return _forward(model, t, len(prefix_kv), prefix_kv.to_cache(model))


def decode_step(model, kv: KV, token: int | torch.Tensor) -> tuple[torch.Tensor, KV]:
    """Append one token: returns ``(logits for the next token [vocab], KV one position longer)``.

    No mask is needed: the past K/V are written first, and the single new query attends
    to them and to itself, so causality comes from the order of the writes.
    """
    if isinstance(token, torch.Tensor):
        if token.numel() != 1:
            raise InvalidIdsError(f"decode_step takes one token, got shape {tuple(token.shape)}")
        token = token.reshape(1)
    else:
        token = [token]
    logits, kv = extend(model, kv, token)
    return logits[-1], kv


def greedy(model, ids: IdsLike, n: int, kv: KV | None = None) -> list[int]:
    """The ``n`` tokens greedy decoding appends to ``ids`` (no early stop at end-of-sequence).

    With ``kv`` given, it is taken as the K/V of ``ids[:len(kv)]`` (not checked: that is
    the point of chapter 01's splice experiment) and only the rest of ``ids`` is prefilled.
    """
    if n < 0:
        raise RequestError(f"number of tokens to generate must be >= 0, got {n}")
    t = as_ids(model, ids)[0]
    if kv is None:
        logits, kv = prefill(model, t)
    else:
        if len(kv) >= len(t):
            raise InvalidIdsError(
                f"kv covers {len(kv)} positions but ids has only {len(t)}: at least one token "
                "after the cached prefix must be computed to get logits to continue from")
        logits, kv = extend(model, kv, t[len(kv):])
    out: list[int] = []
    next_logits = logits[-1]
    for step in range(n):
        token = int(next_logits.argmax())
        out.append(token)
        if step + 1 < n:
            next_logits, kv = decode_step(model, kv, token)
    return out


def splice(*parts: KV) -> KV:
    """Concatenate K/V pieces (possibly from different runs) along the sequence, in order.

    The result is what a cache would hold if it glued those pieces together; whether the
    model would have computed the same K/V is what chapter 01 tests.
    """
    if not parts:
        raise KVMismatchError("splice needs at least one KV")
    first = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if (p.num_layers, p.kv_heads, p.head_dim, p.dtype) != (
                first.num_layers, first.kv_heads, first.head_dim, first.dtype):
            raise KVMismatchError(
                f"splice part {i} has (layers, kv_heads, head_dim, dtype) = "
                f"{(p.num_layers, p.kv_heads, p.head_dim, p.dtype)}, part 0 has "
                f"{(first.num_layers, first.kv_heads, first.head_dim, first.dtype)}")
    keys = [torch.cat([p.keys[layer].to(first.device) for p in parts], dim=1)
            for layer in range(first.num_layers)]
    values = [torch.cat([p.values[layer].to(first.device) for p in parts], dim=1)
              for layer in range(first.num_layers)]
    return KV(keys, values)


def compare(a: KV, b: KV) -> KVDiff:
    """Per layer, the max absolute difference of ``a``'s and ``b``'s keys, and of their values.

    Both must have the same shape (slice them to the positions you want to compare).
    """
    if (a.num_layers, len(a), a.kv_heads, a.head_dim) != (b.num_layers, len(b), b.kv_heads,
                                                          b.head_dim):
        raise KVMismatchError(
            f"compare needs equal shapes: (layers, seq, kv_heads, head_dim) = "
            f"{(a.num_layers, len(a), a.kv_heads, a.head_dim)} vs "
            f"{(b.num_layers, len(b), b.kv_heads, b.head_dim)}")
    if len(a) == 0:
        zeros = [0.0] * a.num_layers
        return KVDiff(zeros, list(zeros))

    def diff(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.float() - y.to(x.device).float()).abs().max())

    return KVDiff([diff(x, y) for x, y in zip(a.keys, b.keys, strict=True)],
                  [diff(x, y) for x, y in zip(a.values, b.values, strict=True)])
