"""The Responses WebSocket on the real daemon (uvicorn, its connection protocol, a worker on the scripted engine): a
socket outlives the request-body deadline, idle and while a reply streams (every Codex socket was closed 60 s after
its handshake); Codex's prewarm (``generate: false``, ``input: []``) completes and warms the session; reconnects
are countable in /metrics."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Daemon, start_daemon
from tests.observe import reported_divergences

BODY_TIMEOUT = 1.0  # the request-body deadline of this daemon: the tests pass it on purpose


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    instance = start_daemon(tmp_path_factory.mktemp("socket"), engine="scripted", keep_alive="-1",
                            body_timeout=str(BODY_TIMEOUT))
    yield instance
    instance.stop()


def turn(socket: Any, **fields: Any) -> list[dict[str, Any]]:
    socket.send(json.dumps({"type": "response.create", "model": "smollm2", **fields}))
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed",
                                                   "error"):
        events.append(json.loads(socket.recv(timeout=60)))
    return events


def counter(daemon: Daemon, name: str) -> float:
    with daemon.http() as http:
        text = http.get("/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_socket_outlives_the_body_deadline_idle_and_while_a_reply_streams(scripted: Daemon) -> None:
    from websockets.sync.client import connect

    opened = counter(scripted, "localai_responses_websockets_total")
    with connect(f"ws://127.0.0.1:{scripted.port}/v1/responses") as socket:
        # idle for over twice the body deadline: the deadline used to keep running after the upgrade and close it
        time.sleep(2.5 * BODY_TIMEOUT)
        socket.ping().wait(10)
        started = time.monotonic()
        # a reply of 40 tokens at the scripted engine's 20 a second: it streams for ~2 s, past the deadline again
        events = turn(socket, input="go [[slow]]", max_output_tokens=40, store=False)
        assert events[-1]["type"] == "response.incomplete", events[-1]  # cut by max_output_tokens, not the socket
        assert time.monotonic() - started > BODY_TIMEOUT
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text.startswith("tick tick") and len(text) >= 40
        # and the socket still takes the next turn
        assert turn(socket, input="again [[say:done]]", store=False)[-1]["type"] == "response.completed"
    assert counter(scripted, "localai_responses_websockets_total") == opened + 1  # one connection, no reconnect


def test_codex_prewarm_with_no_input_completes_and_warms_the_session(scripted: Daemon) -> None:
    from websockets.sync.client import connect

    instructions = "You are Codex, a coding agent. " + "Follow the repository's conventions. " * 40
    tools = [{"type": "function", "name": "shell", "description": "Run a command",
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                             "required": ["command"]}}]
    with connect(f"ws://127.0.0.1:{scripted.port}/v1/responses") as socket:
        warm = turn(socket, instructions=instructions, tools=tools, input=[], generate=False, store=False,
                    prompt_cache_key="codex-session-1")
        kinds = [e["type"] for e in warm]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", warm
        done = warm[-1]["response"]
        assert done["output"] == [] and done["usage"]["output_tokens"] == 0
        assert not any(k.startswith("response.output") for k in kinds)
        # the first real turn continues the prewarm by id and finds its prefix (instructions, tools) computed
        first = turn(socket, instructions=instructions, tools=tools, previous_response_id=done["id"], store=False,
                     prompt_cache_key="codex-session-1",
                     input=[{"type": "message", "role": "user", "content": "list the files [[say:ok]]"}])
        assert first[-1]["type"] == "response.completed", first[-1]
        usage = first[-1]["response"]["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= done["usage"]["input_tokens"] - 1
        assert done["usage"]["input_tokens"] > len(instructions) // 2  # the instructions were evaluated
        # a prewarm with a message in it warms the whole prompt, and a prewarm of nothing at all still completes
        again = turn(socket, input="hello", generate=False, store=False)
        assert again[-1]["type"] == "response.completed" and again[-1]["response"]["output"] == []
        empty = turn(socket, input=[], generate=False, store=False)
        assert empty[-1]["type"] == "response.completed", empty  # the template's own system prompt is warmed
        # a real turn with no message is still refused, as an error event, and the socket stays
        refused = turn(socket, input=[], store=False)
        assert refused[-1]["type"] == "error" and refused[-1]["error"]["param"] == "input"
        assert turn(socket, input="still there [[say:yes]]", store=False)[-1]["type"] == "response.completed"


def test_codex_prewarm_without_instructions_computes_nothing_its_first_turn_does_not_reuse(scripted: Daemon) -> None:
    """Codex 0.171's prewarm carries its tools and no instructions (``input: []``); its first turn brings them as
    developer messages, which the template writes before the tools. Everything the prewarm evaluated is reused by
    that turn (before: the prewarm evaluated the tools block, and the turn reused the first few tokens of it)."""
    from websockets.sync.client import connect

    tools = [{"type": "function", "name": f"tool_{i}", "description": "Run a command. " * 20,
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}} for i in range(8)]
    with connect(f"ws://127.0.0.1:{scripted.port}/v1/responses") as socket:
        warm = turn(socket, tools=tools, input=[], generate=False, store=False, prompt_cache_key="codex-bare")
        assert warm[-1]["type"] == "response.completed", warm[-1]
        warmed = warm[-1]["response"]["usage"]["input_tokens"]
        first = turn(socket, tools=tools, previous_response_id=warm[-1]["response"]["id"], store=False,
                     prompt_cache_key="codex-bare", input=[
                         {"type": "message", "role": "developer", "content": "<permissions>The repo.</permissions>"},
                         {"type": "message", "role": "user", "content": "list the files [[say:ok]]"}])
        assert first[-1]["type"] == "response.completed", first[-1]
        cached = first[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= warmed - 1, (warmed, cached)
    # what the prewarm evaluated is a prefix of the first turn: it does not read as the system prompt changing
    with scripted.http(timeout=60) as http:
        assert reported_divergences(http, "codex-bare") == []
