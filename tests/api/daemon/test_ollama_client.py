"""The Ollama-native API with the real ollama Python client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import ollama
import pytest

from tests.conftest import Daemon

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


@pytest.fixture
def client(daemon: Daemon) -> Iterator[ollama.Client]:
    with ollama.Client(host=daemon.base_url) as client:
        yield client


def test_chat_and_stream(client: ollama.Client) -> None:
    reply = client.chat(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                        options={"num_predict": 8, "temperature": 0})
    assert reply.message.role == "assistant" and reply.message.content and reply.done
    assert reply.eval_count and reply.prompt_eval_count
    parts = list(client.chat(model="smollm2", messages=[{"role": "user", "content": "Say hi."}], stream=True,
                             options={"num_predict": 8, "temperature": 0}))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert "".join(p.message.content or "" for p in parts) == reply.message.content


def test_generate_with_format_schema(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    reply = client.generate(model="smollm2", prompt="Describe an apple.", format=schema, options={"num_predict": 48})
    jsonschema.validate(json.loads(reply.response), schema)
    chat = client.chat(model="smollm2", messages=[{"role": "user", "content": "Describe an apple."}], format=schema,
                       options={"num_predict": 48})
    jsonschema.validate(json.loads(chat.message.content or ""), schema)


def test_chat_with_tools(client: ollama.Client, daemon: Daemon) -> None:
    reply = client.chat(model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}],
                        tools=[WEATHER], options={"num_predict": 64})
    assert reply.done  # auto: the model may or may not call; the call, if any, is well formed
    for call in reply.message.tool_calls or []:
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    follow_up: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Rain, 12C", "tool_name": "get_weather"},
    ]
    answer = client.chat(model="smollm2", messages=follow_up, tools=[WEATHER], options={"num_predict": 16})
    assert answer.done


def test_tags_show_ps(client: ollama.Client) -> None:
    names = [m.model for m in client.list().models]
    assert "smollm2:135m" in names
    shown = client.show("smollm2")
    assert shown.capabilities and "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo and shown.modelinfo["llama.context_length"] == 8192
    assert shown.details and shown.details.quantization_level
    client.chat(model="smollm2", messages=[{"role": "user", "content": "x"}], options={"num_predict": 1})
    assert "smollm2:135m" in [m.model for m in client.ps().models]


def test_embed_batch_and_legacy(client: ollama.Client) -> None:
    result = client.embed(model="smollm2", input=["first text", "second text"])
    assert len(result.embeddings) == 2 and len(result.embeddings[0]) > 100
    assert result.prompt_eval_count and result.prompt_eval_count > 2
    assert sum(v * v for v in result.embeddings[0]) == pytest.approx(1.0, abs=1e-4)
    legacy = client.embeddings(model="smollm2", prompt="first text")
    assert list(legacy.embedding) == pytest.approx(list(result.embeddings[0]), abs=1e-5)


@pytest.mark.parametrize(("path", "body", "needle"), [
    # the shape errors run in-process (tests/api/test_dialect_errors.py); these need the real engine
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "format": {"type": "nonsense"}}, "schema"),
    ("/api/embed", {"input": "x" * 20000, "truncate": False}, "truncation"),
])
def test_malformed_requests_get_ollama_errors(daemon: Daemon, path: str, body: dict[str, Any], needle: str) -> None:
    with daemon.http() as http:
        response = http.post(path, json={"model": "smollm2", "stream": False, **body})
        assert response.status_code == 400, response.text
        assert isinstance(response.json()["error"], str) and needle in response.json()["error"]
        assert http.get("/health").status_code == 200
