"""Chapter 12 checkers accept the reference solutions and reject plausible wrong ones."""

from __future__ import annotations

import pytest
from brute_force import lcp
from exercise_util import rejects

from minirt.checks import ch12
from minirt.checks._common import reset_attempts


@pytest.fixture(scope="module")
def tokenizer():
    return ch12._tokenizer()


def _ids(tokenizer, messages, generation_prompt=True):
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- references
# (the same code as solutions/12_hit_rate.ipynb)


def part_at(tokenizer, a, b):
    return lcp(_ids(tokenizer, a), _ids(tokenizer, b))


def stable_messages(stamp, question):
    return [{"role": "system", "content": ch12.FIX_SYSTEM},
            {"role": "user", "content": f"{question}\n(Current time: {stamp}.)"}]


def block_loss(requests, block_size):
    out = []
    for i, ids in enumerate(requests):
        hit = max((lcp(ids, requests[j]) for j in range(i)), default=0)
        out.append(hit % block_size)
    return out


def retokenized_at(tokenizer, question, reply_ids):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    asked = [{"role": "user", "content": question}]
    body = [t for t in reply_ids if t != end]
    cached = _ids(tokenizer, asked) + body + [end]
    following = _ids(tokenizer, asked + [{"role": "assistant", "content": tokenizer.decode(body)},
                                         {"role": "user", "content": "Thanks."}])
    n = lcp(cached, following)
    return None if n == len(cached) else n


# --------------------------------------------------------------------------- 12.1


def test_part_at_accepts_the_reference(capsys):
    reset_attempts("12.1")
    ch12.check_part_at(part_at)
    assert "Exercise 12.1 passed" in capsys.readouterr().out


def part_at_characters(tokenizer, a, b):  # characters of the rendered text, not tokens
    ta = tokenizer.apply_chat_template(a, tokenize=False, add_generation_prompt=True)
    tb = tokenizer.apply_chat_template(b, tokenize=False, add_generation_prompt=True)
    return lcp(ta, tb)


def part_at_no_template(tokenizer, a, b):  # the messages' contents alone
    def ids(messages):
        return [t for m in messages
                for t in tokenizer(m["content"], add_special_tokens=False)["input_ids"]]
    return lcp(ids(a), ids(b))


def part_at_no_generation_prompt(tokenizer, a, b):  # forgets the assistant prompt
    return lcp(_ids(tokenizer, a, False), _ids(tokenizer, b, False))


@pytest.mark.parametrize("wrong", [part_at_characters, part_at_no_template,
                                   part_at_no_generation_prompt])
def test_part_at_rejects(wrong):
    rejects(ch12.check_part_at, wrong, "12.1")


# --------------------------------------------------------------------------- 12.2


def test_stable_messages_accepts_the_reference(capsys):
    reset_attempts("12.2")
    ch12.check_stable_messages(stable_messages)
    assert "Exercise 12.2 passed" in capsys.readouterr().out


def stable_drops_the_stamp(stamp, question):  # shares, but the model loses the time
    return [{"role": "system", "content": ch12.FIX_SYSTEM}, {"role": "user", "content": question}]


def stable_stamp_last_in_system(stamp, question):  # the system message still differs
    return [{"role": "system", "content": f"{ch12.FIX_SYSTEM}\nCurrent time: {stamp}."},
            {"role": "user", "content": question}]


@pytest.mark.parametrize("wrong", [ch12.volatile_messages, stable_drops_the_stamp,
                                   stable_stamp_last_in_system])
def test_stable_messages_rejects(wrong):
    rejects(ch12.check_stable_messages, wrong, "12.2")


def test_stable_messages_rejects_a_string():
    rejects(ch12.check_stable_messages, lambda stamp, question: f"{stamp} {question}", "12.2",
            contains="expected a list")


# --------------------------------------------------------------------------- 12.3


def test_block_loss_accepts_the_reference(capsys):
    reset_attempts("12.3")
    ch12.check_block_loss(block_loss)
    assert "Exercise 12.3 passed" in capsys.readouterr().out


def block_loss_previous_only(requests, block_size):  # compares with the one before only
    return [0] + [lcp(requests[i], requests[i - 1]) % block_size
                  for i in range(1, len(requests))]


def block_loss_uncached(requests, block_size):  # counts every token whole blocks miss
    out = []
    for i, ids in enumerate(requests):
        hit = max((lcp(ids, requests[j]) for j in range(i)), default=0)
        out.append(len(ids) - hit // block_size * block_size)
    return out


def block_loss_rounds_up(requests, block_size):  # partial blocks counted as whole
    out = []
    for i, ids in enumerate(requests):
        hit = max((lcp(ids, requests[j]) for j in range(i)), default=0)
        out.append(-hit % block_size)
    return out


@pytest.mark.parametrize("wrong", [block_loss_previous_only, block_loss_uncached,
                                   block_loss_rounds_up])
def test_block_loss_rejects(wrong):
    rejects(ch12.check_block_loss, wrong, "12.3")


def test_block_loss_rejects_a_total():
    rejects(ch12.check_block_loss, lambda r, b: sum(block_loss(r, b)), "12.3",
            contains="expected a list")


# --------------------------------------------------------------------------- 12.4


def test_retokenized_at_accepts_the_reference(capsys):
    reset_attempts("12.4")
    ch12.check_retokenized_at(retokenized_at)
    assert "Exercise 12.4 passed" in capsys.readouterr().out


def retok_round_trip_alone(tokenizer, question, reply_ids):  # outside the template
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = [t for t in reply_ids if t != end]
    again = tokenizer(tokenizer.decode(body), add_special_tokens=False)["input_ids"]
    n = lcp(body, again)
    start = len(_ids(tokenizer, [{"role": "user", "content": question}]))
    return None if n == len(body) and len(again) == len(body) else start + n


def retok_compares_text(tokenizer, question, reply_ids):  # the text always survives
    return None


def retok_counts_in_the_reply(tokenizer, question, reply_ids):  # a position in the reply only
    found = retokenized_at(tokenizer, question, reply_ids)
    start = len(_ids(tokenizer, [{"role": "user", "content": question}]))
    return None if found is None else found - start


@pytest.mark.parametrize("wrong", [retok_round_trip_alone, retok_compares_text,
                                   retok_counts_in_the_reply])
def test_retokenized_at_rejects(wrong):
    rejects(ch12.check_retokenized_at, wrong, "12.4")


def test_the_italian_reply_is_split_at_its_third_token(tokenizer):
    question, reply = ch12._retok_cases(tokenizer)[0]
    start = len(_ids(tokenizer, [{"role": "user", "content": question}]))
    assert ch12._retokenized_at(tokenizer, question, reply) == start + 2
