"""Constrained generation: GBNF grammars built from JSON schemas and tool definitions (worker side).

The daemon describes a constraint (``protocol.Constraint``); the worker turns it into a grammar
with llama-cpp-python's JSON-schema converter. A schema that cannot be compiled raises
``ValueError``, which becomes a 400 for the request and leaves the worker serving.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_grammar import json_schema_to_gbnf

from localai.protocol import Constraint

HERMES_TRIGGER = r"[\s\S]*?(<tool_call>[\s\S]*)"


class GrammarError(ValueError):
    """The request's schema or tools cannot become a grammar: the request's fault, not the worker's."""


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar; with ``triggers`` it only applies from the first match (a lazy grammar)."""

    text: str
    triggers: tuple[str, ...] = ()


def schema_grammar(schema: dict[str, Any], prop_order: list[str] | None = None) -> str:
    try:
        return str(json_schema_to_gbnf(json.dumps(schema), prop_order))
    except Exception as exc:  # the converter raises whatever it meets: keep it a request error
        raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {type(exc).__name__}: {exc}") from exc


def _renamed_root(gbnf: str, name: str) -> str:
    return re.sub(r"^root ::=", f"{name} ::=", gbnf, flags=re.MULTILINE)


def tool_call_grammar(constraint: Constraint) -> Grammar:
    """One (forced) or any number of (lazy, after ``<tool_call>``) calls of the given tools."""
    tools = constraint.get("tools") or []
    if not tools:
        raise GrammarError("a tool call was required but no tools were given")
    style = constraint.get("format", "hermes")
    key = "parameters" if style == "llama3" else "arguments"
    choices = []
    for tool in tools:
        parameters = tool.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise GrammarError(f"the parameters of tool '{tool.get('name')}' are not a JSON schema object")
        choices.append({
            "type": "object", "properties": {"name": {"const": tool["name"]}, key: parameters},
            "required": ["name", key], "additionalProperties": False,
        })
    schema = choices[0] if len(choices) == 1 else {"oneOf": choices}
    call = _renamed_root(schema_grammar(schema, ["name", key]), "tool-call")
    lazy = bool(constraint.get("lazy"))
    if style == "hermes":
        block = 'tool-block ::= "<tool_call>" "\\n"? tool-call "\\n"? "</tool_call>"'
        root = 'root ::= tool-block ("\\n" tool-block)*' if lazy else "root ::= tool-block"
        return Grammar("\n".join([root, block, call]), (HERMES_TRIGGER,) if lazy else ())
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
