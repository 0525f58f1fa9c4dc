"""Chapter 06a checker: accepts the right answer, rejects plausible wrong ones, and its
reference agrees with what the real ``Engine.step`` does."""

from __future__ import annotations

import json

import pytest
from exercise_util import ROOT

import minirt.checks as checks
from minirt.checks import _common, ch06a
from minirt.engine import Engine
from minirt.request import Request


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


def mistake(name):
    return lambda arrivals, uncached, budget: ch06a._first_token_steps(
        arrivals, uncached, budget, mistake=name)


def _two_failures(check, answer, label):
    _common.reset_attempts(label)
    with pytest.raises(AssertionError) as first:
        check(answer)
    with pytest.raises(AssertionError) as second:
        check(answer)
    _common.reset_attempts(label)
    return str(first.value), str(second.value)


@pytest.mark.parametrize("wrong", [ignores_arrivals, index_order, skip_ahead])
def test_rejects_mutants(wrong):
    one, two = _two_failures(checks.check_first_token_steps, wrong, "6a.1")
    assert "first_token_steps" in one and "expected" in one and "Hint" not in one
    assert "Hint (failed 2 times)" in two


# The cold run's wrong answers (overtaking, `arrival < step`, `>=` at the budget's boundary,
# shortest prompt first) and two more, each with the words its hint must contain.
@pytest.mark.parametrize("name, words", [
    ("overtake", "keeps its place"), ("late", "at step s itself"),
    ("strict", "exactly use up"), ("shortest", "first come, first served"),
    ("budget", "what is left of the token budget"), ("one", "more than one request"),
    ("early", "before the step it arrives"), ("no_first", "always goes"),
])
def test_a_repeated_failure_gets_the_hint_for_the_rule_it_broke(name, words):
    one, two = _two_failures(checks.check_first_token_steps, mistake(name), "6a.1")
    assert "Hint" not in one and "expected" in one, one
    assert words in two.split("Hint (failed 2 times):")[1], two


def test_crashes_and_bad_forms_name_the_input():
    with pytest.raises(AssertionError, match="raised ZeroDivisionError"):
        checks.check_first_token_steps(lambda a, u, b: [1 / 0])
    with pytest.raises(AssertionError, match="a list of 3 ints"):
        checks.check_first_token_steps(lambda a, u, b: "0 0 0")
    _common.reset_attempts("6a.1")


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
    assert _common.failures("6a.1 prediction") == 0


@pytest.mark.parametrize("wrong, words", [
    ([0, 0, 1, 2], "what is left of the token budget"),   # the cold run's: ignores the budget
    ([0, 1, 2, 3], "more than one request"),              # one request a step
    ([1, 2, 2, 3], "at step s itself"),                   # admitted a step after arriving
    ([0, 1, 2, 2], "admit from its head"),                # the cold run's: no rule explains it
    ([0, 1, 1, 3], "admit from its head"),                # the cold run's
    ("0, 1, 1, 2", "template"),
    ({"0": 0}, "template"),                               # the cold run's dict
])
def test_prediction_rejects_wrong_ones_without_giving_the_answer(wrong, words):
    one, two = _two_failures(checks.check_first_token_prediction, wrong, "6a.1 prediction")
    assert "your prediction" in one and "Hint" not in one, one
    assert words in two.split("Hint (failed 2 times):")[1], two
    for message in (one, two):
        rest = message.replace(repr(wrong), "")
        assert "[0, 1, 1, 2]" not in rest and "expected" not in rest, message


def test_the_prediction_form_is_stated_before_any_failure():
    """The exercise says what form ``predicted`` takes, and its cell holds a template."""
    cells = json.loads((ROOT / "exercises" / "06a_online.ipynb").read_text())["cells"]
    text = "".join("".join(c["source"]) for c in cells)
    assert "# predicted = [" in text and "a list of four ints" in text
