"""Grammars from real agents' tool schemas: they must compile, and llama.cpp must parse them without crashing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llama_cpp as L
import pytest

from localai.engines.grammars import GrammarError, grammar_for, sanitized
from tests.parallel import threads

# The shape of Claude Code 2.1's Workflow tool: a typeless "any value" property and a 512 KiB maxLength,
# which unrolled naively overflows llama.cpp's grammar parser (the worker died with SIGSEGV).
WORKFLOW = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "additionalProperties": False,
            "properties": {"script": {"type": "string", "maxLength": 524288, "description": "code"},
                           "args": {"description": "any JSON value"},
                           "runId": {"type": "string", "pattern": "^wf_[a-z0-9-]{6,}$"}}}
STRANGE = {"type": "object", "properties": {"x": {"if": {"type": "string"}, "then": {"minLength": 1}}}}


def test_sanitized_drops_annotations_and_unrollable_bounds() -> None:
    clean = sanitized(WORKFLOW)
    assert "$schema" not in clean
    assert clean["properties"]["script"] == {"type": "string"}
    assert clean["properties"]["args"] == {}
    assert clean["properties"]["runId"]["pattern"] == "^wf_[a-z0-9-]{6,}$"
    assert sanitized({"type": "string", "maxLength": 40})["maxLength"] == 40


@pytest.mark.parametrize("lazy", [True, False])
def test_agent_tool_schemas_give_grammars_llama_cpp_accepts(vocab: Any, lazy: bool) -> None:
    tools = [{"name": "Workflow", "parameters": WORKFLOW}, {"name": "Odd", "parameters": STRANGE},
             {"name": "Bare", "parameters": {}}]
    grammar = grammar_for({"type": "tool_call", "tools": tools, "format": "hermes", "lazy": lazy})  # type: ignore[typeddict-item]
    assert grammar is not None and ('"\\"Workflow\\""' in grammar.text)
    if grammar.trigger:
        assert lazy and grammar.trigger == "<tool_call>"
        tokens = (L.llama_token * 1)(1)  # any token id: the grammar text is what llama.cpp parses here
        sampler = L.llama_sampler_init_grammar_lazy_patterns(vocab, grammar.text.encode(), b"root", None, 0,
                                                             tokens, 1)
    else:
        sampler = L.llama_sampler_init_grammar(vocab, grammar.text.encode(), b"root")
    assert sampler
    L.llama_sampler_free(sampler)


def test_response_format_schema_that_cannot_compile_is_a_grammar_error() -> None:
    with pytest.raises(GrammarError, match="cannot be compiled"):
        grammar_for({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "date"}}}})
    with pytest.raises(GrammarError, match="'#/x' does not resolve"):
        grammar_for({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}})
    with pytest.raises(GrammarError, match="no tools"):
        grammar_for({"type": "tool_call", "tools": []})


def test_json_strings_cannot_hold_raw_control_characters(vocab: Any) -> None:
    """A raw newline inside a JSON string makes the output unparseable: the grammar must not allow it."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    grammar = grammar_for({"type": "json_schema", "schema": schema})
    assert grammar is not None
    char_rule = next(line for line in grammar.text.splitlines() if line.startswith("char ::="))
    assert r"\x00-\x1F" in char_rule
    sampler = L.llama_sampler_init_grammar(vocab, grammar.text.encode(), b"root")
    assert sampler
    L.llama_sampler_free(sampler)


def test_lazy_tool_grammar_only_with_a_one_token_trigger(smollm2_path: Path) -> None:
    """smollm2 writes <tool_call> as several tokens: a text-triggered lazy grammar could be fed a piece running
    past the trigger and abort the worker, so it gets no lazy grammar (its calls are parsed, unconstrained)."""
    from localai.engines.llama_cpp import LlamaCppEngine, LoadOptions

    engine = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=512, n_parallel=1))
    assert len(engine.tokenize_special("<tool_call>")) > 1
    tools = [{"name": "f", "parameters": {"type": "object"}}]
    assert engine._grammar_sampler({"type": "tool_call", "tools": tools, "lazy": True}) is None  # type: ignore[typeddict-item]
    forced = engine._grammar_sampler({"type": "tool_call", "tools": tools})  # type: ignore[typeddict-item]
    assert forced
    L.llama_sampler_free(forced)


def test_closed_schemas_take_only_their_listed_properties_on_both_engines() -> None:
    from localai.engines.grammars import closed

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}},
              "$defs": {"e": {"type": "object", "properties": {"f": {}}, "additionalProperties": True}}}
    result = closed(schema)
    assert result["additionalProperties"] is False
    assert result["properties"]["a"]["additionalProperties"] is False
    assert result["properties"]["c"]["items"]["additionalProperties"] is False
    assert result["$defs"]["e"]["additionalProperties"] is True  # what a schema says is kept
    assert "additionalProperties" not in closed({"type": "object"})  # a free object stays free
    assert schema["properties"]["a"].get("additionalProperties") is None  # the client's schema is not changed


def accepted(vocab: Any, grammar: str, text: str) -> tuple[bool, bool]:
    """Whether llama.cpp's grammar sampler lets ``text`` through token by token, and then lets the model end."""
    import ctypes

    sampler = L.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    assert sampler, "llama.cpp could not parse the grammar"
    data = text.encode()
    room = len(data) + 8
    tokens = (L.llama_token * room)()
    count = L.llama_tokenize(vocab, data, len(data), tokens, room, False, False)

    def allowed(token: int) -> bool:
        cell = (L.llama_token_data * 1)(L.llama_token_data(token, 0.0, 0.0))
        array = L.llama_token_data_array(cell, 1, -1, False)
        L.llama_sampler_apply(sampler, ctypes.byref(array))
        return bool(cell[0].logit != float("-inf"))

    try:
        for token in tokens[:count]:
            if not allowed(token):
                return False, False
            L.llama_sampler_accept(sampler, token)
        return True, allowed(L.llama_vocab_eos(vocab))
    finally:
        L.llama_sampler_free(sampler)


NATIVE_TOOLS = [
    {"name": "write_file", "parameters": {"type": "object", "required": ["path", "content"], "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "kind": {"enum": ["text", "binary"]}, "meta": {"type": "object"}}}},
    {"name": "run", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
]
CODE = "if a < b && c > d:\n    print(\"<p>x</p>\", '</param>', {'k': [1]})\n"


@pytest.mark.parametrize("style", ["qwen3-coder", "glm-4.5", "harmony", "deepseek-v3.1", "mistral-args"])
def test_a_forced_call_in_a_familys_own_syntax_is_what_llama_cpp_lets_through(vocab: Any, style: str) -> None:
    """The forced call in each family's syntax: the call as the family writes it passes llama.cpp's grammar
    sampler whole (code full of markup in a value), and then the model may end; a call of another function, a
    typed value that is not of its type, or (in the tagged formats) a value holding its own closing tag do not."""
    from localai.engines.scripted import native_call

    grammar = grammar_for({"type": "tool_call", "tools": NATIVE_TOOLS, "format": style})  # type: ignore[typeddict-item]
    assert grammar is not None and grammar.trigger is None
    arguments = {"path": "src/a.py", "content": CODE, "mode": 644, "kind": "binary", "meta": {"x": [1, None]}}
    assert accepted(vocab, grammar.text, native_call(style, "write_file", arguments)) == (True, True)
    assert accepted(vocab, grammar.text, native_call(style, "run", {"command": "ls"})) == (True, True)
    assert accepted(vocab, grammar.text, native_call(style, "delete", {"path": "x"}))[0] is False
    assert accepted(vocab, grammar.text, native_call(style, "write_file", {"path": "a", "content": "b",
                                                                           "mode": "rw"}))[0] is False
    assert accepted(vocab, grammar.text, native_call(style, "write_file", {"path": "a"}))[1] is False  # no content
    if style in ("qwen3-coder", "glm-4.5"):
        closing = "</parameter>" if style == "qwen3-coder" else "</arg_value>"
        text = native_call(style, "write_file", {"path": "a", "content": f"x{closing}y"})
        assert accepted(vocab, grammar.text, text)[0] is False


# Pydantic writes nested models as references into $defs (agent frameworks send such tools); two tools with a
# definition of the same name, one recursive, one a reference from another definition.
POINT = {"type": "object", "required": ["x", "y"], "additionalProperties": False,
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
DEFS_TOOLS = [
    {"name": "move", "parameters": {"$defs": {"P": POINT, "Path": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
                                    "type": "object", "required": ["to", "via"], "additionalProperties": False,
                                    "properties": {"to": {"$ref": "#/$defs/P"}, "via": {"$ref": "#/$defs/Path"}}}},
    {"name": "label", "parameters": {"definitions": {"P": {"type": "string", "enum": ["a", "b"]}},
                                     "type": "object", "required": ["p"], "additionalProperties": False,
                                     "properties": {"p": {"$ref": "#/definitions/P"}}}},
    {"name": "tree", "parameters": {"$ref": "#/$defs/Node", "$defs": {"Node": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}}},
]


def hermes(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_forced_calls_of_tools_whose_schemas_use_defs_and_refs(vocab: Any) -> None:
    """Each tool's references point into its own definitions, as if its parameters were the whole schema: the
    call's grammar lets its right arguments through and refuses another tool's definition of the same name."""
    grammar = grammar_for({"type": "tool_call", "tools": DEFS_TOOLS, "format": "hermes"})  # type: ignore[typeddict-item]
    assert grammar is not None
    move = {"to": {"x": 1, "y": 2}, "via": [{"x": 0, "y": 0}]}
    assert accepted(vocab, grammar.text, hermes("move", move)) == (True, True)
    assert accepted(vocab, grammar.text, hermes("label", {"p": "b"})) == (True, True)
    tree = {"name": "root", "children": [{"name": "leaf", "children": []}]}
    assert accepted(vocab, grammar.text, hermes("tree", tree)) == (True, True)  # recursive
    assert accepted(vocab, grammar.text, hermes("label", {"p": {"x": 1, "y": 2}}))[0] is False  # move's P
    assert accepted(vocab, grammar.text, hermes("move", {"to": "a", "via": []}))[0] is False  # label's P
    assert accepted(vocab, grammar.text, hermes("move", {"to": {"x": "1", "y": 2}, "via": []}))[0] is False


def test_a_family_syntax_call_follows_a_parameters_ref(vocab: Any) -> None:
    """Qwen3-Coder's tagged call: a parameter that is a reference to an object is JSON, not free text."""
    from localai.engines.scripted import native_call

    grammar = grammar_for({"type": "tool_call", "tools": DEFS_TOOLS[:2], "format": "qwen3-coder"})  # type: ignore[typeddict-item]
    assert grammar is not None
    move = {"to": {"x": 1, "y": 2}, "via": [{"x": 3, "y": 4}]}
    assert accepted(vocab, grammar.text, native_call("qwen3-coder", "move", move)) == (True, True)
    assert accepted(vocab, grammar.text, native_call("qwen3-coder", "label", {"p": "a"})) == (True, True)
    bad = native_call("qwen3-coder", "move", {"to": "somewhere", "via": []})
    assert accepted(vocab, grammar.text, bad)[0] is False


def test_a_tool_whose_schema_does_not_compile_takes_any_object_but_one_whose_refs_leave_it_is_refused() -> None:
    """An agent's call must not fail for a schema the converter cannot read; a reference to another document is
    the client's error, named in the 400 (tests/engines/test_schema_refs.py has the rest)."""
    odd = {"type": "object", "properties": {"a": {"type": "date"}}}
    grammar = grammar_for({"type": "tool_call", "tools": [{"name": "f", "parameters": odd}], "format": "hermes"})  # type: ignore[typeddict-item]
    assert grammar is not None and "date" not in grammar.text
    remote = {"type": "object", "properties": {"a": {"$ref": "https://127.0.0.1:9/schema.json#/x"}}}
    for constraint in ({"type": "json_schema", "schema": remote},
                       {"type": "tool_call", "tools": [{"name": "f", "parameters": remote}], "format": "hermes"}):
        with pytest.raises(GrammarError, match=r"'https://127\.0\.0\.1:9/schema\.json#/x': only references within"):
            grammar_for(constraint)  # type: ignore[arg-type]


def test_a_schema_whose_root_is_a_ref_compiles(vocab: Any) -> None:
    """A response format that is a reference to a definition which itself refers to another (Pydantic's shape for
    a model whose fields are models)."""
    schema = {"$ref": "#/$defs/Move", "$defs": {"P": POINT, "Move": {
        "type": "object", "required": ["to"], "additionalProperties": False,
        "properties": {"to": {"$ref": "#/$defs/P"}}}}}
    grammar = grammar_for({"type": "json_schema", "schema": schema})
    assert grammar is not None
    assert accepted(vocab, grammar.text, json.dumps({"to": {"x": 1, "y": 2}})) == (True, True)
    assert accepted(vocab, grammar.text, json.dumps({"to": {"x": "a", "y": 2}}))[0] is False


def test_lark_grammars_resolve_each_tools_refs() -> None:
    """The MLX engine's llguidance grammar: the same tools compile, and each call keeps to its own definitions."""
    from llguidance import LLMatcher

    from localai.engines.grammars import lark_for

    grammar = lark_for({"type": "tool_call", "tools": DEFS_TOOLS, "format": "hermes"}, lambda _: "")  # type: ignore[typeddict-item]
    assert grammar is not None and LLMatcher.validate_grammar(grammar) == ""
    assert '"t0-P"' in grammar and '"t1-definitions-P"' in grammar
