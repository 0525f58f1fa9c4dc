"""The exceptions minirt raises: one hierarchy, so callers can catch `MinirtError`.

Every operation that raises one of these leaves the cache and the pool exactly as
they were before the call: nothing leaked, nothing lost.
"""

from __future__ import annotations


class MinirtError(Exception):
    """Base class of every error minirt raises on purpose."""


class InvalidIdsError(MinirtError, ValueError):
    """Token ids (or pool indices) of the wrong shape, dtype, sign or length."""


class ModelError(MinirtError):
    """A model could not be found, fetched or loaded."""


class UnknownModelError(ModelError, ValueError):
    """The name is neither the default model, a local folder, nor a known hub id."""


class ModelUnavailableError(ModelError):
    """The default model is not cached and cannot be fetched (no network)."""


class KVMismatchError(MinirtError, ValueError):
    """Per-layer K/V that do not fit the model or each other (layers, heads, head_dim, dtype)."""


class HandleError(MinirtError):
    """A cache handle that cannot be used: never locked, already unlocked, or stale."""


class StaleHandleError(HandleError):
    """The handle's node was evicted (or the cache reset) since the handle was made."""


class PoolError(MinirtError):
    """Misuse of the KV pool: double free, freeing unknown slots, bad sizes."""


class OutOfMemoryError(PoolError):
    """Not enough free slots, even after evicting every unlocked cached token."""


class RequestError(MinirtError, ValueError):
    """A request the runtime cannot serve: empty prompt, bad limits, too long for the pool."""


class ScheduleError(MinirtError, ValueError):
    """A scheduler setting that cannot work: unknown policy, negative or non-integer limits."""


class TierError(MinirtError, ValueError):
    """A host-tier setting that cannot work: unknown write policy, bad capacity or threshold."""


class RouterError(MinirtError, ValueError):
    """A router setting or call that cannot work: unknown policy, thresholds out of range,
    a replica index that does not exist, ``done`` without a request in flight."""


class TraceError(MinirtError, ValueError):
    """A request trace that cannot be trusted: a checksum that does not match, or a line
    that is not a request (the message names the line and the field)."""
