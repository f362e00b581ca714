"""gpt-oss's Harmony format: the reply is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>The user wants the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"X"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

``analysis`` bodies are reasoning; a body addressed ``to=functions.NAME`` (in the header, before or after the
channel) is a tool call whose JSON arguments stream as written; ``final`` bodies, and ``commentary`` without a
recipient (a preamble to the user), are text. ``<|call|>`` and ``<|return|>`` end generation, so the output may stop
without them. Output that never opens a channel (a template without Harmony) is plain text. Where Ollama and LM
Studio dropped or mangled messages whose header carried the recipient before the channel, or a ``<|constrain|>``
word other than ``json`` (ollama #12187, lmstudio #942), any order and any constraint word are read here.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from localai.runtime.formats.common import Thinking
from localai.schema import Event, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart, new_call_id
from localai.text import partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
BODY_ENDS = (*ENDS, START)  # a body also ends where the next message begins
RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
HEADER_MAX = 400


class HarmonyParser(Thinking):
    """Feed text deltas in, get events out; ``finish()`` flushes what is held back."""

    def __init__(self, *, tools: bool, names: Collection[str] | None = None) -> None:
        super().__init__(reasoning=False)
        self.tools = tools
        self.names = frozenset(names) if names is not None else None
        self.calls: list[ToolCallEnd] = []
        self._kind = "text"  # the current body: text, reasoning or call
        self._call_id = ""
        self._call_name = ""
        self._arguments = ""
        self._raw_header = ""

    def _advance(self, events: list[Event], final: bool) -> bool:
        return {"start": self._start, "header": self._header, "body": self._body,
                "plain": self._plain}[self._state](events, final)

    def _start(self, events: list[Event], final: bool) -> bool:
        """Between messages: a header, or (no Harmony at all) plain text."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if stripped.startswith((START, CHANNEL)):
            self._buffer = stripped
            self._state = "header"
            return True
        for end in ENDS:  # a stray end marker between messages
            if stripped.startswith(end):
                self._buffer = stripped[len(end):]
                return True
        if not final and any(marker.startswith(stripped) for marker in (START, CHANNEL, *ENDS)):
            return False
        self._state = "plain"
        return True

    def _plain(self, events: list[Event], final: bool) -> bool:
        self.emit_text(events, self._buffer)
        self._buffer = ""
        return False

    def _header(self, events: list[Event], final: bool) -> bool:
        at = self._buffer.find(MESSAGE)
        if at == -1:
            if final or len(self._buffer) > HEADER_MAX:
                self._state = "plain"  # not a header after all
                return True
            return False
        header = self._buffer[:at]
        self._raw_header = self._buffer[:at + len(MESSAGE)]
        self._buffer = self._buffer[at + len(MESSAGE):]
        channel = CHANNEL_NAME.search(header)
        recipient = RECIPIENT.search(header)
        name = recipient.group(1) if recipient else ""
        if name.startswith("functions."):
            name = name[len("functions."):]
        if recipient and self.tools and name and (self.names is None or name in self.names):
            self._kind = "call"
            self._call_id, self._call_name, self._arguments = new_call_id(), name, ""
            events.append(ToolCallStart(len(self.calls), self._call_id, name))
        elif recipient:
            self._kind = "foreign"  # a call of a function not offered (or a built-in tool): kept as text
            self.emit_text(events, self._raw_header)
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "text"  # final, or commentary addressed to the user
        self._state = "body"
        return True

    def _body(self, events: list[Event], final: bool) -> bool:
        found = [(self._buffer.find(end), end) for end in BODY_ENDS if end in self._buffer]
        if found:
            at, end = min(found)
            self._emit(events, self._buffer[:at])
            self._buffer = self._buffer[at + (0 if end == START else len(end)):]
            self._close(events, end)
            self._state = "start"
            return True
        cut = len(self._buffer) - (0 if final else partial_suffix(self._buffer, BODY_ENDS))
        if cut > 0:
            self._emit(events, self._buffer[:cut])
            self._buffer = self._buffer[cut:]
        return False

    def _emit(self, events: list[Event], text: str) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            events.append(ReasoningDelta(text))
        elif self._kind == "call":
            self._arguments += text
            events.append(ToolCallDelta(len(self.calls), text))
        else:
            self.emit_text(events, text)

    def _close(self, events: list[Event], end: str) -> None:
        if self._kind == "call":
            arguments = self._arguments  # the deltas sent are the arguments, whitespace and all
            if not arguments.strip():
                events.append(ToolCallDelta(len(self.calls), "{}"))
                arguments = "{}"
            call = ToolCallEnd(len(self.calls), self._call_id, self._call_name, arguments)
            self.calls.append(call)
            events.append(call)
        elif self._kind == "foreign" and end in ENDS:
            self.emit_text(events, end)
        self._kind = "text"

    def _finish_open(self, events: list[Event]) -> None:
        if self._state == "body":
            self._emit(events, self._buffer)
            self._buffer = ""
            self._close(events, "")
            self._state = "start"
        elif self._state == "header":
            self._state = "plain"

