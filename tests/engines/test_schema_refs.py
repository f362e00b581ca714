"""References and allOf in the schemas of forced calls and response formats (``engines/schema_refs.py``): resolved as
RFC 6901 says, merged where a grammar can hold them, and a reference that leaves the schema or points to nothing is
a GrammarError naming it, on both engines' grammars. What llama.cpp's grammar sampler lets through is the proof."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from localai.engines.grammars import GrammarError, RefError, grammar_for, lark_for
from localai.engines.schema_refs import flattened, ref_tokens
from tests.engines.test_grammars import accepted, hermes

# A probe's shape: names with "/" and "~" in them, as RFC 6901 escapes them, and a required integer behind an
# allOf of one reference (Pydantic writes a field with a description that way).
ESCAPED = {"type": "object", "required": ["x", "y", "w"], "additionalProperties": False,
           "properties": {"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/c~0d"},
                          "w": {"allOf": [{"$ref": "#/$defs/Count"}], "description": "how many"}},
           "$defs": {"a/b": {"type": "integer"}, "c~d": {"enum": ["p", "q"]}, "Count": {"type": "integer"}}}
GOOD = {"x": 1, "y": "q", "w": 3}
BROKEN = {
    "#/$defs/missing": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "$defs": {"b": {}}},
    "https://example.com/s.json#/x": {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json#/x"}}},
    "other.json": {"type": "object", "properties": {"a": {"$ref": "other.json"}}},
    "#/$defs/a/b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a/b"}}, "$defs": {"a/b": {}}},  # unescaped
    "#/properties/b/enum/7": {"type": "object", "properties": {"a": {"$ref": "#/properties/b/enum/7"},
                                                               "b": {"enum": [1]}}},
}


def forced(parameters: dict[str, Any], style: str = "hermes") -> Any:
    return {"type": "tool_call", "tools": [{"name": "f", "parameters": parameters}], "format": style}


def test_pointer_tokens_are_unescaped_as_rfc_6901_says() -> None:
    assert ref_tokens("#/$defs/a~1b") == ["$defs", "a/b"]
    assert ref_tokens("#/$defs/c~0d") == ["$defs", "c~d"]
    assert ref_tokens("#/$defs/~01") == ["$defs", "~1"]  # ~0 first would make it "/"
    assert ref_tokens("#/$defs/a%20b") == ["$defs", "a b"]  # a URI fragment, percent-decoded
    assert ref_tokens("#") == []


def test_escaped_refs_in_a_response_format_constrain_the_output(vocab: Any) -> None:
    grammar = grammar_for({"type": "json_schema", "schema": ESCAPED})
    assert grammar is not None
    assert accepted(vocab, grammar.text, json.dumps(GOOD)) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps(ESCAPED["$defs"]))[0] is False  # the definitions block
    assert accepted(vocab, grammar.text, json.dumps({**GOOD, "x": "1"}))[0] is False
    assert accepted(vocab, grammar.text, json.dumps({**GOOD, "y": "r"}))[0] is False
    assert accepted(vocab, grammar.text, json.dumps({**GOOD, "w": {}}))[0] is False  # allOf: an integer


@pytest.mark.parametrize("style", ["hermes", "qwen3-coder", "harmony"])
def test_escaped_refs_in_a_forced_call_constrain_its_arguments(vocab: Any, style: str) -> None:
    from localai.engines.scripted import native_call

    grammar = grammar_for(forced(ESCAPED, style))
    assert grammar is not None

    def call(arguments: Any) -> str:
        return hermes("f", arguments) if style == "hermes" else native_call(style, "f", arguments)

    assert accepted(vocab, grammar.text, call(GOOD)) == (True, True)
    assert accepted(vocab, grammar.text, call({"$defs": ESCAPED["$defs"]}))[0] is False
    assert accepted(vocab, grammar.text, call({**GOOD, "w": {}}))[0] is False
    assert accepted(vocab, grammar.text, call({**GOOD, "x": "a"}))[0] is False


def test_all_of_parts_are_merged_into_one_schema(vocab: Any) -> None:
    """Pydantic's model inheritance and a field's constraints on a referenced type: the parts' properties, requireds,
    types and bounds all hold."""
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
                        "Name": {"type": "string", "maxLength": 8}},
              "allOf": [{"$ref": "#/$defs/Base"},
                        {"properties": {"name": {"allOf": [{"$ref": "#/$defs/Name"}, {"minLength": 2}]}},
                         "required": ["name"]}]}
    grammar = grammar_for({"type": "json_schema", "schema": schema})
    assert grammar is not None
    assert accepted(vocab, grammar.text, json.dumps({"id": 1, "name": "ab"})) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps({"id": 1}))[1] is False  # name is required
    assert accepted(vocab, grammar.text, json.dumps({"name": "ab"}))[0] is False  # so is id (it comes first)
    assert accepted(vocab, grammar.text, json.dumps({"id": 1, "name": "a"}))[0] is False  # minLength 2
    assert accepted(vocab, grammar.text, json.dumps({"id": 1, "name": "abcdefghi"}))[0] is False  # maxLength 8


def test_all_of_with_alternatives_and_recursion(vocab: Any) -> None:
    """An allOf whose part is a choice: each alternative takes the other parts' keywords; a recursive definition
    behind an allOf still compiles."""
    schema = {"allOf": [{"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]},
                        {"anyOf": [{"properties": {"n": {"type": "integer"}}, "required": ["n"]},
                                   {"properties": {"s": {"type": "string"}}, "required": ["s"]}]}]}
    grammar = grammar_for({"type": "json_schema", "schema": schema})
    assert grammar is not None
    assert accepted(vocab, grammar.text, json.dumps({"kind": "a", "n": 1})) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps({"kind": "b", "s": "x"})) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps({"kind": "a", "n": "x"}))[0] is False
    tree = {"$ref": "#/$defs/Node", "$defs": {"Node": {"allOf": [{"$ref": "#/$defs/Named"}], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}, "required": ["kids"]},
        "Named": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
    grammar = grammar_for({"type": "json_schema", "schema": tree})
    assert grammar is not None
    nested = {"name": "r", "kids": [{"name": "k", "kids": []}]}
    assert accepted(vocab, grammar.text, json.dumps(nested)) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps({"name": "r", "kids": [{"kids": []}]}))[0] is False


def test_all_of_parts_that_cannot_both_hold_are_a_grammar_error() -> None:
    for schema, words in [({"allOf": [{"type": "string"}, {"type": "integer"}]}, "no value in common"),
                          ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "'pattern' two values"),
                          ({"$defs": {"L": {"allOf": [{"$ref": "#/$defs/L"}]}}, "$ref": "#/$defs/L"}, "itself"),
                          ({"allOf": [3]}, "must be schemas")]:
        with pytest.raises(GrammarError, match=words):
            grammar_for({"type": "json_schema", "schema": schema})


def test_references_sharing_a_last_token_or_a_propertys_name_keep_their_own_rules(vocab: Any) -> None:
    """The converter named a reference's rule after its last token: "#/$defs/A/properties/v" and "#/$defs/B/
    properties/v" were one rule, and a definition named like a property took that property's rule."""
    schema = {"type": "object", "required": ["P", "q", "r", "s"], "additionalProperties": False, "properties": {
        "P": {"enum": ["s"]}, "q": {"$ref": "#/$defs/P"},
        "r": {"$ref": "#/$defs/A/properties/v"}, "s": {"$ref": "#/$defs/B/properties/v"}},
        "$defs": {"P": {"enum": [1]}, "A": {"properties": {"v": {"enum": [True]}}},
                  "B": {"properties": {"v": {"enum": [None]}}}}}
    grammar = grammar_for({"type": "json_schema", "schema": schema})
    assert grammar is not None
    good = {"P": "s", "q": 1, "r": True, "s": None}
    assert accepted(vocab, grammar.text, json.dumps(good)) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps({**good, "q": "s"}))[0] is False
    assert accepted(vocab, grammar.text, json.dumps({**good, "s": True}))[0] is False


@pytest.mark.parametrize("ref", list(BROKEN))
def test_a_ref_that_leaves_the_schema_or_resolves_to_nothing_is_refused_naming_it(ref: str) -> None:
    """Malformed references: a missing definition, a URL, another document, a "/" that should be "~1", an index
    past a list's end. The schema is refused wherever it is, a tool's parameters included (which, when they only
    fail to compile, take any object instead), on llama.cpp's and on llguidance's grammars."""
    schema = BROKEN[ref]
    constraints = [{"type": "json_schema", "schema": schema}, forced(schema), forced(schema, "qwen3-coder"),
                   forced(schema, "harmony")]
    for constraint in constraints:
        with pytest.raises(RefError, match=re.escape(f"$ref {ref!r}")) as refused:
            grammar_for(constraint)  # type: ignore[arg-type]
        assert "AssertionError" not in str(refused.value)
        if constraint["type"] == "tool_call":
            assert str(refused.value).startswith("tool 'f': ")
    for constraint in constraints[:2]:
        with pytest.raises(RefError, match=re.escape(f"$ref {ref!r}")):
            lark_for(constraint, lambda _: "")  # type: ignore[arg-type]


def test_a_lazy_grammar_gives_a_tool_with_a_broken_ref_any_object() -> None:
    """With ``auto`` the agent chose no call: one tool's broken schema must not refuse every request of its
    session, so that tool takes any object, as a schema that does not compile does."""
    tools = [{"name": "broken", "parameters": BROKEN["#/$defs/missing"]}, {"name": "fine", "parameters": ESCAPED}]
    grammar = grammar_for({"type": "tool_call", "tools": tools, "format": "hermes", "lazy": True})  # type: ignore[typeddict-item]
    assert grammar is not None and grammar.trigger == "<tool_call>" and "missing" not in grammar.text
    from localai.engines.lark_calls import lazy_call_grammar

    assert lazy_call_grammar({"type": "tool_call", "tools": tools, "lazy": True}, {}, lambda _: "")  # type: ignore[typeddict-item]


def test_lark_grammars_take_escaped_refs() -> None:
    from llguidance import LLMatcher

    for constraint in ({"type": "json_schema", "schema": ESCAPED}, forced(ESCAPED)):
        grammar = lark_for(constraint, lambda _: "")  # type: ignore[arg-type]
        assert grammar is not None and LLMatcher.validate_grammar(grammar) == ""


def test_flattened_leaves_the_clients_schema_as_it_was() -> None:
    before = json.dumps(ESCAPED, sort_keys=True)
    flat = flattened(ESCAPED)
    assert json.dumps(ESCAPED, sort_keys=True) == before
    assert sorted(flat["$defs"]) == ["ref--Count", "ref--a-b", "ref--c-d"]
    assert flat["properties"]["w"] == {"type": "integer", "description": "how many"}
