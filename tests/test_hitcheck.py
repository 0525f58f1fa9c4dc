"""minirt.hitcheck: every cause planted once and found, the bounds against brute force,
the command line's output forms and its errors. The book's tokenizer (SmolLM2's) unless a
test builds its own."""

from __future__ import annotations

import json
import random

import pytest
from brute_force import lcp

from minirt.hitcheck import (
    BLOCK,
    CAPACITY,
    CAUSES,
    COLD,
    CONTENT,
    EXTENDS,
    HIT,
    ISOLATION,
    REORDERED,
    RETOKENIZATION,
    TEMPLATE,
    VOLATILE,
    HitcheckInputError,
    analyze,
    load_requests,
    load_tokenizer,
    main,
    render,
    render_all,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def lines(*objs) -> list[str]:
    return [json.dumps(o) for o in objs]


def chat(*turns, **extra) -> dict:
    """turns: (role, content) pairs."""
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def run(tok, *objs, **kw):
    return analyze(load_requests(lines(*objs)), tok, **kw)


def causes(report) -> list[tuple[str, ...]]:
    return [r.causes for r in report.requests]


# ------------------------------------------------------------------ rendering


def test_rendering_matches_the_tokenizers_own_chat_template(tok):
    """The memoized piecewise tokenization gives the ids apply_chat_template gives."""
    objs = [chat(("system", "Be brief."), ("user", "Hi there, how are you?")),
            chat(("user", "Tell me a joke.")),
            chat(("user", "Tell me a joke."), ("assistant", "No."), ("user", "  Please!! "))]
    requests = load_requests(lines(*objs))
    for request, r in zip(requests, render_all(requests, tok), strict=True):
        want = tok.apply_chat_template(request.messages, tokenize=True,
                                       add_generation_prompt=True)
        want = want if isinstance(want, list) else want["input_ids"]
        assert list(r.ids) == list(want)
        assert r.text == tok.apply_chat_template(request.messages, tokenize=False,
                                                 add_generation_prompt=True)
    one = render(requests[0], tok)
    assert list(one.ids) == list(render_all(requests, tok)[0].ids) and not one.reply_ids


def test_a_text_reply_is_cached_as_its_ids_and_the_end_of_sequence_token(tok):
    (r,) = render_all(load_requests(lines(chat(("user", "x"), reply="Hello"))), tok)
    assert list(r.reply_ids) == tok.encode("Hello", add_special_tokens=False) + [
        tok.eos_token_id]
    assert list(r.cached) == list(r.ids) + list(r.reply_ids)


def test_a_text_reply_gets_the_ids_its_text_gets_in_the_history(tok):
    """Not the text's ids on their own: ' 42' after the turn's header, as the next turn
    renders it, so a text reply alone never shows re-tokenization."""
    reply = " Forty-two,  said the   computer."
    first, second = render_all(load_requests(lines(
        chat(("user", "x"), reply=reply),
        chat(("user", "x"), ("assistant", reply), ("user", "y")))), tok)
    n = len(first.cached)
    assert list(second.ids[:n]) == list(first.cached)
    assert tok.decode(list(first.reply_ids)) == reply + tok.eos_token


# ------------------------------------------------------------------ the bounds


def test_bounds_agree_with_brute_force_on_random_id_prompts(tok):
    """bound = longest common prefix with any earlier prompt; paged = the bound short of
    the prompt's last token (a server computes it, for its logits), rounded down to pages;
    the replay at a capacity holding everything hits the paged bound exactly."""
    rng = random.Random(5)
    stems = [[rng.randrange(50, 500) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    prompts = [rng.choice(stems)[: rng.randrange(1, 30)] + [rng.randrange(50, 500)
                                                           for _ in range(rng.randrange(0, 9))]
               for _ in range(60)]
    report = run(tok, *({"prompt": p} for p in prompts), page_size=4, capacity=10**6)

    for i, (p, r) in enumerate(zip(prompts, report.requests, strict=True)):
        best = max((lcp(p, q) for q in prompts[:i]), default=0)
        served = min(best, len(p) - 1) // 4 * 4
        assert (r.shared, r.bound, r.paged, r.hit) == (best, best, served, served)
    assert report.bound_tokens == sum(r.bound for r in report.requests)
    assert report.prompt_tokens == sum(map(len, prompts))
    assert report.unique_tokens == report.prompt_tokens - report.bound_tokens
    assert set(report.cause_counts) == set(CAUSES)


def test_the_bound_under_isolation_keys_agrees_with_brute_force(tok):
    """bound = longest common prefix with an earlier prompt or reply of the same key (salt,
    model), read off one tree; shared ignores the keys; capacity replay at page 1 with room
    for everything hits the bound."""
    rng = random.Random(11)
    stems = [[rng.randrange(50, 90) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    objs = []
    for _ in range(120):
        obj = {"prompt": rng.choice(stems)[: rng.randrange(1, 12)]
               + [rng.randrange(50, 60) for _ in range(rng.randrange(0, 6))]}
        if rng.random() < 0.5:
            obj["reply"] = [rng.randrange(50, 60) for _ in range(rng.randrange(0, 4))]
        salt = rng.choice([None, "a", "b"])
        if salt:
            obj["cache_salt"] = salt
        if rng.random() < 0.2:
            obj["model"] = "m2"
        objs.append(obj)
    report = run(tok, *objs, capacity=10**6)

    def key(o):
        return o.get("cache_salt"), o.get("model")

    for i, (o, r) in enumerate(zip(objs, report.requests, strict=True)):
        earlier = [(p["prompt"] + p.get("reply", []), key(p)) for p in objs[:i]]
        assert r.shared == max((lcp(o["prompt"], c) for c, _ in earlier), default=0)
        want = max((lcp(o["prompt"], c) for c, k in earlier if k == key(o)), default=0)
        assert (r.bound, r.hit) == (want, min(want, len(o["prompt"]) - 1)), i
        assert (ISOLATION in r.causes) == (r.shared > r.bound)


def test_the_partner_is_the_earlier_request_sharing_most_and_its_own_conversation_first(tok):
    report = run(tok,
                 {"prompt": [5, 6, 7, 8], "conversation": "a"},
                 {"prompt": [5, 6, 7, 9], "conversation": "b"},
                 {"prompt": [5, 6, 7, 10], "conversation": "a"},
                 {"prompt": [5, 6, 7, 11]})
    d = [r.divergence for r in report.requests]
    assert d[0].partner is None and d[0].cause == COLD
    assert (d[1].partner, d[1].position) == (0, 3)
    assert d[2].partner == 0  # ties with both: its own conversation's request
    assert d[3].partner == 2  # no conversation: the latest
    assert d[1].partner_line == 1


# ------------------------------------------------------------------ one planted example per cause


def test_volatile_timestamp_in_the_system_prompt(tok):
    report = run(tok,
                 chat(("system", "You are helpful. Time: 2024-05-01 10:00:01."), ("user", "Hi")),
                 chat(("system", "You are helpful. Time: 2024-05-01 10:00:07."), ("user", "Hi")))
    second = report.requests[1]
    assert second.causes == (VOLATILE,)
    assert "10:00:07" in second.divergence.detail and "10:00:01" in second.divergence.detail
    assert second.shared < second.prompt_tokens


def test_volatile_request_id_and_date_are_found_too(tok):
    report = run(tok,
                 chat(("system", "Request id: 3f2a9c1e-7b4d-4e8a-9f1c-2d3e4f5a6b7c. Be kind."),
                      ("user", "Hi")),
                 chat(("system", "Request id: 9b8c7d6e-1a2b-4c3d-8e9f-0a1b2c3d4e5f. Be kind."),
                      ("user", "Hi")),
                 chat(("system", "Today is Monday, 6 May 2024."), ("user", "Hi")),
                 chat(("system", "Today is Tuesday, 7 May 2024."), ("user", "Hi")))
    assert report.requests[1].causes == (VOLATILE,)
    assert report.requests[3].causes == (VOLATILE,)


def test_reordered_documents(tok):
    docs = ["The moon is made of rock.", "Paris is in France.", "Water boils at 100 C."]
    report = run(tok, chat(("user", "\n\n".join(docs) + "\n\nQuestion: where is Paris?")),
                 chat(("user", "\n\n".join(docs[::-1]) + "\n\nQuestion: where is Paris?")))
    assert report.requests[1].causes == (REORDERED,)


def test_other_content_is_not_a_fault(tok):
    report = run(tok, chat(("user", "What is the capital of France?")),
                 chat(("user", "How tall is Everest?")))
    assert report.requests[1].causes == (CONTENT,)
    assert report.cause_counts[CONTENT] == 1


def test_a_conversation_that_resends_the_reply_continues_it(tok):
    reply = "Why did the chicken cross the road? To get to the other side!"
    report = run(tok, chat(("user", "Tell me a joke."), reply=reply, conversation=1),
                 chat(("user", "Tell me a joke."), ("assistant", reply), ("user", "Another"),
                      conversation=1),
                 chat(("user", "Tell me a joke.")))
    assert report.requests[1].causes == (EXTENDS,)
    assert report.requests[1].shared == len(render_all(load_requests(lines(
        chat(("user", "Tell me a joke."), reply=reply))), tok)[0].cached)
    assert report.requests[2].causes == (HIT,)


def test_template_drops_reasoning_from_history(tok):
    """The reply carried a reasoning block; the client sends back only the answer, so the
    cached reasoning tokens are never matched again."""
    report = run(tok,
                 chat(("user", "2+2?"), reply={"text": "4", "reasoning": "Two and two: four."}),
                 chat(("user", "2+2?"), ("assistant", "4"), ("user", "3+3?")))
    second = report.requests[1]
    assert second.causes == (TEMPLATE,)
    assert "reasoning" in second.divergence.detail
    assert "<think>" in second.divergence.theirs


def test_template_end_of_turn_marker(tok):
    """The model stopped on <|endoftext|>; the template closes the turn with <|im_end|>."""
    answer = tok.encode("Four.", add_special_tokens=False)
    report = run(tok,
                 chat(("user", "2+2?"), reply=answer + [tok.convert_tokens_to_ids(
                     "<|endoftext|>")]),
                 chat(("user", "2+2?"), ("assistant", "Four."), ("user", "3+3?")))
    second = report.requests[1]
    assert second.causes == (TEMPLATE,)
    assert "end-of-turn" in second.divergence.detail


def test_retokenization_of_the_reply(tok):
    """The model generated 'Hel' + 'lo'; the same text sent back tokenizes as 'Hello'."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    generated = enc("Hel") + enc("lo") + [tok.eos_token_id]
    assert enc("Hel") + enc("lo") != enc("Hello")
    report = run(tok, chat(("user", "Greet me"), reply=generated),
                 chat(("user", "Greet me"), ("assistant", "Hello"), ("user", "Again")))
    second = report.requests[1]
    assert second.causes == (RETOKENIZATION,)
    assert second.divergence.ours.startswith("Hello")
    assert second.divergence.theirs.startswith("Hello")


def test_block_granularity_and_prompts_shorter_than_a_block(tok):
    """A repeated prompt of 20 ids can hit 19 (the last is computed): 16 at page 16, 3 lost
    below the boundary; a repeated 3-id prompt can hit 2, none at page 16."""
    report = run(tok, {"prompt": list(range(100, 120))}, {"prompt": list(range(100, 120))},
                 {"prompt": [7, 8, 9]}, {"prompt": [7, 8, 9]}, page_size=16)
    long_, short = report.requests[1], report.requests[3]
    assert long_.causes == (HIT, BLOCK) and long_.lost == {BLOCK: 3}
    assert (long_.shared, long_.bound, long_.paged) == (20, 20, 16)
    assert short.causes == (HIT, BLOCK) and short.paged == 0 and short.lost == {BLOCK: 2}
    assert report.cause_tokens[BLOCK] == 5


@pytest.mark.parametrize("field, a, b", [("cache_salt", "alice", "bob"),
                                         ("extra_key", "k1", "k2"),
                                         ("lora_path", "adapter-a", "adapter-b"),
                                         ("model", "base", "my-lora")])
def test_isolation_keys(tok, field, a, b):
    report = run(tok, {"prompt": "hello world, a long shared prompt", field: a},
                 {"prompt": "hello world, a long shared prompt", field: b},
                 {"prompt": "hello world, a long shared prompt", field: b})
    second, third = report.requests[1], report.requests[2]
    assert second.causes == (HIT, ISOLATION)
    assert second.bound == 0 and second.lost[ISOLATION] == second.prompt_tokens
    assert "isolation key differs" in second.divergence.detail
    assert third.causes == (HIT,) and third.bound == third.prompt_tokens
    assert third.paged == third.prompt_tokens - 1  # the last token is computed, no loss


def test_capacity_evicts_before_reuse(tok):
    """Ten long distinct prompts through a cache that holds two: the first comes back
    evicted; with room for all it hits."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(50)] for _ in range(10)]
    objs = [{"prompt": p} for p in prompts] + [{"prompt": prompts[0]}]
    small = run(tok, *objs, capacity=100)
    assert small.requests[-1].causes == (HIT, CAPACITY)
    assert small.requests[-1].hit == 0 and small.requests[-1].lost == {CAPACITY: 49}
    big = run(tok, *objs, capacity=10_000)
    assert big.requests[-1].causes == (HIT,) and big.requests[-1].hit == 49  # all but the last
    assert big.hit_rate > small.hit_rate == 0


@pytest.mark.parametrize("policy, config, kept", [
    ("lru", None, False), ("fifo", None, False), ("lfu", None, True), ("slru", None, True),
    ("slru", {"protected_threshold": 3}, False),
    ("tlru", {"threshold": 40, "next_prompt_estimate": 10}, False)])
def test_the_capacity_replay_evicts_by_each_of_sglangs_policies(tok, policy, config, kept):
    """A prompt used twice, then two others through a cache that holds two: LRU and FIFO
    evict the reused prompt before it comes back; LFU and SLRU (its reuse protected it)
    keep it; an SLRU that protects only from a third use does not."""
    rng = random.Random(0)
    p = [[rng.randrange(100, 40000) for _ in range(50)] for _ in range(3)]
    objs = [{"prompt": q} for q in (p[0], p[0], p[1], p[2], p[0])]
    report = run(tok, *objs, capacity=120, policy=policy, policy_config=config)
    assert [r.hit for r in report.requests] == [0, 49, 0, 0, 49 if kept else 0]
    assert report.policy == policy


def test_a_policy_without_its_settings_is_refused_before_anything_is_read(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert main([str(log), "--capacity", "64", "--policy", "tlru"]) == 2
    assert "--policy-config" in capsys.readouterr().err
    assert main([str(log), "--capacity", "64", "--policy", "slru",
                 "--policy-config", '{"threshold": 4}']) == 2
    assert "unknown setting 'threshold'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(log), "--policy", "tlru", "--policy-config", "[1]"])
    assert "a JSON object of settings" in capsys.readouterr().err
    with pytest.raises(HitcheckInputError, match="unknown policy"):
        analyze(load_requests(lines({"prompt": "hi"})), None, policy="mru")
    assert main([str(log), "--capacity", "64", "--policy", "tlru", "--policy-config",
                 '{"threshold": 40, "next_prompt_estimate": 10}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "tlru"


# ------------------------------------------------------------------ bad input


def test_a_line_that_is_not_json(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(chat(("user", "hi"))) + "\n\n{not json\n")
    with pytest.raises(HitcheckInputError, match=r"line 3: not JSON") as err:
        load_requests(path)
    assert err.value.line == 3


def test_an_unknown_role_names_its_line_and_field():
    with pytest.raises(HitcheckInputError, match=r"line 2, field 'messages\[1\].role': "
                                                  r"unknown role 'robot'"):
        load_requests(lines(chat(("user", "hi")), chat(("user", "hi"), ("robot", "beep"))))


@pytest.mark.parametrize("obj, field", [
    ({"messages": []}, "messages"), ({"prompt": ""}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
    ({"hello": 1}, None), ({"messages": [{"role": "user", "content": 5}]},
                           "messages[0].content"),
    ({"prompt": "x", "reply": 3}, "reply"), ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
    ({"prompt": "x", "conversation": [1]}, "conversation"),
    ({"prompt": "x", "reply": {"token_ids": [1.5]}}, "reply.token_ids"),
])
def test_bad_fields_are_named(obj, field):
    with pytest.raises(HitcheckInputError) as err:
        load_requests(lines(obj))
    assert (err.value.line, err.value.field) == (1, field)


def test_a_tokenizer_that_cannot_be_loaded(tmp_path):
    with pytest.raises(HitcheckInputError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_the_command_line_exits_non_zero_with_a_clear_message(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(chat(("user", "hi"))) + "\n[1, 2]\n")
    assert main([str(log)]) == 2
    assert "line 2: must be a JSON object" in capsys.readouterr().err
    log.write_text(json.dumps(chat(("user", "hi"))) + "\n")
    assert main([str(log), "--tokenizer", str(tmp_path / "nothing")]) == 2
    assert "cannot load tokenizer" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main([str(log), "--page-size", "0"]) == 2
    assert "page size" in capsys.readouterr().err


# ------------------------------------------------------------------ output forms


def test_table_json_and_plot(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines(
        chat(("system", "Time: 2024-05-01 10:00:01."), ("user", "Hi")),
        chat(("system", "Time: 2024-05-01 10:00:07."), ("user", "Hi")),
        {"prompt": "hello there", "cache_salt": "a"}, {"prompt": "hello there"})) + "\n")
    assert main([str(log), "--page-size", "4", "--capacity", "64"]) == 0
    table = capsys.readouterr().out
    assert "unique-token bound" in table and " volatile " in table
    assert "'10:00:07' here, '10:00:01' in line 1" in table
    assert main([str(log), "--json", "--page-size", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cause_counts"][VOLATILE] == 1 and data["cause_counts"][ISOLATION] == 1
    assert len(data["requests"]) == 4 and data["requests"][1]["divergence"]["partner"] == 0
    assert data["bound_rate"] == data["bound_tokens"] / data["prompt_tokens"]
    plot = tmp_path / "curve.png"
    assert main([str(log), "--plot", str(plot), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    rates = [rate for _, rate in data["curve"]]
    assert rates == sorted(rates) and rates[-1] <= data["bound_rate"] + 1e-12


def test_rendering_in_a_second_process_gives_the_same_report(tok):
    import importlib

    render_module = importlib.import_module("minirt.hitcheck.render")
    objs = [chat(("system", f"Time: 2024-05-01 10:00:0{k % 3}."), ("user", f"Question {k % 4}"),
                 conversation=k % 5, reply=f"Answer {k}") for k in range(40)]
    requests = load_requests(lines(*objs))
    owners = {render_module._owner(r, render_module.PROCESSES) for r in requests}
    assert owners == set(range(render_module.PROCESSES))  # every process has work
    here = analyze(requests, tok, page_size=4, capacity=300, parallel=False, batch=7)
    forked = analyze(requests, tok, page_size=4, capacity=300, parallel=True, batch=7)
    assert forked.to_json() == here.to_json()
    assert here.cause_counts[VOLATILE] > 0 and here.cause_counts[HIT] > 0


def test_an_error_in_the_rendering_process_names_the_line(tok):
    tok2 = tok.__class__.from_pretrained(tok.name_or_path)
    tok2.chat_template = "{{ raise_exception('no system role here') if messages[0].role == " \
                         "'system' else messages[0].content }}"
    requests = load_requests(lines(chat(("user", "hi")), chat(("system", "x"), ("user", "y"))))
    with pytest.raises(HitcheckInputError, match=r"line 2, field 'messages': the chat template "
                                                  r"cannot render this request.*no system"):
        analyze(requests, tok2, parallel=True)


def test_a_small_memo_forgets_old_pieces_and_still_gives_every_prompt(tok, monkeypatch):
    import importlib

    render_module = importlib.import_module("minirt.hitcheck.render")
    objs = [chat(("system", f"System {k % 5}"), ("user", f"Question {k}")) for k in range(30)]
    requests = load_requests(lines(*objs))
    want = [list(r.ids) for r in render_all(requests, tok)]
    monkeypatch.setattr(render_module, "MEMO_PIECES", 4)
    assert [list(r.ids) for r in render_all(requests, tok, batch=3)] == want
