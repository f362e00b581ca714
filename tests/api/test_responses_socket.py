"""WebSocket mode of /v1/responses: several turns on one connection, the same events as the HTTP stream, bad
messages answered with an error event (the connection stays), the guards before the handshake, the idle limit,
and a client that leaves mid-response."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from localai.settings import Settings
from tests.api.conftest import scripted_settings
from tests.api.test_spec_conformance import check_response
from tests.observe import counted, wait_for

SOCKET = "ws://localhost/v1/responses"


@pytest.fixture(scope="module")
def api_settings() -> Settings:
    return scripted_settings(num_parallel=1)  # one slot: a reply that is not stopped holds it


def turn(socket: Any, **fields: Any) -> list[dict[str, Any]]:
    """Send one response.create and read its events up to the last (completed, incomplete or failed)."""
    socket.send_text(json.dumps({"type": "response.create", **fields}))
    events = []
    while True:
        event = json.loads(socket.receive_text())
        events.append(event)
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events


def test_several_turns_on_one_connection_with_the_http_streams_events(api: TestClient) -> None:
    with api.websocket_connect(SOCKET) as socket:
        first = turn(socket, model="smollm2", input="hi [[turns:Hello.|||Again.]]", store=False)
        kinds = [e["type"] for e in first]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e["sequence_number"] for e in first] == list(range(len(first)))
        assert "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta") == "Hello."
        done = first[-1]["response"]
        check_response(done, "completed")
        # the next turn continues the first by id although it was not stored: the connection remembers it
        second = turn(socket, model="smollm2", previous_response_id=done["id"], store=False,
                      input=[{"type": "message", "role": "user", "content": "and?"}])
        assert second[-1]["type"] == "response.completed"
        assert second[-1]["response"]["output"][0]["content"][0]["text"] == "Again."
        assert second[-1]["response"]["usage"]["input_tokens"] > done["usage"]["input_tokens"]
        # the same id over HTTP does not exist: store was false
        assert api.get(f"/v1/responses/{done['id']}").status_code == 404
    with api.stream("POST", "/v1/responses", json={"model": "smollm2", "input": "hi [[turns:Hello.|||Again.]]",
                                                    "stream": True}) as response:
        http = [json.loads(line[6:])["type"] for line in response.iter_lines() if line.startswith("data: {")]
    assert http == kinds  # the same event sequence as the HTTP stream


@pytest.mark.parametrize(("message", "param", "says"), [
    ("not json", None, "not valid JSON"),
    (json.dumps({"type": "session.update"}), "type", "response.create"),
    (json.dumps([1, 2]), "type", "response.create"),
    (json.dumps({"type": "response.create", "model": "smollm2", "input": "x", "temperature": 9}), "temperature",
     "temperature"),
    (json.dumps({"type": "response.create", "input": "x"}), "model", "model"),
    (json.dumps({"type": "response.create", "model": "nope", "input": "x"}), "model", "nope"),
    (json.dumps({"type": "response.create", "model": "smollm2", "input": "x", "background": True}), "background",
     "background"),
    (json.dumps({"type": "response.create", "model": "smollm2", "previous_response_id": "resp_gone",
                 "input": "x"}), "previous_response_id", "resp_gone"),
])
def test_a_bad_message_gets_an_error_event_and_the_connection_stays(api: TestClient, message: str,
                                                                   param: str | None, says: str) -> None:
    with api.websocket_connect(SOCKET) as socket:
        socket.send_text(message)
        error = json.loads(socket.receive_text())
        assert error["type"] == "error" and error["status"] in (400, 404)
        assert error["error"]["param"] == param and says in error["error"]["message"]
        assert turn(socket, model="smollm2", input="still there? [[say:yes]]")[-1]["type"] == "response.completed"


def test_a_message_over_the_size_limit_is_refused(api: TestClient) -> None:
    limit = api.app.state.settings.max_request_bytes  # type: ignore[attr-defined]
    with api.websocket_connect(SOCKET) as socket:
        socket.send_text(json.dumps({"type": "response.create", "model": "smollm2", "input": "x" * (limit + 1)}))
        error = json.loads(socket.receive_text())
        assert error["type"] == "error" and "over the limit" in error["error"]["message"]
        assert turn(socket, model="smollm2", input="small [[say:ok]]")[-1]["type"] == "response.completed"


def test_a_foreign_page_cannot_open_the_socket(api: TestClient) -> None:
    """Browsers do not apply CORS to WebSockets: the Origin guard refuses the handshake itself."""
    with pytest.raises(WebSocketDisconnect) as refused, \
            api.websocket_connect(SOCKET, headers={"Origin": "https://evil.example"}):
        pass
    assert refused.value.code == 1008
    with pytest.raises(WebSocketDisconnect), api.websocket_connect(SOCKET, headers={"Host": "attacker.example"}):
        pass
    with api.websocket_connect(SOCKET, headers={"Origin": "http://localhost:3000"}) as socket:
        assert turn(socket, model="smollm2", input="hi [[say:ok]]")[-1]["type"] == "response.completed"


def test_an_idle_connection_is_closed(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api.app.state.settings, "ws_idle_timeout", 0.3)  # type: ignore[attr-defined]
    with api.websocket_connect(SOCKET) as socket:
        with pytest.raises(WebSocketDisconnect) as closed:
            socket.receive_text()
        assert closed.value.code == 1000


def test_a_client_that_leaves_mid_response_stops_it(api: TestClient) -> None:
    """The slow reply (2,000 tokens, 100 s) is counted as cancelled, not run to its end, and the one slot is free
    for the next request. (A model of its own: its /metrics outcomes are this test's alone.)"""
    model = "socket-leaver"
    assert api.post("/api/create", json={"model": model, "modelfile": "FROM smollm2\n"}).status_code == 200
    with api.websocket_connect(SOCKET) as socket:
        socket.send_text(json.dumps({"type": "response.create", "model": model, "input": "go [[slow]]"}))
        while json.loads(socket.receive_text())["type"] != "response.output_text.delta":
            pass
    wait_for(lambda: counted(api, "localai_requests_total", model) == 1, "the slow reply's end")
    assert counted(api, "localai_requests_total", model, "cancelled") == 1, "the slow reply ran on: never stopped"
    # one slot (this module's settings): served only because the slow reply no longer holds it
    answer = api.post("/v1/responses", json={"model": model, "input": "next [[say:free]]"}).json()
    assert answer["output"][0]["content"][0]["text"] == "free"


def test_a_failed_continuation_forgets_the_response_it_continued(api: TestClient) -> None:
    """Unstored responses live on their connection only: another connection gets previous_response_not_found,
    and a continuation that fails evicts the response it named (a retry cannot build on a broken turn)."""
    with api.websocket_connect(SOCKET) as socket:
        first = turn(socket, model="smollm2", input="remember ember [[say:OK]]", store=False)[-1]["response"]
        failed = turn(socket, model="smollm2", previous_response_id=first["id"], store=False, input=[
            {"type": "function_call_output", "call_id": "call_missing", "output": "x"}])[-1]
        assert failed["type"] == "error" and failed["status"] == 400
        stale = turn(socket, model="smollm2", previous_response_id=first["id"], store=False, input="again")[-1]
        assert stale["type"] == "error" and stale["error"]["code"] == "previous_response_not_found"
        second = turn(socket, model="smollm2", input="other [[say:OK]]", store=False)[-1]["response"]
    with api.websocket_connect(SOCKET) as other:
        missing = turn(other, model="smollm2", previous_response_id=second["id"], store=False, input="go on")[-1]
        assert missing == {"type": "error", "status": 404, "error": {
            "type": "not_found_error", "code": "previous_response_not_found", "param": "previous_response_id",
            "message": missing["error"]["message"]}}
        assert turn(other, model="smollm2", input="recovered [[say:ok]]")[-1]["type"] == "response.completed"


def test_a_prewarm_evaluates_the_prompt_and_generates_nothing(api: TestClient) -> None:
    """Codex opens a session with generate: false: the prompt is evaluated and cached, the response has no
    output, and the real first turn then finds the prompt cached."""
    ask = [{"type": "message", "role": "user", "content": "a long task description " * 40 + "[[say:Done.]]"}]
    with api.websocket_connect(SOCKET) as socket:
        warm = turn(socket, model="smollm2", input=ask, generate=False, store=False)
        assert warm[-1]["type"] == "response.completed"
        assert warm[-1]["response"]["output"] == [] and warm[-1]["response"]["usage"]["output_tokens"] == 0
        assert not [e for e in warm if e["type"] == "response.output_text.delta"]
        real = turn(socket, model="smollm2", input=ask, store=False)[-1]["response"]
        assert real["output"][0]["content"][0]["text"] == "Done."
        usage = real["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= usage["input_tokens"] - 1


def test_a_second_request_sent_during_a_response_waits_for_it(api: TestClient) -> None:
    """One response at a time per connection: a response.create that arrives while one is streaming is answered
    after it, in order, never interleaved."""
    with api.websocket_connect(SOCKET) as socket:
        for word in ("first", "second"):
            socket.send_text(json.dumps({"type": "response.create", "model": "smollm2", "store": False,
                                         "input": f"{word} [[say:{word} answer]]"}))
        events: list[dict[str, Any]] = []
        while sum(e["type"] == "response.completed" for e in events) < 2:
            events.append(json.loads(socket.receive_text()))
    done = [i for i, e in enumerate(events) if e["type"] == "response.completed"]
    created = [i for i, e in enumerate(events) if e["type"] == "response.created"]
    assert created[0] < done[0] < created[1] < done[1]  # the second began after the first ended
    texts = [e["response"]["output"][0]["content"][0]["text"] for e in events if e["type"] == "response.completed"]
    assert texts == ["first answer", "second answer"]
    assert [e["sequence_number"] for e in events[created[1]:]] == list(range(len(events) - created[1]))
