"""Constrained generation: grammars built from JSON schemas and tool definitions (worker side).

The daemon describes a constraint (``protocol.Constraint``); the worker turns it into a grammar for its engine:
GBNF through llama-cpp-python's JSON-schema converter for llama.cpp, a Lark grammar with embedded JSON schemas
for llguidance (the MLX engine). Both enforce the same calls and schemas. A schema that cannot be compiled
raises ``GrammarError``, which becomes a 400 for the request and leaves the worker serving.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from localai.engines.schema_refs import ANNOTATIONS, REF_HOMES, check_refs, dereferenced, flattened, hoisted
from localai.engines.schema_refs import GrammarError as GrammarError
from localai.engines.schema_refs import RefError as RefError
from localai.protocol import Constraint

HERMES_TRIGGER = "<tool_call>"
# Bounds the converter unrolls into one rule per step: Claude Code sends maxLength 524288, which becomes a
# grammar nested half a million levels deep and overflows llama.cpp's parser stack.
BOUNDS = {"maxLength": 512, "minLength": 64, "maxItems": 64, "minItems": 16, "maxProperties": 64,
          "minProperties": 16}
MAX_GRAMMAR_CHARS = 256 * 1024


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar; with a ``trigger`` it applies only once the model emits that word (a lazy grammar)."""

    text: str
    trigger: str | None = None


def sanitized(schema: Any) -> Any:
    """A schema the converter can turn into a grammar llama.cpp parses safely: annotations go (a schema of
    only a description means "any value"), and bounds too large to unroll are dropped."""
    if isinstance(schema, list):
        return [sanitized(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in BOUNDS and isinstance(value, int) and value > BOUNDS[key]:
            continue
        if key == "pattern" and isinstance(value, str) and len(value) > 200:
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            result[key] = {name: sanitized(sub) for name, sub in value.items()}
        else:
            result[key] = sanitized(value)
    return result


def schema_grammar(schema: dict[str, Any], prop_order: list[str] | None = None) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # only llama.cpp workers build GBNF

    schema = flattened(schema)  # its references checked and made ones the converter reads right, allOf merged
    if isinstance(schema.get("$ref"), str):
        # the converter follows a root's $ref without reading its siblings, so the references inside the
        # definitions beside it were never resolved (a KeyError): the reference goes one level down
        schema = {**{key: schema[key] for key in REF_HOMES if key in schema},
                  "anyOf": [{key: value for key, value in schema.items() if key not in REF_HOMES}]}
    try:
        text = str(json_schema_to_gbnf(json.dumps(sanitized(schema)), prop_order))
    except Exception as exc:  # the converter raises whatever it meets: keep it a request error
        raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {type(exc).__name__}: {exc}") from exc
    # The converter's string characters admit raw control characters, which JSON forbids inside strings
    # (a newline in a value made the output unparseable); exclude them as llama.cpp's own converter does.
    text = text.replace(r'char ::= [^"\\]', r'char ::= [^"\\\x7F\x00-\x1F]')
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the JSON schema makes a grammar of {len(text)} characters, over the limit of "
                           f"{MAX_GRAMMAR_CHARS}; simplify it")
    return text


def _arguments_schema(parameters: Any, check: Any, name: str = "", forced: bool = True) -> dict[str, Any]:
    """A tool's parameters (tool ``name``'s) if they convert; otherwise any JSON object (an agent's call must not
    fail). In a ``forced`` call a reference in them that leaves them or points to nothing is a RefError all the
    same: the client asked for a call of that schema, which is wrong whatever the engine can compile, and is told
    which reference. A lazy grammar (``auto``) keeps the agent's other calls going: that tool takes any object."""
    if isinstance(parameters, dict) and parameters:
        try:
            check_refs(parameters)
        except RefError as exc:
            if not forced:
                return {"type": "object"}
            raise RefError(f"tool {name[:100]!r}: {exc}") from None
        try:
            check(parameters)
            return parameters
        except GrammarError:
            pass
    return {"type": "object"}


def _renamed_root(gbnf: str, name: str) -> str:
    return re.sub(r"^root ::=", f"{name} ::=", gbnf, flags=re.MULTILINE)


def call_schema(constraint: Constraint, check: Any = None) -> tuple[dict[str, Any], str, str]:
    """The JSON schema of one call of any of the constraint's tools, its arguments key and the call style.
    ``check(schema)`` raises GrammarError for a tool's parameters the engine cannot compile (that tool then
    takes any object: an agent's call must not fail)."""
    tools = constraint.get("tools") or []
    if not tools:
        raise GrammarError("a tool call was required but no tools were given")
    style = constraint.get("format", "hermes")
    key = "parameters" if style == "llama3" else "arguments"
    choices = []
    definitions: dict[str, Any] = {}
    for number, tool in enumerate(tools):
        parameters = _arguments_schema(tool.get("parameters"), check or schema_grammar, tool["name"],
                                       forced=not constraint.get("lazy"))
        arguments, defined = _hoisted_arguments(parameters, f"t{number}")
        definitions.update(defined)
        choices.append({
            "type": "object", "properties": {"name": {"const": tool["name"]}, key: arguments},
            "required": ["name", key], "additionalProperties": False,
        })
    schema = choices[0] if len(choices) == 1 else {"oneOf": choices}
    return ({**schema, "$defs": definitions} if definitions else schema), key, style


def _hoisted_arguments(arguments: dict[str, Any], tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tool's arguments schema (from ``_arguments_schema``) and its definitions, ``hoisted`` under ``tag``."""
    try:
        return hoisted(arguments, tag)
    except GrammarError:
        return {"type": "object"}, {}  # as for any schema that does not compile: the call takes any object


# The forced call in each family's own syntax. Its markers are written as text: llama.cpp matches a grammar's
# literals against token pieces with special tokens spelled out, so "<|channel|>" is the model's own special token.
BAR, SPACE = "\uff5c", "\u2581"
JSON_ARGUMENT_CALLS = {  # format: (before the name, between the name and the JSON arguments, after them)
    "harmony": ("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", ""),
    "deepseek-v3.1": (f"<{BAR}tool{SPACE}calls{SPACE}begin{BAR}><{BAR}tool{SPACE}call{SPACE}begin{BAR}>",
                      f"<{BAR}tool{SPACE}sep{BAR}>",
                      f"<{BAR}tool{SPACE}call{SPACE}end{BAR}><{BAR}tool{SPACE}calls{SPACE}end{BAR}>"),
    "mistral-args": ("[TOOL_CALLS]", "[ARGS]", ""),
}
TAGGED_CALLS = {  # format: (call open, name open, name close, key open, key close, value close, call close)
    "qwen3-coder": ("<tool_call>\n", "<function=", ">\n", "<parameter=", ">\n", "\n</parameter>\n",
                    "</function>\n</tool_call>"),
    # GLM-4.5/4.6 break lines between the tags, GLM-4.7 does not (the grammar makes the breaks optional)
    "glm-4.5": ("<tool_call>", "", "\n", "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n", "</tool_call>"),
}
NATIVE_FORCED = frozenset({*JSON_ARGUMENT_CALLS, *TAGGED_CALLS})
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z0-9-]+|.', re.S)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _prefixed(gbnf: str, prefix: str) -> str:
    """``gbnf`` with every rule it defines renamed ``prefix``-name (so several converted schemas share a grammar)."""
    names = set(re.findall(r"^([A-Za-z0-9-]+)\s*::=", gbnf, re.M))
    return "".join(f"{prefix}-{token}" if token in names else token
                   for token in (m.group(0) for m in _TOKEN.finditer(gbnf)))


def _optional_newlines(literal: str) -> str:
    """A literal whose line breaks are optional (GLM-4.7 writes its tags without them)."""
    parts = literal.split("\n")
    return " ".join(item for n, part in enumerate(parts)
                    for item in ([_literal(part)] if part else []) + (['"\\n"?'] if n < len(parts) - 1 else []))


def _text_without(name: str, tag: str) -> str:
    """Rules ``name``-0... for any text that does not hold ``tag`` (which starts with "<" and has no other)."""
    def chars(*excluded: str) -> str:
        return "[^" + "".join("\\" + c if c in "]\\^-" else c for c in excluded) + "]"

    rules = [f'{name}-0 ::= ({chars("<")} {name}-0 | "<" {name}-1)?']
    for index in range(1, len(tag)):
        nxt = tag[index]
        going = [] if index == len(tag) - 1 else [f"{_literal(nxt)} {name}-{index + 1}"]
        rules.append(f"{name}-{index} ::= (" + " | ".join(
            [*going, f'"<" {name}-1', f"{chars(nxt, '<')} {name}-0"]) + ")?")
    return "\n".join(rules)


def _is_text(schema: Any) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind in (None, "string") or (isinstance(kind, list) and "string" in kind)


@dataclass(frozen=True)
class TaggedParameter:
    """One parameter of a tagged call (Qwen3-Coder, GLM), as both engines' grammars write it: bare text up to the
    value's closing tag, one of its string ``enum`` values bare, or JSON of its schema (``schema``, with the
    definitions its references point to)."""

    key: str
    kind: str  # "text", "enum" or "json"
    schema: dict[str, Any]
    required: bool


def tagged_parameters(parameters: Any, tag: str, check: Any, name: str = "") -> list[TaggedParameter]:
    """A tool's parameters (tool ``name``'s) for a tagged call, the required first; ``check(schema)`` raises
    GrammarError for parameters the engine cannot compile (the tool then takes any object)."""
    arguments = _arguments_schema(parameters, check, name)
    arguments, definitions = _hoisted_arguments(arguments, tag)
    arguments = dereferenced(arguments, definitions)
    listed = arguments.get("properties")
    properties: dict[str, Any] = listed if isinstance(listed, dict) else {}
    required = [name for name in arguments.get("required") or [] if name in properties]
    result = []
    for key in [*required, *(name for name in properties if name not in required)]:
        seen = dereferenced(properties[key], definitions)
        choices = seen.get("enum") if isinstance(seen, dict) else None
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            kind, schema = "enum", seen
        elif _is_text(seen):
            kind, schema = "text", seen if isinstance(seen, dict) else {}
        else:
            own = properties[key] if isinstance(properties[key], dict) else {}
            kind, schema = "json", {**own, "$defs": definitions} if definitions else own
        result.append(TaggedParameter(key, kind, schema, key in required))
    return result


def native_call_grammar(constraint: Constraint, style: str) -> Grammar:
    """One call of any of the constraint's tools, written in ``style``'s own syntax."""
    tools = constraint.get("tools") or []
    if not tools:
        raise GrammarError("a tool call was required but no tools were given")
    rules: list[str] = []
    alternatives: list[str] = []
    for number, tool in enumerate(tools):
        prefix = f"t{number}"
        if style in JSON_ARGUMENT_CALLS:
            before, between, after = JSON_ARGUMENT_CALLS[style]
            arguments = _arguments_schema(tool.get("parameters"), schema_grammar, tool["name"])
            rules.append(_prefixed(schema_grammar(arguments), prefix))
            alternatives.append(" ".join(part for part in (
                _literal(before + tool["name"] + between), f"{prefix}-root", _literal(after) if after else "") if part))
            continue
        call_open, name_open, name_close, key_open, key_close, value_close, call_close = TAGGED_CALLS[style]
        loose = style == "glm-4.5"
        parameters = tagged_parameters(tool.get("parameters"), prefix, schema_grammar, tool["name"])
        params: list[str] = []
        for index, parameter in enumerate(parameters):
            value = f"{prefix}-v{index}"
            if parameter.kind == "enum":  # written bare, unquoted
                rules.append(f"{value} ::= " + " | ".join(_literal(c) for c in parameter.schema["enum"]))
            elif parameter.kind == "text":
                rules.append(_text_without(value, value_close.strip("\n")))
                value += "-0"
            else:
                rules.append(_prefixed(schema_grammar(parameter.schema), value))
                value += "-root"
            opening = _literal(key_open + parameter.key) + " " + (
                _optional_newlines(key_close) if loose else _literal(key_close))
            closing = _optional_newlines(value_close) if loose else _literal(value_close)
            rules.append(f"{prefix}-p{index} ::= {opening} {value} {closing}")
            params.append(f"{prefix}-p{index}")
        required = [p for p in parameters if p.required]
        given = " ".join(params[:len(required)])
        optional = params[len(required):]
        body = " ".join(part for part in (given, f"({' | '.join(optional)})*" if optional else "") if part)
        head = _literal(call_open + name_open + tool["name"]) + " " + (
            _optional_newlines(name_close) if loose else _literal(name_close))
        alternatives.append(" ".join(part for part in (head, body, _literal(call_close)) if part))
    return Grammar("\n".join(["root ::= " + " | ".join(f"({a})" for a in alternatives), *rules]))


def tool_call_grammar(constraint: Constraint) -> Grammar:
    """One (forced) or any number of (lazy, after ``<tool_call>``) calls of the given tools."""
    if constraint.get("format") in NATIVE_FORCED and not constraint.get("lazy"):
        return native_call_grammar(constraint, str(constraint.get("format")))
    schema, key, style = call_schema(constraint)
    call = _renamed_root(schema_grammar(schema, ["name", key]), "tool-call")
    lazy = bool(constraint.get("lazy"))
    if style == "hermes":
        block = 'tool-block ::= "<tool_call>" "\\n"? tool-call "\\n"? "</tool_call>"'
        root = 'root ::= tool-block ("\\n" tool-block)*' if lazy else "root ::= tool-block"
        return Grammar("\n".join([root, block, call]), HERMES_TRIGGER if lazy else None)
    if lazy:
        raise GrammarError(f"lazy tool grammars are only built for the hermes format, not {style}")
    if style == "mistral":
        return Grammar("\n".join(['root ::= "[" tool-call ("," " "? tool-call)* "]"', call]))
    return Grammar("\n".join(["root ::= tool-call", call]))


def grammar_for(constraint: Constraint | None) -> Grammar | None:
    """The grammar that enforces ``constraint``, or None when generation is free."""
    if not constraint:
        return None
    kind = constraint.get("type")
    if kind == "json_object":
        return Grammar(schema_grammar({"type": "object"}))
    if kind == "json_schema":
        schema = constraint.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        return Grammar(schema_grammar(schema))
    if kind == "tool_call":
        return tool_call_grammar(constraint)
    raise GrammarError(f"unknown constraint type {kind!r}")


# -- llguidance (the MLX engine) -----------------------------------------------------------------------------

def closed(schema: Any) -> Any:
    """Objects that list their properties take no others unless they say so: llama.cpp's converter reads a
    missing ``additionalProperties`` that way, JSON Schema (and llguidance) the other way. Both engines keep to
    the properties a client listed, so a forced call's arguments never grow keys the tool does not take."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: (({name: closed(sub) for name, sub in value.items()} if isinstance(value, dict) else value)
                    if key in ("properties", "$defs", "definitions", "patternProperties") else closed(value))
              for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        result["additionalProperties"] = False
    return result


# Between JSON tokens: nothing, a space, or a line break and an indent (llama.cpp's converter allows the same).
# llguidance's default is any run of whitespace, which a model can write for ever inside a forced call.
LLGUIDANCE_WHITESPACE = {"whitespace_pattern": "(?: |\n[ \t]{0,20})?"}


def llguidance_schema(schema: Any) -> Any:
    """A JSON schema as llguidance compiles it here: sanitized, closed, whitespace bounded as llama.cpp's."""
    bounded = closed(sanitized(schema))
    return {**bounded, "x-guidance": LLGUIDANCE_WHITESPACE} if isinstance(bounded, dict) else bounded


def lark_for(constraint: Constraint | None, validate: Any) -> str | None:
    """The llguidance grammar that enforces ``constraint``, or None when generation is free (and for lazy tool
    calls, whose grammar applies from their trigger: ``lark_calls.lazy_call_grammar``). ``validate(grammar)``
    returns an error message or "" (``LLMatcher.validate_grammar`` with the model's tokenizer)."""
    from llguidance import LLMatcher

    def compiled(schema: dict[str, Any]) -> str:
        check_refs(schema)  # llguidance resolves references itself, but takes some that point to nothing
        grammar = str(LLMatcher.grammar_from_json_schema(json.dumps(llguidance_schema(schema))))
        error = validate(grammar)
        if error:
            raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {error}")
        return grammar

    if not constraint:
        return None
    kind = constraint.get("type")
    if kind == "json_object":
        return compiled({"type": "object"})
    if kind == "json_schema":
        schema = constraint.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        return compiled(schema)
    if kind != "tool_call":
        raise GrammarError(f"unknown constraint type {kind!r}")
    if constraint.get("lazy"):
        return None
    schema, _, style = call_schema(constraint, compiled)
    call = "call: %json " + json.dumps(llguidance_schema(schema))
    start = {"hermes": 'start: "<tool_call>\\n" call "\\n</tool_call>"',
             "mistral": 'start: "[" call ("," call)* "]"'}.get(style, "start: call")
    grammar = str(LLMatcher.grammar_from_lark(f"{start}\n{call}"))
    error = validate(grammar)
    if error:
        raise GrammarError(f"the tools cannot be compiled to a grammar: {error}")
    return grammar
