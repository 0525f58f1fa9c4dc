"""Interactive explorers for the notebooks; their logic is plain Python that tests call.

``Explorer`` keeps a ``RadixCache`` and plays a tiny server: ``match(text)`` looks a prompt
up (and may split a node), ``insert(text)`` caches it the way a request would (match,
fresh slots for the uncached part only, insert), and ``render()`` draws the tree with the
last match or insert highlighted. ``explorer_widget`` wraps it in ipywidgets.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any

import graphviz

from .cache import InsertResult, MatchResult, RadixCache, insert_fresh
from .errors import InvalidIdsError, RequestError
from .viz import LifecycleState, draw_tree, pool_map_html

__all__ = ["DEFAULT_PROMPTS", "Explorer", "explorer_widget", "lifecycle_stepper", "step_index"]

DEFAULT_PROMPTS = [
    "The cat sat on the mat.",
    "The cat sat on the sofa.",
    "The cat chased a mouse.",
    "The dog sat on the mat.",
    "A bird sang in the old oak tree.",
]


def _slot_range(slots: list[int]) -> str:
    if not slots:
        return "none"
    if slots == list(range(slots[0], slots[-1] + 1)) and len(slots) > 2:
        return f"p{slots[0]}..p{slots[-1]}"
    return ", ".join(f"p{s}" for s in slots)


class Explorer:
    """Match and insert prompts in a RadixCache, and say what happened in words.

    ``tokenizer``: a Hugging Face tokenizer; without one, a prompt is a list of integers
    written as text ("101 11 12" or "101, 11, 12"). ``chat=True`` wraps each prompt in the
    tokenizer's chat template as one user message. Fresh pool slots are numbered 0, 1, ...
    """

    def __init__(self, tokenizer: Any = None, page_size: int = 1,
                 prompts: list[str] | None = None, chat: bool = False, max_tokens: int = 6) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_tokens = max_tokens
        self.prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
        self.cache = RadixCache(page_size=page_size)
        self.reset()

    def reset(self) -> None:
        """Empty the cache and forget the last action."""
        self.cache.reset()
        self.next_slot = 0
        self.highlight: Any = None
        self.message = "empty cache"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: through the tokenizer, or parsed as integers without one."""
        if self.tokenizer is None:
            parts = [p for p in re.split(r"[\s,\[\]]+", text.strip()) if p]
            if not parts or not all(p.isdigit() for p in parts):
                raise InvalidIdsError(f"without a tokenizer, type token ids like '101 11 12', "
                                      f"got {text!r}")
            return [int(p) for p in parts]
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if not ids:
            raise InvalidIdsError("the prompt is empty")
        return ids

    def match(self, text: str) -> MatchResult:
        """Look ``text`` up: the longest cached prefix (whole pages), highlighted in ``render``.

        Like ``RadixCache.match_prefix`` it may split the node where the match stops.
        """
        ids = self.encode(text)
        before = self.cache.num_nodes
        result = self.cache.match_prefix(ids)
        split = self.cache.num_nodes - before
        self.highlight = result.handle.node if result.cached_len else None
        self.message = (f"match: {result.cached_len} of {len(ids)} tokens cached "
                        f"(slots {_slot_range(result.indices.tolist())})"
                        + (f"; split {split} node to end the match exactly" if split else ""))
        return result

    def insert(self, text: str) -> InsertResult:
        """Cache ``text`` as a request would: match, fresh slots for the rest, insert.

        Only whole pages are cached; tokens past the last whole page are reported, not kept.
        """
        ids = self.encode(text)
        page = self.cache.page_size
        aligned = len(ids) - len(ids) % page
        first = self.next_slot
        result, self.next_slot = insert_fresh(self.cache, ids, first)
        fresh = list(range(first, self.next_slot))
        tail = len(ids) - aligned
        self.highlight = result.handle.node if aligned else None
        self.message = (f"insert: {len(ids)} tokens, {result.cached_len} already cached, "
                        f"{len(fresh)} new in slots {_slot_range(fresh)}"
                        + (f"; {tail} token{'s' * (tail > 1)} past the last whole page not "
                           "cached" if tail else ""))
        return result

    def render(self, **kwargs: Any) -> graphviz.Digraph:
        """The tree, with the last match or insert path highlighted."""
        options = {"tokenizer": self.tokenizer, "highlight": self.highlight,
                   "max_tokens": self.max_tokens, "legend": False}
        options.update(kwargs)
        return draw_tree(self.cache, **options)

    def status(self) -> str:
        """Nodes, cached tokens and the hit rate of every lookup so far."""
        stats = self.cache.stats
        return (f"{self.cache.num_nodes} nodes, {self.cache.total_size} cached tokens, "
                f"hit rate {stats.hit_rate:.2f} over {stats.queries} lookups")


def explorer_widget(explorer: Explorer | None = None, **kwargs: Any):
    """An ipywidgets box: pick or type a prompt, press Match or Insert, watch the tree.

    ``kwargs`` build a new ``Explorer`` when none is given. The box's ``explorer``
    attribute is the Explorer it drives.
    """
    import ipywidgets as w

    ex = explorer if explorer is not None else Explorer(**kwargs)
    prompt = w.Combobox(options=ex.prompts, value=ex.prompts[0] if ex.prompts else "",
                        placeholder="pick or type a prompt", ensure_option=False,
                        layout=w.Layout(width="60%"))
    buttons = {name: w.Button(description=name) for name in ("Match", "Insert", "Reset")}
    message = w.HTML()
    picture = w.HTML()

    def refresh() -> None:
        message.value = (f"<code>{html.escape(ex.message)}</code><br>"
                         f"<small>{html.escape(ex.status())}</small>")
        picture.value = ex.render().pipe(format="svg").decode()

    def run(action) -> None:
        try:
            action()
        except (InvalidIdsError, ValueError) as exc:
            ex.message = f"error: {exc}"
        refresh()

    buttons["Match"].on_click(lambda _: run(lambda: ex.match(prompt.value)))
    buttons["Insert"].on_click(lambda _: run(lambda: ex.insert(prompt.value)))
    buttons["Reset"].on_click(lambda _: run(ex.reset))
    refresh()
    box = w.VBox([w.HBox([prompt, *buttons.values()]), message, picture])
    box.explorer = ex
    box.controls = {"prompt": prompt, **buttons, "message": message, "picture": picture}
    return box


def step_index(current: int, delta: int, count: int) -> int:
    """The frame after pressing Next (+1) or Back (-1): clamped to ``0 .. count-1``."""
    return max(0, min(count - 1, current + delta))


def lifecycle_stepper(states: Sequence[LifecycleState]):
    """An ipywidgets Next/Back stepper over recorded frames: tree, pool map and counters."""
    import graphviz
    import ipywidgets as widgets

    if not states:
        raise RequestError("lifecycle_stepper needs at least one recorded state")
    pos = {"i": 0}
    title, tree, pool, text = (widgets.HTML(), widgets.HTML(), widgets.HTML(),
                               widgets.HTML())
    back, nxt = widgets.Button(description="Back"), widgets.Button(description="Next")

    def show() -> None:
        s = states[pos["i"]]
        title.value = f"<b>{pos['i'] + 1}/{len(states)}: {s.step}</b> {s.note}"
        tree.value = graphviz.Source(s.tree_source).pipe(format="svg").decode()
        pool.value = pool_map_html(s.pool)
        text.value = f"<pre>{html.escape(s.counters_text())}</pre>"
        back.disabled, nxt.disabled = pos["i"] == 0, pos["i"] == len(states) - 1

    def move(delta: int) -> None:
        pos["i"] = step_index(pos["i"], delta, len(states))
        show()

    back.on_click(lambda _: move(-1))
    nxt.on_click(lambda _: move(+1))
    show()
    return widgets.VBox([widgets.HBox([back, nxt, title]), pool, text, tree])
