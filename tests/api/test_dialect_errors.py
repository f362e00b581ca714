"""Each dialect's malformed requests, in-process on the scripted engine: a 4xx in that dialect's error shape,
naming the field, and the app keeps serving. (Errors that depend on the real engine, such as a JSON schema that
llama.cpp's grammar converter refuses, are tested against the real model in tests/api/daemon/.)"""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from starlette.testclient import TestClient

ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Current weather for a city",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(("change", "field"), [
    ({"temperature": 9}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 9}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                    "@@@"}}]}]},
     "messages.0.content.0.image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}]},
     "messages.0.content.0.input_audio"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages.1"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
])
def test_openai_chat_errors_name_the_field(api: TestClient, change: dict[str, Any], field: str) -> None:
    response = api.post("/v1/chat/completions", json={"model": "smollm2", "messages": ASK, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error" and error["message"]


def test_malformed_json_is_400_in_every_dialect(api: TestClient) -> None:
    broken = {"content": b'{"model": "smollm2", "messages": [', "headers": {"content-type": "application/json"}}
    openai = api.post("/v1/chat/completions", **broken)  # type: ignore[arg-type]
    assert openai.status_code == 400 and "not valid JSON" in openai.json()["error"]["message"]
    anthropic = api.post("/v1/messages", **broken)  # type: ignore[arg-type]
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    ollama = api.post("/api/chat", **broken)  # type: ignore[arg-type]
    assert ollama.status_code == 400 and isinstance(ollama.json()["error"], str)


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
     400, "no earlier assistant message"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0.source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "needs 'source'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                                            "image/png", "data": "%%%"}}]}]},
     400, "not valid base64"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400, "hologram"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ANTHROPIC_WEATHER],
      "tool_choice": {"type": "tool", "name": "absent"}}, 400, "absent"),
    ({"messages": []}, 400, "messages"),
    ({"model": "missing-model", "messages": [{"role": "user", "content": "x"}]}, 404, "localai pull"),
])
def test_anthropic_errors(api: TestClient, body: dict[str, Any], status: int, needle: str) -> None:
    response = api.post("/v1/messages", json={"model": "smollm2", "max_tokens": 8, **body})
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert needle in payload["error"]["message"]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input.0.role"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, 400, "input.0"),
    ({"input": [{"type": "mystery"}]}, 400, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, 400, "input.0.content.0"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_responses_errors(api: TestClient, body: dict[str, Any], status: int, param: str) -> None:
    response = api.post("/v1/responses", json={"model": "smollm2", **body})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert api.get("/v1/responses/resp_missing").status_code == 404


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/api/chat", {"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "format": 42}, "format"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]},
     "messages.0.images.0"),
    ("/api/generate", {"prompt": "x", "images": ["not base64!"]}, "images.0"),
    ("/api/generate", {"prompt": "x", "images": ["aGk="], "raw": True}, "raw"),
    ("/api/embed", {"input": []}, "input"),
])
def test_ollama_errors(api: TestClient, path: str, body: dict[str, Any], needle: str) -> None:
    response = api.post(path, json={"model": "smollm2", "stream": False, **body})
    assert response.status_code == 400, response.text
    assert isinstance(response.json()["error"], str) and needle in response.json()["error"]


def test_embeddings_errors(api: TestClient) -> None:
    assert api.post("/v1/embeddings", json={"model": "smollm2", "input": []}).status_code == 400
    missing = api.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert missing.status_code == 404 and "localai pull" in missing.json()["error"]["message"]
    too_many = api.post("/v1/embeddings", json={"model": "smollm2", "input": "x", "dimensions": 100000})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "dimensions"


def test_a_forced_tool_call_and_a_schema_come_back_well_formed(api: TestClient) -> None:
    """The scripted engine honours constraints with minimal instances: the dialects' plumbing of calls and
    structured output, end to end without a model."""
    forced = api.post("/v1/chat/completions", json={"model": "smollm2", "messages": ASK, "tools": [WEATHER],
                                                     "tool_choice": "required"}).json()
    call = forced["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and forced["choices"][0]["finish_reason"] == "tool_calls"
    anthropic = api.post("/v1/messages", json={"model": "smollm2", "max_tokens": 256, "messages": ASK,
                                               "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "any"}}).json()
    assert anthropic["stop_reason"] == "tool_use" and anthropic["content"][-1]["input"] == {"city": "x"}
    shaped = api.post("/api/chat", json={"model": "smollm2", "stream": False, "messages": ASK,
                                         "format": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                    "required": ["n"]}}).json()
    assert shaped["message"]["content"] == '{"n": 0}'


def disk_full(*_: Any, **__: Any) -> None:
    raise sqlite3.OperationalError("database or disk is full")


def test_a_full_disk_is_a_507_in_each_dialects_shape(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's "database or disk is full" while storing a response or creating a model: a 507 saying so, in the
    dialect's error shape (a plain-text 500 before), and a streamed response ends with response.failed."""
    from localai.api import response_store
    from localai.models.registry import Registry

    monkeypatch.setattr(response_store, "retain", disk_full)
    stored = api.post("/v1/responses", json={"model": "smollm2", "input": "hi", "max_output_tokens": 4})
    assert stored.status_code == 507, stored.text
    error = stored.json()["error"]
    assert "disk is full" in error["message"] and error["code"] == "insufficient_storage"
    with api.stream("POST", "/v1/responses", json={"model": "smollm2", "input": "hi", "max_output_tokens": 4,
                                                   "stream": True}) as streamed:
        text = "".join(streamed.iter_text())
    assert "response.failed" in text and "disk is full" in text
    monkeypatch.setattr(Registry, "create", disk_full)
    created = api.post("/api/create", json={"model": "full-disk", "modelfile": "FROM smollm2\n"})
    assert created.status_code == 507 and "disk is full" in created.json()["error"], created.text


def logprob_tokens(path: str, body: dict[str, Any]) -> list[str]:
    """The tokens of a response's logprobs, wherever its dialect puts them (none: [])."""
    if path == "/v1/chat/completions":
        return [entry["token"] for entry in (body["choices"][0]["logprobs"] or {}).get("content", [])]
    if path == "/v1/completions":
        return list((body["choices"][0]["logprobs"] or {}).get("tokens", []))
    if path == "/v1/responses":
        return [entry["token"] for entry in body["output"][0]["content"][0]["logprobs"]]
    return [entry["token"] for entry in body.get("logprobs", [])]


@pytest.mark.parametrize(("path", "body", "text"), [
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True}, ("choices", 0, "message", "content")),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 3}, ("choices", 0, "message",
                                                                                       "content")),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, ("choices", 0, "text")),
    ("/v1/responses", {"input": "x", "top_logprobs": 2}, ("output", 0, "content", 0, "text")),
    ("/v1/responses", {"input": "x", "include": ["message.output_text.logprobs"]}, ("output", 0, "content", 0,
                                                                                     "text")),
    ("/api/chat", {"messages": ASK, "stream": False, "logprobs": True}, ("message", "content")),
    ("/api/generate", {"prompt": "x", "stream": False, "top_logprobs": 1}, ("response",)),
])
def test_logprobs_asked_for_are_served_in_each_dialect(api: TestClient, path: str, body: dict[str, Any],
                                                       text: tuple[str | int, ...]) -> None:
    """The scripted engine is certain of each token (logprob 0): one entry per token of the reply, in the place
    each dialect's spec gives them; not asked for, none."""
    response = api.post(path, json={"model": "smollm2", **body})
    assert response.status_code == 200, response.text
    reply: Any = response.json()
    for key in text:
        reply = reply[key]
    tokens = logprob_tokens(path, response.json())
    assert reply and "".join(tokens) == reply and len(tokens) == len(reply.encode())  # a byte a token
    off = {key: (False if value is True else None if isinstance(value, int) else []) for key, value in body.items()
           if key in ("logprobs", "top_logprobs", "include")}
    assert logprob_tokens(path, api.post(path, json={"model": "smollm2", **body, **off}).json()) == []
