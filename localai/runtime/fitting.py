"""Fit an over-long conversation into the context, keeping it cache-friendly.

Kept: the leading system/developer messages, the last user message and everything after it.
Dropped first: whole messages from the oldest end of the middle, in blocks with slack, so the fitted
prompt keeps the same prefix for several turns (a cut that moved every turn would defeat the cache).
Then the tools' descriptions are trimmed (an agent's tool schemas can outweigh a small model's context),
then the longest kept texts and tool results are shortened in their middle, and as a last resort the tools
lose every description and finally go.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from localai.schema import Block, Message, TextBlock, Tool, ToolResultBlock

MARKER = "\n[... {n} characters omitted by localai to fit the context ...]\n"


@dataclass
class Fit:
    """How a conversation was fitted: messages dropped from the middle and characters cut."""

    dropped: int = 0
    shortened_chars: int = 0
    tool_level: int = 0  # see slim_tools
    attempts: int = 0

    def header(self) -> str:
        text = f"dropped_messages={self.dropped}; shortened_chars={self.shortened_chars}"
        return text + (f"; tools={TOOL_LEVELS[self.tool_level]}" if self.tool_level else "")


TOOL_LEVELS = ("full", "without_parameter_descriptions", "without_descriptions", "dropped")


def _strip_descriptions(schema: object) -> object:
    if isinstance(schema, dict):
        return {k: _strip_descriptions(v) for k, v in schema.items() if k not in ("description", "examples", "title")}
    if isinstance(schema, list):
        return [_strip_descriptions(item) for item in schema]
    return schema


def slim_tools(tools: list[Tool], level: int) -> list[Tool]:
    """Tools made smaller, step by step, when they alone crowd out the conversation.

    1: parameter descriptions go and tool descriptions keep their first 200 characters; 2: no descriptions
    at all (names and schemas stay); 3: no tools.
    """
    if level <= 0:
        return tools
    if level >= 3:
        return []
    slim = []
    for tool in tools:
        description = tool.description[:200] if level == 1 else ""
        parameters = _strip_descriptions(tool.parameters)
        slim.append(Tool(tool.name, description, parameters if isinstance(parameters, dict) else {}))
    return slim


def size(message: Message) -> int:
    """Characters of a message's text and tool results: what shortening can cut."""
    return len(message.text()) + sum(len(b.content) for b in message.content if isinstance(b, ToolResultBlock))


def protected_bounds(messages: list[Message]) -> tuple[int, int]:
    """[start, end) of the droppable middle: after leading system messages, before the last user message."""
    start = 0
    while start < len(messages) and messages[start].role in ("system", "developer"):
        start += 1
    end = len(messages)
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "user":
            end = index
            break
    return start, max(start, end)


def apply(messages: list[Message], dropped: int, cut_chars: int) -> list[Message]:
    """The conversation with ``dropped`` middle messages removed and ``cut_chars`` cut from long messages."""
    start, end = protected_bounds(messages)
    dropped = min(dropped, end - start)
    fitted = messages[:start] + messages[start + dropped:]
    if cut_chars > 0:
        fitted = _shorten(fitted, cut_chars)
    return fitted


MIN_CUTTABLE = 200  # shorter texts are left whole: the marker would cost about what cutting saves
KEEP = 100  # characters a shortened text keeps (half at each end)


def _merged(message: Message) -> Message:
    """The message with adjacent text blocks joined: templates render them joined anyway, and one long text can be
    shortened where many short ones (an Anthropic turn of 400 small blocks) could not."""
    content: list[Block] = []
    for block in message.content:
        if isinstance(block, TextBlock) and content and isinstance(content[-1], TextBlock):
            content[-1] = TextBlock(content[-1].text + block.text)
        else:
            content.append(block)
    return message if len(content) == len(message.content) else Message(message.role, content, message.name)


def _cuttable_blocks(messages: list[Message]) -> list[tuple[int, int, int]]:
    """(message index, block index, length) of every text or tool result long enough to shorten."""
    return [(index, position, length)
            for index, message in enumerate(messages) for position, block in enumerate(message.content)
            if isinstance(block, TextBlock | ToolResultBlock)
            for length in [len(block.text if isinstance(block, TextBlock) else block.content)]
            if length >= MIN_CUTTABLE]


def cuttable(messages: list[Message]) -> int:
    """The most characters shortening can take out of ``messages``."""
    merged = [_merged(message) for message in messages]
    return sum(length - KEEP for _, _, length in _cuttable_blocks(merged))


def _shorten(messages: list[Message], cut_chars: int) -> list[Message]:
    """Cut ``cut_chars`` from the middle of the longest texts and tool results; other blocks stay as they are."""
    result = [_merged(message) for message in messages]
    remaining = cut_chars
    for index, position, length in sorted(_cuttable_blocks(result), key=lambda item: -item[2]):
        if remaining <= 0:
            break
        block = result[index].content[position]
        text = block.text if isinstance(block, TextBlock) else block.content  # type: ignore[union-attr]
        cut = min(remaining, length - KEEP)
        head = (length - cut) // 2
        new_text = text[:head] + MARKER.format(n=cut) + text[head + cut:]
        content = list(result[index].content)
        content[position] = (TextBlock(new_text) if isinstance(block, TextBlock)
                             else ToolResultBlock(block.tool_call_id, new_text, block.name,  # type: ignore[union-attr]
                                                  block.is_error))  # type: ignore[union-attr]
        result[index] = Message(result[index].role, content, result[index].name)
        remaining -= cut
    return result


def conversation_key(model: str, partition: str, session: str | None, messages: list[Message]) -> str:
    """Identifies a conversation across turns, within a cache partition (an API key's, a salt's): its session id, or
    its first messages. Two keys' conversations never share a key, even with the same session id or opening."""
    if session:
        return f"{model}\0{partition}\0{session}"
    digest = hashlib.sha256(model.encode() + b"\0" + partition.encode() + b"\0")
    for message in messages[:3]:
        digest.update(message.role.encode() + b"\0" + message.text().encode() + b"\0")
    return digest.hexdigest()


def dropped_digest(messages: list[Message], dropped: int) -> str:
    """What a cut of ``dropped`` messages takes out of ``messages``: a later turn reuses the cut only when it would
    drop the same messages (the ones that made the prompt too long), never another conversation's by its opening."""
    start, end = protected_bounds(messages)
    digest = hashlib.sha256()
    for message in messages[start:min(start + dropped, end)]:
        digest.update(message.role.encode() + b"\0" + message.text().encode() + b"\0")
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                digest.update(block.content.encode() + b"\0")
    return digest.hexdigest()


@dataclass
class FitMemory:
    """Remembers each conversation's cut so the next turn reuses it (and its cached prefix)."""

    capacity: int = 1024
    cuts: OrderedDict[str, tuple[int, int, str]] = field(default_factory=OrderedDict)

    def get(self, key: str, messages: list[Message]) -> tuple[int, int]:
        """(messages dropped, tool level) of the conversation's last fit, when that cut drops the same messages of
        ``messages`` as it did then; (0, 0) otherwise."""
        dropped, tool_level, digest = self.cuts.get(key, (0, 0, ""))
        if key not in self.cuts or digest != dropped_digest(messages, dropped):
            return 0, 0
        self.cuts.move_to_end(key)
        return dropped, tool_level

    def put(self, key: str, messages: list[Message], dropped: int, tool_level: int = 0) -> None:
        self.cuts[key] = (dropped, tool_level, dropped_digest(messages, dropped))
        self.cuts.move_to_end(key)
        while len(self.cuts) > self.capacity:
            self.cuts.popitem(last=False)


def next_cut(messages: list[Message], dropped: int, cut_chars: int, prompt_tokens: int, budget: int,
             n_ctx: int) -> tuple[int, int] | None:
    """The next (dropped, cut_chars) to try after a prompt of ``prompt_tokens`` did not fit ``budget``.

    Drops whole messages with a quarter of the context as slack; then cuts characters. None: nothing left.
    """
    start, end = protected_bounds(messages)
    current = apply(messages, dropped, cut_chars)
    chars = sum(size(m) for m in current) or 1
    chars_per_token = chars / max(prompt_tokens, 1)
    excess_chars = int((prompt_tokens - budget + n_ctx // 4) * chars_per_token)
    droppable = end - start - dropped
    if droppable > 0:
        middle = messages[start + dropped:end]
        removed, take = 0, 0
        while take < len(middle) and removed < excess_chars:
            removed += size(middle[take]) + 20
            take += 1
        return dropped + max(1, take), cut_chars
    excess_chars = int((prompt_tokens - budget + 16) * chars_per_token * 1.1)
    capacity = cuttable(apply(messages, dropped, 0))
    if cut_chars >= capacity:
        return None  # nothing long enough is left to shorten: the caller answers 400
    return dropped, min(cut_chars + max(excess_chars, 64), capacity)


def output_reserve(max_tokens: int | None, n_ctx: int) -> int:
    """Room a prompt must leave for its reply: what the request may generate (512 when it sets no limit), at most
    a quarter of the context. ``localai launch`` gives agents that quarter as their output limit, so a reply is
    never cut by a full context before the limit the agent was told (agents treat that as an error, or loop)."""
    wanted = max_tokens if max_tokens is not None and max_tokens >= 0 else 512
    return min(wanted, n_ctx // 4)
