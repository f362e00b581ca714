"""Turn a model's streamed text into text, reasoning and structured tool calls.

Small local models write tool calls in their family's format: Hermes/Qwen ``<tool_call>{json}</tool_call>``,
Llama 3 ``{"name": ..., "parameters": ...}`` (optionally after ``<|python_tag|>``), Mistral
``[TOOL_CALLS][{...}]``, or a plain JSON object. ``OutputParser`` recognises all of them as text
arrives, streams a call's arguments while they are written, and holds back only what may still turn
out to be the start of a call. Reasoning between ``<think>`` and ``</think>`` at the start becomes
reasoning events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from localai.runtime.formats.common import Thinking
from localai.schema import Event, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart, new_call_id
from localai.text import partial_suffix

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_ARGS = "[ARGS]"  # Mistral's current form (Devstral, Magistral): [TOOL_CALLS]NAME[ARGS]{...}
BAR, SPACE = "\uff5c", "\u2581"  # DeepSeek's markers: fullwidth bars, and the tokenizer's word-start mark for spaces
DEEPSEEK_OPEN, DEEPSEEK_SEP, DEEPSEEK_CLOSE = (f"<{BAR}tool{SPACE}{word}{BAR}>" for word in
                                               (f"call{SPACE}begin", "sep", f"call{SPACE}end"))
DEEPSEEK_OUTER = (f"<{BAR}tool{SPACE}calls{SPACE}begin{BAR}>",  # around DeepSeek-V3.1's calls: dropped
                  f"<{BAR}tool{SPACE}calls{SPACE}end{BAR}>")
MARKERS = (HERMES_OPEN, MISTRAL_MARK, PYTHON_TAG, DEEPSEEK_OPEN, *DEEPSEEK_OUTER)
NAME = re.compile(r"[\w.\-]{1,200}")
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class JsonScan:
    """Where the JSON value (object, array or string) starting at ``start`` ends, in a text that grows at its end as
    a streamed reply does: each call reads only what came since the last, so following a long value delta by delta
    costs its length once, not its length at every delta."""

    def __init__(self, start: int = 0) -> None:
        self.index = start  # the next character to read
        self.depth = 0
        self.in_string = self.escaped = False
        self.end: int | None = None  # found: the value ends just before this index
        self.not_json = False

    def end_in(self, text: str) -> int | None:
        """Where the value ends in ``text`` (the same text as before, maybe longer), None while it has not."""
        if self.end is not None or self.not_json:
            return self.end
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for index in range(self.index, len(text)):
            char = text[index]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
                    if depth == 0:
                        self.end = index + 1
                        return self.end
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self.end = index + 1
                    return self.end
            elif depth == 0 and not char.isspace():
                self.not_json = True  # not an object, array or string
                return None
        self.index, self.depth, self.in_string, self.escaped = max(self.index, len(text)), depth, in_string, escaped
        return None


@dataclass
class _Call:
    """A call being written: the raw JSON so far and how much of its arguments has been streamed."""

    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    args_start: int | None = None
    streamed: int = 0  # characters of the arguments already sent
    opener: str = ""  # the marker that began it, given back as text if it turns out not to be a call
    unknown: bool = False  # names a function the request did not offer: text, not a call
    args_scan: JsonScan | None = None  # the arguments' value, followed as it is written
    body_scan: JsonScan | None = None  # the whole call's JSON: the call ends with it, or at a marker after it


class OutputParser(Thinking):
    """Feed text deltas in, get events out; ``finish()`` flushes what is held back."""

    def __init__(self, *, tools: bool, reasoning: bool, names: Collection[str] | None = None,
                 opened: bool = False) -> None:
        super().__init__(reasoning=reasoning, opened=opened)
        self.tools = tools
        self.names = frozenset(names) if names is not None else None  # the offered functions (None: any)
        self.calls: list[ToolCallEnd] = []
        self._call: _Call | None = None
        self._close: str | None = None  # what ends the current call block (None: the JSON value itself)
        self._array = False  # inside a JSON array of calls (Mistral's [TOOL_CALLS][...])
        self._document: JsonScan | None = None
        self._named: tuple[str, str, str | None] = ("", "", None)  # a named call's opener, separator and closer

    # -- public --------------------------------------------------------------------------------

    def finish(self) -> list[Event]:
        """The end of the output: flush held-back text and close an unterminated call."""
        events: list[Event] = []
        for _ in range(10_000):  # every step consumes or changes state; the bound only guards bugs
            if self._state == "call" and self._call is not None:
                if not self._advance(events, True):
                    self._end_call(events, self._buffer)
                    self._buffer, self._state = "", "text"
                continue
            if not self._advance(events, True):
                break
        if self._buffer:
            self.emit_text(events, self._buffer) if self._state != "think" else events.append(
                ReasoningDelta(self._buffer))
        self._buffer = ""
        return events

    # -- states --------------------------------------------------------------------------------

    def _advance(self, events: list[Event], final: bool) -> bool:
        """One step of the state machine; False when it must wait for more text."""
        handler = {
            "think?": self._think_open, "think": self._think, "start": self._start, "json?": self._bare_json,
            "text": self._text, "call": self._in_call, "mistral": self._mistral, "array": self._array_tail,
            "named": self._named_call,
        }[self._state]
        return handler(events, final)

    def _start(self, events: list[Event], final: bool) -> bool:
        if not self.tools:
            self._state = "text"
            return True
        stripped = self._buffer.lstrip()
        if not stripped and not final:
            return False
        if self.calls or stripped[:1] in ("{", "["):
            self._buffer = stripped  # no whitespace between or before calls
        self._state = "json?" if stripped[:1] in ("{", "[") else "text"
        self._document = None  # a bare JSON document's scan, from its first character
        return True

    def _text(self, events: list[Event], final: bool) -> bool:
        found = self._text_until(events, final, MARKERS if self.tools else ())
        if found is None:
            return False
        position, marker = found
        self._buffer = self._buffer[position + len(marker):]
        if marker == HERMES_OPEN:
            self._begin_call(close=HERMES_CLOSE, opener=marker)
        elif marker == MISTRAL_MARK:
            self._state = "mistral"
        elif marker == DEEPSEEK_OPEN:
            self._named = (marker, DEEPSEEK_SEP, DEEPSEEK_CLOSE)
            self._state = "named"
        elif marker in DEEPSEEK_OUTER:
            self._state = "start"
        else:  # <|python_tag|>: a bare JSON call follows
            self._begin_call(close=None, opener=marker)
        return True

    def _mistral(self, events: list[Event], final: bool) -> bool:
        stripped = self._buffer.lstrip()
        if not stripped:
            if final:
                self._state = "text"
                return True
            return False
        opener = MISTRAL_MARK
        if stripped[0] not in "[{":
            self._named = (MISTRAL_MARK + self._buffer[:len(self._buffer) - len(stripped)], MISTRAL_ARGS, None)
            self._buffer = stripped
            self._state = "named"
            return True
        if stripped[0] == "[":
            self._array = True
            stripped = stripped[1:]
            opener += "["
        self._buffer = stripped
        self._begin_call(close=None, opener=opener)
        return True

    def _named_call(self, events: list[Event], final: bool) -> bool:
        """A call written as its name, a separator, then its JSON arguments (Mistral's current form, DeepSeek's)."""
        opener, separator, close = self._named
        at = self._buffer.find(separator)
        if at == -1:
            name_so_far = self._buffer[:len(self._buffer) - partial_suffix(self._buffer, (separator,))].strip()
            if final or (name_so_far and not NAME.fullmatch(name_so_far)) or len(name_so_far) > 200:
                self.emit_text(events, opener)  # not a call after all
                self._state = "text"
                return True
            return False
        name = self._buffer[:at].strip()
        if not NAME.fullmatch(name):
            self.emit_text(events, opener)
            self._state = "text"
            return True
        self._begin_call(close=close, opener=opener + self._buffer[:at + len(separator)])
        self._buffer = self._buffer[at + len(separator):]
        call = self._call
        assert call is not None
        call.name, call.args_start, call.unknown = name, 0, not self._offered(name)
        if not call.unknown:
            events.append(ToolCallStart(call.index, call.id, name))
        return True

    def _bare_json(self, events: list[Event], final: bool) -> bool:
        """Output that opens with ``{`` or ``[``: a call when it is one, else plain text."""
        buffer = self._buffer
        inner = buffer[1:].lstrip() if buffer.startswith("[") else buffer
        if HEAD.match(inner):
            self._array = buffer.startswith("[")
            self._buffer = inner
            self._begin_call(close=None, opener="[" if self._array else "")
            return True
        if not final and (not inner or _could_be_head(inner)):
            return False
        if self._document is None:
            self._document = JsonScan()
        end = self._document.end_in(buffer)
        if end is None and not final:
            return False  # some other JSON document: decide once it is complete
        candidate = _as_call(buffer[:end]) if end is not None else None
        if candidate is None or not self._offered(candidate[0]):
            self._state = "text"
            return True
        self._emit_whole_call(events, _Call(index=len(self.calls)), *candidate)
        self._buffer = buffer[end:]
        self._state = "start"
        return True

    def _begin_call(self, *, close: str | None, opener: str = "") -> None:
        self._call = _Call(index=len(self.calls), opener=opener)
        self._close = close
        self._state = "call"

    def _offered(self, name: str) -> bool:
        """A call only of a function the request offered: a small model may copy the prompt's example
        (``"<function name>"``) or invent one; that is text, never a call the client cannot run."""
        return self.names is None or name in self.names

    def _in_call(self, events: list[Event], final: bool) -> bool:
        call = self._call
        assert call is not None
        buffer = self._buffer
        if call.name is None:
            match = HEAD.match(buffer)
            if match:
                call.name = json.loads(f'"{match.group(1)}"')
                call.args_start = match.end()
                call.unknown = not self._offered(call.name)
                if not call.unknown:
                    events.append(ToolCallStart(call.index, call.id, call.name))
        start = call.args_start
        while start is not None and start < len(buffer) and buffer[start].isspace() and not call.streamed:
            start = call.args_start = start + 1  # the value has not begun yet
        if start is not None and start < len(buffer) and buffer[start] in "{[" and not call.unknown:
            if call.args_scan is None:
                call.args_scan = JsonScan(start)  # the value has begun: its start no longer moves
            end = call.args_scan.end_in(buffer)
            upto = (end if end is not None else len(buffer)) - start
            if upto > call.streamed:
                events.append(ToolCallDelta(call.index, buffer[start + call.streamed:start + upto]))
                call.streamed = upto
        if call.body_scan is None and buffer.strip():  # the body has begun: its start no longer moves
            call.body_scan = JsonScan(len(buffer) - len(buffer.lstrip()))
        end_of_json = call.body_scan.end_in(buffer) if call.body_scan is not None else None
        if self._close is not None:
            close_at = self._close_at(call, buffer, end_of_json, final)
            if close_at == -1:
                return False
            self._end_call(events, buffer[:close_at], self._close)
            self._buffer = buffer[close_at + len(self._close):]
            self._state = "start"
            return True
        if end_of_json is None:
            return False
        self._end_call(events, buffer[:end_of_json])
        self._buffer = buffer[end_of_json:]
        self._state = "array" if self._array else "start"
        return True

    def _close_at(self, call: _Call, buffer: str, body_end: int | None, final: bool) -> int:
        """Where the call's closing marker starts, -1 while it has not come: after the call's JSON, so arguments
        holding the marker (a file about tool calls) stay whole. Anywhere when the body is not JSON, or when the
        output ends with the JSON still open."""
        assert self._close is not None
        if body_end is not None:
            return buffer.find(self._close, body_end)
        if final or (call.body_scan is not None and call.body_scan.not_json):
            return buffer.find(self._close)
        return -1

    def _array_tail(self, events: list[Event], final: bool) -> bool:
        """After a call inside ``[...]``: another call, the closing bracket, or text."""
        stripped = self._buffer.lstrip()
        if not stripped and not final:
            return False
        if stripped.startswith(","):
            self._buffer = stripped[1:].lstrip()
            self._begin_call(close=None)
            return True
        self._array = False
        self._buffer = stripped[1:] if stripped.startswith("]") else stripped
        self._state = "start"
        return True

    def _end_call(self, events: list[Event], raw: str, closer: str = "") -> None:
        call = self._call
        assert call is not None
        self._call = None
        parsed = _as_call(raw.strip())
        if call.unknown or (call.name is None and (parsed is None or not self._offered(parsed[0]))):
            self.emit_text(events, call.opener + raw + closer)  # never became a call: it was text after all
            return
        if call.name is None:
            assert parsed is not None
            self._emit_whole_call(events, call, *parsed)
            return
        start = call.args_start or 0
        arguments = raw[start:start + call.streamed]
        if not arguments and parsed is not None:
            arguments = json.dumps(parsed[1], ensure_ascii=False)
            events.append(ToolCallDelta(call.index, arguments))
        end = ToolCallEnd(call.index, call.id, call.name, arguments or "{}")
        self.calls.append(end)
        events.append(end)

    def _emit_whole_call(self, events: list[Event], call: _Call, name: str, arguments: dict[str, Any]) -> None:
        text = json.dumps(arguments, ensure_ascii=False)
        events.append(ToolCallStart(call.index, call.id, name))
        events.append(ToolCallDelta(call.index, text))
        end = ToolCallEnd(call.index, call.id, name, text)
        self.calls.append(end)
        events.append(end)

def _could_be_head(text: str) -> bool:
    """Whether ``text`` may still grow into ``{"name": "...", "arguments": ...``."""
    probe = '{"name": "x", "arguments": '
    compact = re.sub(r"\s+", "", text)
    if len(compact) < len('{"name":"'):
        return probe.replace(" ", "").startswith(compact)
    return compact.startswith('{"name":"')


def _as_call(raw: str) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` when ``raw`` is a JSON function call in any of the common shapes."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):  # {"type": "function", "function": {...}}
        value = value["function"]
    name = value.get("name")
    if "arguments" not in value and "parameters" not in value:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, arguments
