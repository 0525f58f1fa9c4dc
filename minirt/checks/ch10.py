"""Checkers for chapter 10: resuming a sum where the cache stopped, the fewest rows a matrix
product must be padded to for every row to keep its bits, a chunk-aligned attention merge,
and the decode steps a rounding can flip.

Each checker runs the reader's function on several inputs, compares with a reference
computed here and names the first input that disagrees; a repeated failure adds a nudge.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._common import as_int_list, call_reader, checker, expect, passed, same_int

__all__ = ["aligned_merge", "at_risk", "check_aligned_merge", "check_at_risk",
           "check_resume_sum", "check_rows_needed", "resume_sum", "rows_needed"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- 10.1 resume a sum

def resume_sum(total: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Reference for 10.1: ``total`` (the fp32 left-to-right sum of the cached values) with
    ``rest`` added one value at a time, left to right: the full pass's bits."""
    for x in rest:
        total = total + x
    return total


def _sequential(values: torch.Tensor) -> torch.Tensor:
    return resume_sum(values.new_zeros(()), values)


_NUDGE_101 = ("The full pass adds one value after another, left to right. Which additions "
              "does it perform after the last cached value, and in what order?")


@checker("10.1", _NUDGE_101)
def check_resume_sum(fn: Callable) -> None:
    """Exercise 10.1: ``fn(total, rest)`` -> the full left-to-right sum's exact bits."""
    gen = _gen(101)
    cases = []
    for n, cut in ((8, 3), (100, 40), (300, 256), (257, 1), (64, 0)):
        values = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 100).float()
        cases.append((values, cut))
    for values, cut in cases:
        want = _sequential(values)
        total = _sequential(values[:cut])
        got = call_reader(f"resume_sum(total of {cut} values, {values.numel() - cut} more)",
                          fn, total.clone(), values[cut:].clone())
        ok = isinstance(got, torch.Tensor) and got.dtype == torch.float32 \
            and got.numel() == 1 and torch.equal(got.reshape(()), want)
        shown = got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
        expect(ok, f"resume_sum after {cut} cached of {values.numel()} fp32 values returned "
                   f"{shown!r} ({getattr(got, 'dtype', type(got).__name__)}); the full "
                   f"left-to-right pass gives {want.item()!r} "
                   "(a 0-d fp32 tensor, equal bit for bit).")
    passed("10.1", f"{len(cases)} sums resumed with the full pass's bits")


# ---------------------------------------------------------------- 10.2 the padding a kernel needs

def rows_needed(product: Callable, x: torch.Tensor) -> int | None:
    """Reference for 10.2: the smallest ``p`` (1 to ``len(x)``) such that, for every row
    count ``M`` from ``p`` to ``len(x)`` and every row ``r < M``, row ``r`` of
    ``product(x[:M])`` has the bits of row 0 of ``product`` on ``x[r]`` padded with
    ``p - 1`` zero rows (a request computed alone, padded to ``p`` rows); None if no ``p``
    works. ``product`` maps ``[M, K]`` to ``[M, N]`` row by row."""
    n = x.shape[0]
    batched = [product(x[:m]) for m in range(1, n + 1)]  # batched[m - 1]: M = m
    for p in range(1, n + 1):
        alone = [product(torch.cat([x[r:r + 1], x.new_zeros(p - 1, x.shape[1])]))[0]
                 for r in range(n)]
        if all(torch.equal(batched[m - 1][r], alone[r])
               for m in range(p, n + 1) for r in range(m)):
            return p
    return None


class _SyntheticKernel:
    """A row-wise product whose bits this checker controls, the same on every machine:
    ``x @ w.T`` exact (small integers), then one unit in the last place added to row ``r``
    of an ``M``-row product wherever ``moved(M, r)``. Printed as ``name``."""

    def __init__(self, name: str, weight: torch.Tensor, moved: Callable[[int, int], bool]):
        self.name, self.weight, self.moved = name, weight, moved

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = (x.double() @ self.weight.double().T).float()  # exact: small integers
        rows = x.shape[0]
        for r in range(rows):
            if self.moved(rows, r):
                out[r] = torch.nextafter(out[r], torch.full_like(out[r], float("inf")))
        return out

    def __repr__(self) -> str:
        return self.name


def _integer_rows(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randint(1, 9, (rows, cols), generator=gen).float()


def _linear_kernel(weight: torch.Tensor) -> Callable:
    def product(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight)
    product.__qualname__ = f"F.linear(., {weight.dtype} weight {tuple(weight.shape)})"
    return product


_NUDGE_102 = ("Two things can move a row's bits: how many rows the product has and where the "
              "row sits among them. The padded row alone is the one to match, bit for bit, "
              "for every row of every count from p up.")


@checker("10.2", _NUDGE_102)
def check_rows_needed(fn: Callable) -> None:
    """Exercise 10.2: ``fn(product, x)`` -> the fewest rows to pad a product to (or None)."""
    gen = _gen(102)
    weight = _integer_rows(gen, 6, 64) * 128  # large outputs: one ulp is far above allclose's
    x = _integer_rows(gen, 12, 64)
    kernels = [
        _SyntheticKernel("a kernel no row count or position changes", weight,
                         lambda m, r: False),
        _SyntheticKernel("a kernel whose 1-3-row products round otherwise", weight,
                         lambda m, r: m < 4),
        _SyntheticKernel("a kernel whose rows 4 and up of 5-7-row products round otherwise",
                         weight, lambda m, r: 5 <= m <= 7 and r >= 4),
        _SyntheticKernel("a kernel whose 2-row products alone round otherwise", weight,
                         lambda m, r: m == 2),
        _SyntheticKernel("a kernel whose last row of a 12-row product rounds otherwise",
                         weight, lambda m, r: m == 12 and r == 11),
        _SyntheticKernel("a kernel whose row 9 of 10-11-row products rounds otherwise",
                         weight, lambda m, r: m in (10, 11) and r == 9),
    ]
    cases = [(k, x) for k in kernels]
    for out_f, in_f in ((576, 1536), (96, 64)):  # this machine's torch kernels
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(out_f, in_f, generator=gen).to(dtype)
            cases.append((_linear_kernel(w), torch.randn(9, in_f, generator=gen).to(dtype)))
    for product, rows in cases:
        want = rows_needed(product, rows)
        name = getattr(product, "__qualname__", None) if not isinstance(
            product, _SyntheticKernel) else repr(product)
        what = f"rows_needed({name}, x {tuple(rows.shape)})"
        got = call_reader(what, fn, product, rows.clone())
        ok = got is None if want is None else same_int(got, want)
        expect(ok, f"{what} returned {got!r}; expected {want!r}"
                   + (" (no padding makes every row match)." if want is None else "."))
    passed("10.2", f"{len(cases)} kernels, synthetic and this machine's")


# ---------------------------------------------------------------- 10.3 an aligned merge

def aligned_merge(scores: torch.Tensor, values: torch.Tensor, chunk: int) -> torch.Tensor:
    """Reference for 10.3: one query's attention output ``[d]`` from its fp32 ``scores``
    ``[n]`` (``-inf`` where a key is masked) and ``values`` ``[n, d]``: the exact maximum,
    ``exp(score - max)``, the keys padded with weight 0 and value 0 to a whole number of
    chunks, then per chunk of ``chunk`` keys from position 0 the sum of its ``chunk``
    weights and ``weights @ values``, the chunks added left to right, one division."""
    top = scores.max()
    weights = torch.exp(scores - top)
    width = -(-scores.numel() // chunk) * chunk  # every chunk, the last too, is `chunk` long
    weights = torch.cat([weights, weights.new_zeros(width - scores.numel())])
    values = torch.cat([values, values.new_zeros(width - scores.numel(), values.shape[1])])
    total, out = weights.new_zeros(()), values.new_zeros(values.shape[1])
    for start in range(0, width, chunk):
        w = weights[start:start + chunk]
        total = total + w.sum()
        out = out + w @ values[start:start + chunk]
    return out / total


_NUDGE_103 = ("Padding with masked keys must add exact zeros and nothing else: the chunks "
              "have to start at the same positions whatever the length, each has to be "
              "reduced over the same number of keys whatever the length, and the partial "
              "results have to be combined in one fixed order.")


@checker("10.3", _NUDGE_103)
def check_aligned_merge(fn: Callable) -> None:
    """Exercise 10.3: ``fn(scores, values, chunk)`` -> the aligned merge's exact bits, the
    same with masked keys appended."""
    gen = _gen(103)
    shapes = [(5, 4), (33, 8), (100, 16), (256, 64), (300, 64)]
    # last chunks holding 2 to 15 real keys, several draws each: where a short sum and the
    # same sum padded with zeros can part
    shapes += [(n, chunk) for chunk in (8, 16) for n in (chunk + 2, chunk + 5, 2 * chunk + 7,
                                                        3 * chunk - 3, 3 * chunk - 1)]
    shapes += [(300, 64)] * 4 + [(37, 16)] * 4 + [(21, 16)] * 3 + [(38, 16)] * 3
    cases = []
    for n, chunk in shapes:
        scores = torch.randn(n, generator=gen) * 3
        cases.append((scores, torch.randn(n, 16, generator=gen), chunk))
    s3 = torch.Generator().manual_seed(3)  # a short last chunk of 5 keys out of 8
    scores = torch.randn(5, generator=s3)
    cases.append((scores, torch.randn(5, 4, generator=s3), 8))
    for scores, values, chunk in cases:
        want = aligned_merge(scores, values, chunk)
        for pad in (0, 3, chunk, 2 * chunk + 1):
            s = torch.cat([scores, torch.full((pad,), float("-inf"))])
            v = torch.cat([values, torch.randn(pad, values.shape[1], generator=gen)])
            what = (f"aligned_merge({scores.numel()} scores + {pad} masked, values "
                    f"{tuple(values.shape)}, chunk={chunk})")
            got = call_reader(what, fn, s.clone(), v.clone(), chunk)
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape \
                and torch.equal(got, want)
            close = isinstance(got, torch.Tensor) and got.shape == want.shape \
                and torch.allclose(got.float(), want, atol=1e-5)
            expect(ok, f"{what}: " + ("close to softmax attention but not the aligned "
                                      "merge's bits" if close else f"returned {got!r}")
                   + f"; expected {want.tolist()[:3]}... (shape {tuple(want.shape)}, "
                   "equal bit for bit).")
    passed("10.3", f"{len(cases)} queries, each padded four ways, same bits")


# ---------------------------------------------------------------- 10.4 steps at risk

def at_risk(logits: torch.Tensor, eps: float) -> list[int]:
    """Reference for 10.4: the decode steps (rows of ``logits`` ``[steps, vocab]``) whose
    greedy token can change when every logit moves by at most ``eps``: top-1 minus top-2
    at most ``2 * eps``."""
    top = logits.float().topk(2, -1).values
    return [i for i, gap in enumerate((top[:, 0] - top[:, 1]).tolist()) if gap <= 2 * eps]


_NUDGE_104 = ("In the worst case the best token's logit moves down and the runner-up's up, "
              "each by as much as they can. How far apart must they start for the order "
              "to survive?")


@checker("10.4", _NUDGE_104)
def check_at_risk(fn: Callable) -> None:
    """Exercise 10.4: ``fn(logits, eps)`` -> the steps at risk, in order."""
    gen = _gen(104)
    cases: list[tuple[torch.Tensor, float]] = []
    for steps, vocab, eps in ((6, 10, 0.1), (20, 50, 0.05), (8, 30, 0.5), (12, 8, 0.0)):
        logits = torch.randn(steps, vocab, generator=gen) * 2
        # make some steps near-ties at about eps and 2 * eps
        for i in range(0, steps, 3):
            best = int(logits[i].argmax())
            other = (best + 1) % vocab
            logits[i, other] = logits[i, best] - (1.5 if i % 2 else 0.75) * eps
        cases.append((logits, eps))
    for logits, eps in cases:
        want = at_risk(logits, eps)
        what = f"at_risk(logits {tuple(logits.shape)}, eps={eps})"
        got = as_int_list(call_reader(what, fn, logits.clone(), eps))
        expect(got == want, f"{what} returned {got!r}; expected {want}.")
    passed("10.4", f"{len(cases)} runs of logits")
