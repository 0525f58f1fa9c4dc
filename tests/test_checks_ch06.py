"""Chapter 06 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest

import minirt.checks as checks
from minirt.checks import ch06

# ---------------------------------------------------------------- Exercise 6.1


def plan_right(prompt_len, common_len, page_size):
    cached = min(common_len, prompt_len - 1) // page_size * page_size
    return cached, prompt_len - cached


def plan_whole_prompt(prompt_len, common_len, page_size):  # forgets the last-token rule
    cached = min(common_len, prompt_len) // page_size * page_size
    return cached, prompt_len - cached


def plan_unaligned(prompt_len, common_len, page_size):  # forgets whole pages
    cached = min(common_len, prompt_len - 1)
    return cached, prompt_len - cached


def plan_align_then_clip(prompt_len, common_len, page_size):  # clips after aligning
    cached = min(common_len // page_size * page_size, prompt_len - 1)
    return cached, prompt_len - cached


def plan_list(prompt_len, common_len, page_size):  # right numbers, wrong type
    return list(plan_right(prompt_len, common_len, page_size))


def test_plan_accepts_reference(capsys):
    checks.check_prefill_plan(plan_right)
    assert capsys.readouterr().out.startswith("Exercise 6.1 passed")


@pytest.mark.parametrize("wrong", [plan_whole_prompt, plan_unaligned, plan_align_then_clip,
                                   plan_list])
def test_plan_rejects(wrong):
    with pytest.raises(AssertionError, match="prefill_plan"):
        checks.check_prefill_plan(wrong)


def test_plan_seed_case():
    assert ch06._prefill_plan(30, 20, 16) == (16, 14)


# ---------------------------------------------------------------- Exercise 6.2


def tpot_right(m):
    return 0.0 if m.output_tokens <= 1 else (m.latency - m.ttft) / (m.output_tokens - 1)


def tpot_mean_latency(m):  # latency per token, TTFT included
    return m.latency / m.output_tokens


def tpot_off_by_one(m):  # divides by every token, though the first came from prefill
    return (m.latency - m.ttft) / m.output_tokens


def tpot_crashes_on_one(m):  # no guard for a single output token
    return (m.latency - m.ttft) / (m.output_tokens - 1)


def test_tpot_accepts_reference(capsys):
    checks.check_time_per_output_token(tpot_right)
    assert capsys.readouterr().out.startswith("Exercise 6.2 passed")


@pytest.mark.parametrize("wrong", [tpot_mean_latency, tpot_off_by_one])
def test_tpot_rejects(wrong):
    with pytest.raises(AssertionError, match="time_per_output_token"):
        checks.check_time_per_output_token(wrong)


def test_tpot_crash_is_not_accepted():
    with pytest.raises(ZeroDivisionError):
        checks.check_time_per_output_token(tpot_crashes_on_one)


# ---------------------------------------------------------------- Exercise 6.3


def flops_right(num_new, num_cached, params, layers, heads, head_dim):
    pairs = sum(num_cached + i for i in range(1, num_new + 1))
    return 2 * params * num_new + 4 * layers * heads * head_dim * pairs


def flops_no_attention(num_new, num_cached, params, layers, heads, head_dim):
    return 2 * params * num_new


def flops_full_square(num_new, num_cached, params, layers, heads, head_dim):  # ignores causality
    return 2 * params * num_new + 4 * layers * heads * head_dim * num_new * (num_cached + num_new)


def flops_forgets_prefix(num_new, num_cached, params, layers, heads, head_dim):
    return flops_right(num_new, 0, params, layers, heads, head_dim)


def test_flops_accepts_reference(capsys):
    checks.check_prefill_flops(flops_right)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 6.3 passed") and "1.33x" in out


@pytest.mark.parametrize("wrong", [flops_no_attention, flops_full_square, flops_forgets_prefix])
def test_flops_rejects(wrong):
    with pytest.raises(AssertionError, match="prefill_flops"):
        checks.check_prefill_flops(wrong)


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
    with pytest.raises(AssertionError, match="admission_steps"):
        checks.check_admission_steps(wrong)


def test_admission_reference_matches_the_engine():
    """The checker's rule is the engine's: replay a queue through Engine on tiny_model."""
    import torch

    from minirt.engine import Engine, Request
    from minirt.model import tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lengths, budget = [5, 12, 3, 3, 9, 1], 8
        prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate(lengths)]
        # distinct first tokens: nothing is shared, so uncached == prompt length
        assert len({p[0] for p in prompts}) == len(prompts)
        order = []
        engine = Engine(tiny_model(0), capacity=256, token_budget=budget)
        engine.generate([Request(prompt=p, max_new_tokens=30, stop_on_eos=False)
                         for p in prompts], progress=False,
                        on_token=lambda rid, tok: order.append(rid))
    finally:
        torch.set_num_threads(threads)
    # Step s admits its requests, then one decode step: request r's first token is
    # emitted at step ch06._admission_steps(...)[r]; count decode tokens of request 0
    # emitted before each first token.
    steps = ch06._admission_steps(lengths, budget)
    rids = [f"q{i + 1}" for i in range(len(prompts))]
    firsts = [order.index(rid) for rid in rids]
    decoded_by_q1 = [order[:f].count("q1") - 1 if i else 0 for i, f in enumerate(firsts)]
    assert decoded_by_q1 == steps
