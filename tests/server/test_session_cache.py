"""The persisted prompt cache through the real daemon: restart, sharing, corruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import Daemon, start_daemon

SYSTEM = "You are a careful coding assistant. " + "Follow the project's conventions and explain briefly. " * 12


def chat(daemon: Daemon, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    with daemon.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def cached(result: dict[str, Any]) -> int:
    return int(result["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_resume_after_restart_is_cached_and_gives_the_same_greedy_output(tmp_path: Path, smollm2_path: Path) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a linked list?"}]
    daemon = start_daemon(tmp_path / "home")
    try:
        first = chat(daemon, turn1)
    finally:
        daemon.stop()
    turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And a queue?"}]
    daemon = start_daemon(tmp_path / "home")  # a new daemon and worker: only the disk remembers
    try:
        resumed = chat(daemon, turn2)
    finally:
        daemon.stop()
    assert cached(resumed) >= first["usage"]["prompt_tokens"] - 1
    baseline = start_daemon(tmp_path / "nocache", cache_max_bytes="0")
    try:
        fresh = chat(baseline, turn2)
    finally:
        baseline.stop()
    assert cached(fresh) == 0
    assert resumed["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


def test_a_second_session_reuses_the_shared_system_prompt(fresh_daemon: Daemon) -> None:
    first = chat(fresh_daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task A"}],
                 prompt_cache_key="agent-a")
    second = chat(fresh_daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task B"}],
                  prompt_cache_key="agent-b")
    assert cached(first) == 0
    assert cached(second) > 100  # the system prompt was computed once


def test_corrupt_cache_files_are_recomputed_not_served(tmp_path: Path, smollm2_path: Path) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    daemon = start_daemon(tmp_path / "home")
    try:
        expected = chat(daemon, messages)
    finally:
        daemon.stop()
    files = list((tmp_path / "home" / "cache").rglob("*.kv"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    daemon = start_daemon(tmp_path / "home")
    try:
        again = chat(daemon, messages)
        assert cached(again) == 0
        assert again["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert "dropping cache entry" in (tmp_path / "home" / "logs" / "workers.log").read_text()
    finally:
        daemon.stop()
