"""Chapter 06 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest
from exercise_util import accepts, rejects

import minirt.checks as checks
from minirt.checks import ch06

# ---------------------------------------------------------------- Exercise 6.1


def plan(turns, page_size, *, last_token=True, whole_output=False, pages=True,
         previous_only=False):
    held, out = [], []
    for prompt, output in turns:
        matchable = prompt[:-1] if last_token else prompt
        best = 0
        for h in (held[-1:] if previous_only else held):
            n = 0
            while n < min(len(matchable), len(h)) and matchable[n] == h[n]:
                n += 1
            best = max(best, n)
        cached = best - best % page_size if pages else best
        out.append((cached, len(prompt) - cached))
        kv = prompt + (output if whole_output else output[:-1])
        held.append(kv[: len(kv) - len(kv) % page_size] if pages else kv)
    return out


def test_chat_plan_accepts_reference(capsys):
    accepts(checks.check_chat_plan, plan, "6.1", capsys)


@pytest.mark.parametrize("kwargs", [dict(last_token=False), dict(whole_output=True),
                                    dict(pages=False), dict(previous_only=True)])
def test_chat_plan_rejects(kwargs):
    rejects(checks.check_chat_plan, lambda t, p: plan(t, p, **kwargs), "6.1",
            contains="chat_plan(")


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_chat_plan_reference_matches_the_engine(page_size):
    """The checker's rule is the engine's: a chat through Engine on tiny_model."""
    import torch

    from minirt.engine import Engine
    from minirt.model import tiny_model
    from minirt.request import Request

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(tiny_model(0), capacity=512, page_size=page_size)
        prompt, turns, measured = [5, 6, 7, 8, 9, 10, 11], [], []
        for user, n_out in [([20, 21], 3), ([22], 4), ([], 1), ([23, 24, 25], 2)]:
            r = engine.generate([Request(prompt=list(prompt), max_new_tokens=n_out,
                                         stop_on_eos=False)], progress=False)[0]
            turns.append((list(prompt), list(r.output_ids)))
            measured.append((r.metrics.cached_tokens, r.metrics.computed_tokens))
            prompt = prompt + list(r.output_ids) + user
        other = [40, 41, 42, 43, 44]
        r = engine.generate([Request(prompt=other, max_new_tokens=2, stop_on_eos=False)],
                            progress=False)[0]
        turns.append((other, list(r.output_ids)))
        measured.append((r.metrics.cached_tokens, r.metrics.computed_tokens))
    finally:
        torch.set_num_threads(threads)
    assert measured == ch06.chat_plan_reference(turns, page_size)


# ---------------------------------------------------------------- Exercise 6.2


def order_right(requests, step_time):
    return sorted(range(len(requests)), key=lambda i: step_time(*requests[i]))


def order_by_uncached(requests, step_time):
    return sorted(range(len(requests)), key=lambda i: requests[i][0] - requests[i][1])


def order_by_prompt(requests, step_time):
    return sorted(range(len(requests)), key=lambda i: requests[i][0])


def order_longest_first(requests, step_time):
    return order_right(requests, step_time)[::-1]


def order_arrival(requests, step_time):
    return list(range(len(requests)))


def test_best_ttft_order_accepts_reference(capsys):
    accepts(checks.check_best_ttft_order, order_right, "6.2", capsys)


@pytest.mark.parametrize("wrong", [order_by_uncached, order_by_prompt, order_longest_first,
                                   order_arrival])
def test_best_ttft_order_rejects(wrong):
    rejects(checks.check_best_ttft_order, wrong, "6.2", contains="best_ttft_order(")


# ---------------------------------------------------------------- Exercise 6.3


def flops_right(num_new, num_cached, params, layers, heads, head_dim, window=None):
    keys = [num_cached + i for i in range(1, num_new + 1)]
    pairs = sum(k if window is None else min(window, k) for k in keys)
    return 2 * params * num_new + 4 * layers * heads * head_dim * pairs


def flops_ignores_window(num_new, num_cached, params, layers, heads, head_dim, window=None):
    return flops_right(num_new, num_cached, params, layers, heads, head_dim)


def flops_window_on_new_only(num_new, num_cached, params, layers, heads, head_dim, window=None):
    w = num_new if window is None else window  # caps the new tokens' triangle, keeps the prefix
    pairs = num_new * num_cached + sum(min(w, i) for i in range(1, num_new + 1))
    return 2 * params * num_new + 4 * layers * heads * head_dim * pairs


def flops_window_off_by_one(num_new, num_cached, params, layers, heads, head_dim, window=None):
    return flops_right(num_new, num_cached, params, layers, heads, head_dim,
                       None if window is None else window + 1)  # a window of w past tokens


def flops_no_attention(num_new, num_cached, params, layers, heads, head_dim, window=None):
    return 2 * params * num_new


def test_flops_accepts_reference(capsys):
    checks.check_prefill_flops(flops_right)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 6.3 passed") and "1.33x" in out


@pytest.mark.parametrize("wrong", [flops_ignores_window, flops_window_on_new_only,
                                   flops_window_off_by_one, flops_no_attention])
def test_flops_rejects(wrong):
    rejects(checks.check_prefill_flops, wrong, "6.3", contains="prefill_flops(")


def test_smollm2_params_are_the_non_embedding_linear_weights():
    hidden, inter, layers, kv = 576, 1536, 30, 3 * 64
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    assert ch06.SMOLLM2["params"] == layers * per_layer


# ---------------------------------------------------------------- Exercise 6.4


def admit_right(uncached, budget):
    steps, step, queue = [0] * len(uncached), 0, list(enumerate(uncached))
    while queue:
        left, first = budget, True
        while queue and (first or queue[0][1] <= left):
            i, n = queue.pop(0)
            steps[i], left, first = step, left - n, False
            if left <= 0:
                break
        step += 1
    return steps


def admit_overtaking(uncached, budget):  # lets short requests jump over a long one
    steps, step, queue = [0] * len(uncached), 0, list(enumerate(uncached))
    while queue:
        left, first, rest = budget, True, []
        for i, n in queue:
            if first or n <= left:
                steps[i], left, first = step, left - n, False
            else:
                rest.append((i, n))
        queue, step = rest, step + 1
    return steps


def admit_long_waits_forever(uncached, budget):  # never admits more than the budget, skips it
    steps, step, left = [], 0, budget
    for n in uncached:
        if n > left:
            step, left = step + 1, budget
        steps.append(step)
        left -= min(n, left)
    return steps


def admit_one_per_step(uncached, budget):
    return list(range(len(uncached)))


def test_admit_accepts_reference(capsys):
    checks.check_admission_steps(admit_right)
    assert capsys.readouterr().out.startswith("Exercise 6.4 passed")


@pytest.mark.parametrize("wrong", [admit_overtaking, admit_long_waits_forever,
                                   admit_one_per_step])
def test_admit_rejects(wrong):
    rejects(checks.check_admission_steps, wrong, "6.4", contains="admission_steps(")


def test_admission_reference_matches_the_engine():
    """The checker's rule is the engine's: replay a queue through Engine on tiny_model."""
    import torch

    from minirt.engine import Engine
    from minirt.model import tiny_model
    from minirt.request import Request

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lengths, budget = [5, 12, 3, 3, 9, 1], 8
        prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate(lengths)]
        # distinct first tokens: nothing is shared, so uncached == prompt length
        assert len({p[0] for p in prompts}) == len(prompts)
        engine = Engine(tiny_model(0), capacity=256, token_budget=budget)
        handles = [engine.submit(Request(prompt=p, max_new_tokens=30, stop_on_eos=False))
                   for p in prompts]
        admitted_at, step = {}, 0
        while engine.has_work:
            for h in engine.step().admitted:
                admitted_at[h.rid] = step
            step += 1
    finally:
        torch.set_num_threads(threads)
    assert [admitted_at[h.rid] for h in handles] == ch06._admission_steps(lengths, budget)
