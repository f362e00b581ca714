"""Why a session's prompt stopped matching its cached prefix: the token offset and the likely cause.

An agent resends its whole conversation every turn, so each prompt should start with the previous one (and the
previous reply, as the next turn renders it). When it does not, most of the prompt is recomputed; the usual causes
are volatile text in the system prompt, tools sent in a new order, history rewritten by the client (compaction,
dropped reasoning) or a template that renders earlier turns differently as the conversation grows. The daemon
keeps each session's last turn here, compares the next one with it, logs what it finds and records it in
``<cache>/divergences.jsonl`` (``promptcache/divergences.py``), which ``localai cache diverged`` and ``/api/cache``
show.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localai.promptcache import divergences
from localai.promptcache.divergences import Divergence
from localai.runtime.prompt import tool_json
from localai.schema import Message, ReasoningBlock, TextBlock, Tool, ToolCallBlock, ToolResultBlock
from localai.text import common_prefix_length

log = logging.getLogger("localai.cache")
MAX_SESSIONS = 64  # sessions whose last turns are remembered (least recently seen forgotten first)
TURNS_PER_SESSION = 3
HEADER_SLACK = 32  # a rendered reply ends with the next message's header, which depends on what comes next


@dataclass
class Turn:
    """What a session's last request looked like, in the pieces a divergence is explained by."""

    system: str
    tools: list[str]  # canonical JSON, in the order sent
    messages: list[str]  # a digest of each message after the leading system ones
    bare: list[str]  # the same digests without reasoning
    roles: list[str]
    reasoning: list[str]  # each message's reasoning text ("" for none)
    prompt: str
    expected: str = ""  # the prompt and its reply as the next turn renders them, once the reply is known
    reply_reasoning: str = ""  # the reply's reasoning, once known
    tokens: int = 0  # the prompt's length in tokens
    fitted: tuple[int, int, int] = (0, 0, 0)  # messages dropped, characters cut, tool slimming level by fitting


def turn_of(messages: list[Message], tools: list[Tool], prompt: str, *,
            fitted: tuple[int, int, int] = (0, 0, 0)) -> Turn:
    index = 0
    leading = []
    while index < len(messages) and messages[index].role in ("system", "developer"):
        leading.append(messages[index].text())
        index += 1
    rest = messages[index:]
    return Turn(
        system="\n\n".join(leading), tools=[json.dumps(tool_json(t), sort_keys=True) for t in tools],
        messages=[_digest(m, reasoning=True) for m in rest], bare=[_digest(m, reasoning=False) for m in rest],
        roles=[m.role for m in rest],
        reasoning=["".join(b.text for b in m.content if isinstance(b, ReasoningBlock)) for m in rest],
        prompt=prompt, fitted=fitted,
    )


def _digest(message: Message, *, reasoning: bool) -> str:
    parts: list[Any] = [message.role, message.name]
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append(["t", block.text])
        elif isinstance(block, ReasoningBlock) and reasoning:
            parts.append(["r", block.text])
        elif isinstance(block, ToolCallBlock):
            parts.append(["c", block.name, json.dumps(block.arguments, sort_keys=True)])
        elif isinstance(block, ToolResultBlock):
            parts.append(["o", block.content])
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=12).hexdigest()


def explain(previous: Turn, current: Turn, offset: int) -> tuple[str, str]:
    """The likely cause of prompts parting at character ``offset``, and a detail."""
    if offset >= len(previous.prompt):  # the prompt was kept; the reply came back different
        last = len(previous.messages)
        if last < len(current.roles) and current.roles[last] == "assistant":
            said = current.reasoning[last]
            if previous.reply_reasoning and not said:
                return "reasoning dropped by the client", "the reply was resent without its reasoning"
            if said and said not in current.prompt:
                return "reasoning dropped by the template", "the template leaves out earlier turns' reasoning"
        return "reply resent changed", "the client sent the last reply back different from what was generated"
    if current.fitted != previous.fitted:
        dropped, cut, level = current.fitted
        return "context fitting cut the conversation", \
            f"{dropped} earlier messages left out, {cut} characters cut, tool level {level}"
    if current.system != previous.system:
        return "system prompt changed", _where(previous.system, current.system)
    if current.tools != previous.tools:
        if sorted(current.tools) == sorted(previous.tools):
            return "tools reordered", "the same tools, sent in another order"
        before = {json.loads(t)["function"]["name"] for t in previous.tools}
        after = {json.loads(t)["function"]["name"] for t in current.tools}
        changes = [f"+{n}" for n in sorted(after - before)] + [f"-{n}" for n in sorted(before - after)]
        return "tools changed", " ".join(changes) or "a tool's description or schema changed"
    shared = min(len(previous.messages), len(current.messages))
    for index in range(shared):
        if previous.messages[index] == current.messages[index]:
            continue
        role = previous.roles[index]
        if previous.bare[index] == current.bare[index]:
            return "reasoning dropped by the client", f"message {index + 1} ({role}) was resent without its reasoning"
        if role in ("system", "developer"):
            return "a mid-conversation system message changed", f"message {index + 1}"
        return "history rewritten", f"message {index + 1} of {len(previous.messages)} ({role}) changed"
    if len(current.messages) < len(previous.messages):
        return "history rewritten", f"{len(previous.messages) - len(current.messages)} messages removed"
    late = [i for i in range(len(previous.messages), len(current.messages))
            if current.roles[i] in ("system", "developer")]
    if late:
        return "a new system message moved to the front by the template", f"message {late[0] + 1}"
    with_reasoning = [i for i, text in enumerate(previous.reasoning) if text and text not in current.prompt]
    if with_reasoning:
        return "reasoning dropped by the template", f"message {with_reasoning[0] + 1}'s reasoning is no longer rendered"
    return "template renders earlier turns differently", "same messages, tools and system prompt"


def _where(before: str, after: str) -> str:
    at = common_prefix_length(before, after)
    return f"from character {at}: {before[at:at + 24]!r} became {after[at:at + 24]!r}"


class Tracker:
    """Each session's last turns (per model), and the divergences found, logged and recorded.

    A session keeps its last few distinct conversations: agents send side requests (titles, summaries) under the
    main conversation's session id, and a new prompt is compared with whichever of them it shares most with."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root
        self.turns: OrderedDict[tuple[str, str], list[Turn]] = OrderedDict()

    def compare(self, model: str, session: str, turn: Turn) -> tuple[int, Turn] | None:
        """Remember ``turn``; return the parting offset and the closest earlier turn of the session when the new
        prompt extends none of them (the next message's header, at the end of a reply's rendering, aside)."""
        key = (model, session)
        earlier = self.turns.pop(key, [])
        best: tuple[int, Turn] | None = None
        for previous in earlier:
            expected = previous.expected or previous.prompt
            offset = len(expected) if turn.prompt.startswith(expected) else common_prefix_length(expected, turn.prompt)
            if best is None or offset > best[0]:
                best = (offset, previous)
        parted = best
        if best is not None:
            offset, previous = best
            expected = previous.expected or previous.prompt
            if offset >= len(expected) - HEADER_SLACK and offset >= len(previous.prompt):
                parted = None
        # A turn that extends an earlier one replaces it (the same thread, grown); one that parts is kept beside it.
        kept = [t for t in earlier if parted is not None or best is None or t is not best[1]]
        self.turns[key] = [*kept[-(TURNS_PER_SESSION - 1):], turn]
        while len(self.turns) > MAX_SESSIONS:
            self.turns.popitem(last=False)
        return parted

    def expect(self, model: str, session: str, prompt: str, rendered: str, reasoning: str) -> None:
        """The reply is known: the next turn should start with ``rendered``."""
        for turn in self.turns.get((model, session), []):
            if turn.prompt == prompt:
                turn.expected, turn.reply_reasoning = rendered, reasoning

    def record(self, divergence: Divergence) -> None:
        level = logging.WARNING if divergence.early else logging.INFO
        log.log(level, "session %s on %s: the prompt parts from its last one at token %d of %d (%s: %s); "
                "the rest is recomputed", divergence.session, divergence.model, divergence.offset_tokens,
                divergence.previous_tokens, divergence.cause, divergence.detail)
        divergences.append(divergence, self.root)
