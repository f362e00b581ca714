"""Integer fields of the request bodies take integers only: ``n: true`` was read as 1 and ``"2"`` or ``2.0`` as 2.
Each such value is a 400 naming the field, in every dialect's request models (in-process, on the scripted engine)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "smollm2", "messages": USER}
ANTHROPIC = {"model": "smollm2", "messages": USER, "max_tokens": 8}
NOT_INTEGERS = [(True, "true/false"), ("2", "a string"), (2.0, "a number"), (2.5, "a number")]
FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", CHAT, "n"),
    ("/v1/chat/completions", CHAT, "max_tokens"),
    ("/v1/chat/completions", CHAT, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT, "top_k"),
    ("/v1/chat/completions", CHAT, "seed"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, "top_logprobs"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi"}, "n"),
    ("/v1/embeddings", {"model": "smollm2", "input": "x"}, "dimensions"),
    ("/v1/messages", ANTHROPIC, "max_tokens"),
    ("/v1/messages", ANTHROPIC, "top_k"),
    ("/v1/messages/count_tokens", {"model": "smollm2", "messages": USER}, "max_tokens"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "stream": False}, "top_logprobs"),
    ("/api/embed", {"model": "smollm2", "input": "x"}, "dimensions"),
    ("/v1/rerank", {"model": "smollm2", "query": "q", "documents": ["a", "b"]}, "top_n"),
    ("/api/cache/prune", {}, "max_bytes"),
    ("/v1/responses", {"model": "smollm2", "input": "hi"}, "max_output_tokens"),
    ("/v1/responses", {"model": "smollm2", "input": "hi"}, "max_tool_calls"),
    ("/v1/responses", {"model": "smollm2", "input": "hi"}, "top_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "field"), FIELDS, ids=[f"{f[0]}:{f[2]}" for f in FIELDS])
@pytest.mark.parametrize(("value", "got"), NOT_INTEGERS, ids=["true", "string", "whole-float", "float"])
def test_an_integer_field_takes_only_an_integer(api: TestClient, path: str, body: dict[str, Any], field: str,
                                                value: Any, got: str) -> None:
    response = api.post(path, json={**body, field: value})
    assert response.status_code == 400, (field, value, response.text[:300])
    payload = response.json()
    error = payload["error"]
    text = error if isinstance(error, str) else error["message"]
    assert f"'{field}' must be an integer, not {got}" in text, text


def test_a_nested_integer_and_the_logprobs_union_are_strict_too(api: TestClient) -> None:
    thinking = api.post("/v1/messages", json={**ANTHROPIC, "max_tokens": 64,
                                              "thinking": {"type": "enabled", "budget_tokens": "16"}})
    assert thinking.status_code == 400 and "'thinking.budget_tokens' must be an integer" in thinking.text
    for value in ("1", 1.0):  # completions' logprobs is a count; chat's is true/false
        refused = api.post("/v1/completions", json={"model": "smollm2", "prompt": "hi", "logprobs": value})
        assert refused.status_code == 400 and "'logprobs'" in refused.text, refused.text


def test_integers_and_booleans_still_pass(api: TestClient) -> None:
    response = api.post("/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 4, "seed": -1, "top_k": 0,
                                                      "logprobs": True, "top_logprobs": 2})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    completion = api.post("/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2, "logprobs": 1})
    assert completion.status_code == 200, completion.text


OLLAMA = [("/api/generate", {"model": "smollm2", "prompt": "hi", "stream": False}),
          ("/api/chat", {"model": "smollm2", "messages": USER, "stream": False})]
OPTIONS = [
    ("num_predict", True, "options.num_predict: num_predict must be an integer, not true/false"),
    ("num_predict", "2", "options.num_predict: num_predict must be an integer, not a string"),
    ("num_ctx", [2048], "options.num_ctx: num_ctx must be an integer, not a list of numbers"),
    ("temperature", "0.5", "options.temperature: temperature must be a number, not a string"),
    ("temperature", False, "options.temperature: temperature must be a number, not true/false"),
    ("num_predict", 2.5, "num_predict must be an integer"),
]


@pytest.mark.parametrize(("path", "body"), OLLAMA, ids=["generate", "chat"])
@pytest.mark.parametrize(("option", "value", "message"), OPTIONS,
                         ids=[f"{o}={v!r}" for o, v, _ in OPTIONS])
def test_ollama_options_take_their_json_types(api: TestClient, path: str, body: dict[str, Any], option: str,
                                              value: Any, message: str) -> None:
    """Ollama's numeric options are JSON numbers: "2" and true were read as 2 and 1 (their parser also reads
    Modelfile text)."""
    response = api.post(path, json={**body, "options": {option: value}})
    assert response.status_code == 400, (option, value, response.text[:300])
    assert message in response.json()["error"], response.text


def test_ollama_options_of_the_right_types_still_pass(api: TestClient) -> None:
    """A whole float for an integer is an integer, as in Ollama (JSON has one number type); an int for a float."""
    for path, body in OLLAMA:
        options = {"num_predict": 2.0, "temperature": 0, "top_p": 0.9, "seed": 3, "use_mmap": True, "stop": ["x"],
                   "fit_context": "true"}  # a switch as a Modelfile writes it still reads (test_limits)
        response = api.post(path, json={**body, "options": options})
        assert response.status_code == 200, response.text


def test_create_parameters_take_their_json_types(api: TestClient) -> None:
    refused = api.post("/api/create", json={"model": "typed", "from": "smollm2", "parameters": {"num_ctx": "2048"}})
    assert refused.status_code == 400 and "parameters.num_ctx: num_ctx must be an integer, not a string" in refused.text
    assert api.post("/api/show", json={"model": "typed"}).status_code == 404
    made = api.post("/api/create", json={"model": "typed", "from": "smollm2", "parameters": {"num_ctx": 2048}})
    assert made.status_code == 200, made.text
