"""Oversized requests are refused before any rendering or tokenizing, in every dialect and on the WebSocket, with
the field named; large bodies are checked in a checker process (killed when it overruns, replaced when it dies),
and a large body within the limits is parsed once and answered as before."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from localai.api import limits
from localai.api.body_check import LARGE, BodyChecker
from localai.errors import ServerBusy
from localai.models import renderer

SOCKET = "ws://localhost/v1/responses"
MANY = [{"role": "user", "content": "x"}] * (limits.MAX_ITEMS + 1)
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                               for i in range(12_000)}}  # ~1.6 MB: over a tool's 1 MiB


def post(api: TestClient, path: str, body: dict[str, Any]) -> tuple[int, str]:
    response = api.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return response.status_code, response.text


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": MANY}, "'messages' holds"),
    ("/v1/completions", {"prompt": "x", "messages": MANY}, "'messages' holds"),
    ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": "x"}] * 10_001}, "'input' holds"),
    ("/v1/messages", {"max_tokens": 4, "messages": MANY}, "'messages' holds"),
    ("/v1/messages/count_tokens", {"messages": MANY}, "'messages' holds"),
    ("/api/chat", {"stream": False, "messages": MANY}, "'messages' holds"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "big", "parameters": BIG_SCHEMA}}]},
     "tools.0 is"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(600)]},
     "'tools' holds 600"),
    ("/api/chat", {"stream": False, "messages": [{"role": "user", "content": "x"}], "junk": [0] * 600_000},
     "values"),
])
def test_oversized_requests_are_413s_naming_what_is_too_big(api: TestClient, path: str, body: dict[str, Any],
                                                            field: str) -> None:
    status, text = post(api, path, {"model": "smollm2", **body})
    assert status == 413 and field in text, text[:300]
    assert post(api, "/api/chat", {"model": "smollm2", "stream": False,
                                   "messages": [{"role": "user", "content": "still here?"}]})[0] == 200


def test_a_large_body_within_the_limits_is_answered(api: TestClient) -> None:
    texts = ["lorem ipsum " * 100] * 1_500  # ~1.8 MB: checked in the checker process, then parsed once here
    response = api.post("/v1/embeddings", json={"model": "smollm2", "input": texts})
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["data"]) == len(texts)


@pytest.mark.parametrize(("message", "status", "needle"), [
    ('{"type": "response.create", "model": "smollm2", "input": ' + "[" * 5000 + "]" * 5000 + "}", 400, "nested"),
    ('{"type": "response.create", "model": "smollm2", "input": "\\ud800"}', 400, "surrogate"),
    ('{"type": "response.create", "model": "smollm2", "input": 1e400}', 400, "out of range"),
    (json.dumps({"type": "response.create", "model": "smollm2",
                 "input": [{"type": "message", "role": "user", "content": "x"}] * 10_001}), 413, "'input' holds"),
])
def test_the_websocket_checks_messages_as_http_checks_bodies(api: TestClient, message: str, status: int,
                                                             needle: str) -> None:
    with api.websocket_connect(SOCKET) as socket:
        socket.send_text(message)
        event = socket.receive_json()
        assert event["type"] == "error" and event["status"] == status and needle in event["error"]["message"], event
        socket.send_text(json.dumps({"type": "response.create", "model": "smollm2", "input": "hi [[say:ok]]"}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "error"):
            events.append(socket.receive_json())
        assert events[-1]["type"] == "response.completed"  # the connection stayed and serves


def test_a_large_websocket_message_within_the_limits_is_answered(api: TestClient) -> None:
    filler = [{"type": "message", "role": "developer", "content": "note " * 40}] * 6000  # ~1.4 MB
    message = json.dumps({"type": "response.create", "model": "smollm2", "max_output_tokens": 2,
                          "input": [*filler, {"type": "message", "role": "user", "content": "hi"}]})
    assert len(message) > LARGE
    with api.websocket_connect(SOCKET) as socket:
        socket.send_text(message)
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.failed", "error"):
            events.append(socket.receive_json())
        assert events[-1]["type"] in ("response.completed", "response.failed") or events[-1]["status"] == 400, \
            events[-1]  # answered (completed, or a context too small for it): never a 500


def test_a_checker_that_overruns_is_killed_and_one_that_dies_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        checker = BodyChecker(processes=1, seconds=30.0)
        await checker.check(b'{"fine": true}')
        [first] = checker._idle
        monkeypatch.setattr(renderer, "KILL_GRACE", 0.0)
        checker.seconds = 0.01  # walking 400,000 values takes longer: the check overruns
        with pytest.raises(ServerBusy, match="took over"):
            await checker.check(json.dumps({"values": list(range(400_000))}).encode())
        assert first.process.poll() is not None and not checker._idle  # killed, not kept
        checker.seconds = 30.0
        await checker.check(b'{"fine": true}')  # a fresh process
        [process] = checker._idle
        process.process.kill()
        process.process.wait()
        await checker.check(b'{"fine": true}')  # the dead one is noticed and replaced
        with pytest.raises(limits.BodyProblem, match="surrogate"):
            await checker.check(b'{"x": "\\ud800"}')
        checker.close()

    asyncio.run(scenario())


def test_limits_checks_the_shape_before_every_value() -> None:
    assert limits.check_json(b"not json") is None
    assert limits.check_json(b'{"messages": []}') == {"messages": []}
    with pytest.raises(limits.BodyProblem, match="'system' holds") as refused:
        limits.check_json(json.dumps({"system": [{"type": "text"}] * 10_001}).encode())
    assert refused.value.status == 413
    with pytest.raises(limits.BodyProblem, match="together"):
        limits.check_json(json.dumps({"tools": [{"d": "x" * 900_000}] * 5}).encode())


def test_a_large_body_that_is_not_json_is_a_400(api: TestClient) -> None:
    body = b'{"model": "smollm2", "messages": [' + b'{"role": "user", "content": "x"},' * 40_000 + b"oops"
    assert len(body) > LARGE
    response = api.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.text, response.text[:200]
