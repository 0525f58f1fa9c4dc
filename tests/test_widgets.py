"""The tree explorer: its logic (match, insert, render) and the ipywidgets wrapper."""

from __future__ import annotations

import pytest

from minirt.errors import InvalidIdsError
from minirt.viz import tree_dict
from minirt.widgets import Explorer, explorer_widget
from minirt.workloads import default_tokenizer

A, B, C = "101 11 12 21 22", "101 11 12 31 32", "101, 11, 99"


def test_abc_through_the_explorer():
    ex = Explorer()
    results = [ex.insert(t) for t in (A, B, C)]
    assert [r.cached_len for r in results] == [0, 3, 2]
    assert tree_dict(ex.cache) == {(101, 11): {(12,): {(21, 22): {}, (31, 32): {}}, (99,): {}}}
    assert ex.next_slot == 8  # fresh slots only for uncached tokens
    assert results[1].indices.tolist() == [0, 1, 2, 5, 6]
    assert ex.message == "insert: 3 tokens, 2 already cached, 1 new in slots p7"
    ex.cache.check_integrity()


def test_match_highlights_and_reports_a_split():
    ex = Explorer()
    ex.insert(A)
    result = ex.match("101 11 12 9")
    assert result.cached_len == 3 and result.indices.tolist() == [0, 1, 2]
    assert "split 1 node" in ex.message and "3 of 4 tokens cached" in ex.message
    assert ex.highlight is result.handle.node
    src = ex.render().source
    bold = [line for line in src.splitlines() if "penwidth=3" in line and "label=" in line]
    assert len(bold) == 2 and "[101, 11, 12]" in bold[1]  # root and the matched node
    # A miss highlights nothing and splits nothing.
    nodes = ex.cache.num_nodes
    assert ex.match("7 7").cached_len == 0 and ex.highlight is None
    assert ex.cache.num_nodes == nodes and "split" not in ex.message


def test_pages_cache_whole_pages_only():
    ex = Explorer(page_size=4)
    first = ex.insert(" ".join(map(str, range(1, 11))))  # 10 tokens -> 8 cached
    assert first.handle.cached_len == 8 and ex.cache.total_size == 8
    assert ex.message.endswith("2 tokens past the last whole page not cached")
    # Shares 6 tokens with the first: 4 reused (one page), then a new branch.
    second = ex.insert("1 2 3 4 5 6 9 9 9")
    assert second.cached_len == 4 and ex.cache.total_size == 12
    assert tree_dict(ex.cache) == {(1, 2, 3, 4): {(5, 6, 7, 8): {}, (5, 6, 9, 9): {}}}
    assert ex.message.endswith("1 token past the last whole page not cached")


def test_bad_input_and_reset():
    ex = Explorer()
    with pytest.raises(InvalidIdsError, match="token ids"):
        ex.insert("hello")
    assert ex.cache.num_nodes == 0 and ex.next_slot == 0
    ex.insert(A)
    ex.reset()
    assert ex.cache.num_nodes == 0 and ex.next_slot == 0 and ex.highlight is None
    assert ex.status() == "0 nodes, 0 cached tokens, hit rate 0.00 over 0 lookups"


def test_real_tokenizer_and_chat_template():
    tok = default_tokenizer()
    ex = Explorer(tokenizer=tok)
    ex.insert("The cat sat on the mat.")
    r = ex.match("The cat sat on the sofa.")
    assert r.cached_len == len(tok("The cat sat on the", add_special_tokens=False)["input_ids"])
    assert "'The cat sat on the'" in ex.render().source  # decoded labels
    chat = Explorer(tokenizer=tok, chat=True)
    chat.insert("Hello!")
    assert chat.match("Goodbye!").cached_len > 10  # the template's system prompt is shared


def test_widget_buttons_drive_the_explorer():
    pytest.importorskip("ipywidgets")
    box = explorer_widget()
    ex, c = box.explorer, box.controls
    c["prompt"].value = "101 11 12"
    c["Insert"].click()
    assert ex.cache.total_size == 3 and "<svg" in c["picture"].value
    assert "insert: 3 tokens" in c["message"].value
    c["prompt"].value = "101 11 7"
    c["Match"].click()
    assert "match: 2 of 3" in c["message"].value
    c["prompt"].value = "not <ids>"
    c["Insert"].click()
    assert "error:" in c["message"].value and "&lt;ids&gt;" in c["message"].value
    c["Reset"].click()
    assert ex.cache.num_nodes == 0 and "empty cache" in c["message"].value
