"""logprobs through the real daemon on smollm2, in every dialect that has them (OpenAI chat and completions,
Responses, Ollama's chat and generate), streamed and not; checked against llama-cpp-python's own server on the same
file, and malformed requests refused naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest

from localai.bench.servers import LlamaCppPythonServer
from tests.conftest import Daemon

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three primary colours are"


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    chunks = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def check_entries(entries: list[dict[str, Any]], top: int, *, greedy: bool = True) -> None:
    """Each entry: a token with its bytes and logprob, ``top`` alternatives best first; ``greedy`` (no repeat
    penalty: the logprobs are the model's logits before any sampling step, as llama-server's) the token taken
    the first of them."""
    assert entries
    for entry in entries:
        assert entry["bytes"] == list(entry["token"].encode()) or "\ufffd" in entry["token"]
        assert entry["logprob"] <= 0
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == top
        values = [alt["logprob"] for alt in alternatives]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        if top and greedy:
            assert alternatives[0]["token"] == entry["token"] and alternatives[0]["logprob"] == entry["logprob"]
            assert sum(math.exp(v) for v in values) <= 1 + 1e-6


def same_values(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [e["token"] for e in a] == [e["token"] for e in b]
    for x, y in zip(a, b, strict=True):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]


def test_chat_logprobs_streamed_and_not(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "repeat_penalty": 1.0,
            "logprobs": True, "top_logprobs": 5}
    with daemon.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            chunks = sse_chunks(response)
        plain = http.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    choice = whole["choices"][0]
    entries = choice["logprobs"]["content"]
    check_entries(entries, 5)
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    assert len(entries) == whole["usage"]["completion_tokens"]  # max_tokens reached or an end token (none of it)
    streamed = [e for c in chunks if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    same_values(streamed, entries)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) \
        == choice["message"]["content"]
    assert plain["choices"][0]["logprobs"] is None  # not asked: none (the schema's null)
    assert plain["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_the_openai_sdk_reads_them(daemon: Daemon) -> None:
    with openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        response = sdk.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6,  # type: ignore[arg-type]
                                               temperature=0, logprobs=True, top_logprobs=2,
                                               extra_body={"repeat_penalty": 1.0})
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(item.top_logprobs) == 2 for item in content)
    assert "".join(item.token for item in content) == response.choices[0].message.content


def test_tokens_past_a_stop_sequence_have_none(daemon: Daemon) -> None:
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    with daemon.http() as http:
        free = http.post("/v1/completions", json=body).json()["choices"][0]
        text = free["text"]
        cut = text.index(text.split()[1])  # stop at the second word: its tokens and the rest never sent
        stopped = http.post("/v1/completions", json={**body, "stop": [text.split()[1]]}).json()["choices"][0]
    assert stopped["text"] == text[:cut]
    tokens = stopped["logprobs"]["tokens"]
    assert "".join(tokens).startswith(stopped["text"]) and tokens == free["logprobs"]["tokens"][:len(tokens)]
    assert len("".join(tokens[:-1])) < len(stopped["text"])  # no token after the one the text ends in


def test_completions_logprobs_match_llama_cpp_pythons_server(daemon: Daemon,
                                                              llama_servers: list[LlamaCppPythonServer]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "repeat_penalty": 1.0, "logprobs": 5}
    with daemon.http() as http:
        ours = http.post("/v1/completions", json={**body, "model": "smollm2"}).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "model": "smollm2", "stream": True}) as response:
            chunks = sse_chunks(response)
    theirs = httpx.post(f"{llama_servers[0].base_url}/completions", json={**body, "model": "smol"},
                        timeout=120).json()["choices"][0]
    mine = ours["logprobs"]
    assert ours["text"] == theirs["text"] and "".join(mine["tokens"]) == ours["text"]
    assert mine["tokens"] == theirs["logprobs"]["tokens"]
    assert mine["token_logprobs"] == pytest.approx(theirs["logprobs"]["token_logprobs"], abs=1e-3)
    # where each token begins in the prompt and text together (OpenAI's and theirs, with or without echo)
    assert mine["text_offset"] == theirs["logprobs"]["text_offset"] \
        == [len(PROMPT + "".join(mine["tokens"][:i])) for i in range(len(mine["tokens"]))]
    for top, reference in zip(mine["top_logprobs"], theirs["logprobs"]["top_logprobs"], strict=True):
        assert len(top) == 5
        common = set(top) & set(reference)  # theirs adds the token taken; equal values may order differently
        assert len(common) >= 4
        for token in common:
            assert top[token] == pytest.approx(reference[token], abs=1e-3)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for part in streamed for t in part["tokens"]] == mine["tokens"]
    assert [o for part in streamed for o in part["text_offset"]] == mine["text_offset"]


def test_responses_and_ollama_logprobs(daemon: Daemon) -> None:
    with daemon.http() as http:
        chat = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 8,
                                                       "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
        reference = chat["choices"][0]["logprobs"]["content"]
        response = http.post("/v1/responses", json={
            "model": "smollm2", "input": MESSAGES, "max_output_tokens": 8, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 3}).json()
        with http.stream("POST", "/v1/responses", json={
                "model": "smollm2", "input": MESSAGES, "max_output_tokens": 8, "temperature": 0, "top_logprobs": 3,
                "stream": True}) as stream:
            events = [c for c in sse_chunks(stream)]
        ollama = http.post("/api/chat", json={"model": "smollm2", "messages": MESSAGES, "stream": False,
                                              "options": {"num_predict": 8, "temperature": 0},
                                              "logprobs": True, "top_logprobs": 3}).json()
        with http.stream("POST", "/api/chat", json={"model": "smollm2", "messages": MESSAGES,
                                                    "options": {"num_predict": 8, "temperature": 0},
                                                    "logprobs": True, "top_logprobs": 3}) as stream:
            lines = [json.loads(line) for line in stream.iter_lines() if line]
        generate = http.post("/api/generate", json={"model": "smollm2", "prompt": PROMPT, "raw": True,
                                                    "stream": False, "logprobs": True,
                                                    "options": {"num_predict": 4, "temperature": 0,
                                                                "repeat_penalty": 1.0}}).json()
        plain = http.post("/api/chat", json={"model": "smollm2", "messages": MESSAGES, "stream": False,
                                             "options": {"num_predict": 8, "temperature": 0}}).json()
    check_entries(reference, 3, greedy=False)  # the Modelfile's repeat_penalty 1.1 (Responses has no field for it)
    part = response["output"][0]["content"][0]
    same_values(part["logprobs"], reference)
    deltas = [e for e in events if e.get("type") == "response.output_text.delta"]
    same_values([lp for d in deltas for lp in d["logprobs"]], reference)
    done = next(e for e in events if e.get("type") == "response.output_text.done")
    same_values(done["logprobs"], reference)
    same_values(ollama["logprobs"], reference)
    same_values([lp for line in lines for lp in line.get("logprobs", [])], reference)
    check_entries(generate["logprobs"], 0)
    assert "".join(e["token"] for e in generate["logprobs"]) == generate["response"]
    assert "logprobs" not in plain


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ("/api/chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/api/generate", {"prompt": "x", "top_logprobs": "many"}, "top_logprobs"),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 4, "logprobs": True}, "logprobs"),
])
def test_malformed_logprobs_are_400s_naming_the_field(daemon: Daemon, path: str, body: dict[str, Any],
                                                      field: str) -> None:
    with daemon.http() as http:
        response = http.post(path, json={"model": "smollm2", **body})
    assert response.status_code == 400, response.text
    assert field in response.text
