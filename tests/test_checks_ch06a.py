"""Chapter 06a checker: accepts the right answer, rejects plausible wrong ones, and its
reference agrees with what the real ``Engine.step`` does."""

from __future__ import annotations

import pytest

import minirt.checks as checks
from minirt.checks import ch06a
from minirt.engine import Engine, Request


def right(arrivals, uncached, budget):
    return ch06a._first_token_steps(arrivals, uncached, budget)


def ignores_arrivals(arrivals, uncached, budget):  # as if everyone arrived at step 0
    return ch06a._first_token_steps([0] * len(arrivals), uncached, budget)


def index_order(arrivals, uncached, budget):  # queue by index, not by arrival
    steps, queue, step, pending = [0] * len(arrivals), [], 0, list(range(len(arrivals)))
    while pending or queue:
        queue += [i for i in pending if arrivals[i] <= step]
        pending = [i for i in pending if arrivals[i] > step]
        queue.sort()
        left, admitted = budget, 0
        while queue and (not admitted or uncached[queue[0]] <= left) and left > 0:
            i = queue.pop(0)
            steps[i], left, admitted = step, left - uncached[i], admitted + 1
        step += 1
    return steps


def skip_ahead(arrivals, uncached, budget):  # a later request overtakes one that does not fit
    steps, queue, step, pending = [0] * len(arrivals), [], 0, sorted(
        range(len(arrivals)), key=lambda i: (arrivals[i], i))
    while pending or queue:
        while pending and arrivals[pending[0]] <= step:
            queue.append(pending.pop(0))
        left, admitted = budget, 0
        for i in list(queue):
            if left > 0 and (not admitted or uncached[i] <= left):
                queue.remove(i)
                steps[i], left, admitted = step, left - uncached[i], admitted + 1
        step += 1
    return steps


def test_accepts_reference(capsys):
    checks.check_first_token_steps(right)
    assert capsys.readouterr().out.startswith("Exercise 6a.1 passed")


@pytest.mark.parametrize("wrong", [ignores_arrivals, index_order, skip_ahead])
def test_rejects_mutants(wrong):
    with pytest.raises(AssertionError, match="first_token_steps"):
        checks.check_first_token_steps(wrong)


def test_hint_only_on_a_repeated_failure():
    ch06a._failures["6a.1"] = 0
    with pytest.raises(AssertionError) as first:
        checks.check_first_token_steps(ignores_arrivals)
    with pytest.raises(AssertionError) as second:
        checks.check_first_token_steps(ignores_arrivals)
    assert "Hint" not in str(first.value) and "expected" in str(first.value)
    assert "Hint" in str(second.value)
    with pytest.raises(AssertionError, match="raised ZeroDivisionError"):
        checks.check_first_token_steps(lambda a, u, b: [1 / 0])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", ch06a.FIRST_TOKEN_CASES[:-1])
def test_reference_matches_the_engine(tiny64, case):
    """Distinct prompts (nothing cached) submitted just before their arrival step: the step
    whose StepOutput admits each one is the reference's."""
    arrivals, uncached, budget = case
    engine = Engine(tiny64, capacity=4096, token_budget=budget)
    prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate(uncached)]
    prompts = [[120 + i] + p[1:] for i, p in enumerate(prompts)]  # distinct first tokens
    handles, admitted_at, step = {}, {}, 0
    while len(admitted_at) < len(arrivals):
        for i in sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i)):
            if arrivals[i] == step:
                handles[i] = engine.submit(Request(prompt=prompts[i], max_new_tokens=20,
                                                   stop_on_eos=False))
        out = engine.step()
        for i, h in handles.items():
            if h in out.admitted:
                admitted_at[i] = step
        step += 1
    assert [admitted_at[i] for i in range(len(arrivals))] == right(arrivals, uncached, budget)


def test_prediction_accepts_the_right_one(capsys):
    checks.check_first_token_prediction([0, 1, 1, 2])
    assert capsys.readouterr().out.startswith("Exercise 6a.1 passed")


@pytest.mark.parametrize("wrong", [[0, 0, 1, 2],   # ignores the budget
                                   [0, 1, 2, 3],   # one request a step
                                   [0, 2, 1, 2],   # the newcomer overtakes
                                   "0, 1, 1, 2"])
def test_prediction_rejects_wrong_ones(wrong):
    ch06a._failures["6a.1 prediction"] = 0
    with pytest.raises(AssertionError, match="your prediction") as first:
        checks.check_first_token_prediction(wrong)
    with pytest.raises(AssertionError) as second:
        checks.check_first_token_prediction(wrong)
    assert "Hint" not in str(first.value) and "Hint" in str(second.value)
