"""Reading and checking SSE streams the way each dialect's clients do."""

from __future__ import annotations

import json
from typing import Any

import httpx


def named_events(http: httpx.Client, path: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> list[tuple[str | None, Any]]:
    """``(event name, data)`` for every event of a streamed response; ``[DONE]`` comes back as a string."""
    events: list[tuple[str | None, Any]] = []
    name: str | None = None
    with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
    return events


def check_chat_stream(events: list[tuple[str | None, Any]], *, usage: bool) -> dict[str, Any]:
    """A well-formed chat.completion.chunk stream; returns the assembled message and finish reason."""
    assert events[-1][1] == "[DONE]"
    chunks = [data for _, data in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    text, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    assert len(reasons) == 1, reasons
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    for call in calls.values():
        json.loads(call["arguments"])
    return {"text": text, "calls": list(calls.values()), "finish_reason": reasons[0]}


def check_anthropic_stream(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """A well-formed Messages stream: names match types, blocks open and close in order, one stop."""
    for name, data in events:
        assert name == data["type"], (name, data)
    types = [name for name, _ in events if name != "ping"]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    open_index: int | None = None
    blocks: list[dict[str, Any]] = []
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "partial_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta = data["delta"]
            block = blocks[open_index]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                block["partial_json"] += delta["partial_json"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial_json"] or "{}")
    final = events[-2][1] if events[-2][0] == "message_delta" else next(
        data for name, data in events if name == "message_delta")
    return {"blocks": blocks, "stop_reason": final["delta"]["stop_reason"], "usage": final["usage"],
            "start": events[0][1]["message"]}


def check_responses_stream(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """A well-formed Responses stream: created first, completed last, numbered, every item added then done."""
    for name, data in events:
        assert name == data["type"]
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))
    assert events[0][0] == "response.created" and events[1][0] == "response.in_progress"
    assert events[-1][0] in ("response.completed", "response.incomplete"), events[-1][0]
    added = [data["output_index"] for name, data in events if name == "response.output_item.added"]
    done = [data["output_index"] for name, data in events if name == "response.output_item.done"]
    assert added == done == list(range(len(added)))
    final = events[-1][1]["response"]
    assert len(final["output"]) == len(added)
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    text = "".join(part["text"] for item in final["output"] if item["type"] == "message" for part in item["content"])
    assert deltas == text
    for item in final["output"]:
        if item["type"] == "function_call":
            json.loads(item["arguments"])
    return final
