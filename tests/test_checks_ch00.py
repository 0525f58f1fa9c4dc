"""Chapter 00 checkers: each accepts a right answer and rejects plausible wrong ones."""

from __future__ import annotations

import pytest

import minirt.checks as checks
from minirt.checks import ch00

# ---------------------------------------------------------------- Exercise 0.1

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def kv_bytes_right(config):
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
            * config["head_dim"] * _BYTES[config["dtype"]])


def kv_bytes_query_heads(config):  # counts query heads: forgets grouped-query attention
    return (2 * config["num_hidden_layers"] * config["num_attention_heads"]
            * config["head_dim"] * _BYTES[config["dtype"]])


def kv_bytes_keys_only(config):  # forgets V
    return kv_bytes_right(config) // 2


def kv_bytes_always_bf16(config):  # ignores the dtype
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2


def kv_bytes_float(config):  # right value, but a float
    return float(kv_bytes_right(config))


def test_kv_bytes_accepts_reference(capsys):
    checks.check_kv_bytes_per_token(kv_bytes_right)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 0.1 passed") and "131072 bytes" in out


@pytest.mark.parametrize("wrong", [kv_bytes_query_heads, kv_bytes_keys_only,
                                   kv_bytes_always_bf16, kv_bytes_float])
def test_kv_bytes_rejects(wrong):
    with pytest.raises(AssertionError, match="kv_bytes_per_token"):
        checks.check_kv_bytes_per_token(wrong)


def test_llama_3_8b_like_is_131072():
    assert ch00._kv_bytes_per_token(ch00.KV_CONFIGS[0][1]) == 131072


# ---------------------------------------------------------------- Exercise 0.2

def fit_right(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return max(budget - prompt_len * per_token, 0) // (own_len * per_token)
    return budget // ((prompt_len + own_len) * per_token)


def fit_forgets_shared_copy(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return budget // (own_len * per_token)
    return fit_right(budget, per_token, prompt_len, own_len, shared)


def fit_rounds_up(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return max(-(-(budget - prompt_len * per_token) // (own_len * per_token)), 0)
    return -(-budget // ((prompt_len + own_len) * per_token))


def fit_negative_when_short(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return (budget - prompt_len * per_token) // (own_len * per_token)
    return fit_right(budget, per_token, prompt_len, own_len, shared)


def fit_ignores_own_tokens(budget, per_token, prompt_len, own_len, shared):
    if shared:
        return fit_right(budget, per_token, prompt_len, own_len, shared)
    return budget // (prompt_len * per_token)


def test_fit_accepts_reference(capsys):
    checks.check_requests_that_fit(fit_right)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 0.2 passed") and "428" in out and "2616" in out


@pytest.mark.parametrize("wrong", [fit_forgets_shared_copy, fit_rounds_up,
                                   fit_negative_when_short, fit_ignores_own_tokens])
def test_fit_rejects(wrong):
    with pytest.raises(AssertionError, match="requests_that_fit"):
        checks.check_requests_that_fit(wrong)


def test_fit_by_hand():
    # 64 GiB / 128 KiB = 524288 tokens: 524288 // 1224 = 428; (524288 - 1024) // 200 = 2616.
    assert ch00._requests_that_fit(64 << 30, 131072, 1024, 200, False) == 428
    assert ch00._requests_that_fit(64 << 30, 131072, 1024, 200, True) == 2616
    assert ch00._requests_that_fit(100, 10, 20, 1, True) == 0


# ---------------------------------------------------------------- Exercise 0.3

def waste_right(requests):
    prefixes = {tuple(r[: i + 1]) for r in requests for i in range(len(r))}
    return sum(map(len, requests)), len(prefixes)


def waste_token_set(requests):  # distinct tokens, ignoring what comes before them
    return sum(map(len, requests)), len({t for r in requests for t in r})


def waste_common_prefix_of_all(requests):  # shares only what every request has in common
    if not requests:
        return 0, 0
    common = 0
    while all(len(r) > common and r[common] == requests[0][common] for r in requests):
        common += 1
    return sum(map(len, requests)), sum(len(r) - common for r in requests) + common


def waste_distinct_requests(requests):  # caches whole requests, not prefixes
    return sum(map(len, requests)), sum(len(r) for r in {tuple(r) for r in requests})


def waste_list(requests):  # right numbers, wrong type
    return list(waste_right(requests))


def test_waste_accepts_reference(capsys):
    checks.check_prefill_waste(waste_right)
    assert capsys.readouterr().out.startswith("Exercise 0.3 passed")


@pytest.mark.parametrize("wrong", [waste_token_set, waste_common_prefix_of_all,
                                   waste_distinct_requests, waste_list])
def test_waste_rejects(wrong):
    with pytest.raises(AssertionError, match="prefill_waste"):
        checks.check_prefill_waste(wrong)


def test_waste_reference_by_hand():
    assert ch00._prefill_waste([[1, 2, 3], [1, 2, 4], [5, 6]]) == (8, 6)
    assert ch00._prefill_waste([[1, 9, 9], [2, 9, 9]]) == (6, 6)


# ---------------------------------------------------------------- Exercise 0.4

def system_right(system_len, turns, user_len):
    return turns * (system_len + user_len), system_len + turns * user_len


def system_ignores_user(system_len, turns, user_len):
    return turns * system_len, system_len


def system_forgets_first_prefill(system_len, turns, user_len):
    return turns * (system_len + user_len), turns * user_len


def system_caches_user_too(system_len, turns, user_len):
    return turns * (system_len + user_len), system_len + user_len


def test_system_accepts_reference(capsys):
    checks.check_system_prompt_prefill(system_right)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 0.4 passed") and "102400" in out and "101376 saved" in out


@pytest.mark.parametrize("wrong", [system_ignores_user, system_forgets_first_prefill,
                                   system_caches_user_too])
def test_system_rejects(wrong):
    with pytest.raises(AssertionError, match="system_prompt_prefill"):
        checks.check_system_prompt_prefill(wrong)


def test_all_checkers_exported():
    assert set(ch00.__all__) <= set(dir(checks))
