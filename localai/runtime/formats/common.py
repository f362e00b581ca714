"""What every format's parser shares: the feed/finish loop over a buffer, ``<think>`` reasoning at the start,
text events, and reading a parameter's type from a tool's JSON schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localai.engines.schema_refs import GrammarError, expanded
from localai.schema import Event, ReasoningDelta, TextDelta
from localai.text import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Thinking:
    """A streaming state machine over ``_buffer``: subclasses give ``_advance`` (one step; False when it must wait
    for more text) and start in ``"start"``; with ``reasoning`` the output may open with ``<think>...</think>``,
    and with ``opened`` too it starts inside the reasoning (the prompt ended with ``<think>``, as GLM-4.7's and
    Qwen3's thinking templates' generation prompts do)."""

    def __init__(self, *, reasoning: bool, opened: bool = False) -> None:
        self._state = ("think" if opened else "think?") if reasoning else "start"
        self._buffer = ""
        self._after_think = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._advance(events, False):
            pass
        return events

    def finish(self) -> list[Event]:
        """The end of the output: flush held-back text and close an unterminated call."""
        events: list[Event] = []
        for _ in range(2):
            for _ in range(100_000):  # every step consumes or changes state; the bound only guards bugs
                if not self._advance(events, True):
                    break
            self._finish_open(events)
        if self._buffer:
            if self._state == "think":
                events.append(ReasoningDelta(self._buffer))
            else:
                self.emit_text(events, self._buffer)
        self._buffer = ""
        return events

    def _advance(self, events: list[Event], final: bool) -> bool:
        raise NotImplementedError

    def _finish_open(self, events: list[Event]) -> None:
        """Close whatever the output left open (a call cut off by the token limit)."""

    def _think_open(self, events: list[Event], final: bool) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN):]
            self._state = "think"
            return True
        if THINK_OPEN.startswith(stripped) and not final:
            return False
        self._state = "start"
        return True

    def _think(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(THINK_CLOSE)
        if end == -1:
            cut = len(self._buffer) - (0 if final else partial_suffix(self._buffer, (THINK_CLOSE,)))
            if cut > 0:
                events.append(ReasoningDelta(self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
            return False
        if end:
            events.append(ReasoningDelta(self._buffer[:end]))
        self._buffer = self._buffer[end + len(THINK_CLOSE):]
        self._after_think = True  # the blank lines after </think> are not part of the answer
        self._state = "start"
        return True

    def _leading_blank(self, final: bool) -> bool:
        """Drop the blank lines after ``</think>``; True while only blanks have come (wait for more)."""
        if self._after_think:
            self._buffer = self._buffer.lstrip()
            if not self._buffer and not final:
                return True
            self._after_think = False
        return False

    def _text_until(self, events: list[Event], final: bool, markers: tuple[str, ...]) -> tuple[int, str] | None:
        """Text up to the first of ``markers``, emitted less the whitespace before the marker: where the marker is
        in the buffer and which it is; or None when there is none yet (the text that cannot begin one is emitted,
        the rest and trailing whitespace held back). Drops the blank lines after ``</think>`` first."""
        if self._leading_blank(final):
            return None
        found = [(self._buffer.find(marker), marker) for marker in markers if marker in self._buffer]
        if found:
            position, marker = min(found)
            self.emit_text(events, self._buffer[:position].rstrip())
            return position, marker
        hold = 0 if final else partial_suffix(self._buffer, markers)
        if not final:  # whitespace that a following marker would drop
            body = self._buffer[:len(self._buffer) - hold]
            hold += len(body) - len(body.rstrip())
        cut = len(self._buffer) - hold
        if cut > 0:
            self.emit_text(events, self._buffer[:cut])
            self._buffer = self._buffer[cut:]
        return None

    @staticmethod
    def emit_text(events: list[Event], text: str) -> None:
        if not text:
            return
        if events and isinstance(events[-1], TextDelta):
            events[-1] = TextDelta(events[-1].text + text)
        else:
            events.append(TextDelta(text))


def _parameter(schema: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    """Parameter ``key``'s schema, a local ``$ref`` followed (Pydantic writes a nested model as
    ``{"$ref": "#/$defs/Model"}``) and an ``allOf`` merged (and a field with a description as ``{"allOf":
    [{"$ref": ...}]}``), as the grammar that forced the call read them; None when it cannot be read."""
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    prop = properties.get(key) if isinstance(properties, Mapping) else None
    try:
        prop = expanded(prop, schema)
    except GrammarError:
        return None
    return prop if isinstance(prop, Mapping) else None


def string_typed(schema: Mapping[str, Any], key: str) -> bool:
    """Whether parameter ``key`` of a function whose parameters are ``schema`` takes a string (or is not described:
    then its text is kept as text)."""
    prop = _parameter(schema, key)
    if prop is None:
        return True
    kind = prop.get("type")
    if kind is None:
        for choice in (*prop.get("anyOf", ()), *prop.get("oneOf", ())):
            if isinstance(choice, Mapping) and choice.get("type") not in (None, "null"):
                kind = choice.get("type")
                break
        else:
            return "enum" not in prop or all(isinstance(item, str) for item in prop["enum"])
    if isinstance(kind, list):
        return "string" in kind
    return bool(kind == "string")


def nullable(schema: Mapping[str, Any], key: str) -> bool:
    """Whether parameter ``key`` may be null (``"type": ["string", "null"]``, or an ``anyOf`` with null)."""
    prop = _parameter(schema, key)
    if prop is None:
        return False
    kind = prop.get("type")
    if isinstance(kind, list):
        return "null" in kind
    return any(isinstance(choice, Mapping) and choice.get("type") == "null"
               for choice in (*prop.get("anyOf", ()), *prop.get("oneOf", ())))
