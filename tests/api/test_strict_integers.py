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
