"""hitcheck with a second tokenizer, built here: a small byte-level BPE trained with the
``tokenizers`` library, with a chat template in the style of Qwen3's (tools listed in a
system turn, reasoning stripped from assistant turns before the last user turn), saved to a
folder and loaded by path, as a user's own tokenizer would be."""

from __future__ import annotations

import json

import pytest

from minirt.hitcheck import (
    EXTENDS,
    REORDERED,
    TEMPLATE,
    VOLATILE,
    analyze,
    load_requests,
    load_tokenizer,
    main,
    render_all,
)

TEMPLATE_TEXT = (
    "{%- if tools %}<|im_start|>system\nTools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for m in messages %}{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "You are a helpful assistant. The weather is fine today.",
    "What is the capital of France? Paris is the capital of France.",
    "Think step by step before you answer the question.",
    "Tools: get_weather looks up the weather, get_time tells the time.",
    "Current time 2024-05-01 10:00:01, request id 12345.",
] * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE_TEXT
    path = tmp_path_factory.mktemp("bpe")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(str(folder))


def run(tok, *objs, **kw):
    return analyze(load_requests([json.dumps(o) for o in objs]), tok, **kw)


def test_the_built_tokenizer_renders_as_its_own_template_says(tok):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    (r,) = render_all(load_requests([json.dumps({"messages": msgs})]), tok)
    assert len(tok) < 500
    assert r.text == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert list(r.ids) == list(want if isinstance(want, list) else want["input_ids"])


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {}}}


def test_tools_in_another_order(tok):
    ask = [{"role": "user", "content": "What is the weather?"}]
    report = run(tok, {"messages": ask, "tools": [tool("get_weather"), tool("get_time")]},
                 {"messages": ask, "tools": [tool("get_time"), tool("get_weather")]})
    second = report.requests[1]
    assert second.causes == (REORDERED,) and "tools" in second.divergence.detail
    assert 0 < second.shared < second.prompt_tokens


def test_a_template_that_strips_reasoning_from_history(tok):
    """The client sends the reply back whole; the template drops its reasoning block."""
    reply = "<think>\nThink step by step.\n</think>\n\nParis is the capital."
    q = {"role": "user", "content": "What is the capital of France?"}
    report = run(tok, {"messages": [q], "reply": reply, "conversation": "c"},
                 {"messages": [q, {"role": "assistant", "content": reply},
                               {"role": "user", "content": "Thanks"}], "conversation": "c"})
    second = report.requests[1]
    assert second.causes == (TEMPLATE,) and "reasoning" in second.divergence.detail
    assert second.divergence.theirs.startswith("<think>")
    # a reply without reasoning is sent back and continued whole
    plain = "Paris is the capital."
    report = run(tok, {"messages": [q], "reply": plain},
                 {"messages": [q, {"role": "assistant", "content": plain},
                               {"role": "user", "content": "Thanks"}]})
    assert report.requests[1].causes == (EXTENDS,)


def test_the_command_line_takes_the_tokenizer_by_path(folder, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    sys_ = "You are a helpful assistant. Current time 2024-05-01 10:00:0{}."
    log.write_text("\n".join(json.dumps({"messages": [
        {"role": "system", "content": sys_.format(k)},
        {"role": "user", "content": "What is the capital of France?"}]}) for k in (1, 7)))
    assert main([str(log), "--tokenizer", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokenizer"] == str(folder)
    assert data["cause_counts"][VOLATILE] == 1
    assert data["requests"][1]["causes"] == [VOLATILE]


def test_completions_get_the_tokenizers_special_tokens_and_chat_does_not(folder):
    """As vLLM's server by default: a BOS before a completions prompt (this tokenizer adds
    one), none on top of the chat template; a request's add_special_tokens decides."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    text = "What is the capital of France?"
    bare = tok.encode(text, add_special_tokens=False)
    rows = [{"prompt": text}, {"prompt": text, "add_special_tokens": False},
            {"messages": [{"role": "user", "content": text}]},
            {"messages": [{"role": "user", "content": text}], "add_special_tokens": True}]
    got = render_all(load_requests([json.dumps(r) for r in rows]), tok)
    assert list(got[0].ids) == [bos] + bare == tok.encode(text)
    assert list(got[1].ids) == bare
    assert got[2].ids[0] != bos and got[3].ids[0] == bos
