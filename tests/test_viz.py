"""Drawings of the radix tree: deterministic source, highlight, styling, elision."""

from __future__ import annotations

import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from minirt.radix import RadixNode, page_key, token_key
from minirt.viz import (
    STYLE,
    draw_designs,
    draw_tree,
    node_state,
    path_to_root,
    tree_dict,
    tree_nodes,
    tree_text,
)


def attach(parent: RadixNode, key, value, tick: int = 0) -> RadixNode:
    node = RadixNode(parent.key_fn, torch.tensor(key), torch.tensor(value), tick)
    node.parent = parent
    parent.children[parent.key_fn(node.key)] = node
    return node


def abc_tree():
    """The seed's A/B/C tree built by hand: returns the root and the three leaves."""
    root = RadixNode(token_key)
    a = attach(root, [101, 11, 12, 21, 22], [0, 1, 2, 3, 4], tick=1)
    mid = a.split_at(3)
    b = attach(mid, [31, 32], [5, 6], tick=2)
    top = mid.split_at(2)
    c = attach(top, [99], [7], tick=3)
    return root, a, b, c


def node_lines(source: str) -> dict[str, str]:
    """name -> attribute text for every node statement of a DOT source."""
    return dict(re.findall(r"^\s*(n\d+) \[(.*)\]$", source, re.M))


def test_tree_dict_is_the_abc_figure():
    root, *_ = abc_tree()
    assert tree_dict(root) == {(101, 11): {(12,): {(21, 22): {}, (31, 32): {}}, (99,): {}}}


def test_source_is_deterministic_and_address_free():
    first = draw_tree(abc_tree()[0]).source
    # A second tree built in another insertion order of the children dicts draws the same.
    root = RadixNode(token_key)
    top = attach(root, [101, 11], [0, 1], tick=1)
    attach(top, [99], [7], tick=3)
    mid = attach(top, [12], [2], tick=1)
    attach(mid, [31, 32], [5, 6], tick=2)
    attach(mid, [21, 22], [3, 4], tick=1)
    assert draw_tree(root).source == first
    assert "0x" not in first
    names = list(node_lines(first))
    assert names == [f"n{i}" for i in range(6)]
    # Children in key order: [12] before [99], [21, 22] before [31, 32].
    labels = [node_lines(first)[n] for n in names]
    assert [lbl.split("\\n")[0].split('"')[1] for lbl in labels[1:]] == [
        "[101, 11]", "[12]", "[21, 22]", "[31, 32]", "[99]"]


def test_labels_show_slots_ref_count_and_last_access():
    root, a, b, c = abc_tree()
    b.ref_count = 2
    src = draw_tree(root).source
    assert '"[31, 32]\\nslots [p5, p6]\\nref=2  last=2"' in src
    assert '"[99]\\nslots [p7]\\nref=0  last=3"' in src
    assert "slots [5, 6]" in draw_tree(root, slot_prefix="").source


def test_states_are_styled_and_legend_present():
    root, a, b, c = abc_tree()
    for node in path_to_root(b)[:-1]:
        node.ref_count = 1  # what lock() does: the whole path to the root
    assert [node_state(n) for n in tree_nodes(root)] == [
        "root", "protected", "protected", "evictable", "protected", "evictable"]
    lines = node_lines(draw_tree(root).source)
    fill = {n: re.search(r'fillcolor="([^"]+)"', attrs).group(1) for n, attrs in lines.items()}
    assert fill["n4"] == STYLE["protected"]["fillcolor"]  # [31, 32], locked
    assert fill["n3"] == fill["n5"] == STYLE["evictable"]["fillcolor"]  # unlocked leaves
    assert "dashed" in lines["n3"] and "dashed" not in lines["n4"]
    src = draw_tree(root).source
    assert "cluster_legend" in src and "protected\\n(ref_count > 0)" in src
    assert "cluster_legend" not in draw_tree(root, legend=False).source
    # An unlocked node with children is neither: the plain inner style.
    b.ref_count = 0
    for node in path_to_root(b)[1:-1]:
        node.ref_count = 0
    assert node_state(b.parent) == "internal"


def bold(source: str) -> set[str]:
    return {n for n, attrs in node_lines(source).items() if "penwidth=3" in attrs}


def bold_edges(source: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s*(n\d+) -> (n\d+) \[[^\]]*penwidth=3", source, re.M))


def test_highlight_a_node_draws_its_path_from_the_root():
    root, a, b, c = abc_tree()
    src = draw_tree(root, highlight=c).source
    assert bold(src) == {"n0", "n1", "n5"}  # root, [101, 11], [99]
    assert bold_edges(src) == {("n0", "n1"), ("n1", "n5")}
    assert bold(draw_tree(root).source) == set()


def test_highlight_accepts_handles_results_and_lists():
    root, a, b, c = abc_tree()
    handle = SimpleNamespace(node=b, cached_len=5)
    result = SimpleNamespace(handle=handle, indices=torch.arange(5), cached_len=5)
    expected = {"n0", "n1", "n2", "n4"}
    assert bold(draw_tree(root, highlight=handle).source) == expected
    assert bold(draw_tree(root, highlight=result).source) == expected
    assert bold(draw_tree(root, highlight=[a, c]).source) == {"n3", "n5"}
    with pytest.raises(TypeError, match="highlight"):
        draw_tree(root, highlight=42)
    with pytest.raises(TypeError, match="RadixNode"):
        draw_tree(root, highlight=[1, 2])


def test_long_keys_are_elided_with_a_count():
    root = RadixNode(token_key)
    attach(root, list(range(100, 145)), list(range(45)))
    src = draw_tree(root, max_tokens=8).source
    assert "[100, 101, 102, 103, 104, 105, 106, 107 … +37 tokens]" in src
    assert "slots [p0, p1, p2, p3, p4, p5, p6, p7 … +37 tokens]" in src
    assert "+40 tokens" in draw_tree(root, max_tokens=5).source
    assert "tokens]" not in draw_tree(root, max_tokens=45).source
    with pytest.raises(ValueError, match="max_tokens"):
        draw_tree(root, max_tokens=0)


class FakeTokenizer:
    """Decodes id i to the character chr(i) (with a quote, a backslash and a newline)."""

    def decode(self, ids):
        return "".join({1: '"', 2: "\\", 3: "\n"}.get(i, chr(i)) for i in ids)


def test_decoded_labels_escape_quotes_backslashes_and_newlines():
    root = RadixNode(token_key)
    attach(root, [ord("h"), ord("i"), 1, 2, 3, ord("x")], list(range(6)))
    src = draw_tree(root, tokenizer=FakeTokenizer(), max_tokens=5).source
    assert "'hi\\\"\\\\⏎' … +1 tokens" in src
    if shutil.which("dot"):  # dot parses it and shows the text literally
        svg = draw_tree(root, tokenizer=FakeTokenizer(), max_tokens=5).pipe(format="svg")
        assert "&#39;hi&quot;\\⏎&#39; … +1 tokens" in svg.decode()


def test_page_keyed_tree_and_cache_like_objects():
    root = RadixNode(page_key(2))
    attach(root, [5, 6, 7, 8], [0, 1, 2, 3])
    attach(root, [1, 2], [4, 5])
    cache = SimpleNamespace(root=root)
    assert tree_dict(cache) == {(1, 2): {}, (5, 6, 7, 8): {}}
    assert draw_tree(cache).source == draw_tree(root).source
    with pytest.raises(TypeError, match="RadixCache or a RadixNode"):
        draw_tree("not a tree")


def test_tree_text_outline():
    root, a, b, c = abc_tree()
    b.ref_count = 1
    assert tree_text(root) == "\n".join([
        "root",
        "    [101, 11] -> [p0, p1] ref=0",
        "        [12] -> [p2] ref=0",
        "            [21, 22] -> [p3, p4] ref=0 [E]",
        "            [31, 32] -> [p5, p6] ref=1 [P]",
        "        [99] -> [p7] ref=0 [E]",
    ])


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz dot not installed")
def test_renders_with_dot():
    svg = draw_tree(abc_tree()[0], highlight=abc_tree()[3]).pipe(format="svg")
    assert svg.startswith(b"<?xml") or b"<svg" in svg[:400]


def test_draw_designs_side_by_side():
    designs = {
        "page-aligned": [("root", None, ["root"]), ("a", "root", ["[1, 2]", "pages 0"])],
        "offset": [("root", None, ["root"]), ("a", "root", ["[1, 2]"]),
                   ("b", "a", ["[3]", "offset 1"])],
    }
    g = draw_designs(designs, title="two designs")
    src = g.source
    assert src == draw_designs(designs, title="two designs").source  # deterministic
    assert src.count("subgraph cluster_") == 2
    assert "d0_root -> d0_a" in src and "d1_a -> d1_b" in src and "d0_a -> d0_b" not in src
    assert '"[1, 2]\\npages 0"' in src and "offset 1" in src
    with pytest.raises(ValueError, match="must come before"):
        draw_designs({"bad": [("b", "a", ["x"]), ("a", None, ["root"])]})
    with pytest.raises(ValueError, match="appears twice"):
        draw_designs({"bad": [("a", None, ["root"]), ("a", None, ["root"])]})
