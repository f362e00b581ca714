"""The stream tail the dialects share (api/common.py's stream_response): a worker killed mid-stream ends each
dialect's stream with that dialect's own error frame, and the generation is closed (the next request loads a new
worker)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Daemon, start_daemon
from tests.observe import worker_pid

SLOW = "[[slow]]"
USER = [{"role": "user", "content": SLOW}]
DIALECTS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai chat": ("/v1/chat/completions", {"messages": USER, "stream": True}),
    "openai completions": ("/v1/completions", {"prompt": SLOW, "stream": True}),
    "anthropic": ("/v1/messages", {"messages": USER, "max_tokens": 4000, "stream": True}),
    "responses": ("/v1/responses", {"input": SLOW, "stream": True}),
    "ollama": ("/api/chat", {"messages": USER, "stream": True}),
}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A real daemon whose models run on the scripted engine (no model loads; the worker is a real process)."""
    instance = start_daemon(tmp_path_factory.mktemp("tail"), engine="scripted", keep_alive="-1")
    yield instance
    instance.stop()


def error_of(dialect: str, lines: list[str]) -> dict[str, Any] | str | None:
    """The error the stream ended with, in the dialect's shape (None if it ended without one)."""
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines
                if line.startswith(("data: {", "{"))]
    if not payloads:
        return None
    last = payloads[-1]
    if dialect == "anthropic":
        return last["error"] if last.get("type") == "error" else None
    if dialect == "responses":
        return last["response"]["error"] if last.get("type") == "response.failed" else None
    return last.get("error")


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_a_worker_killed_mid_stream_ends_the_stream_with_the_dialects_error(scripted: Daemon, dialect: str) -> None:
    path, body = DIALECTS[dialect]
    with scripted.http(timeout=60) as http, http.stream("POST", path, json={"model": "smollm2", **body}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        for line in lines:  # the scripted reply comes a byte a token, 20 a second: a few bytes of text are out
            seen += bool(line.strip())
            if seen == 30:
                break
        pid = worker_pid(http, "smollm2")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line.strip()]
    error = error_of(dialect, rest)
    assert error, rest[-3:]
    text = json.dumps(error)
    assert "crashed" in text, text
    assert "data: [DONE]" not in rest
    with scripted.http(timeout=60) as http:
        again = http.post("/api/chat", json={"model": "smollm2", "stream": False, "messages": [
            {"role": "user", "content": "[[say:back]]"}]})
    assert again.status_code == 200 and again.json()["message"]["content"] == "back"
