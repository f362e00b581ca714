"""Generated replies in every format, through every dialect: what the model wrote (text, reasoning, tool calls
with code full of markup, unicode, nested JSON) comes out of each dialect's response exactly, streamed and not.

The replies are tests/runtime/formats/test_formats_roundtrip.py's (seeded; the same generator runs 1,000 per format
at the parser), said by the scripted engine. ``make test`` runs ``FORMAT_CASES`` (default 40) per format and
dialect, half of them streamed; ``FORMAT_CASES=1000 pytest tests/api/test_formats_cases.py`` runs the full thousand.
"""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from localai.settings import Settings
from tests.api.conftest import scripted_settings
from tests.metagguf import metadata_gguf
from tests.runtime.formats.test_formats_roundtrip import SCHEMAS, STYLES, arguments, text_piece, write

CASES = int(os.environ.get("FORMAT_CASES", "40"))
TOOLS = [{"name": name, "description": name, "parameters": schema} for name, schema in SCHEMAS.items()]
# ChatML, and a model that may open with <think> (what decides that reasoning is parsed for the JSON formats)
TEMPLATE = ("{# a model that thinks: <think> #}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
Outcome = tuple[str, str, list[tuple[str, Any]]]


@pytest.fixture(scope="module")
def api_settings() -> Settings:
    """Without the prompt cache: this is about what each dialect makes of a reply, and thousands of one-off
    conversations would only fill the cache (and its lookups) with entries no one continues."""
    return scripted_settings(cache_max_bytes=0)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return metadata_gguf(tmp_path_factory.mktemp("gguf") / "cases.gguf", arch="qwen3moe", context_length=262144)


def case(rng: random.Random, style: str) -> Outcome:
    """One reply, as tests/runtime/formats/test_formats_roundtrip.py generates them."""
    count = 1 if style == "llama3" else rng.randrange(0, 4)
    calls = [(name, arguments(rng, name)) for name in rng.choices(list(SCHEMAS), k=count)]
    text = text_piece(rng) if rng.random() < 0.6 or not calls else ""
    if style == "llama3" and calls:
        text = ""
    return text, text_piece(rng) if rng.random() < 0.5 else "", calls


def sse(response: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def openai(api: TestClient, body: dict[str, Any], stream: bool) -> Outcome:
    body = {**body, "tools": [{"type": "function", "function": t} for t in TOOLS]}
    if not stream:
        message = api.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        return (message["content"] or "", message.get("reasoning_content") or "",
                [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message.get("tool_calls") or []])
    with api.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = sse(response)
    text = reasoning = ""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            text += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call.get("function", {}).get("name") or ""
                entry[1] += call.get("function", {}).get("arguments") or ""
    return text, reasoning, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def anthropic(api: TestClient, body: dict[str, Any], stream: bool) -> Outcome:
    body = {**body, "max_tokens": 100000, "thinking": {"type": "enabled", "budget_tokens": 2048},
            "tools": [{"name": t["name"], "input_schema": t["parameters"]} for t in TOOLS]}
    if not stream:
        blocks = api.post("/v1/messages", json=body).json()["content"]
    else:
        with api.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
            events = sse(response)
        blocks = []
        for event in events:
            if event["type"] == "content_block_start":
                blocks.append({**event["content_block"], "partial": ""})
            elif event["type"] == "content_block_delta":
                delta, block = event["delta"], blocks[event["index"]]
                key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}.get(
                    delta["type"])
                if key:
                    block[key] = block.get(key, "") + delta[{"partial": "partial_json"}.get(key, key)]
        for block in blocks:
            if block["type"] == "tool_use":
                block["input"] = json.loads(block["partial"] or "{}")
    return ("".join(b["text"] for b in blocks if b["type"] == "text"),
            "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])


def responses(api: TestClient, body: dict[str, Any], stream: bool) -> Outcome:
    body = {"model": body["model"], "input": body["messages"], "tools": [{"type": "function", **t} for t in TOOLS]}
    if not stream:
        output = api.post("/v1/responses", json=body).json()["output"]
    else:
        with api.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
            events = sse(response)
        output = next(e["response"]["output"] for e in events if e["type"] == "response.completed")
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert streamed == "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        assert deltas == "".join(item["arguments"] for item in output if item["type"] == "function_call")
    return ("".join(p["text"] for i in output if i["type"] == "message" for p in i["content"]),
            "".join(p["text"] for i in output if i["type"] == "reasoning" for p in i.get("content") or []),
            [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"])


def ollama(api: TestClient, body: dict[str, Any], stream: bool) -> Outcome:
    body = {**body, "stream": stream, "think": True, "tools": [{"type": "function", "function": t} for t in TOOLS]}
    if not stream:
        lines = [api.post("/api/chat", json=body).json()["message"]]
    else:
        with api.stream("POST", "/api/chat", json=body) as response:
            lines = [json.loads(line)["message"] for line in response.iter_lines() if line]
    return ("".join(line.get("content") or "" for line in lines),
            "".join(line.get("thinking") or "" for line in lines),
            [(c["function"]["name"], c["function"]["arguments"])
             for line in lines for c in line.get("tool_calls") or []])


DIALECTS = {"openai": openai, "anthropic": anthropic, "responses": responses, "ollama": ollama}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_generated_replies_come_out_of_each_dialect_exactly(api: TestClient, weights: Path, style: str,
                                                            dialect: str) -> None:
    name = f"cases-{style}"
    parser = "mistral" if style == "mistral-args" else style
    created = api.post("/api/create", json={"model": name, "modelfile": (
        f'FROM {weights}\nPARSER {parser}\nPARAMETER num_ctx 60000\nTEMPLATE """{TEMPLATE}"""\n')})
    assert created.status_code == 200, created.text
    rng = random.Random(f"roundtrip-{style}")  # the parser-level test's seed: the same first replies
    for number in range(CASES):
        text, reasoning, calls = case(rng, style)
        said = base64.b64encode(write(style, text, reasoning, calls).encode()).decode()
        body = {"model": name, "messages": [{"role": "user", "content": f"case {number} [[say64:{said}]]"}]}
        got = DIALECTS[dialect](api, body, stream=number % 2 == 1)
        assert got == (text, reasoning, calls), f"case {number} ({'streamed' if number % 2 else 'plain'}): " \
                                                f"{write(style, text, reasoning, calls)!r}"
