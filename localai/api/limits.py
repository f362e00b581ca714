"""What a request body may hold, checked before any handler sees it (HTTP bodies and WebSocket messages alike).

JSON no handler can use safely (non-finite or huge numbers, lone UTF-16 surrogates, nesting deeper than
``MAX_DEPTH``) is refused, and so is a body too big in the ways that make every later step slow: more than
``MAX_VALUES`` JSON values, more than ``MAX_ITEMS`` messages or input items, more than ``MAX_TOOLS`` tools, a tool's
definition over ``MAX_TOOL_BYTES`` or all of them over ``MAX_TOOLS_BYTES``. Real requests stay far under each: an
agent's 200k-token conversation is a few thousand messages and a few hundred thousand values; its tools, tens of
kilobytes each. Large bodies are checked in a process of their own (``body_check.py``), so parsing them never holds
the daemon's event loop.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 100  # JSON nesting; real requests (tool schemas included) stay under 20
MAX_VALUES = 500_000  # JSON values in one body: bounds what parsing and validating it cost
MAX_ITEMS = 10_000  # messages (chat, Messages, Ollama), input items (Responses), system blocks
MAX_TOOLS = 512
MAX_TOOL_BYTES = 1 << 20  # one tool's definition, as JSON
MAX_TOOLS_BYTES = 4 << 20  # all of a request's tools
LISTS = ("messages", "input", "system", "contents")  # the fields that hold a conversation, in every dialect
PARSED = "localai.json"  # the scope key holding a body's parsed value (for api/common.ParsedBodyRoute)
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyProblem(ValueError):
    """Why a JSON body is refused before any handler sees it; ``status`` is its HTTP status (400 or 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyProblem(f"the number {text[:20]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise BodyProblem(f"{name} is not a JSON number")


def parse(body: bytes | str) -> Any:
    """The JSON value of a body; BodyProblem for what cannot be used safely, ValueError for what is not JSON."""
    try:
        return json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise BodyProblem(f"the JSON body is nested more than {MAX_DEPTH} levels deep") from None


def check_value(value: Any) -> None:
    """Raise BodyProblem when a parsed value holds lone surrogates, huge integers, nesting deeper than
    ``MAX_DEPTH`` or more than ``MAX_VALUES`` values."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise BodyProblem(f"the JSON body holds more than {MAX_VALUES} values", 413)
        if isinstance(item, str):
            match = _SURROGATE.search(item)
            if match:
                raise BodyProblem(f"a string holds a lone UTF-16 surrogate (\\u{ord(match.group()):04x}); "
                                  "send valid Unicode")
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 1 << 64:
            raise BodyProblem(f"the integer {str(item)[:20]}... is out of range")
        elif isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise BodyProblem(f"the JSON body is nested more than {MAX_DEPTH} levels deep")
            children = item.items() if isinstance(item, dict) else ((None, child) for child in item)
            for key, child in children:
                if key is not None:
                    stack.append((key, depth))
                stack.append((child, depth + 1))


def check_shape(value: Any) -> None:
    """Raise BodyProblem (413, naming the field) for more messages, input items or tools than a request may
    have, or a tool definition too large. Cheap: lengths first, each tool serialized once."""
    if not isinstance(value, dict):
        return
    for name in LISTS:
        items = value.get(name)
        if isinstance(items, list) and len(items) > MAX_ITEMS:
            raise BodyProblem(f"'{name}' holds {len(items)} items; a request may hold at most {MAX_ITEMS}", 413)
    tools = value.get("tools")
    if not isinstance(tools, list):
        return
    if len(tools) > MAX_TOOLS:
        raise BodyProblem(f"'tools' holds {len(tools)} tools; a request may hold at most {MAX_TOOLS}", 413)
    total = 0
    for index, tool in enumerate(tools):
        size = len(json.dumps(tool, ensure_ascii=False))
        if size > MAX_TOOL_BYTES:
            raise BodyProblem(f"tools.{index} is {size} bytes of JSON; a tool's definition may be at most "
                              f"{MAX_TOOL_BYTES} bytes", 413)
        total += size
        if total > MAX_TOOLS_BYTES:
            raise BodyProblem(f"the tools are over {MAX_TOOLS_BYTES} bytes of JSON together", 413)


def check_json(body: bytes | str) -> Any:
    """The parsed body when it is JSON a handler can use, None when it is not JSON at all (left to the handler's
    own validation); raises BodyProblem for the rest. The shape is checked before the walk over every value, so
    a body with 200,000 messages is refused right after parsing."""
    try:
        value = parse(body)
    except BodyProblem:
        raise
    except ValueError:
        return None
    check_shape(value)
    check_value(value)
    return value
