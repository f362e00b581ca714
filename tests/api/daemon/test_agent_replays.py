"""Request shapes captured from real agents (../shared/reference/agents.md), replayed against the daemon.

Each agent's real first request is replayed with its own headers, fields and quirks; only ``max_tokens``
is lowered so the test stays quick. Every stream must be well formed in the agent's own protocol.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.daemon.streams import check_anthropic_stream, check_chat_stream, check_responses_stream, named_events
from tests.conftest import Daemon


def schema(**properties: str) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": v, "description": k} for k, v in properties.items()},
            "required": list(properties)}


CLAUDE_TOOLS = [{"name": name, "description": f"{name} tool", "input_schema": schema(**props)} for name, props in [
    ("Bash", {"command": "string", "timeout": "number"}), ("Read", {"file_path": "string"}),
    ("Edit", {"file_path": "string", "old_string": "string", "new_string": "string"}),
    ("Glob", {"pattern": "string"}),
]]
CLAUDE_CODE = {
    "model": "smollm2", "max_tokens": 48, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code, a coding agent.", "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "Working directory: /repo"}],
    "messages": [
        {"role": "system", "content": "Reminder: prefer small edits."},
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": "What does main.py do?",
                                      "cache_control": {"type": "ephemeral"}}]}],
    "tools": CLAUDE_TOOLS, "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "user_abc_account__session_123"}, "temperature": 1,
}
CLAUDE_HEADERS = {"anthropic-version": "2023-06-01", "x-app": "cli", "X-Claude-Code-Session-Id": "cc-session-1",
                  "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,effort-2025-11-24",
                  "Authorization": "Bearer localai"}

CODEX = {
    "model": "smollm2", "stream": True, "store": False, "parallel_tool_calls": False,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "codex-thread-7", "tool_choice": "auto",
    "reasoning": {"summary": "auto"}, "text": {"verbosity": "low"}, "max_output_tokens": 48,
    "client_metadata": {"originator": "codex_exec"},
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
    ],
    "tools": [
        {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
         "parameters": schema(cmd="string", workdir="string")},
        {"type": "function", "name": "write_stdin", "description": "Write to a session",
         "parameters": schema(session_id="number", chars="string")},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents", "tools": [
            {"type": "function", "name": "spawn_agent", "parameters": schema(task="string")}]},
        {"type": "web_search", "external_web_access": False},
    ],
}
CODEX_HEADERS = {"x-codex-turn-metadata": '{"turn":1}', "x-codex-window-id": "w1", "x-codex-beta-features": "",
                 "Authorization": "Bearer localai"}

OPENAI_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                                  "parameters": schema(**props)}}
                for name, props in [("read", {"path": "string"}), ("bash", {"command": "string"}),
                                    ("edit", {"path": "string", "oldText": "string", "newText": "string"}),
                                    ("write", {"path": "string", "content": "string"})]]
OPENCODE = {"model": "smollm2", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 48,
            "tools": OPENAI_TOOLS, "tool_choice": "auto",
            "messages": [{"role": "system", "content": "You are opencode, an interactive CLI agent."},
                         {"role": "user", "content": "What is in this repo?"}]}
OPENCODE_HEADERS = {"x-session-id": "ses_opencode_1", "x-session-affinity": "ses_opencode_1"}
QWEN = {"model": "smollm2", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 48,
        "tools": OPENAI_TOOLS,
        "messages": [{"role": "system", "content": [{"type": "text", "text": "You are Qwen Code."}]},
                     {"role": "user", "content": [{"type": "text", "text": "Summarise README.md"}]}]}
PI = {"model": "smollm2", "stream": True, "store": False, "stream_options": {"include_usage": True},
      "max_completion_tokens": 48, "tools": OPENAI_TOOLS,
      "messages": [{"role": "developer", "content": "You are pi."}, {"role": "user", "content": "hello"}]}


def test_claude_code_first_request(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert http.head("/").status_code == 200
        events = named_events(http, "/v1/messages?beta=true", CLAUDE_CODE, headers=CLAUDE_HEADERS)
        again = named_events(http, "/v1/messages?beta=true", CLAUDE_CODE, headers=CLAUDE_HEADERS)
    result = check_anthropic_stream(events)
    assert result["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert result["blocks"], "the reply has content"
    assert result["start"]["usage"]["input_tokens"] > 100
    # The same session resends the same prefix: it is read from the cache.
    assert check_anthropic_stream(again)["usage"]["cache_read_input_tokens"] > 100


def test_codex_first_request(daemon: Daemon) -> None:
    with daemon.http() as http:
        final = check_responses_stream(named_events(http, "/v1/responses", CODEX, headers=CODEX_HEADERS))
        warmup = http.post("/v1/responses", json={**CODEX, "stream": False, "max_output_tokens": 1},
                           headers=CODEX_HEADERS)
    assert final["output"] and final["usage"]["input_tokens"] > 100
    assert [tool["name"] for tool in final["tools"]] == ["exec_command", "write_stdin", "multi_agent_v1.spawn_agent"]
    assert warmup.status_code == 200 and warmup.json()["usage"]["output_tokens"] <= 1


@pytest.mark.parametrize(("body", "headers"), [(OPENCODE, OPENCODE_HEADERS), (QWEN, {}), (PI, {})],
                         ids=["opencode", "qwen-code", "pi"])
def test_chat_completion_agents(daemon: Daemon, body: dict[str, Any], headers: dict[str, str]) -> None:
    with daemon.http() as http:
        result = check_chat_stream(named_events(http, "/v1/chat/completions", body, headers=headers), usage=True)
    assert result["finish_reason"] in ("stop", "length", "tool_calls")
    assert result["text"] or result["calls"]


def test_hermes_and_codex_oss_probes(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert http.get("/api/version").json()["version"]
        assert http.get("/api/tags").json()["models"]
        assert http.post("/api/show", json={"name": "smollm2"}).json()["model_info"]["llama.context_length"] == 8192
        assert http.get("/v1/models").json()["data"]


def test_tools_larger_than_the_context_are_slimmed_not_refused(daemon: Daemon) -> None:
    """An agent's first call with tool schemas bigger than smollm2's 8,192 tokens still gets an answer."""
    words = "Reads, edits or searches the files of the repository under strict rules. " * 12
    tools = [{"name": f"tool_{i}", "description": words, "input_schema": {"type": "object", "properties": {
        "path": {"type": "string", "description": words}, "mode": {"type": "string", "description": words}}}}
        for i in range(16)]
    body = {**CLAUDE_CODE, "tools": tools, "stream": False, "max_tokens": 16}
    with daemon.http() as http:
        counted = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        response = http.post("/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": "too-many-tools"})
        again = http.post("/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": "too-many-tools"})
    assert counted > 8192
    assert response.status_code == 200, response.text
    assert "tools=" in response.headers["X-LocalAI-Context-Fitted"]
    assert response.json()["content"]
    # The next turn of the session starts from the remembered fit, so its prefix comes from the cache.
    assert again.json()["usage"]["cache_read_input_tokens"] > 100
