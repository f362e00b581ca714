"""A forced tool call in its family's own syntax, as an llguidance Lark grammar (the MLX engine's grammars).

The markers are the same as the llama.cpp engine's (``grammars.JSON_ARGUMENT_CALLS`` and ``TAGGED_CALLS``), but
llguidance matches a special token only by its id, never by the text it stands for: each marker is cut into the
model's special tokens (written ``<[id]>``) and plain text (a quoted literal). A marker the tokenizer has no special
token for stays text, which the model can still write and the parser still reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from localai.engines.grammars import (
    HERMES_TRIGGER,
    JSON_ARGUMENT_CALLS,
    TAGGED_CALLS,
    GrammarError,
    _arguments_schema,
    call_schema,
    llguidance_schema,
    tagged_parameters,
)
from localai.protocol import Constraint

HERMES_CLOSE = "</tool_call>"
SpecialIds = dict[str, int]  # a special token's text -> its id


def marker(text: str, specials: SpecialIds) -> str:
    """``text`` as a sequence of Lark items: the special tokens it holds by id, the rest as literals."""
    if not text:
        return ""
    names = sorted((name for name in specials if name and name in text), key=len, reverse=True)
    if not names:
        return json.dumps(text, ensure_ascii=False)
    pattern = re.compile("|".join(re.escape(name) for name in names))
    items, position = [], 0
    for found in pattern.finditer(text):
        if found.start() > position:
            items.append(json.dumps(text[position:found.start()], ensure_ascii=False))
        items.append(f"<[{specials[found.group(0)]}]>")
        position = found.end()
    if position < len(text):
        items.append(json.dumps(text[position:], ensure_ascii=False))
    return " ".join(items)


def _loose(text: str, specials: SpecialIds) -> str:
    """A marker whose line breaks are optional (GLM-4.7 writes its tags without them)."""
    parts = text.split("\n")
    items = []
    for index, part in enumerate(parts):
        if part:
            items.append(marker(part, specials))
        if index < len(parts) - 1:
            items.append('"\\n"?')
    return " ".join(items)


def _schema(schema: Any) -> str:
    return "%json " + json.dumps(llguidance_schema(schema))


def native_call_lark(constraint: Constraint, style: str, specials: SpecialIds,
                     check: Callable[[dict[str, Any]], Any]) -> str:
    """Lark for one call of any of the constraint's tools, in ``style``'s syntax. ``check(schema)`` raises
    GrammarError for a tool's parameters llguidance cannot compile (that tool then takes any object)."""
    tools = constraint.get("tools") or []
    if not tools:
        raise GrammarError("a tool call was required but no tools were given")
    rules: list[str] = []
    alternatives: list[str] = []
    for number, tool in enumerate(tools):
        prefix = f"t{number}"
        if style in JSON_ARGUMENT_CALLS:
            before, between, after = JSON_ARGUMENT_CALLS[style]
            rules.append(f"{prefix}_args: {_schema(_arguments_schema(tool.get('parameters'), check, tool['name']))}")
            alternatives.append(" ".join(item for item in (
                marker(before + tool["name"] + between, specials), f"{prefix}_args", marker(after, specials))
                if item))
            continue
        if style not in TAGGED_CALLS:
            raise GrammarError(f"no grammar is built for {style!r} tool calls")
        call_open, name_open, name_close, key_open, key_close, value_close, call_close = TAGGED_CALLS[style]
        spaced = _loose if style == "glm-4.5" else marker
        close_tag = value_close.strip("\n")
        after_tag = value_close[value_close.index(close_tag) + len(close_tag):]
        closing = re.escape(close_tag).replace("/", "\\/")
        params = []
        for index, parameter in enumerate(tagged_parameters(tool.get("parameters"), prefix, check, tool["name"])):
            value = f"{prefix}_v{index}"
            value_end = value_close  # what follows the value (a lexeme with a suffix has written its tag)
            if parameter.kind == "enum":  # written bare, unquoted
                rules.append(f"{value}: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                       for c in parameter.schema["enum"]))
            elif parameter.kind == "text":  # any text up to the value's closing tag, and its maxLength
                longest = parameter.schema.get("maxLength")
                length = f"{{0,{int(longest)}}}" if isinstance(longest, int) and longest >= 0 else "*"
                if marker(close_tag, specials).startswith("<["):  # a special token: no text can run into it
                    value = value.upper()
                    rules.append(f"{value}: /(?s:.{length})/ & ~/(?s:.*){closing}(?s:.*)/")
                else:
                    # The value ends where its closing tag is written: a lazy lexeme with the tag as its suffix (a
                    # greedy text lexeme went on through "\n</parameter" and could then never take the ">", so a
                    # model could not close a value without a maxLength)
                    suffix = json.dumps(value_close[:value_close.index(close_tag)] + close_tag, ensure_ascii=False)
                    rules.append(f"{value}[suffix={suffix}]: /(?s:.{length})/")
                    value_end = after_tag
            else:
                rules.append(f"{value}: {_schema(parameter.schema)}")
            rules.append(f"{prefix}_p{index}: {marker(key_open + parameter.key, specials)} "
                         f"{spaced(key_close, specials)} {value} {spaced(value_end, specials)}")
            # each optional parameter at most once, in the schema's order: a repeat of one, which a model could
            # write for ever, is not a call the tool takes
            params.append(f"{prefix}_p{index}" + ("" if parameter.required else "?"))
        head = f"{marker(call_open + name_open + tool['name'], specials)} {spaced(name_close, specials)}"
        alternatives.append(" ".join(item for item in (head, *params, marker(call_close, specials)) if item))
    return "\n".join(["start: " + " | ".join(f"({a})" for a in alternatives), *rules])


def _schema_check(validate: Callable[[str], str]) -> Callable[[dict[str, Any]], None]:
    """``check(schema)`` for a tool's parameters: GrammarError where llguidance cannot compile them (that tool then
    takes any object)."""
    from llguidance import LLMatcher

    def check(schema: dict[str, Any]) -> None:
        error = validate(str(LLMatcher.grammar_from_json_schema(json.dumps(llguidance_schema(schema)))))
        if error:
            raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {error}")

    return check


def forced_call_grammar(constraint: Constraint, specials: SpecialIds, validate: Callable[[str], str]) -> str:
    """The llguidance grammar of a forced call in its family's syntax; ``validate(grammar)`` returns an error or ""
    (``LLMatcher.validate_grammar`` with the model's tokenizer)."""
    from llguidance import LLMatcher

    grammar = str(LLMatcher.grammar_from_lark(native_call_lark(constraint, str(constraint.get("format")), specials,
                                                               _schema_check(validate))))
    error = validate(grammar)
    if error:
        raise GrammarError(f"the tools cannot be compiled to a grammar: {error}")
    return grammar


def lazy_call_grammar(constraint: Constraint, specials: SpecialIds, validate: Callable[[str], str]) -> str:
    """The llguidance grammar of what follows ``<tool_call>`` in an ``auto`` reply (the llama.cpp engine's lazy
    grammar, ``grammars.tool_call_grammar``, from its trigger on): the call, its closing tag, then any further
    calls, each in its own block, and nothing after them."""
    from llguidance import LLMatcher

    schema, _, style = call_schema(constraint, _schema_check(validate))
    if style != "hermes":
        raise GrammarError(f"lazy tool grammars are only built for the hermes format, not {style}")
    block_end = f'"\\n"? call "\\n"? {marker(HERMES_CLOSE, specials)}'
    lark = "\n".join([f'start: {block_end} ("\\n" {marker(HERMES_TRIGGER, specials)} {block_end})*',
                      f"call: {_schema(schema)}"])
    grammar = str(LLMatcher.grammar_from_lark(lark))
    error = validate(grammar)
    if error:
        raise GrammarError(f"the tools cannot be compiled to a grammar: {error}")
    return grammar
