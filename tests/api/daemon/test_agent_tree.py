"""Sub-agents and side requests cached as sessions of their own under their parent (a real daemon, a worker on the
scripted engine, two slots): Claude Code's sub-agent (``x-claude-code-agent-id`` beside the session id) neither
displaces its parent's live slot nor reads as the parent's conversation changing; OpenCode's title request and
Codex's side requests (``request_kind``) likewise; ``cache ls`` shows the tree."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from localai.api.sessions import session_id
from localai.schema import child_session, parent_session
from tests.conftest import Daemon, start_daemon
from tests.observe import reported_divergences

TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i} of the agent. " * 4,
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}} for i in range(6)]
PARENT_SYSTEM = "You are Claude Code, the main agent. " + "Work carefully in the repository. " * 30
AGENT_SYSTEM = "You are a sub-agent exploring the code base for your parent. " + "Report what you find. " * 30


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    instance = start_daemon(tmp_path_factory.mktemp("tree"), engine="scripted", keep_alive="-1")
    yield instance
    instance.stop()


def messages_call(daemon: Daemon, system: str, messages: list[dict[str, Any]],
                  headers: dict[str, str]) -> httpx.Response:
    with daemon.http(timeout=60) as http:
        response = http.post("/v1/messages", headers={"anthropic-version": "2023-06-01", **headers}, json={
            "model": "smollm2", "max_tokens": 16, "system": system, "tools": TOOLS, "messages": messages})
    assert response.status_code == 200, response.text
    return response


def test_the_session_header_names_children() -> None:
    assert session_id({"x-claude-code-session-id": "s1"}) == "s1"
    sub = session_id({"x-claude-code-session-id": "s1", "x-claude-code-agent-id": "a7"})
    assert sub == child_session("s1", "agent:a7") and parent_session(sub) == "s1"
    codex = {"session-id": "c1", "x-codex-turn-metadata": json.dumps({"request_kind": "memory"})}
    assert session_id(codex) == child_session("c1", "memory")
    assert session_id({**codex, "x-codex-turn-metadata": json.dumps({"request_kind": "turn"})}) == "c1"
    assert session_id({**codex, "x-codex-turn-metadata": json.dumps({"request_kind": "prewarm"})}) == "c1"
    # what Codex might send malformed is the main session, never an error
    for bad in ("not json", "[1]", json.dumps({"request_kind": 5}), json.dumps({"request_kind": "a\nb"})):
        assert session_id({**codex, "x-codex-turn-metadata": bad}) == "c1"
    assert session_id({"x-claude-code-agent-id": "a7"}) is None  # an agent id alone names no session
    long = session_id({"x-claude-code-session-id": "s1", "x-claude-code-agent-id": "x" * 10_000})
    assert long is not None and len(long) < 200
    assert parent_session(None) is None and parent_session("plain") is None


def test_a_sub_agent_gets_a_session_under_its_parent_and_leaves_the_parent_live(scripted: Daemon) -> None:
    parent = {"x-claude-code-session-id": "cc-parent"}
    turns: list[dict[str, Any]] = [{"role": "user", "content": "find the bug [[say:Looking.]]"}]
    messages_call(scripted, PARENT_SYSTEM, turns, parent)
    turns += [{"role": "assistant", "content": "Looking."}, {"role": "user", "content": "go on [[say:Sure.]]"}]
    messages_call(scripted, PARENT_SYSTEM, turns, parent)
    # the sub-agent: its own system prompt and task, the parent's session id and its own agent id
    sub = {**parent, "x-claude-code-agent-id": "agent-1"}
    task = [{"role": "user", "content": "explore src/ [[say:Found it.]]"}]
    messages_call(scripted, AGENT_SYSTEM, task, sub)
    task += [{"role": "assistant", "content": "Found it."}, {"role": "user", "content": "more [[say:Done.]]"}]
    second = messages_call(scripted, AGENT_SYSTEM, task, sub)
    assert second.headers["X-LocalAI-Cache"] == "live"  # the sub-agent's own slot continues
    # the parent's next turn finds its own slot as it left it
    turns += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "and now? [[say:Fixed.]]"}]
    resumed = messages_call(scripted, PARENT_SYSTEM, turns, parent)
    assert resumed.headers["X-LocalAI-Cache"] == "live", dict(resumed.headers)
    # neither the sub-agent nor the parent read as a conversation that changed
    with scripted.http(timeout=60) as http:
        assert reported_divergences(http, "cc-parent") == []
    listing = json.loads(subprocess.run(
        [sys.executable, "-m", "localai", "cache", "ls", "--json"], capture_output=True, text=True, check=True,
        env={**scripted.env}).stdout)
    sessions = [e["session"] for e in listing if (e["session"] or "").startswith("cc-parent")]
    assert child_session("cc-parent", "agent:agent-1") in sessions and "cc-parent" in sessions
    # the tree order: the parent's entries, then its children's
    assert sessions.index("cc-parent") < sessions.index(child_session("cc-parent", "agent:agent-1"))
    assert next(e for e in listing if e["session"] == child_session("cc-parent", "agent:agent-1"))[
        "parent_session"] == "cc-parent"
    table = subprocess.run([sys.executable, "-m", "localai", "cache", "ls"], capture_output=True, text=True,
                           check=True, env={**scripted.env}).stdout
    assert "└ agent:agent-1" in table


def test_opencodes_title_request_goes_to_a_side_session(scripted: Daemon) -> None:
    headers = {"x-session-id": "oc-1"}
    system = "You are OpenCode, a coding agent. " + "Be precise. " * 40

    def chat(system_text: str, user: str) -> httpx.Response:
        with scripted.http(timeout=60) as http:
            response = http.post("/v1/chat/completions", headers=headers, json={
                "model": "smollm2", "max_tokens": 8, "messages": [
                    {"role": "system", "content": system_text}, {"role": "user", "content": user}]})
        assert response.status_code == 200, response.text
        return response

    chat(system, "hello [[say:Hi.]]")
    chat("You are a title generator. You output ONLY a thread title.", "Generate a title [[say:A title]]")
    again = chat(system, "hello [[say:Hi.]]")  # the same prompt again: a retry, from its own live slot
    assert again.headers["X-LocalAI-Cache"] == "live"
    with scripted.http(timeout=60) as http:
        assert reported_divergences(http, "oc-1") == []
