"""Snapshot tests: each screen at 120x36 on the fake daemon's fixed data, so layout changes are reviewed as SVG
diffs (``pytest tests/tui --snapshot-update`` rewrites them; look at them before committing)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input

from localai.tui.app import LocalAIApp
from localai.tui.screens.chat import ChatScreen
from localai.tui.screens.dialogs import AskScreen
from tests.tui.conftest import settle, store_row, until
from tests.tui.fakedaemon import REPLY, FakeDaemon

SIZE = (120, 36)
SESSION = "5e551on0000000000000000000000001"



def conversation() -> None:
    stats = {"prompt_tokens": 120, "cached_tokens": 96, "completion_tokens": 32, "eval_seconds": 0.4}
    store_row(SESSION, "Reverse a list in Python", "smollm2", [
        {"role": "user", "content": "How do I reverse a list in Python?"},
        {"role": "assistant", "content": REPLY, "stats": stats},
        {"role": "user", "content": "And in place?"},
        {"role": "assistant", "content": "Use `items.reverse()`: it reverses the list in place and returns None.",
         "stats": {**stats, "prompt_tokens": 171, "cached_tokens": 152, "completion_tokens": 18}},
    ], options='{"num_predict": 64, "temperature": 0.2}')
    store_row("0000000000000000000000000000beef", "Damaged on disk", "smollm2", "[{not json",
              updated_at="2026-01-14T08:00:00+00:00")


def test_home(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=settle)


def test_chat(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    conversation()

    async def resume(pilot: Pilot[Any]) -> None:
        await pilot.press("f2")
        screen = pilot.app.screen
        assert isinstance(screen, ChatScreen)
        screen.resume(SESSION)
        await settle(pilot)

    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=resume)


def test_conversations(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0xC0FFEE))  # the new chat behind the list
    conversation()

    async def open_list(pilot: Pilot[Any]) -> None:
        await pilot.press("f2", "ctrl+l")
        await settle(pilot)

    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=open_list)


async def open_settings(pilot: Pilot[Any]) -> None:
    """The chat of SESSION, then its settings."""
    await pilot.press("f2")
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    screen.resume(SESSION)
    await pilot.press("ctrl+t")
    await settle(pilot)


def test_settings(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    conversation()
    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=open_settings)


async def models_screen(pilot: Pilot[Any]) -> None:
    """F3, and wait until the library table has its rows: it is filled by a worker the screen starts when it
    mounts, which under load can begin after ``settle`` saw the app idle (a fresh clone's snapshot once caught the
    table's header alone, its columns narrow)."""
    await pilot.press("f3")
    await settle(pilot)

    def filled() -> bool:
        tables = pilot.app.screen.query("#library")
        return bool(tables) and tables.first(DataTable).row_count > 0
    await until(pilot, filled, "the library table's rows")
    await settle(pilot)


def test_models(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    async def pulled(pilot: Pilot[Any]) -> None:
        await models_screen(pilot)
        screen = pilot.app.screen
        screen.start_pull("qwen2.5-coder:3b")  # type: ignore[attr-defined]
        await settle(pilot)

    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=pulled)


def test_running(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    assert snap_compare(build(fake.client()), terminal_size=SIZE, press=["f4"], run_before=settle)


def test_cache(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    conversation()
    assert snap_compare(build(fake.client()), terminal_size=SIZE, press=["f5"], run_before=settle)


def test_agents(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    assert snap_compare(build(fake.client()), terminal_size=SIZE, press=["f6"], run_before=settle)


def test_pull_dialog(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    """The pull question whole (wrapped), an example placeholder, and what Enter on an empty line says."""
    async def ask(pilot: Pilot[Any]) -> None:
        await models_screen(pilot)
        await pilot.press("p")
        # Enter goes to the dialog's line only once the dialog has focus (under load the push may take a while)
        await pilot.wait_for_scheduled_animations()
        await until(pilot, lambda: isinstance(pilot.app.screen, AskScreen) and isinstance(pilot.app.focused, Input),
                    "the pull dialog with its line focused")
        await pilot.press("enter")
        await settle(pilot)

    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=ask)


def test_failed_pull(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    fake.pull_error = "hf.co/nobody/nothing-GGUF: repository not found on the hub"

    async def failed(pilot: Pilot[Any]) -> None:
        await models_screen(pilot)
        pilot.app.screen.start_pull("hf.co/nobody/nothing-GGUF")  # type: ignore[attr-defined]
        await settle(pilot)
        pilot.app.clear_notifications()

    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=failed)


@pytest.mark.parametrize("size", [(160, 45), (80, 24)])
def test_settings_sizes(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon,
                        size: tuple[int, int]) -> None:
    conversation()
    assert snap_compare(build(fake.client()), terminal_size=size, run_before=open_settings)


def test_cache_named_by_the_daemon(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    """Entries of sessions the TUI did not make, under the model the daemon names (not a fingerprint)."""
    for entry, models in zip(fake.entries, (["smollm2:135m"], ["pirate:latest", "smollm2:135m"]), strict=True):
        entry.update(session=entry["session"] and "agent-session-1", model=models[0] if len(models) == 1 else None,
                     models=models)
    assert snap_compare(build(fake.client()), terminal_size=SIZE, press=["f5"], run_before=settle)


@pytest.mark.parametrize("opened", [False, True])
def test_a_thinking_reply(snap_compare: Any, build: Callable[..., LocalAIApp], fake: FakeDaemon,
                          opened: bool) -> None:
    """A thinking model's reply: its reasoning collapsed above the answer, then opened."""
    store_row("0000000000000000000000000000f00d", "Reverse in place", "qwen3", [
        {"role": "user", "content": "How do I reverse a list in place?"},
        {"role": "assistant", "content": "Use `items.reverse()`: it reverses the list in place and returns None.",
         "thinking": "The user wants it in place, so slicing is out: it makes a copy. list.reverse() mutates the "
                     "list and returns None, which is worth saying.",
         "stats": {"prompt_tokens": 40, "cached_tokens": 0, "completion_tokens": 58, "eval_seconds": 0.5}},
    ])

    async def resume(pilot: Pilot[Any]) -> None:
        await pilot.press("f2")
        screen = pilot.app.screen
        assert isinstance(screen, ChatScreen)
        screen.resume("0000000000000000000000000000f00d")
        await settle(pilot)
        if opened:
            screen.query_one("CollapsibleTitle").focus()
            await pilot.press("enter")
            await settle(pilot)

    assert snap_compare(build(fake.client()), terminal_size=SIZE, run_before=resume)
