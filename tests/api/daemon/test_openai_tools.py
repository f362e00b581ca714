"""Tool calls, structured output and embeddings on the OpenAI dialect, with the real SDK and smollm2."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.api.daemon.streams import check_chat_stream, named_events
from tests.conftest import Daemon, scripted_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "colour": {"enum": ["red", "green", "blue"]}}}


@pytest.fixture
def sdk(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_named_tool_choice_forces_a_well_formed_call(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=64,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_time" and call.id  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, CLOCK["function"]["parameters"])  # type: ignore[index]


def test_required_tool_choice_streams_the_call(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "stream": True,
            "max_tokens": 64, "stream_options": {"include_usage": True}}
    with daemon.http() as http:
        result = check_chat_stream(named_events(http, "/v1/chat/completions", body), usage=True)
    assert result["finish_reason"] == "tool_calls"
    assert [call["name"] for call in result["calls"]] == ["get_weather"]
    jsonschema.validate(json.loads(result["calls"][0]["arguments"]), WEATHER["function"]["parameters"])  # type: ignore[index]


# Pydantic's shape for a tool whose argument is a model: a reference into $defs
ROUTE = {"type": "function", "function": {
    "name": "plan_route", "description": "Plan a route to a place", "parameters": {
    "$defs": {"Place": {"type": "object", "additionalProperties": False, "required": ["city"],
                        "properties": {"city": {"type": "string", "maxLength": 40}}}},
    "type": "object", "additionalProperties": False, "required": ["destination"],
    "properties": {"destination": {"$ref": "#/$defs/Place"}}}}}


def test_required_tool_choice_with_defs_and_refs_in_the_schema(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Plan a route to Paris."}],
            "tools": [ROUTE, WEATHER], "tool_choice": "required", "max_tokens": 64, "temperature": 0}
    with daemon.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    schema = next(t["function"]["parameters"] for t in (ROUTE, WEATHER) if t["function"]["name"] == call["name"])  # type: ignore[index]
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_tool_choice_none_answers_in_text(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type,list-item]
                                           max_tokens=24, temperature=0)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content


def test_tool_results_continue_the_conversation(sdk: openai.OpenAI, daemon: Daemon) -> None:
    """The call and its result reach the model after the question, in order, and the reply is the turn after them
    (the scripted engine on smollm2's template: its reply is the last ``[[say:...]]`` in the prompt, here the tool
    result's, and ``[[echo]]`` replies the prompt itself)."""
    model = scripted_model(daemon, "scripted-tools")

    def answer(result: str) -> openai.types.chat.ChatCompletion:
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris? [[say:no tool result]]"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                               {"role": "tool", "tool_call_id": "call_1", "content": result}]
        return sdk.chat.completions.create(model=model, messages=messages, tools=[WEATHER],  # type: ignore[list-item]
                                           max_tokens=3000, tool_choice="none")

    reply = answer("Sunny and 21 degrees. [[say:Paris is sunny, 21 degrees.]]").choices[0]
    assert reply.message.content == "Paris is sunny, 21 degrees." and not reply.message.tool_calls
    assert reply.finish_reason == "stop"
    prompt = answer("Sunny and 21 degrees. [[echo]]").choices[0].message.content or ""
    asked, called, result = (prompt.find(s) for s in ("weather in Paris?", '"Paris"', "Sunny and 21 degrees."))
    assert -1 < asked < called < result, prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant"), prompt  # the reply is the turn after the result


def test_json_schema_output_validates(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Invent a person."}], max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(response.choices[0].message.content or ""), PERSON)


def test_json_object_output_parses(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give a JSON object with a key 'ok'."}],
        max_tokens=64, response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_embeddings_float_and_base64(sdk: openai.OpenAI, daemon: Daemon) -> None:
    result = sdk.embeddings.create(model="smollm2", input=["the cat sat", "the cat sat", "stock prices fell"])
    vectors = [item.embedding for item in result.data]  # the SDK asked for base64 and decoded it
    assert len(vectors) == 3 and len(vectors[0]) > 100
    assert sum(a * b for a, b in zip(vectors[0], vectors[1], strict=True)) == pytest.approx(1.0, abs=1e-4)
    assert sum(a * b for a, b in zip(vectors[0], vectors[2], strict=True)) < 0.99
    assert result.usage.prompt_tokens > 0
    with daemon.http() as http:
        raw = http.post("/v1/embeddings", json={"model": "smollm2", "input": "the cat sat",
                                                "encoding_format": "base64"}).json()
        floats = http.post("/v1/embeddings", json={"model": "smollm2", "input": "the cat sat"}).json()
    decoded = struct.unpack(f"<{len(vectors[0])}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert decoded == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)


def test_embeddings_leave_the_chat_cache_alone(sdk: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse. " * 30}, *ASK]
    sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    sdk.embeddings.create(model="smollm2", input=["x " * 300])
    again = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert again.usage and again.usage.prompt_tokens_details
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


@pytest.mark.parametrize(("body", "param"), [
    # the shape errors run in-process on the scripted engine (tests/api/test_dialect_errors.py); a schema that
    # llama.cpp's grammar converter refuses needs the real engine
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
])
def test_bad_tool_and_format_requests_get_400_naming_the_field(daemon: Daemon, body: dict[str, Any],
                                                               param: str) -> None:
    with daemon.http() as http:
        response = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": ASK, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
        assert http.get("/health").status_code == 200


def test_post_without_json_content_type_is_read_as_json(daemon: Daemon) -> None:
    """``curl -d`` sends a form content type; Ollama reads such bodies as JSON, so does localai."""
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    with daemon.http() as http:
        response = http.post("/api/generate", content=body,
                             headers={"content-type": "application/x-www-form-urlencoded"})
        assert response.status_code == 200 and response.json()["done"] is True
        browser = http.post("/api/generate", content=body, headers={"content-type": "text/plain",
                                                                     "origin": "http://localhost:3000"})
        assert browser.status_code == 400  # a page in a browser gets no JSON coercion, even an allowed one
        foreign = http.post("/api/generate", content=body, headers={"content-type": "text/plain",
                                                                     "origin": "http://evil.example"})
        assert foreign.status_code == 403  # and a page from another site is refused outright


@pytest.mark.parametrize("parser", ["qwen3-coder", "harmony", "mistral"])
def test_a_forced_call_in_a_familys_syntax_from_the_real_model(daemon: Daemon, parser: str) -> None:
    """smollm2 under a PARSER naming another family: the grammar makes the real model write the call in that
    family's own syntax (Qwen3-Coder's XML, Harmony's channel header), and it comes back as the call."""
    name = f"smollm2-{parser}"
    with daemon.http() as http:
        created = http.post("/api/create", json={"model": name, "modelfile": f"FROM smollm2\nPARSER {parser}\n"})
        assert created.status_code == 200, created.text
        body = {"model": name, "messages": [{"role": "user", "content": "What time is it in Paris?"}],
                "tools": [CLOCK], "tool_choice": "required", "max_tokens": 60, "temperature": 0}
        answer = http.post("/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", answer
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), CLOCK["function"]["parameters"])  # type: ignore[index]
    assert not choice["message"]["content"]
