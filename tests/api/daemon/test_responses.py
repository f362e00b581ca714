"""OpenAI Responses API through the real daemon and the real openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from websockets.exceptions import ConnectionClosed

from tests.api.daemon.streams import check_responses_stream, named_events
from tests.conftest import Daemon, scripted_model

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"]}}


@pytest.fixture
def sdk(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_create_retrieve_and_continue_with_previous_response_id(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model="smollm2", input="My name is Ada. Say hello.", max_output_tokens=24,
                                 temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    stored = sdk.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text
    second = sdk.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=16, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage and second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2
    # The stored conversation is the prefix of the new prompt: it comes from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_stream_has_the_full_event_sequence(daemon: Daemon) -> None:
    body = {"model": "smollm2", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}],
            "instructions": "Answer briefly.", "stream": True, "max_output_tokens": 16}
    with daemon.http() as http:
        events = named_events(http, "/v1/responses", body)
    final = check_responses_stream(events)
    names = [name for name, _ in events]
    for expected in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert expected in names
    assert final["usage"]["output_tokens"] > 0 and final["output"][0]["role"] == "assistant"


def test_sdk_stream_with_a_required_tool_and_codex_style_tools(sdk: openai.OpenAI) -> None:
    tools: list[Any] = [WEATHER, {"type": "web_search", "external_web_access": False},
                        {"type": "namespace", "name": "agents", "tools": [
                            {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}]}]
    stream = sdk.responses.create(model="smollm2", input="Weather in Oslo?", tools=tools,
                                  tool_choice={"type": "function", "name": "get_weather"}, stream=True,
                                  max_output_tokens=64)
    kinds, arguments, final = [], "", None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.completed":
            final = event.response
    assert "response.function_call_arguments.done" in kinds and final is not None
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == json.loads(arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[arg-type]
    assert [t.name for t in final.tools] == ["get_weather", "agents.spawn"]  # type: ignore[union-attr]


def test_function_call_output_round_trip(sdk: openai.OpenAI, daemon: Daemon) -> None:
    """A function_call and its function_call_output in ``input`` reach the model in order, after the question, and
    the reply is the turn after them (the scripted engine on smollm2's template: ``[[say:...]]``, the last one in
    the prompt, is its reply; ``[[echo]]`` replies the prompt)."""
    model = scripted_model(daemon, "scripted-responses-tools")

    def answer(output: str) -> Any:
        return sdk.responses.create(model=model, max_output_tokens=3000, tools=[WEATHER],  # type: ignore[list-item]
                                    tool_choice="none", input=[
            {"role": "developer", "content": "You report weather."},
            {"role": "user", "content": "Weather in Oslo? [[say:no function output]]"},
            {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_9", "output": output},
        ])

    response = answer("Snow, -3C [[say:Oslo has snow at -3C.]]")
    assert response.output_text == "Oslo has snow at -3C." and response.status == "completed"
    assert [item.type for item in response.output] == ["message"]  # an answer, not another call
    prompt = answer("Snow, -3C [[echo]]").output_text
    asked, called, output = (prompt.find(s) for s in ("Weather in Oslo?", '"Oslo"', "Snow, -3C"))
    assert -1 < asked < called < output, prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant"), prompt


def test_text_format_json_schema_validates(sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    response = sdk.responses.create(model="smollm2", input="Name a big city.", max_output_tokens=64,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_store_false_keeps_nothing(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="smollm2", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)


@pytest.mark.parametrize(("body", "status", "param"), [
    # the rest of the malformed cases run in-process on the scripted engine (tests/api/test_dialect_errors.py);
    # this one needs llama.cpp's grammar converter to refuse the schema
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "text.format"),
])
def test_malformed_requests_get_openai_errors(daemon: Daemon, body: dict[str, Any], status: int, param: str) -> None:
    with daemon.http() as http:
        response = http.post("/v1/responses", json={"model": "smollm2", **body})
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param
        assert http.get("/v1/responses/resp_missing").status_code == 404
        assert http.get("/health").status_code == 200


def test_websocket_mode_on_the_real_daemon_two_turns_and_a_clean_close_at_shutdown(fresh_daemon: Daemon) -> None:
    """A real WebSocket client (the websockets library) against uvicorn on TCP, smollm2 answering: two turns on one
    connection, the second continuing the first by id, then the daemon stops and the socket closes cleanly."""
    from websockets.sync.client import connect

    def turn(socket: Any, **fields: Any) -> list[dict[str, Any]]:
        socket.send(json.dumps({"type": "response.create", "model": "smollm2", "max_output_tokens": 8,
                                "temperature": 0, **fields}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
            events.append(json.loads(socket.recv(timeout=120)))
        return events

    with connect(f"ws://127.0.0.1:{fresh_daemon.port}/v1/responses") as socket:
        first = turn(socket, input="Say hello.", store=False)
        assert first[0]["type"] == "response.created" and first[-1]["type"] in ("response.completed",
                                                                                 "response.incomplete")
        text = "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta")
        assert text and text == first[-1]["response"]["output"][-1]["content"][0]["text"]
        second = turn(socket, input="Again.", previous_response_id=first[-1]["response"]["id"], store=False)
        assert second[-1]["response"]["usage"]["input_tokens"] > first[-1]["response"]["usage"]["input_tokens"]
        assert second[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the same session
        fresh_daemon.stop()
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012  # uvicorn's "service restart"
