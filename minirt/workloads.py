"""Seeded, realistic token workloads: the request streams the book measures caches on.

Four shapes of traffic, each built as text and tokenized with the model's tokenizer
(through its chat template where a chat fits):

- ``multi_turn_chat``: conversations sharing one long system prompt; every turn
  sends the whole conversation so far, so each request extends an earlier one.
- ``few_shot``: prompts that share a task instruction and its worked examples.
- ``rag``: prompts that quote one or two of a few documents, then ask a question.
- ``no_sharing``: unrelated plain-text prompts, the baseline where caching cannot help.

Every ``Workload`` knows its ``unique_tokens``: the number of distinct prefixes over
all requests (the nodes of a per-token trie), which is the fewest tokens any prefix
cache must compute to serve the whole stream.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Workload",
    "default_tokenizer",
    "few_shot",
    "lookup_steps",
    "multi_turn_chat",
    "no_sharing",
    "prefix_node_counts",
    "rag",
    "standard_workloads",
    "support_chats",
    "unique_prefix_count",
]


# --------------------------------------------------------------------------- the data type


@dataclass(frozen=True)
class Workload:
    """A named stream of requests (token id lists) in arrival order, with their texts."""

    name: str
    requests: list[list[int]]
    texts: list[str] = field(default_factory=list, repr=False)

    @property
    def total_tokens(self) -> int:
        """Tokens a cacheless server prefills: the sum of all request lengths."""
        return sum(len(r) for r in self.requests)

    @property
    def unique_tokens(self) -> int:
        """Distinct prefixes over all requests: the fewest tokens any cache must compute."""
        return unique_prefix_count(self.requests)

    @property
    def best_hit_rate(self) -> float:
        """The hit rate of a cache that never forgets: ``1 - unique_tokens / total_tokens``."""
        total = self.total_tokens
        return 0.0 if total == 0 else 1.0 - self.unique_tokens / total

    def __len__(self) -> int:
        return len(self.requests)

    def summary(self) -> str:
        """One line: name, requests, total and unique tokens, best possible hit rate."""
        return (f"{self.name}: {len(self)} requests, {self.total_tokens} tokens, "
                f"{self.unique_tokens} unique, best hit rate {self.best_hit_rate:.3f}")


# --------------------------------------------------------------------------- trie counts


def _build_trie(requests: Sequence[Sequence[int]]) -> tuple[list[dict[int, int]], list[bool]]:
    """A per-token trie as arrays: ``children[n]`` maps a token to a node; node 0 is the root."""
    children: list[dict[int, int]] = [{}]
    is_end: list[bool] = [False]
    for request in requests:
        node = 0
        for token in request:
            nxt = children[node].get(int(token))
            if nxt is None:
                nxt = len(children)
                children[node][int(token)] = nxt
                children.append({})
                is_end.append(False)
            node = nxt
        is_end[node] = True
    return children, is_end


def unique_prefix_count(requests: Sequence[Sequence[int]]) -> int:
    """Nodes (root excluded) of the per-token trie over ``requests``: the distinct prefixes."""
    children, _ = _build_trie(requests)
    return len(children) - 1


def _boundaries(children: list[dict[int, int]], is_end: list[bool]) -> list[bool]:
    """Trie nodes where a radix-tree node ends: a request ends there, or the path forks or stops."""
    return [n != 0 and (is_end[n] or len(children[n]) != 1) for n in range(len(children))]


def prefix_node_counts(requests: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(trie_nodes, radix_nodes)`` after inserting every request, root excluded.

    A radix tree keeps one node per maximal unbranched run of trie nodes: a run ends
    where a request ends (insert splits there) or where the path forks or stops.
    """
    children, is_end = _build_trie(requests)
    return len(children) - 1, sum(_boundaries(children, is_end))


def lookup_steps(requests: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(trie_hops, radix_hops)``: nodes visited to look up every request in the full tree.

    A trie visits one node per token; a radix tree one node per compressed run. Both
    compare the same number of tokens; the radix tree follows far fewer pointers.
    """
    children, is_end = _build_trie(requests)
    boundary = _boundaries(children, is_end)
    trie_hops = radix_hops = 0
    for request in requests:
        node = 0
        for token in request:
            node = children[node][int(token)]
            trie_hops += 1
            radix_hops += boundary[node]
    return trie_hops, radix_hops


# --------------------------------------------------------------------------- tokenizing


def default_tokenizer():
    """The default model's tokenizer alone (no weights loaded), from the local model cache."""
    from transformers import AutoTokenizer

    from .model import fetch_default_model

    return AutoTokenizer.from_pretrained(fetch_default_model())


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as-is (special tokens written in the text are recognised)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]


def _chat_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text for ``messages``: the chat template if the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(parts) + "\nassistant:"


def _a(noun: str) -> str:
    """``noun`` with its indefinite article."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _workload(name: str, tokenizer: Any, texts: list[str]) -> Workload:
    return Workload(name=name, requests=[_encode(tokenizer, t) for t in texts], texts=texts)


def _check_sizes(**sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


# --------------------------------------------------------------------------- multi-turn chat

_SHOP = ("Northwind Outfitters", "hiking and camping gear")
_POLICY_TOPICS = [
    "returns", "refunds", "delivery times", "damaged parcels", "gift cards", "warranty claims",
    "size exchanges", "order cancellations", "address changes", "payment failures",
    "loyalty points", "price matching", "international shipping", "product availability",
    "bulk orders", "student discounts", "account passwords", "invoices for companies",
    "pre-orders", "recycling old products",
]
_POLICY_ACTIONS = [
    "first ask for the order number and the email address used at checkout",
    "explain the policy in two or three plain sentences before offering options",
    "check whether the order is older than thirty days, because the rules change after that",
    "offer to open a ticket with the warehouse team and give the customer its reference",
    "never promise a date that the tracking page does not show",
    "mention that the customer will receive a confirmation email within an hour",
    "apologise once, briefly, and then focus on what can be done",
    "suggest the self-service page in the account settings if it solves the problem faster",
    "ask one clarifying question when the request is ambiguous instead of guessing",
    "hand the conversation to a human colleague if the customer asks for one",
]
_STYLE_RULES = [
    "Keep answers short: at most five sentences unless the customer asks for detail.",
    "Use a friendly, calm tone and address the customer by name when they give it.",
    "Do not invent product specifications; say that you will check if you are not sure.",
    "Never ask for a full card number, a password or a security code.",
    "Write prices with the currency symbol and two decimals.",
    "If a question is not about the shop, politely steer the conversation back.",
    "Summarise the agreed next steps at the end of a long conversation.",
    "Prefer concrete instructions over general advice.",
]
_PRODUCTS = [
    "two-person tent", "rain jacket", "hiking boot", "sleeping bag", "headlamp",
    "water filter", "camping stove", "backpack", "folding chair", "insulated bottle",
]
_PROBLEMS = [
    "it arrived with a broken zip", "the tracking page has not changed for five days",
    "I was charged twice", "it is one size too small", "the box was empty",
    "the colour is not the one in the photos", "it stopped working after one trip",
    "I received someone else's order",
]
_OPENERS = [
    "Hi, I ordered {a_product} last {day} and {problem}. What can I do?",
    "Hello! My {product} came yesterday, but {problem}.",
    "Good morning. I bought {a_product} from you and {problem}. Can you help me?",
    "Hey there, quick question: I have {a_product} on order and {problem}.",
]
_FOLLOW_UPS = [
    "The order number is {order}. Does that help?",
    "Can I get a refund instead of a replacement?",
    "How long will that take, roughly?",
    "Do I need to print a label, or will you send one?",
    "Is there anything else you need from me?",
    "Could you also check whether the {product} comes in green?",
    "Thanks. And if the new one has the same problem?",
    "My name is {name}, by the way. Can you email me the details?",
]
_REPLIES = [
    "I am sorry to hear that. Could you tell me your order number so I can look it up?",
    "Thanks, I found the order. I can send a replacement {product} today at no cost.",
    "A refund is possible. It usually reaches your account within five working days.",
    "You do not need a printer: the courier will bring the return label with them.",
    "I have opened ticket {ticket} with our warehouse team; they will contact you tomorrow.",
    "That should be all. You will get a confirmation email within the hour.",
    "I checked the stock: the {product} is available in green and in grey.",
    "If it happens again, reply to the confirmation email and we will refund you in full.",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "weekend", "month"]
_NAMES = ["Maya", "Tomas", "Ingrid", "Kofi", "Lena", "Ravi", "Sofia", "Jonah", "Aiko", "Bruno"]


def _system_prompt(tokenizer: Any, rng: random.Random, target_tokens: int) -> str:
    """A support-desk system prompt grown sentence by sentence to about ``target_tokens``."""
    shop, goods = _SHOP
    rules = iter(rng.sample(_STYLE_RULES, k=len(_STYLE_RULES)))
    sentences = [
        f"You are Aster, the customer support assistant of {shop}, an online shop for {goods}.",
        *(next(rules) for _ in range(3)),
    ]
    topics = rng.sample(_POLICY_TOPICS, k=len(_POLICY_TOPICS))
    rounds = 0
    while len(_encode(tokenizer, " ".join(sentences))) < target_tokens:
        topic = topics[rounds % len(topics)]
        lead = "When a customer asks about" if rounds < len(topics) else "Also for"
        sentences.append(f"{lead} {topic}, {rng.choice(_POLICY_ACTIONS)}.")
        rounds += 1
        if rounds % 6 == 0:
            sentences.append(next(rules, "Stay polite even when the customer is upset."))
    return " ".join(sentences)


@dataclass(frozen=True)
class SupportChats:
    """Support-desk conversations: one shared system prompt and, per conversation, a user
    message and a canned assistant reply for every turn."""

    system: str
    users: list[list[str]]
    replies: list[list[str]]


def support_chats(tokenizer: Any, num_conversations: int = 4, turns: int = 3,
                  system_tokens: int = 150, seed: int = 0) -> SupportChats:
    """The conversations behind ``multi_turn_chat`` (and chapter 06's served chats).

    Each conversation is about one product and one problem; its first message opens the
    case, the others follow up. The system prompt is about ``system_tokens`` long.
    """
    _check_sizes(num_conversations=num_conversations, turns=turns, system_tokens=system_tokens)
    rng = random.Random(f"chat-{seed}")
    system = _system_prompt(tokenizer, rng, system_tokens)
    users, replies = [], []
    for _ in range(num_conversations):
        product = rng.choice(_PRODUCTS)
        fill = {"product": product, "a_product": _a(product), "problem": rng.choice(_PROBLEMS),
                "day": rng.choice(_DAYS), "name": rng.choice(_NAMES),
                "order": f"NW-{rng.randrange(10000, 99999)}",
                "ticket": f"T{rng.randrange(1000, 9999)}"}
        said = [rng.choice(_OPENERS)] + rng.sample(_FOLLOW_UPS, k=min(turns - 1, len(_FOLLOW_UPS)))
        while len(said) < turns:
            said.append(rng.choice(_FOLLOW_UPS))
        answered = [_REPLIES[0]] + rng.sample(_REPLIES[1:], k=min(turns, len(_REPLIES)) - 1)
        while len(answered) < turns:
            answered.append(rng.choice(_REPLIES[1:]))
        users.append([m.format(**fill) for m in said])
        replies.append([m.format(**fill) for m in answered])
    return SupportChats(system, users, replies)


def multi_turn_chat(tokenizer: Any, num_conversations: int = 4, turns: int = 3,
                    system_tokens: int = 150, seed: int = 0, interleave: bool = True) -> Workload:
    """Support-desk chats sharing one system prompt; each turn resends the whole conversation.

    Request (c, t) is conversation c up to its t-th user message, through the chat
    template, so it extends request (c, t-1); earlier answers are ``support_chats``'
    canned replies. ``interleave`` sends turn 1 of every conversation, then turn 2 of
    every one, and so on (as concurrent users would).
    """
    chats = support_chats(tokenizer, num_conversations, turns, system_tokens, seed)
    per_conversation: list[list[str]] = []
    for users, replies in zip(chats.users, chats.replies, strict=True):
        messages = [{"role": "system", "content": chats.system}]
        texts = []
        for user, reply in zip(users, replies, strict=True):
            messages.append({"role": "user", "content": user})
            texts.append(_chat_text(tokenizer, messages))
            messages.append({"role": "assistant", "content": reply})
        per_conversation.append(texts)
    if interleave:
        order = [per_conversation[c][t] for t in range(turns) for c in range(num_conversations)]
    else:
        order = [text for conv in per_conversation for text in conv]
    return _workload("multi_turn_chat", tokenizer, order)


# --------------------------------------------------------------------------- few-shot

_REVIEW_SUBJECTS = ["The blender", "This kettle", "The desk lamp", "My new headphones",
                    "The coffee grinder", "This umbrella", "The office chair", "The phone case",
                    "The toaster", "This backpack", "The garden hose", "The yoga mat"]
_REVIEW_GOOD = ["works perfectly and was easy to set up", "feels solid and looks great",
                "exceeded my expectations after a month of daily use",
                "is quiet, fast and worth every penny", "arrived early and does exactly its job"]
_REVIEW_BAD = ["broke after two days", "is much louder than the description suggests",
               "stopped charging within a week", "smells of plastic and feels flimsy",
               "was missing a part and support never replied"]
_HEADLINES = {
    "sports": ["{team} win the cup after a dramatic penalty shoot-out",
               "Veteran striker signs a two-year deal with {team}",
               "{team} coach resigns after a run of six defeats",
               "{team} sell out their stadium for the first time in a decade"],
    "science": ["Astronomers spot water vapour around a distant {body}",
                "New study links sleep quality to {habit} in teenagers",
                "Researchers build a cheaper battery from {material}",
                "Deep-sea survey finds {count} species new to science"],
    "business": ["Shares of {company} jump after strong quarterly results",
                 "{company} plans to open forty new stores next year",
                 "Regulators fine {company} over misleading advertising",
                 "{company} agrees to buy a rival for an undisclosed sum"],
}
_HEADLINE_FILL = {
    "team": ["Riverside United", "the Harbour Hawks", "Glenfield Rovers", "the Capital Lions"],
    "body": ["exoplanet", "comet", "brown dwarf", "moon of Saturn"],
    "habit": ["screen time", "evening exercise", "caffeine", "reading before bed"],
    "material": ["seaweed", "sand", "sodium", "wood pulp"],
    "count": ["twelve", "thirty", "dozens of"],
    "company": ["Brightwell", "Orchid Foods", "Kestrel Motors", "Tallis Bank"],
}


def _review(rng: random.Random) -> tuple[str, str]:
    label = rng.choice(["positive", "negative"])
    pool = _REVIEW_GOOD if label == "positive" else _REVIEW_BAD
    return f"{rng.choice(_REVIEW_SUBJECTS)} {rng.choice(pool)}.", label


def _headline(rng: random.Random) -> tuple[str, str]:
    label = rng.choice(sorted(_HEADLINES))
    text = rng.choice(_HEADLINES[label]).format(
        **{key: rng.choice(values) for key, values in sorted(_HEADLINE_FILL.items())})
    return text + ".", label


_TASKS = [
    ("Classify the sentiment of each product review as positive or negative.",
     "Review", "Sentiment", _review),
    ("Assign each news headline to one topic: sports, science or business.",
     "Headline", "Topic", _headline),
]


def few_shot(tokenizer: Any, num_requests: int = 8, num_examples: int = 4, num_tasks: int = 2,
             seed: int = 0) -> Workload:
    """Classification prompts: each task's instruction and examples are shared, the query is new.

    Requests cycle through ``num_tasks`` tasks (at most 2); every prompt of a task
    carries the same ``num_examples`` worked examples in the same order.
    """
    _check_sizes(num_requests=num_requests, num_examples=num_examples, num_tasks=num_tasks)
    rng = random.Random(f"few-shot-{seed}")
    tasks = _TASKS[: min(num_tasks, len(_TASKS))]
    headers = []
    for instruction, x_name, y_name, draw in tasks:
        shots = [draw(rng) for _ in range(num_examples)]
        body = "\n\n".join(f"{x_name}: {x}\n{y_name}: {y}" for x, y in shots)
        headers.append((f"{instruction}\n\n{body}\n\n", x_name, y_name, draw))
    texts = []
    for i in range(num_requests):
        header, x_name, y_name, draw = headers[i % len(headers)]
        query, _ = draw(rng)
        content = f"{header}{x_name}: {query}\n{y_name}:"
        texts.append(_chat_text(tokenizer, [{"role": "user", "content": content}]))
    return _workload("few_shot", tokenizer, texts)


# --------------------------------------------------------------------------- RAG

_DOC_SUBJECTS = [
    ("the Harlow Bridge", "bridge", "the river Ost"),
    ("Lake Miren", "lake", "the northern highlands"),
    ("the Vey Observatory", "observatory", "the coastal town of Vey"),
    ("the Calder Railway", "railway", "the mining valleys"),
    ("Saint Aurel's Library", "library", "the old quarter of Brenn"),
    ("the Tessaly Vineyards", "vineyard estate", "the southern hills"),
]
_DOC_FACTS = [
    "{Name} is {a_kind} in {place}.",
    "It was completed in {year} after {n} years of work.",
    "The project was led by the engineer {person}, who later wrote a book about it.",
    "Today it receives about {k} thousand visitors every year.",
    "A small museum next to it explains its history with old photographs and models.",
    "In {year2} a storm damaged part of it, and repairs took almost two years.",
    "Local guides offer tours every weekend from April to October.",
    "It appears on the regional coat of arms and on a postage stamp from {year3}.",
    "Scientists from the nearby university use it for long-term measurements.",
    "Entry is free for children under twelve and for residents of the region.",
]
_DOC_QUESTIONS = [
    "When was {name} completed?", "Who led the work on {name}?",
    "How many people visit {name} each year?", "What happened to {name} in {year2}?",
    "Where is {name}?", "Is entry to {name} free for children?",
]
_PEOPLE = ["Ada Lindqvist", "Tomasz Wren", "Helena Okafor", "Marcus Vale", "Ines Duarte"]


def _document(rng: random.Random, subject: tuple[str, str, str], sentences: int) -> dict:
    name, kind, place = subject
    fill = {"Name": name[0].upper() + name[1:], "name": name, "a_kind": _a(kind), "place": place,
            "year": rng.randrange(1820, 1990), "n": rng.randrange(2, 12),
            "person": rng.choice(_PEOPLE), "k": rng.randrange(5, 400),
            "year2": rng.randrange(1990, 2020), "year3": rng.randrange(1950, 2015)}
    facts = [_DOC_FACTS[0]] + rng.sample(_DOC_FACTS[1:], k=min(sentences, len(_DOC_FACTS)) - 1)
    text = " ".join(f.format(**fill) for f in facts)
    return {"title": fill["Name"], "text": text, "fill": fill}


def rag(tokenizer: Any, num_documents: int = 4, num_requests: int = 8, sentences: int = 8,
        max_docs_per_request: int = 2, seed: int = 0) -> Workload:
    """Retrieval-augmented prompts: an instruction, one or two of a few documents, a question.

    Requests share the instruction and, when they retrieve the same first document,
    the whole document; the question at the end is always new.
    """
    _check_sizes(num_documents=num_documents, num_requests=num_requests, sentences=sentences,
                 max_docs_per_request=max_docs_per_request)
    if num_documents > len(_DOC_SUBJECTS):
        raise ValueError(f"num_documents must be at most {len(_DOC_SUBJECTS)}")
    rng = random.Random(f"rag-{seed}")
    docs = [_document(rng, s, sentences) for s in rng.sample(_DOC_SUBJECTS, k=num_documents)]
    system = ("Answer the question using only the documents provided. If the documents do not "
              "contain the answer, say so. Quote the sentence that supports your answer.")
    texts = []
    for _ in range(num_requests):
        k = rng.randint(1, min(max_docs_per_request, num_documents))
        chosen = rng.sample(range(num_documents), k=k)
        quoted = "\n\n".join(f"Document {i + 1}: {docs[d]['title']}\n{docs[d]['text']}"
                             for i, d in enumerate(chosen))
        question = rng.choice(_DOC_QUESTIONS).format(**docs[chosen[0]]["fill"])
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{quoted}\n\nQuestion: {question}"}]
        texts.append(_chat_text(tokenizer, messages))
    return _workload("rag", tokenizer, texts)


# --------------------------------------------------------------------------- no sharing

_UNRELATED = [
    "Write a haiku about autumn rain on a tin roof.",
    "Explain how a refrigerator keeps food cold.",
    "List five household uses for baking soda.",
    "Describe the water cycle to a ten-year-old.",
    "Summarise the plot of a heist film in three sentences.",
    "Translate 'where is the train station' into French and Spanish.",
    "Compose a polite email declining a meeting invitation.",
    "Suggest three names for a small bakery by the harbour.",
    "Compare frogs and toads in a short table.",
    "Outline a four-week plan for learning to juggle.",
    "Draft a packing list for a weekend by the sea.",
    "Give me a recipe for lentil soup that takes under an hour.",
    "Name the planets in order of their distance from the sun.",
    "Tell a short bedtime story about a lighthouse keeper.",
    "Plan a vegetarian dinner party for six people.",
    "Create a riddle whose answer is 'a shadow'.",
    "Why does the sky look blue at noon but red at sunset?",
    "How does compound interest work?",
    "What is the difference between weather and climate?",
    "Which birds can be seen in a city park in winter?",
    "Imagine a city where cars are banned and describe a morning there.",
    "Rewrite this sentence in the passive voice: the cat chased the mouse.",
    "Estimate how many piano tuners work in a city of one million people.",
    "Recommend three board games for a family with young children.",
]


def no_sharing(tokenizer: Any, num_requests: int = 8, seed: int = 0) -> Workload:
    """Unrelated plain-text prompts (no chat template) whose first tokens all differ.

    No two requests share even one token of prefix, so ``unique_tokens == total_tokens``
    and every cache's hit rate is zero: the baseline.
    """
    _check_sizes(num_requests=num_requests)
    rng = random.Random(f"none-{seed}")
    texts: list[str] = []
    firsts: set[int] = set()
    for text in rng.sample(_UNRELATED, k=len(_UNRELATED)):
        if len(texts) == num_requests:
            break
        ids = _encode(tokenizer, text)
        if ids and ids[0] not in firsts:
            firsts.add(ids[0])
            texts.append(text)
    if len(texts) < num_requests:
        raise ValueError(f"no_sharing can build at most {len(texts)} requests with this tokenizer")
    return _workload("no_sharing", tokenizer, texts)


def standard_workloads(tokenizer: Any, seed: int = 0) -> dict[str, Workload]:
    """The four workloads at their default (notebook-sized) sizes, keyed by name."""
    made = [multi_turn_chat(tokenizer, seed=seed), few_shot(tokenizer, seed=seed),
            rag(tokenizer, seed=seed), no_sharing(tokenizer, seed=seed)]
    return {w.name: w for w in made}
