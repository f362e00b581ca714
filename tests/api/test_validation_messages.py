"""Every malformed body gets a message that names the field, what it takes and what it got, in words: never a
validation branch's name (``input.str``, ``list[str]``, ``literal[...]``, ``function-after[...]``) or pydantic's
phrasing. In-process on the scripted engine; embeddings with token ids are here too (LangChain's default)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from starlette.testclient import TestClient

PYDANTIC_ISMS = re.compile(r"Input should|Field required|Value error|valid dictionary|literal\[|list\[|dict\[|"
                           r"function-(after|before|wrap|plain)|\.str\b|\.int\b|union\[")
USER = [{"role": "user", "content": "hi"}]
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/embeddings", {"model": "smollm2", "input": {"text": "x"}}, "input",
     "'input' must be a string, a list of strings, a list of integers or a list of lists of integers, not an object"),
    ("/v1/embeddings", {"model": "smollm2", "input": ["a", 1]}, "input", "'input' must be a string"),
    ("/v1/embeddings", {"model": "smollm2", "input": []}, "input", "'input': at least one input is required"),
    ("/v1/embeddings", {"model": "smollm2", "input": "x", "encoding_format": "hex"}, "encoding_format",
     "'encoding_format' must be one of 'float' or 'base64' (got 'hex')"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "'messages.0.content' must be a string or a list of objects, not a number"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": USER, "tool_choice": "sometimes"}, "tool_choice",
     "'tool_choice' must be 'none', 'auto' or 'required', or an object, not a string"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": USER, "stop": ["x"] * 17}, "stop",
     "'stop': at most 16 stop sequences are allowed (got 17)"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": USER, "stop": 5}, "stop",
     "'stop' must be a string or a list of strings, not a number"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": USER, "temperature": 5}, "temperature",
     "'temperature' must be at most 2 (got 5)"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": USER, "max_tokens": "lots"}, "max_tokens",
     "'max_tokens' must be an integer, not a string"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": []}, "messages", "'messages' must not be empty"),
    ("/v1/chat/completions", {"messages": USER}, "model", "'model' is required"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0.type", "unknown content part type None"),
    ("/v1/completions", {"model": "smollm2", "prompt": ["a", "b"]}, "prompt",
     "'prompt': exactly one prompt is taken per request (got 2)"),
    ("/v1/messages", {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0.type", "'messages.0.content.0.type' is required"),
    ("/v1/messages", {"model": "smollm2", "max_tokens": 8, "messages": USER, "system": 5}, "system",
     "'system' must be a string or a list of objects, not a number"),
    ("/v1/messages", {"model": "smollm2", "max_tokens": 8, "messages": USER, "tool_choice": {"type": "maybe"}},
     "tool_choice.type", "'tool_choice.type' must be one of 'auto', 'any', 'tool' or 'none' (got 'maybe')"),
    ("/v1/responses", {"model": "smollm2", "input": 5}, "input",
     "'input' must be a string or a list of objects, not a number"),
    ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": ["x"]}]}, "messages.0.content",
     "'messages.0.content' must be a string, not a list"),
    ("/api/embed", {"model": "smollm2", "input": 5}, "input",
     "'input' must be a string or a list of strings, not a number"),
]


@pytest.mark.parametrize(("path", "body", "field", "message"), CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_validation_messages_name_the_field_and_what_it_takes(api: TestClient, path: str, body: dict[str, Any],
                                                              field: str, message: str) -> None:
    response = api.post(path, json=body)
    assert response.status_code == 400, response.text
    payload = response.json()
    text = payload["error"] if isinstance(payload["error"], str) else payload["error"]["message"]
    assert message in text
    assert not PYDANTIC_ISMS.search(text), text
    if path.startswith("/v1/") and not path.startswith("/v1/messages"):
        assert payload["error"]["param"] == field


# -- embeddings with token ids -------------------------------------------------------------------------------------

def vectors(api: TestClient, value: Any) -> list[list[float]]:
    response = api.post("/v1/embeddings", json={"model": "smollm2", "input": value})
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


def test_the_models_own_token_ids_embed_as_their_text(api: TestClient) -> None:
    """The scripted engine's tokens are the text's bytes, so its own ids for "hello" are [104, 101, 108, 108, 111]."""
    hello, world = list(b"hello"), list(b"world")
    assert vectors(api, hello) == vectors(api, "hello")
    assert vectors(api, [hello, world]) == vectors(api, ["hello", "world"])


@pytest.mark.parametrize(("ids", "cause"), [
    pytest.param([[15339, 1917]], "token id 15339, outside this model's vocabulary of 257 ids", id="past-vocabulary"),
    pytest.param([104, 200, 201], "not how this model's tokenizer writes any text", id="not-utf8"),
    pytest.param([[104], []], "input 1 is an empty list of token ids", id="empty"),
])
def test_token_ids_from_another_tokenizer_are_a_400_naming_the_fix(api: TestClient, ids: Any, cause: str) -> None:
    response = api.post("/v1/embeddings", json={"model": "smollm2", "input": ids})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and cause in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"] or "empty" in cause
    assert api.post("/v1/embeddings", json={"model": "smollm2", "input": "still serving"}).status_code == 200
