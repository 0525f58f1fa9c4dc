"""Replaying a log against a live OpenAI-compatible server, to set what it cached beside
what could have been.

Requests go one at a time, in the log's order, so the server's cache sees them as they
arrived. Each response's ``usage.prompt_tokens_details.cached_tokens`` is the server's
count of prompt tokens it took from its cache. vLLM reports it only when started with
``--enable-prompt-tokens-details`` (vllm 0.32.0 `entrypoints/launchers/cli_args.py:
BaseFrontendArgs.enable_prompt_tokens_details`; the field: vllm 0.32.0
`entrypoints/serve/engine/protocol.py: PromptTokenUsageInfo.cached_tokens`), SGLang only
with ``--enable-cache-report`` (sglang 0.5.23 `srt/arg_groups/fields/serving.py:
Serving.enable_cache_report`, read in sglang 0.5.23
`srt/entrypoints/openai/usage_processor.py: UsageProcessor.calculate_response_usage`);
``minirt.serve`` always reports it. Where a response lacks it the record says None.

The server generates its own replies (``max_tokens`` is capped, 1 by default), so what it
could have cached is computed from the prompts alone: ``possible`` is each prompt's
longest match against the earlier prompts of the same isolation key, in whole pages of
``page_size`` (set it to the server's page or block size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cache import RadixCache
from .load import HitcheckInputError, LoggedRequest
from .render import Rendered

__all__ = ["LiveRecord", "prompt_bounds", "replay_live"]


@dataclass
class LiveRecord:
    """One request as the server answered it, beside hitcheck's prediction."""

    index: int
    line: int
    prompt_tokens: int | None  # usage.prompt_tokens, as the server counted
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
    possible: int  # hitcheck's bound from the earlier prompts, in whole pages
    expected_prompt_tokens: int  # hitcheck's own count of the prompt's tokens
    error: str | None = None


def prompt_bounds(requests: Sequence[LoggedRequest], rendered: Sequence[Rendered],
                  page_size: int = 1) -> list[int]:
    """Each prompt's longest match against the earlier prompts (replies not cached), with
    isolation keys kept apart, short of the prompt's last token (a server computes it, for
    its logits), rounded down to whole pages: what a server that kept everything reports."""
    tree = RadixCache()
    out = []
    for request, r in zip(requests, rendered, strict=True):
        salt = request.key.salt()
        n = tree.peek_prefix_len(r.ids[:-1], salt=salt)
        out.append(n // page_size * page_size)
        tree.insert_prefix(r.ids, r.ids, salt=salt)
    return out


def _body(request: LoggedRequest, model: str, max_tokens: int) -> dict:
    body = {k: v for k, v in request.body.items()  # without hitcheck's own fields
            if k not in ("stream", "stream_options", "max_completion_tokens", "n",
                         "conversation", "conversation_id", "reply")}
    body["model"] = body.get("model") or model
    body["max_tokens"] = min(int(body.get("max_tokens") or max_tokens), max_tokens)
    body["stream"] = False
    return body


def _served_model(client, base: str) -> str:
    try:
        data = client.get(base + "/models").json()["data"]
        return data[0]["id"]
    except Exception as exc:
        raise HitcheckInputError(f"cannot list the models of {base}: {type(exc).__name__}: "
                                 f"{str(exc)[:200]}", field="--base-url") from None


def replay_live(requests: Sequence[LoggedRequest], rendered: Sequence[Rendered],
                base_url: str, *, page_size: int = 1, model: str | None = None,
                max_tokens: int = 1, timeout: float = 120.0,
                api_key: str = "EMPTY") -> list[LiveRecord]:
    """Send every request to ``base_url`` (ending in ``/v1``), one at a time, in order; read
    what the server cached. ``model``: the model name to send where a request names none
    (default: the server's first model)."""
    import httpx

    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise HitcheckInputError(f"max tokens must be a positive int, got {max_tokens!r}",
                                 field="--max-tokens")
    base = base_url.rstrip("/")
    possible = prompt_bounds(requests, rendered, page_size)
    out = []
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        model = model or _served_model(client, base)
        for i, (request, r) in enumerate(zip(requests, rendered, strict=True)):
            path = "/chat/completions" if request.endpoint == "chat" else "/completions"
            rec = LiveRecord(i, request.line, None, None, possible[i], len(r.ids))
            try:
                resp = client.post(base + path, json=_body(request, model, max_tokens))
                data = resp.json()
                if resp.status_code != 200:
                    message = data.get("error", {}).get("message") if isinstance(
                        data.get("error"), dict) else data
                    rec.error = f"HTTP {resp.status_code}: {str(message)[:200]}"
                else:
                    usage = data.get("usage") or {}
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens")
                    rec.cached_tokens = None if cached is None else int(cached)
            except (httpx.HTTPError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            out.append(rec)
    return out


