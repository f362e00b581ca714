"""Fixtures for the TUI's tests: the app built by ``make_tui`` on the scripted fake daemon (fixed data, fixed
clock, no agents detected from the machine), and helpers shared by the Pilot tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from localai.client import AsyncClient
from localai.conversations import ConversationStore
from localai.tui.app import LocalAIApp, make_tui
from localai.tui.screens.agents import AgentRow
from tests.tui.fakedaemon import NOW, FakeDaemon

AGENTS = [
    AgentRow("claude", "Claude Code", "2.1.197 (localai)", "Anthropic Messages", "environment only"),
    AgentRow("codex", "Codex", "no", "OpenAI Responses", "-c overrides and a model catalog"),
    AgentRow("aider", "Aider", "0.86.2", "OpenAI Chat Completions", "flags and generated metadata files"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fake() -> FakeDaemon:
    return FakeDaemon()


class Launched:
    """Records the agent command lines the app would run."""

    def __init__(self) -> None:
        self.argv: list[list[str]] = []

    def __call__(self, argv: list[str]) -> int:
        self.argv.append(argv)
        return 0


@pytest.fixture
def launched() -> Launched:
    return Launched()


@pytest.fixture
def build(tmp_path: Path, launched: Launched) -> Callable[..., LocalAIApp]:
    """``build(client, **options)``: the app as ``localai tui`` makes it, with test seams filled in."""

    def factory(client: AsyncClient, **options: Any) -> LocalAIApp:
        options.setdefault("clock", lambda: NOW)
        options.setdefault("export_dir", tmp_path)
        options.setdefault("agents", lambda: AGENTS)
        options.setdefault("launcher", launched)
        options.setdefault("live_refresh", None)
        return make_tui(client, **options)

    return factory


def store_row(conversation_id: str, title: str, model: str, messages: Any, *, system: str = "",
              options: str = "{}", updated_at: str = "2026-01-15T11:58:00+00:00") -> None:
    """A conversation row written as is (fixed timestamps, or deliberately broken JSON)."""
    store = ConversationStore.open()
    store.db["conversations"].upsert({  # type: ignore[union-attr]
        "id": conversation_id, "title": title, "model": model, "system": system, "options": options,
        "messages": messages if isinstance(messages, str) else json.dumps(messages),
        "created_at": updated_at, "updated_at": updated_at}, pk="id")
    store.close()


async def settle(pilot: Pilot[Any]) -> None:
    """Wait until the app is idle: no worker running (loading data, streaming) and the screen repainted.
    Workers started by a message handled after a key press are caught by the second round."""
    idle_rounds = 0
    while idle_rounds < 2:
        await pilot.pause()
        running = [worker for worker in pilot.app.workers if not worker.is_finished]
        if running:
            idle_rounds = 0
            await pilot.app.workers.wait_for_complete(running)
        else:
            idle_rounds += 1


async def until(pilot: Pilot[Any], condition: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    """Let the app run until ``condition()`` holds (its value is returned): what a test waits for, or what the app
    does after it looked idle (a screen's push, a worker started on mount). A deadline against hanging, not a
    timing assertion: giving up fails the test, naming ``what`` and the notifications."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await pilot.pause(0.01)
    notes = [f"{n.title}: {n.message}" for n in pilot.app._notifications]
    raise AssertionError(f"gave up waiting for {what}; notifications: {notes}")
