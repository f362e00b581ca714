"""Schemas with references on the real daemon and smollm2 (llama.cpp's grammars): a forced call whose parameters use
RFC 6901 escapes and an allOf gives arguments of that schema, and a reference that points nowhere or to another
document is a 400 naming it in every dialect that takes a schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.conftest import Daemon
from tests.engines.test_schema_refs import ESCAPED

MISSING = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/$defs/a~1gone"}}, "$defs": {}}
REMOTE = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "https://example.com/a.json"}}}
ASK = [{"role": "user", "content": "Call the function."}]


def openai_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_a_forced_call_with_escaped_refs_and_all_of_gives_arguments_of_its_schema(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": ASK, "tools": [openai_tool(ESCAPED)], "max_tokens": 64,
            "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    response = daemon.request("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    call = response.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), ESCAPED)
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ESCAPED}}}
    response = daemon.request("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), ESCAPED)


def requests(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The same schema as each dialect takes it: structured output, and a forced call's parameters."""
    base = {"model": "smollm2", "max_tokens": 16}
    return [
        ("/v1/chat/completions", {**base, "messages": ASK, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/v1/chat/completions", {**base, "messages": ASK, "tools": [openai_tool(schema)],
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ("/v1/messages", {**base, "messages": ASK, "output_config": {"format": {"type": "json_schema",
                                                                               "schema": schema}}}),
        ("/v1/messages", {**base, "messages": ASK, "tools": [{"name": "f", "input_schema": schema}],
                          "tool_choice": {"type": "tool", "name": "f"}}),
        ("/v1/responses", {"model": "smollm2", "max_output_tokens": 16, "input": "Call the function.",
                           "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
        ("/v1/responses", {"model": "smollm2", "max_output_tokens": 16, "input": "Call the function.",
                           "tools": [{"type": "function", "name": "f", "parameters": schema}],
                           "tool_choice": {"type": "function", "name": "f"}}),
        ("/api/chat", {"model": "smollm2", "messages": ASK, "stream": False, "format": schema,
                       "options": {"num_predict": 16}}),
        ("/api/generate", {"model": "smollm2", "prompt": "Say it.", "stream": False, "format": schema,
                           "options": {"num_predict": 16}}),
    ]


@pytest.mark.parametrize(("schema", "ref"), [(MISSING, "#/$defs/a~1gone"), (REMOTE, "https://example.com/a.json")])
def test_a_ref_that_resolves_to_nothing_is_a_400_naming_it_in_every_dialect(daemon: Daemon, schema: dict[str, Any],
                                                                            ref: str) -> None:
    for path, body in requests(schema):
        response = daemon.request("POST", path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert ref in response.text and "AssertionError" not in response.text, (path, response.text)
