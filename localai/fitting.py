"""Fit an over-long conversation into the context, keeping it cache-friendly.

Kept: the leading system/developer messages, the last user message and everything after it.
Dropped first: whole messages from the oldest end of the middle, in blocks with slack, so the fitted
prompt keeps the same prefix for several turns (a cut that moved every turn would defeat the cache).
Only if that is not enough, the longest kept messages are shortened in their middle.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from localai.schema import Message, TextBlock

MARKER = "\n[... {n} characters omitted by localai to fit the context ...]\n"


@dataclass
class Fit:
    """How a conversation was fitted: messages dropped from the middle and characters cut."""

    dropped: int = 0
    shortened_chars: int = 0
    attempts: int = 0

    def header(self) -> str:
        return f"dropped_messages={self.dropped}; shortened_chars={self.shortened_chars}"


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


def _shorten(messages: list[Message], cut_chars: int) -> list[Message]:
    result = list(messages)
    remaining = cut_chars
    order = sorted(range(len(result)), key=lambda i: -len(result[i].text()))
    for index in order:
        if remaining <= 0:
            break
        text = result[index].text()
        if len(text) < 200:
            continue
        cut = min(remaining, len(text) - 100)
        head = (len(text) - cut) // 2
        new_text = text[:head] + MARKER.format(n=cut) + text[head + cut:]
        result[index] = Message(result[index].role, [TextBlock(new_text)], result[index].name)
        remaining -= cut
    return result


def conversation_key(model: str, session: str | None, messages: list[Message]) -> str:
    """Identifies a conversation across turns: its session id, or its first messages."""
    if session:
        return f"{model}\0{session}"
    digest = hashlib.sha256(model.encode())
    for message in messages[:3]:
        digest.update(message.role.encode() + b"\0" + message.text().encode() + b"\0")
    return digest.hexdigest()


@dataclass
class FitMemory:
    """Remembers each conversation's cut so the next turn reuses it (and its cached prefix)."""

    capacity: int = 1024
    cuts: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def get(self, key: str) -> int:
        value = self.cuts.get(key, 0)
        if key in self.cuts:
            self.cuts.move_to_end(key)
        return value

    def put(self, key: str, dropped: int) -> None:
        self.cuts[key] = dropped
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
    chars = sum(len(m.text()) for m in current) or 1
    chars_per_token = chars / max(prompt_tokens, 1)
    excess_chars = int((prompt_tokens - budget + n_ctx // 4) * chars_per_token)
    droppable = end - start - dropped
    if droppable > 0:
        middle = messages[start + dropped:end]
        removed, take = 0, 0
        while take < len(middle) and removed < excess_chars:
            removed += len(middle[take].text()) + 20
            take += 1
        return dropped + max(1, take), cut_chars
    excess_chars = int((prompt_tokens - budget + 16) * chars_per_token * 1.1)
    longest = max((len(m.text()) for m in current), default=0)
    if longest < 300:
        return None
    return dropped, cut_chars + max(excess_chars, 64)
