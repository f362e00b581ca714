"""Anthropic replies that other dialects already got right, in-process on the scripted engine: structured outputs
(``output_config.format``, and the beta's ``output_format``) constrain the reply as ``response_format`` does, and a
tool call cut by ``max_tokens`` keeps what was written of its arguments in the whole reply as in the stream."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from tests.api.daemon.streams import named_events

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.parametrize("field", [
    pytest.param({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, id="output_config"),
    pytest.param({"output_format": {"type": "json_schema", "schema": SCHEMA}}, id="output_format-beta"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages?beta=true"])
def test_structured_output_constrains_the_reply(api: TestClient, field: dict[str, Any], path: str) -> None:
    reply = api.post(path, json={"model": "smollm2", "max_tokens": 256, "messages": ASK, **field})
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["content"][0]["text"]), SCHEMA)
    with api.stream("POST", path, json={"model": "smollm2", "max_tokens": 256, "stream": True, "messages": ASK,
                                        **field}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    jsonschema.validate(json.loads(text), SCHEMA)


def test_without_a_format_the_reply_is_free_text(api: TestClient) -> None:
    """The check above can fail: the same request without the field is the scripted engine's prose."""
    reply = api.post("/v1/messages", json={"model": "smollm2", "max_tokens": 256, "messages": ASK}).json()
    assert reply["content"][0]["text"] == "Hello from the scripted engine."


@pytest.mark.parametrize(("field", "param"), [
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": "json"}}, "output_config.format"),
    ({"output_format": {"type": "json_schema", "schema": "{}"}}, "output_format.schema"),
])
def test_a_malformed_output_format_is_a_400_naming_it(api: TestClient, field: dict[str, Any], param: str) -> None:
    reply = api.post("/v1/messages", json={"model": "smollm2", "max_tokens": 8, "messages": ASK, **field})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"].startswith(f"{param}: ")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CUT = CALL.index("lsius")  # max_tokens (the scripted engine's tokens are bytes) ends the reply inside "celsius"


def ask_for_the_call() -> list[dict[str, Any]]:
    said = base64.b64encode(CALL.encode()).decode()
    return [{"role": "user", "content": f"Weather in Paris? [[say64:{said}]]"}]


def test_a_call_cut_by_max_tokens_keeps_its_arguments_in_every_reply(api: TestClient) -> None:
    body = {"model": "smollm2", "max_tokens": CUT, "messages": ask_for_the_call(), "tools": [WEATHER]}
    whole = api.post("/v1/messages", json=body).json()
    assert whole["stop_reason"] == "max_tokens"
    use = whole["content"][-1]
    assert use["type"] == "tool_use" and use["name"] == "get_weather"
    assert use["input"] == {"city": "Paris", "unit": "ce"}  # was {} before: the partial JSON was dropped
    events = named_events(api, "/v1/messages", {**body, "stream": True})
    streamed = "".join(data["delta"]["partial_json"] for kind, data in events if kind == "content_block_delta"
                       and data["delta"]["type"] == "input_json_delta")
    assert streamed == '{"city": "Paris", "unit": "ce'
    chat = api.post("/v1/chat/completions", json={
        "model": "smollm2", "max_tokens": CUT, "messages": ask_for_the_call(),
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]
    }).json()
    assert chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == streamed
