"""Pictures of the radix tree: graphviz drawings, a plain-text outline, a nested-key summary.

``draw_tree`` returns a ``graphviz.Digraph`` whose ``.source`` depends only on the
tree (children in key order, nodes named by traversal order, no memory addresses),
so a drawing can be asserted on and compared between runs. Each node shows its
tokens (ids, or decoded text when a tokenizer is given), its pool slots, its
``ref_count`` and its last access tick; protected nodes (ref_count > 0) and
evictable ones (unlocked leaves) are coloured, and a matched path is drawn bold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import graphviz

from .radix import RadixNode

if TYPE_CHECKING:
    from .lifecycle import Lifecycle

__all__ = ["STYLE", "TIER_STYLE", "LifecycleState", "draw_designs", "draw_tier_tree", "draw_tree",
           "draw_window_tree", "node_state", "path_to_root", "pool_map_html", "pool_map_text",
           "tier_tree_text", "tree_dict", "tree_nodes", "tree_text"]

# Colours and shapes, in one place so the legend always matches the drawing.
STYLE: dict[str, dict[str, str]] = {
    "root": {"shape": "circle", "style": "filled", "fillcolor": "#d9d9d9", "fontsize": "10"},
    "internal": {"shape": "box", "style": "rounded,filled", "fillcolor": "#ffffff"},
    "protected": {"shape": "box", "style": "rounded,filled", "fillcolor": "#fdd49e"},
    "evictable": {"shape": "box", "style": "rounded,filled,dashed", "fillcolor": "#c7e9c0"},
    "highlight": {"color": "#d62728", "penwidth": "3"},
}
_LEGEND = [
    ("protected", "protected\n(ref_count > 0)"),
    ("evictable", "evictable\n(unlocked leaf)"),
    ("internal", "unlocked inner node"),
]


def _root_of(tree: Any) -> RadixNode:
    """The root node of a RadixCache (its ``root``) or the node itself."""
    root = getattr(tree, "root", tree)
    if not isinstance(root, RadixNode):
        raise TypeError(f"draw a RadixCache or a RadixNode, got {type(tree).__name__}")
    return root


def _sorted_children(node: RadixNode) -> list[RadixNode]:
    """Children in key order (first token, or first page tuple): a deterministic layout."""
    return [node.children[k] for k in sorted(node.children)]


def tree_nodes(tree: Any) -> Iterator[RadixNode]:
    """Every node, root first, depth first, children in key order."""
    stack = [_root_of(tree)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(_sorted_children(node)))


def path_to_root(node: RadixNode) -> list[RadixNode]:
    """``node`` and its ancestors up to the root, root last."""
    path = []
    current: RadixNode | None = node
    while current is not None:
        path.append(current)
        current = current.parent
    return path


def node_state(node: RadixNode) -> str:
    """'root', 'protected' (ref_count > 0), 'evictable' (unlocked leaf) or 'internal'."""
    if node.is_root():
        return "root"
    if node.ref_count > 0:
        return "protected"
    return "evictable" if node.is_leaf() else "internal"


def tree_dict(tree: Any) -> dict[tuple[int, ...], dict]:
    """The tree's shape as nested dicts keyed by each node's token tuple (root omitted).

    ``{(101, 11): {(12,): {(21, 22): {}, (31, 32): {}}, (99,): {}}}`` is chapter 02's A/B/C tree.
    """
    def build(node: RadixNode) -> dict:
        return {tuple(c.key.tolist()): build(c) for c in _sorted_children(node)}

    return build(_root_of(tree))


def _highlighted(highlight: Any) -> set[int]:
    """Python ids of the nodes to draw bold, from a node, handle, match/insert result or list."""
    if highlight is None:
        return set()
    if isinstance(highlight, RadixNode):
        return {id(n) for n in path_to_root(highlight)}
    if isinstance(highlight, Iterable) and not isinstance(highlight, (str, bytes)):
        nodes = list(highlight)
        if not all(isinstance(n, RadixNode) for n in nodes):
            raise TypeError("highlight list must hold RadixNode objects")
        return {id(n) for n in nodes}
    handle = getattr(highlight, "handle", highlight)
    node = getattr(handle, "node", None)
    if not isinstance(node, RadixNode):
        raise TypeError(
            "highlight must be a RadixNode, a list of them, a handle, or a match/insert result; "
            f"got {type(highlight).__name__}")
    return {id(n) for n in path_to_root(node)}


def _shorten_ids(values: list[int], max_tokens: int, prefix: str = "") -> str:
    shown = ", ".join(f"{prefix}{v}" for v in values[:max_tokens])
    extra = len(values) - max_tokens
    return f"[{shown} … +{extra} tokens]" if extra > 0 else f"[{shown}]"


def _text(tokenizer: Any, ids: list[int], max_tokens: int) -> str:
    """Decoded text of the first ``max_tokens`` ids, whitespace made visible, then a count."""
    text = tokenizer.decode(ids[:max_tokens])
    text = text.replace("\n", "⏎").replace("\t", "⇥")
    extra = len(ids) - max_tokens
    return f"'{text}' … +{extra} tokens" if extra > 0 else f"'{text}'"


def _label_lines(node: RadixNode, tokenizer: Any, max_tokens: int, slot_prefix: str,
                 show_ids: bool, compact: bool = False) -> list[str]:
    if node.is_root():
        return ["root"]
    keys = node.key.tolist()
    tokens = _text(tokenizer, keys, max_tokens) if tokenizer else _shorten_ids(keys, max_tokens)
    if compact:
        return [tokens, f"{node.length} tokens" if node.length != 1 else "1 token"]
    lines = [tokens, "slots " + _shorten_ids(node.value.tolist(), max_tokens, slot_prefix),
             f"ref={node.ref_count}  last={node.last_access}"]
    if show_ids:
        lines.insert(0, f"#{node.id}  len={node.length}")
    return lines


def _escape(line: str) -> str:
    """Escape a label line for DOT: backslashes and quotes are taken literally."""
    return line.replace("\\", "\\\\").replace('"', '\\"')


def draw_tree(tree: Any, tokenizer: Any = None, highlight: Any = None, max_tokens: int = 8, *,
              slot_prefix: str = "p", show_ids: bool = False, legend: bool = True,
              title: str | None = None, rankdir: str = "TB",
              compact: bool = False) -> graphviz.Digraph:
    """A graphviz drawing of a RadixCache (or the subtree under a RadixNode).

    Nodes show their tokens (decoded if ``tokenizer`` is given, at most ``max_tokens``,
    then "… +N tokens"), pool slots, ref_count and last access tick; ``compact`` shows
    only the tokens and the edge's length (the tree's structure). ``highlight``
    (a node, a handle, a MatchResult/InsertResult, or a list of nodes) is drawn bold;
    for a node or handle, the whole path from the root. Deterministic ``.source``.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    bold = _highlighted(highlight)
    graph = graphviz.Digraph("radix_tree")
    graph.attr(rankdir=rankdir, fontname="Helvetica", fontsize="11")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", arrowsize="0.6")
    if title:
        graph.attr(label=_escape(title), labelloc="t")
    names: dict[int, str] = {}
    for i, node in enumerate(tree_nodes(tree)):
        name = names[id(node)] = f"n{i}"
        attrs = dict(STYLE[node_state(node)])
        if id(node) in bold:
            attrs.update(STYLE["highlight"])
        lines = _label_lines(node, tokenizer, max_tokens, slot_prefix, show_ids, compact)
        graph.node(name, "\\n".join(_escape(ln) for ln in lines), **attrs)
        parent = node.parent
        if parent is not None and id(parent) in names:
            edge = dict(STYLE["highlight"]) if id(node) in bold and id(parent) in bold else {}
            graph.edge(names[id(parent)], name, **edge)
    if legend:
        with graph.subgraph(name="cluster_legend") as box:
            box.attr(label="legend", fontsize="10", style="dashed", color="#999999")
            previous = None
            for state, text in _LEGEND + [("highlight", "matched path")]:
                attrs = dict(STYLE["internal"] if state == "highlight" else STYLE[state])
                if state == "highlight":
                    attrs.update(STYLE["highlight"])
                box.node(f"legend_{state}", _escape(text).replace("\n", "\\n"), **attrs)
                if previous:
                    box.edge(previous, f"legend_{state}", style="invis")
                previous = f"legend_{state}"
    return graph


def tree_text(tree: Any, tokenizer: Any = None, max_tokens: int = 8, *,
              slot_prefix: str = "p") -> str:
    """A plain-text outline of the tree, one node a line (for stored, comparable outputs).

    Each line: tokens, slots, ref_count and a state tag: [P] protected, [E] evictable.
    """
    tags = {"protected": " [P]", "evictable": " [E]", "internal": "", "root": ""}
    lines: list[str] = []

    def walk(node: RadixNode, depth: int) -> None:
        if node.is_root():
            lines.append("root")
        else:
            keys = node.key.tolist()
            tokens = (_text(tokenizer, keys, max_tokens) if tokenizer
                      else _shorten_ids(keys, max_tokens))
            slots = _shorten_ids(node.value.tolist(), max_tokens, slot_prefix)
            lines.append(f"{'    ' * depth}{tokens} -> {slots} ref={node.ref_count}"
                         f"{tags[node_state(node)]}")
        for child in _sorted_children(node):
            walk(child, depth + 1)

    walk(_root_of(tree), 0)
    return "\n".join(lines)


def draw_designs(designs: Mapping[str, Sequence[tuple[str, str | None, Sequence[str]]]], *,
                 title: str | None = None) -> graphviz.Digraph:
    """Small trees side by side, one boxed cluster per design: two ways to store the same data.

    ``designs`` maps a design's title to its nodes, each ``(name, parent name or None,
    label lines)``, parents before children; names need be unique only within a design.
    A node without a parent is drawn as a root (a grey circle). Deterministic ``.source``.
    """
    graph = graphviz.Digraph("designs")
    graph.attr(fontname="Helvetica", fontsize="11")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", arrowsize="0.6")
    if title:
        graph.attr(label=_escape(title), labelloc="t")
    for i, (design, nodes) in enumerate(designs.items()):
        with graph.subgraph(name=f"cluster_{i}") as box:
            box.attr(label=_escape(design), style="rounded", color="#999999")
            seen: set[str] = set()
            for name, parent, lines in nodes:
                if name in seen:
                    raise ValueError(f"design {design!r}: node {name!r} appears twice")
                if parent is not None and parent not in seen:
                    raise ValueError(f"design {design!r}: parent {parent!r} of {name!r} "
                                     "must come before it")
                seen.add(name)
                attrs = STYLE["root"] if parent is None else STYLE["internal"]
                box.node(f"d{i}_{name}", "\\n".join(_escape(ln) for ln in lines), **attrs)
                if parent is not None:
                    box.edge(f"d{i}_{parent}", f"d{i}_{name}")
    return graph


# ---------------------------------------------------------------- two tiers (chapter 09)

# Where a run of tokens keeps its K/V: the device pool, the host tier, or both.
TIER_STYLE: dict[str, dict[str, str]] = {
    "root": STYLE["root"],
    "device": {"shape": "box", "style": "rounded,filled", "fillcolor": "#9ecae1"},
    "host": {"shape": "box", "style": "rounded,filled,dashed", "fillcolor": "#fdd0a2"},
    "both": {"shape": "box", "style": "rounded,filled", "fillcolor": "#c2a5cf"},
}


def _tier_root(tiers: Any) -> Any:
    """The merged tree of a ``tiers.HiRadixCache`` (its ``residency()``) or a ``TierNode``."""
    root = tiers.residency() if hasattr(tiers, "residency") else tiers
    if not (hasattr(root, "tier") and hasattr(root, "children") and hasattr(root, "tokens")):
        raise TypeError(f"draw a HiRadixCache or a TierNode, got {type(tiers).__name__}")
    return root


def tier_tree_text(tiers: Any, tokenizer: Any = None, max_tokens: int = 8) -> str:
    """A plain-text outline of both tiers merged, one run a line, tagged [device], [host]
    or [both] (a ``HiRadixCache`` or its ``residency()``)."""
    lines = []
    for depth, node in _tier_root(tiers).walk():
        if node.tier == "root":
            lines.append("root")
            continue
        ids = list(node.tokens)
        tokens = _text(tokenizer, ids, max_tokens) if tokenizer else _shorten_ids(ids, max_tokens)
        lines.append(f"{'    ' * depth}{tokens} [{node.tier}]")
    return "\n".join(lines)


def draw_tier_tree(tiers: Any, tokenizer: Any = None, max_tokens: int = 8, *,
                   legend: bool = True, title: str | None = None,
                   rankdir: str = "TB") -> graphviz.Digraph:
    """A graphviz drawing of both tiers merged: each run of tokens coloured by where its K/V
    lives (device, host, both). Deterministic ``.source``."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    graph = graphviz.Digraph("tiers")
    graph.attr(rankdir=rankdir, fontname="Helvetica", fontsize="11")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", arrowsize="0.6")
    if title:
        graph.attr(label=_escape(title), labelloc="t")
    counter = 0

    def add(node: Any, parent: str | None) -> None:
        nonlocal counter
        name = f"n{counter}"
        counter += 1
        if node.tier == "root":
            label = "root"
        else:
            ids = list(node.tokens)
            text = _text(tokenizer, ids, max_tokens) if tokenizer else _shorten_ids(ids, max_tokens)
            label = f"{_escape(text)}\\n{node.tier}, {len(ids)} tokens"
        graph.node(name, label, **TIER_STYLE[node.tier])
        if parent is not None:
            graph.edge(parent, name)
        for child in node.children:
            add(child, name)

    add(_tier_root(tiers), None)
    if legend:
        with graph.subgraph(name="cluster_legend") as box:
            box.attr(label="legend", fontsize="10", style="dashed", color="#999999")
            previous = None
            for tier, text in (("device", "device only"), ("both", "device and host"),
                               ("host", "host only (load back)")):
                box.node(f"legend_{tier}", text, **TIER_STYLE[tier])
                if previous:
                    box.edge(previous, f"legend_{tier}", style="invis")
                previous = f"legend_{tier}"
    return graph


# ---------------------------------------------------------------- lifecycle frames


def pool_map_text(labels: Sequence[str]) -> str:
    """One character per slot: ``.`` free, ``c`` cached, ``P`` protected, request ids' last char."""
    glyph = {"free": ".", "cached": "c", "protected": "P"}
    return "".join(glyph.get(x, x[-1]) for x in labels)


@dataclass(frozen=True)
class LifecycleState:
    """One frame of the walk-through: what each step left behind (plain data, no live objects)."""

    step: str
    note: str
    page_tables: dict[str, list[int]]
    free: list[int]
    ref_counts: dict[str, int]
    counters: dict[str, int]
    pool: list[str]
    tree_source: str
    tree_text: str

    @classmethod
    def capture(cls, lc: Lifecycle, step: str, note: str = "", tokenizer=None) -> LifecycleState:
        """Snapshot ``lc`` now (the tree drawn with minirt.viz, slots prefixed 'p').

        The drawing highlights the matched path of every waiting request that holds a
        live match, so a frame taken right after ``match`` shows what was found.
        """
        from .lifecycle import matched_paths, pool_map  # the frame reads chapter 04's state

        refs = {" ".join(map(str, n.key.tolist())): n.ref_count for n in lc.cache.nodes()}
        tables = {r.rid: r.page_table.tolist() for r in lc.requests.values()
                  if r.state in ("locked", "running")}
        return cls(step, note, tables, lc.pool.free_slots().tolist(), dict(sorted(refs.items())),
                   lc.counters(), pool_map(lc),
                   draw_tree(lc.cache, tokenizer, highlight=matched_paths(lc) or None,
                             title=step).source,
                   tree_text(lc.cache, tokenizer))

    def counters_text(self) -> str:
        """Counters, free list and page tables, one per line."""
        c = self.counters
        lines = [f"free {c['free']}  evictable {c['evictable']}  protected {c['protected']}  "
                 f"private {c['private']}  (capacity {c['capacity']})",
                 f"free list {self.free}"]
        lines += [f"page table {rid}: {slots}" for rid, slots in self.page_tables.items()]
        return "\n".join(lines)

    def text(self) -> str:
        """The whole frame as plain text: step, pool map, counters, page tables, tree."""
        return "\n".join([f"[{self.step}] {self.note}".rstrip(),
                          f"pool |{pool_map_text(self.pool)}|  (. free, c cached, P protected, "
                          "else the owning request's last character)",
                          self.counters_text(), self.tree_text])


_POOL_COLOURS = {"free": "#ffffff", "cached": "#c7e9c0", "protected": "#fdd49e"}


def pool_map_html(labels: Sequence[str]) -> str:
    """The pool as a row of coloured cells (free white, cached green, protected orange)."""
    cells = []
    for i, x in enumerate(labels):
        colour = _POOL_COLOURS.get(x, "#9ecae1")
        cells.append(f"<td style='background:{colour};border:1px solid #888;padding:2px 4px;"
                     f"font-family:monospace;font-size:11px' title='{x}'>p{i}<br>"
                     f"{x if x not in _POOL_COLOURS else x[0]}</td>")
    return "<table style='border-collapse:collapse'><tr>" + "".join(cells) + "</tr></table>"


WINDOW_STYLE: dict[str, dict[str, str]] = {
    "live": {"shape": "box", "style": "rounded,filled", "fillcolor": "#c6dbef"},
    "tombstone": {"shape": "box", "style": "rounded,filled,dashed", "fillcolor": "#f0f0f0",
                  "fontcolor": "#555555"},
    "locked": {"color": "#e6550d", "penwidth": "2"},
}


def draw_window_tree(cache: Any, tokenizer: Any = None, max_tokens: int = 6) -> graphviz.Digraph:
    """A ``hybrid.WindowRadixCache`` drawn: live nodes (full and window K/V) blue,
    tombstones (full K/V only) grey and dashed, locked nodes outlined. Children in key
    order, nodes named by traversal order: a deterministic ``.source``."""
    graph = graphviz.Digraph("window_tree")
    graph.attr(fontname="Helvetica", fontsize="11")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", arrowsize="0.6")
    graph.node("n0", "root", **STYLE["root"])
    stack, count = [(cache.root, "n0")], 1
    while stack:
        node, name = stack.pop()
        below = []
        for key in sorted(node.children):
            child = node.children[key]
            cname, count = f"n{count}", count + 1
            kind = "tombstone" if child.window_value is None else "live"
            tokens = (_text(tokenizer, child.key, max_tokens) if tokenizer
                      else _shorten_ids(child.key, max_tokens))
            window = ("window: tombstone" if child.window_value is None
                      else "window " + _shorten_ids(child.window_value, max_tokens, "w"))
            lines = [tokens, "full " + _shorten_ids(child.value, max_tokens, "f"), window,
                     f"ref={child.ref_count}"]
            attrs = dict(WINDOW_STYLE[kind])
            if child.ref_count:
                attrs.update(WINDOW_STYLE["locked"])
            graph.node(cname, "\\n".join(_escape(ln) for ln in lines), **attrs)
            graph.edge(name, cname)
            below.append((child, cname))
        stack.extend(reversed(below))
    return graph
