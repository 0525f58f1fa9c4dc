"""The prompt-cache timing side channel: tell which candidate prompt is cached from TTFT.

A victim's request leaves its system prompt's K/V in a shared prefix cache. An attacker
who can guess a few candidates sends one probe per candidate (the candidate, then a
question of its own) and times the first token: the cached candidate's probe skips its
prefill and answers first. ``timing_attack`` runs that experiment on an ``Engine``;
``mann_whitney_p`` is a hypothesis test on the two TTFT samples (hits and misses); Gu
et al. (ICML 2025) audit API providers with another two-sample test of this kind, the
Kolmogorov-Smirnov test; ``chance_interval`` says how well pure guessing does. With
per-tenant cache salts, no probe ever hits. The token-by-token version of the attack
(chapter 08's exercise) is Song et al., "The Early Bird Catches the Leak"
(arXiv 2409.20002); PromptPeek (Wu et al., NDSS 2025) reads LPM scheduling order
instead. The defence: vLLM's ``cache_salt`` (vllm 0.32.0
`v1/core/kv_cache_utils.py: generate_block_hash_extra_keys`) and SGLang's, which is in
every child key (sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.child_key_at`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .cache import Salt
from .engine import Engine
from .request import Request

__all__ = ["AttackResult", "chance_interval", "mann_whitney_p", "timing_attack"]


@dataclass(frozen=True)
class AttackResult:
    """Per trial: the victim's candidate, the attacker's guess, and per candidate the probe's
    TTFT (seconds) and the prompt tokens the cache served it (which the attacker cannot see)."""

    secrets: list[int]
    guesses: list[int]
    ttft: list[list[float]]
    cached: list[list[int]]

    @property
    def trials(self) -> int:
        return len(self.secrets)

    @property
    def correct(self) -> int:
        return sum(s == g for s, g in zip(self.secrets, self.guesses, strict=True))

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials if self.trials else 0.0

    def samples(self) -> tuple[list[float], list[float]]:
        """TTFTs of the probes of the victim's candidate, and of every other probe."""
        secret, other = [], []
        for s, row in zip(self.secrets, self.ttft, strict=True):
            for j, t in enumerate(row):
                (secret if j == s else other).append(t)
        return secret, other


def timing_attack(engine: Engine, candidates: Sequence[Sequence[int]], trials: int,
                  victim_suffix: Sequence[int], probe_suffix: Sequence[int], *,
                  victim_salt: Salt = None, attacker_salt: Salt = None, seed: int = 0,
                  progress: bool = False) -> AttackResult:
    """Run ``trials`` rounds of: empty the cache; the victim sends a random candidate + its
    suffix; the attacker probes every candidate (random order) + its suffix and guesses the
    one with the smallest TTFT. Salts go on the victim's and the attacker's requests.
    """
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    secrets, guesses, ttft, cached = [], [], [], []
    for _ in tqdm(range(trials), desc="attack", disable=not progress, leave=False):
        engine.flush()
        secret = rng.randrange(len(candidates))
        engine.generate(Request(prompt=list(candidates[secret]) + list(victim_suffix),
                                max_new_tokens=1, cache_salt=victim_salt), progress=False)
        row_t, row_c = [0.0] * len(candidates), [0] * len(candidates)
        for j in rng.sample(range(len(candidates)), len(candidates)):
            r = engine.generate(Request(prompt=list(candidates[j]) + list(probe_suffix),
                                        max_new_tokens=1, cache_salt=attacker_salt),
                                progress=False)[0]
            row_t[j], row_c[j] = r.metrics.ttft, r.metrics.cached_tokens
        secrets.append(secret)
        guesses.append(min(range(len(candidates)), key=row_t.__getitem__))
        ttft.append(row_t)
        cached.append(row_c)
    return AttackResult(secrets, guesses, ttft, cached)


def mann_whitney_p(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided Mann-Whitney U test: p-value of "``x`` is not stochastically smaller than ``y``".

    Normal approximation with tie correction (fine from about 8 values per sample). A small
    p says the two TTFT samples come from different distributions, x faster.
    """
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        raise ValueError("both samples need at least one value")
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(pooled)
    ties, i = 0.0, 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    rank_x = sum(r for r, (_, g) in zip(ranks, pooled, strict=True) if g == 0)
    u = rank_x - n * (n + 1) / 2  # small when x is small
    mean = n * m / 2
    var = n * m / 12 * ((n + m + 1) - ties / ((n + m) * (n + m - 1) if n + m > 1 else 1))
    if var <= 0:
        return 0.5
    z = (u - mean + 0.5) / math.sqrt(var)  # continuity correction
    return 0.5 * math.erfc(-z / math.sqrt(2))


def chance_interval(trials: int, candidates: int, level: float = 0.95) -> tuple[float, float]:
    """Central ``level`` interval of the accuracy of uniform guessing among ``candidates``.

    Exact binomial quantiles of Binomial(trials, 1/candidates), divided by ``trials``.
    """
    p = 1 / candidates
    pmf = [math.comb(trials, k) * p ** k * (1 - p) ** (trials - k) for k in range(trials + 1)]
    tail = (1 - level) / 2
    cdf, lo = 0.0, 0
    for k, q in enumerate(pmf):
        cdf += q
        if cdf > tail:
            lo = k
            break
    cdf, hi = 0.0, trials
    for k in range(trials, -1, -1):
        cdf += pmf[k]
        if cdf > tail:
            hi = k
            break
    return lo / trials, hi / trials
