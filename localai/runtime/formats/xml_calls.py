"""Tool calls written as tagged parameters rather than JSON: Qwen3-Coder's XML and GLM-4.5's key/value tags.

Qwen3-Coder (and Qwen3.5+)::

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/app.py
    </parameter>
    <parameter=content>
    ...thousands of lines of code, with <, &, quotes and XML-like text...
    </parameter>
    </function>
    </tool_call>

GLM-4.5 / 4.6 / 4.7::

    <tool_call>write_file
    <arg_key>path</arg_key>
    <arg_value>src/app.py</arg_value>
    </tool_call>

Values are raw text, never escaped: a value is typed from the tool's JSON schema (a string stays text; numbers,
booleans, objects and arrays are parsed as JSON, and stay text when they do not parse). Qwen3-Coder's values lose
one leading and one trailing newline. A closing tag ends a value only when what follows it is the next tag (or
the end of the call): code holding ``</parameter>`` in a string literal stays in the value, where Ollama's parser
cuts the file short (ollama #18563). String values are streamed as the model writes them, as JSON string pieces,
so a client sees ``{"path": "src/app.py", "content": "..."`` grow; other types arrive whole when their tag closes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localai.runtime.formats.common import Thinking, nullable, string_typed
from localai.schema import Event, ToolCallDelta, ToolCallEnd, ToolCallStart, new_call_id
from localai.text import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Dialect:
    """The tags of one family."""

    name: str
    function: re.Pattern[str]  # after OPEN (and whitespace): the function's name in group 1
    key_open: str  # what begins a parameter, up to its name
    key_close: str  # what ends its name (Qwen: ">", GLM: "</arg_key>", then "<arg_value>")
    value_close: str  # what ends its value
    function_close: str  # what ends the call's parameters (Qwen: "</function>"; GLM: none, CLOSE does)
    trim_newlines: bool
    bare_function: bool  # a call may come without OPEN (Qwen3-Coder sometimes starts at <function=)


QWEN3_CODER = Dialect("qwen3-coder", re.compile(r"\s*<function=([^>\n]{1,200})>"), "<parameter=", ">",
                      "</parameter>", "</function>", trim_newlines=True, bare_function=True)
GLM45 = Dialect("glm-4.5", re.compile(r"([^<\n]{1,200}?)\s*(?=<arg_key>|</tool_call>)"), "<arg_key>",
                "</arg_key>", "</arg_value>", "", trim_newlines=False, bare_function=False)
VALUE_OPEN_GLM = "<arg_value>"


@dataclass
class _Call:
    index: int
    start: int  # where its raw text begins in the parser's ``_fed`` (given back as text if it is no call)
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    arguments: str = ""  # JSON text sent so far
    params: int = 0
    keys: set[str] = field(default_factory=set)  # the parameters given so far
    known: bool = True


class TaggedCallParser(Thinking):
    """Feed text deltas in, get events out; ``finish()`` flushes what is held back."""

    def __init__(self, dialect: Dialect, *, tools: bool, reasoning: bool,
                 functions: Mapping[str, Mapping[str, Any]] | None = None, opened: bool = False) -> None:
        super().__init__(reasoning=reasoning, opened=opened)
        self.dialect = dialect
        self.tools = tools
        self.functions = functions  # name -> parameters schema of the offered functions (None: any, untyped)
        self.calls: list[ToolCallEnd] = []
        self._call: _Call | None = None
        self._param: str | None = None  # the parameter whose value is being read
        self._value_sent = 0  # characters of the current string value streamed
        self._value_string = True
        self._value_nullable = False  # a string or null: "null" is null, so the quote waits until it cannot be
        self._value_opened = False  # the string value's opening quote was sent
        self._value_trimmed = False  # its leading newline was looked at (and dropped if there)
        self._fed = ""  # the text since the last plain text: a call's raw text, given back if it is no call
        markers = [OPEN]
        if dialect.bare_function:
            markers.append("<function=")
        self._markers = tuple(markers)

    def feed(self, text: str) -> list[Event]:
        self._fed += text
        return super().feed(text)

    # -- states --------------------------------------------------------------------------------

    def _advance(self, events: list[Event], final: bool) -> bool:
        handler = {"think?": self._think_open, "think": self._think, "start": self._start, "text": self._text,
                   "function": self._function, "params": self._params, "value": self._value,
                   "after": self._after}[self._state]
        return handler(events, final)

    def _start(self, events: list[Event], final: bool) -> bool:
        self._state = "text"
        return True

    def _text(self, events: list[Event], final: bool) -> bool:
        found = self._text_until(events, final, self._markers if self.tools else ())
        self._fed = self._buffer  # what came before was text: only a call's raw text is kept
        if found is None:
            return False
        position, marker = found
        self._call = _Call(len(self.calls), len(self._buffer[:position].rstrip()))
        if marker == OPEN:
            self._buffer = self._buffer[position + len(OPEN):]
        else:  # <function= without <tool_call>: the same call
            self._buffer = self._buffer[position:]
        self._state = "function"
        return True

    def _function(self, events: list[Event], final: bool) -> bool:
        call = self._call
        assert call is not None
        match = self.dialect.function.match(self._buffer)
        if match is None:
            limit = 240
            if final or len(self._buffer) > limit or (self.dialect is QWEN3_CODER and not _may_open(self._buffer)):
                self._not_a_call(events)  # not the call it looked like: text
                return True
            return False
        name = match.group(1).strip()
        call.name = name
        self._buffer = self._buffer[match.end():]
        call.known = bool(name) and (self.functions is None or name in self.functions)
        if call.known:
            events.append(ToolCallStart(call.index, call.id, name))
        self._state = "params"
        return True

    def _params(self, events: list[Event], final: bool) -> bool:
        """Between parameters: the next one, the end of the function, or the end of the call."""
        call = self._call
        assert call is not None
        stripped = self._buffer.lstrip()
        dialect = self.dialect
        for closer in filter(None, (dialect.function_close, CLOSE)):
            if stripped.startswith(closer):
                self._buffer = stripped[len(closer):]
                if closer == CLOSE:
                    self._end_call(events)
                    self._state = "start"
                else:
                    self._state = "after"
                return True
        if stripped.startswith(dialect.key_open):
            rest = stripped[len(dialect.key_open):]
            end = rest.find(dialect.key_close)
            if end == -1:
                if final or len(rest) > 400:
                    self._buffer = ""  # a parameter cut off in its own tag: nothing of it was written yet
                    self._end_call(events, broken=True)
                    return True
                return False
            key = rest[:end].strip()
            after = rest[end + len(dialect.key_close):]
            if dialect is GLM45:
                after_stripped = after.lstrip()
                if not after_stripped.startswith(VALUE_OPEN_GLM):
                    if not final and VALUE_OPEN_GLM.startswith(after_stripped):
                        return False
                    self._end_call(events, broken=True)
                    return True
                after = after_stripped[len(VALUE_OPEN_GLM):]
            self._buffer = after
            self._begin_value(events, key)
            return True
        if not final and any(tag.startswith(stripped) for tag in filter(None, (dialect.key_open, CLOSE,
                                                                                 dialect.function_close))):
            return False
        if not stripped and not final:
            return False
        self._end_call(events, broken=True)  # a stray word, or the end of the output inside a call
        return True

    def _after(self, events: list[Event], final: bool) -> bool:
        """After ``</function>``: the ``</tool_call>`` that should follow (a model may leave it out)."""
        call = self._call
        assert call is not None
        stripped = self._buffer.lstrip()
        if stripped.startswith(CLOSE):
            self._buffer = stripped[len(CLOSE):]
        elif not final and CLOSE.startswith(stripped):
            return False
        self._end_call(events)
        self._state = "start"
        return True

    # -- values ----------------------------------------------------------------------------------

    def _begin_value(self, events: list[Event], key: str) -> None:
        call = self._call
        assert call is not None
        self._param = key
        call.keys.add(key)
        self._value_sent = 0
        schema = (self.functions or {}).get(call.name or "", {})
        self._value_string = string_typed(schema, key)
        self._value_nullable = self._value_string and nullable(schema, key)
        self._value_opened = self._value_string and not self._value_nullable
        self._value_trimmed = False
        head = ("{" if not call.params else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._send(events, head + ('"' if self._value_opened else ""))
        call.params += 1
        self._state = "value"

    def _value(self, events: list[Event], final: bool) -> bool:
        dialect = self.dialect
        buffer = self._buffer
        search = 0
        while True:
            at = buffer.find(dialect.value_close, search)
            if at == -1:
                break
            verdict = self._closes(buffer[at + len(dialect.value_close):], final)
            if verdict is None:  # cannot tell yet
                self._stream_value(events, buffer, at)
                return False
            if verdict:
                self._end_value(events, buffer[:at])
                call = self._call
                assert call is not None
                self._buffer = buffer[at + len(dialect.value_close):]
                self._state = "params"
                return True
            search = at + 1  # the tag is part of the value (code that mentions it)
        if final:
            self._end_value(events, buffer)
            self._buffer = ""
            self._end_call(events, broken=True)
            return True
        self._stream_value(events, buffer, len(buffer) - partial_suffix(buffer, (dialect.value_close,)))
        return False

    def _closes(self, after: str, final: bool) -> bool | None:
        """Whether a closing tag followed by ``after`` ends the value: the next tag must follow it, and a next
        parameter must be one the function takes and was not given yet (code that writes such tags stays code)."""
        stripped = after.lstrip()
        dialect = self.dialect
        if stripped.startswith(dialect.key_open):
            rest = stripped[len(dialect.key_open):]
            end = rest.find(dialect.key_close)
            if end == -1:
                return (True if final else None) if len(rest) < 200 else False
            return self._may_follow(rest[:end].strip())
        if dialect.function_close and stripped.startswith(dialect.function_close):
            tail = stripped[len(dialect.function_close):].lstrip()  # the call's end, or the next call
            if tail.startswith((CLOSE, OPEN)):
                return True
            if not tail or CLOSE.startswith(tail) or OPEN.startswith(tail):
                return True if final else None
            return False
        nexts = [tag for tag in (dialect.function_close, CLOSE) if tag]
        if any(stripped.startswith(tag) for tag in nexts):
            return True
        nexts.append(dialect.key_open)
        if not stripped:
            return True if final else None
        if any(tag.startswith(stripped) for tag in nexts):
            return True if final else None
        return False

    def _may_follow(self, key: str) -> bool:
        call = self._call
        assert call is not None
        properties = (self.functions or {}).get(call.name or "", {}).get("properties")
        if key in call.keys:
            return False
        return not isinstance(properties, Mapping) or not properties or key in properties

    def _stream_value(self, events: list[Event], buffer: str, upto: int) -> None:
        """Send the string value's text up to ``upto`` (less what newline trimming may still take)."""
        if not self._value_string:
            return
        text = buffer[:upto]
        if self.dialect.trim_newlines:
            if not self._value_trimmed and text:
                self._value_trimmed = True
                if text.startswith("\n"):
                    text = text[1:]
                    self._buffer = buffer = buffer[1:]
                    upto -= 1
            if text.endswith("\n"):
                text = text[:-1]  # it may be the newline before the closing tag
        if not self._value_opened:
            if "null".startswith(text):
                return  # it may still be null
            self._send(events, '"')
            self._value_opened = True
        if len(text) > self._value_sent:
            self._send(events, json.dumps(text[self._value_sent:], ensure_ascii=False)[1:-1])
            self._value_sent = len(text)

    def _end_value(self, events: list[Event], raw: str) -> None:
        value = raw
        if self.dialect.trim_newlines:
            if value.startswith("\n") and not self._value_trimmed:
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
        if self._value_string and not self._value_opened and value == "null":
            self._send(events, "null")
        elif self._value_string:
            opening = "" if self._value_opened else '"'
            self._send(events, opening + json.dumps(value[self._value_sent:], ensure_ascii=False)[1:-1] + '"')
        else:
            self._send(events, json.dumps(_typed(value), ensure_ascii=False))
        self._param = None
        self._value_sent = 0

    # -- calls -----------------------------------------------------------------------------------

    def _send(self, events: list[Event], text: str) -> None:
        call = self._call
        assert call is not None
        call.arguments += text
        if call.known and text:
            events.append(ToolCallDelta(call.index, text))

    def _end_call(self, events: list[Event], *, broken: bool = False) -> None:
        """Close the call (a truncated one too: what was written is kept, the JSON made whole)."""
        call = self._call
        assert call is not None
        if self._state == "value" and self._param is not None:
            self._end_value(events, self._buffer)
            self._buffer = ""
        if not call.known:
            self._call = None
            self.emit_text(events, self._raw(call) + (self._buffer if broken else ""))
            if broken:
                self._buffer = ""
            self._state = "start"
            return
        self._send(events, "}" if call.params else "{}")
        self._call = None
        end = ToolCallEnd(call.index, call.id, call.name or "", call.arguments)
        self.calls.append(end)
        events.append(end)
        self._state = "start"

    def _not_a_call(self, events: list[Event]) -> None:
        call = self._call
        assert call is not None
        self._call = None
        self.emit_text(events, self._raw(call))
        self._state = "text"
        if self._buffer.startswith("<function="):  # a bare "<function=" that was not one: text, look past it
            self.emit_text(events, self._buffer[:1])
            self._buffer = self._buffer[1:]

    def _raw(self, call: _Call) -> str:
        """The call's text as written, from its marker to what is consumed."""
        return self._fed[call.start:len(self._fed) - len(self._buffer)]

    def _finish_open(self, events: list[Event]) -> None:
        if self._call is not None:
            if self._state == "function":
                self._not_a_call(events)
            else:
                self._end_call(events, broken=True)


def _may_open(text: str) -> bool:
    stripped = text.lstrip()
    return "<function=".startswith(stripped[:10]) or stripped.startswith("<function=")


def _typed(value: str) -> Any:
    """A non-string parameter's value: JSON when it parses as JSON, else the text itself."""
    try:
        return json.loads(value)
    except ValueError:
        stripped = value.strip()
        if stripped in ("True", "False"):
            return stripped == "True"
        return value
