"""A multi-turn chat workload served turn by turn: what the users say (``ChatScript``,
``chat_script``), and ``serve_chat``, which sends turn k+1 of every conversation only once
turn k's answer is known, each prompt the whole conversation so far, as a chat client
resends its history (``ChatRun`` holds the turns' results).
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import Engine
from .request import GenerateResult, Request, RequestResult, Totals, summarize
from .workloads import support_chats

__all__ = ["ChatRun", "ChatScript", "chat_script", "serve_chat"]


@dataclass(frozen=True)
class ChatScript:
    """What the users of a multi-turn chat workload will say: a shared system prompt and,
    per conversation, one user message per turn (the assistant's answers come later,
    from the model)."""

    system: str
    users: list[list[str]]

    @property
    def turns(self) -> int:
        return min(len(u) for u in self.users) if self.users else 0


def chat_script(tokenizer, num_conversations: int = 8, turns: int = 4,
                system_tokens: int = 500, seed: int = 0) -> ChatScript:
    """The users' side of ``workloads.support_chats``: what they say, turn by turn.

    Unlike ``workloads.multi_turn_chat`` (canned replies), the answers are left to the
    model: ``serve_chat`` sends turn k+1 only after turn k's answer is known.
    """
    chats = support_chats(tokenizer, num_conversations, turns, system_tokens, seed)
    return ChatScript(chats.system, chats.users)


@dataclass
class ChatRun:
    """A served chat workload: one ``GenerateResult`` per turn and every conversation's
    final message list (system, then user/assistant pairs)."""

    turns: list[GenerateResult]
    conversations: list[list[dict[str, str]]]

    @property
    def results(self) -> list[RequestResult]:
        """Every request, turn by turn (turn 1 of each conversation first)."""
        return [r for turn in self.turns for r in turn]

    def totals(self) -> Totals:
        """Totals over all turns (the bound over every prompt of the workload)."""
        return summarize(self.results, sum(t.totals.evicted_tokens for t in self.turns),
                         sum(t.totals.wall_time for t in self.turns))


def serve_chat(engine: Engine, script: ChatScript, max_new_tokens: int = 16,
               progress: bool = True) -> ChatRun:
    """Serve ``script`` turn by turn: each turn's prompt is the conversation so far.

    Turn k of every conversation is one ``generate`` call; the answers (text) join the
    histories before turn k+1 is sent, exactly as a chat client resends its history.
    """
    from tqdm.auto import tqdm

    histories = [[{"role": "system", "content": script.system}] for _ in script.users]
    turns = []
    for t in tqdm(range(script.turns), desc="turns", disable=not progress, leave=False):
        for history, users in zip(histories, script.users, strict=True):
            history.append({"role": "user", "content": users[t]})
        reqs = [Request(messages=[dict(m) for m in h], max_new_tokens=max_new_tokens)
                for h in histories]
        result = engine.generate(reqs, progress=False)
        for history, r in zip(histories, result, strict=True):
            history.append({"role": "assistant", "content": r.text})
        turns.append(result)
    return ChatRun(turns, histories)
