"""What a client asks for and what it gets back: ``Request``, how its sampling settings pick
each token, and the accounting of served requests (``RequestMetrics``, ``RequestResult``,
``Totals``, ``GenerateResult``).

These types need no model, pool or cache: ``minirt.engine`` serves a ``Request`` and fills
its ``RequestResult``; ``minirt.serve`` turns HTTP bodies into requests and results into
responses. SGLang keeps the request and output objects its processes pass each other in
one module of their own too (sglang 0.5.23 `srt/managers/io_struct.py: GenerateReqInput`
for a request, `srt/managers/io_struct.py: BatchStrOutput` for what comes back).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from .cache import check_salt
from .errors import RequestError
from .lifecycle import greedy_token
from .workloads import unique_prefix_count

__all__ = [
    "MIN_TEMPERATURE",
    "SEED_RANGE",
    "GenerateResult",
    "Request",
    "RequestMetrics",
    "RequestResult",
    "Totals",
    "chat_prompt_ids",
    "check_request",
    "eos_token_id",
    "sample_token",
    "sampler",
    "summarize",
]

# The smallest temperature a sampled request runs at: a positive one below it is raised to
# it at submit (dividing fp32 logits by 1e-38 overflows to inf, and softmax of inf is NaN),
# as in vllm 0.32.0 `sampling_params.py: SamplingParams.__post_init__, _MAX_TEMP`
MIN_TEMPERATURE = 1e-2
# Seeds are 64-bit signed integers (the range vLLM's OpenAI server accepts).
SEED_RANGE = (-2**63, 2**63 - 1)


@dataclass
class Request:
    """What a client asks for: a prompt (token ids *or* chat messages) and how to generate.

    ``messages`` go through the tokenizer's chat template (with the assistant prompt
    appended). ``temperature == 0`` is greedy decoding; otherwise tokens are sampled
    from the ``top_k`` most likely (0: all) with a generator seeded by ``seed`` (a 64-bit
    signed int), so a seeded request gives the same tokens whatever else is in the batch;
    a positive temperature below ``MIN_TEMPERATURE`` runs at ``MIN_TEMPERATURE``. ``priority``
    is handed to the cache (the "priority" eviction policy keeps high values longest).
    ``stop_on_eos``: finish early when the model emits its end-of-sequence token.
    ``cache_salt``: only requests with the same salt share cached K/V (None: all share).
    ``stop``: finish as soon as the decoded output contains one of these strings (the
    result's text ends before it; needs a tokenizer).
    """

    prompt: Sequence[int] | torch.Tensor | None = None
    messages: list[dict[str, str]] | None = None
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    priority: int = 0
    stop_on_eos: bool = True
    stop: Sequence[str] = ()
    rid: str | None = None
    cache_salt: str | bytes | None = None




def check_request(request: Request) -> None:
    """Check the settings of ``request`` that need no engine: ``max_new_tokens`` >= 1, a
    finite ``temperature`` >= 0, int ``top_k`` >= 0 and ``priority``, the salt, a 64-bit
    ``seed`` and the ``stop`` strings. Raises RequestError saying what is wrong."""
    m = request.max_new_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise RequestError(f"max_new_tokens must be an int >= 1, got {m!r}")
    t = request.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 \
            or math.isinf(t):
        raise RequestError(f"temperature must be a finite number >= 0, got {t!r}")
    for name in ("top_k", "priority"):
        v = getattr(request, name)
        if isinstance(v, bool) or not isinstance(v, int) or (name == "top_k" and v < 0):
            raise RequestError(f"{name} must be an int{' >= 0' * (name == 'top_k')}, "
                               f"got {v!r}")
    check_salt(request.cache_salt)
    if request.seed is not None and (isinstance(request.seed, bool)
                                     or not isinstance(request.seed, int)
                                     or not SEED_RANGE[0] <= request.seed <= SEED_RANGE[1]):
        raise RequestError(f"seed must be None or an int in [{SEED_RANGE[0]}, "
                           f"{SEED_RANGE[1]}], got {request.seed!r}")
    stop = request.stop
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)) \
            or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")

def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` through ``tokenizer``'s chat template, assistant prompt appended, as ids.

    Raises RequestError without a chat template or when the template rejects them.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("chat messages need a tokenizer with a chat template; "
                           "pass token ids as `prompt` instead")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # malformed messages: the template says why
        raise RequestError(f"cannot apply the chat template to these messages: "
                           f"{type(exc).__name__}: {exc}") from exc
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                 generator: torch.Generator | None = None) -> int:
    """The next token: argmax if ``temperature`` is 0, else a draw from the tempered top-k."""
    if temperature <= 0:
        return int(logits.argmax())
    x = logits.detach().float().cpu() / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))



def sampler(request: Request) -> Callable[[torch.Tensor], int]:
    """How ``request`` picks each token: argmax, or draws from its own seeded generator."""
    if request.temperature <= 0:
        return greedy_token  # the lifecycle batches greedy picks into one argmax
    seed = request.seed if request.seed is not None else random.getrandbits(63)
    generator = torch.Generator().manual_seed(seed)
    return partial(sample_token, temperature=max(request.temperature, MIN_TEMPERATURE),
                   top_k=request.top_k, generator=generator)


@dataclass
class RequestMetrics:
    """Per-request measurements. Times in seconds from the request's own arrival
    (its ``submit``; for ``generate``, the call).

    ``ttft``: arrival to first output token (queueing + its own prefill);
    ``prefill_time``: the forward passes that prefilled it (one, or one per chunk; running
    requests decoding in the same passes); ``latency``: arrival to finish.
    ``loaded_tokens``: the part of ``cached_tokens`` loaded back from a host tier for it
    (chapter 09; 0 without one).
    """

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float
    prefill_time: float
    latency: float
    loaded_tokens: int = 0

    @property
    def device_hit_tokens(self) -> int:
        """Prompt tokens found on the device (cached, not loaded back from the host)."""
        return self.cached_tokens - self.loaded_tokens

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens this request prefilled (not found in the cache)."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class RequestResult:
    """One request's outcome: its tokens and text, metrics, or the error that rejected it."""

    rid: str
    request: Request
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    # "length", "eos", "stop", "cancelled", "rejected", or "error" (its sampler raised;
    # ``error`` says why, and the other requests of the batch were not affected)
    finish_reason: str = "rejected"
    metrics: RequestMetrics | None = None
    error: RequestError | None = None

    @property
    def ok(self) -> bool:
        """True if the request was served (not rejected)."""
        return self.error is None


@dataclass(frozen=True)
class Totals:
    """Workload totals over served requests (cancelled ones count from what they computed).

    ``hit_rate`` = cached / prompt tokens. ``unique_bound``: distinct prompt prefixes
    (chapter 03), the fewest prompt tokens any prefix cache computes when every
    prompt's K/V comes from prefill. ``loaded_tokens``: the part of ``cached_tokens``
    loaded back from a host tier (chapter 09).
    """

    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_tokens: int
    unique_bound: int
    evicted_tokens: int = 0
    wall_time: float = 0.0
    loaded_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        """Cached prompt tokens found on the device (not loaded back from the host)."""
        return self.cached_tokens - self.loaded_tokens

    @property
    def computed_over_bound(self) -> float:
        """Prefill tokens computed per token of the unique-prefix bound (1.0 is ideal)."""
        return self.computed_tokens / self.unique_bound if self.unique_bound else 0.0

    def __str__(self) -> str:
        return (f"{self.requests} requests ({self.rejected} rejected): prompt tokens "
                f"{self.prompt_tokens}, cached {self.cached_tokens} (hit rate "
                f"{self.hit_rate:.3f}), computed {self.computed_tokens} vs unique bound "
                f"{self.unique_bound}, output {self.output_tokens}, evicted "
                f"{self.evicted_tokens}"
                + (f", loaded from host {self.loaded_tokens}" if self.loaded_tokens else ""))


def summarize(results: Sequence[RequestResult], evicted_tokens: int = 0,
              wall_time: float = 0.0) -> Totals:
    """Totals over ``results`` (any number of ``generate`` calls): tokens, hits, bound."""
    served = [r for r in results if r.metrics is not None]
    m = [r.metrics for r in served]
    return Totals(
        requests=len(results),
        rejected=sum(not r.ok for r in results),
        prompt_tokens=sum(x.prompt_tokens for x in m),
        cached_tokens=sum(x.cached_tokens for x in m),
        computed_tokens=sum(x.computed_tokens for x in m),
        output_tokens=sum(x.output_tokens for x in m),
        unique_bound=unique_prefix_count([r.prompt_ids for r in served]),
        evicted_tokens=evicted_tokens,
        wall_time=wall_time,
        loaded_tokens=sum(x.loaded_tokens for x in m),
    )


@dataclass
class GenerateResult:
    """What ``generate`` returns: one ``RequestResult`` per request (in order) and totals."""

    results: list[RequestResult]
    totals: Totals

    def __getitem__(self, i: int) -> RequestResult:
        return self.results[i]

    def __iter__(self) -> Iterator[RequestResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def outputs(self) -> list[list[int]]:
        """Output token ids per request ([] for a rejected one)."""
        return [r.output_ids for r in self.results]


def eos_token_id(model, tokenizer) -> int | None:
    """The end-of-sequence token: the tokenizer's, else the model's generation config's."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)
