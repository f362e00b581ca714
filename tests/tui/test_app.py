"""Pilot tests on the scripted fake daemon: the chat's streaming, stop, copy, settings, conversations, the
palette, agents, and errors that must become notifications (never a dead app)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from localai.client import AsyncClient
from localai.conversations import ConversationStore
from localai.tui.app import LocalAIApp
from localai.tui.screens.chat import ChatScreen
from localai.tui.screens.conversations import ConversationsScreen
from localai.tui.screens.models import ModelsScreen
from localai.tui.widgets.messages import Reply
from localai.tui.widgets.prompt import PromptInput
from tests.tui.conftest import Launched, settle, store_row, until
from tests.tui.fakedaemon import REPLY, FakeDaemon

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


def notifications(app: LocalAIApp) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]



async def send(pilot: Pilot[Any], text: str) -> ChatScreen:
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    screen.query_one(PromptInput).text = text
    await pilot.press("enter")
    return screen


async def first_piece(pilot: Pilot[Any], screen: ChatScreen) -> Reply:
    """The reply being streamed, once its first piece of content is in (the fake daemon then holds the stream)."""
    reply = screen.query(Reply).last()
    for _ in range(100):
        if reply.message.content:
            break
        await pilot.pause(0.02)
    return reply


async def test_prompt_typed_streams_a_rendered_reply_with_cache_stats(
        build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    app = build(fake.client(), options={"num_predict": 16})
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c", *"Reverse a list", "ctrl+j", *"in Python")
        await pilot.press("enter")
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        reply = screen.query(Reply).last()
        assert reply.message.content == REPLY
        assert "96 from cache (80%)" in str(reply.query_one(".reply-stats").render())
        assert screen.query_one(PromptInput).text == ""
    body = next(r[2] for r in fake.requests if r[1] == "/api/chat")
    assert body["messages"][-1] == {"role": "user", "content": "Reverse a list\nin Python"}  # multi-line input
    assert body["options"] == {"num_predict": 16}
    stored = ConversationStore.open().load(screen.conversation.id)
    assert [m.role for m in stored.messages] == ["user", "assistant"]
    assert stored.messages[1].stats is not None and stored.messages[1].stats.cached_tokens == 96
    assert stored.title == "Reverse a list"


THINKING = "The user wants the list reversed. Slicing with [::-1] makes a copy; reverse() works in place."


async def test_a_thinking_models_reasoning_streams_into_a_collapsed_block_above_the_answer(
        build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    fake.thinking = THINKING
    fake.hold = asyncio.Event()  # one piece of reasoning, then the stream waits
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        screen = await send(pilot, "Reverse a list")
        reply = await first_piece(pilot, screen)  # the reasoning has streamed; the answer's first piece holds it
        await pilot.pause()
        block = reply.thinking
        assert block.display and block.collapsed and block.title == "Thinking…"  # still streaming, shut
        assert reply.body.source == "Here "  # the answer's first piece below it
        fake.hold.set()
        await settle(pilot)
        assert reply.message.thinking.strip() == THINKING and reply.message.content == REPLY
        assert block.collapsed and block.title == "Thinking (16 words)"
        assert not block.query_one(".thinking-body").region.height  # shut: the answer is all that shows
        block.query_one("CollapsibleTitle").focus()
        await pilot.press("enter")  # open it from the keyboard
        await settle(pilot)
        assert not block.collapsed and block.query_one(".thinking-body").region.height
        assert THINKING.split()[0] in reply.query_one(".thinking-body").source
        fake.thinking = ""
        screen.query_one(PromptInput).focus()
        await send(pilot, "In place?")
        await settle(pilot)
        assert not screen.query(Reply).last().thinking.display  # a reply without reasoning shows no block
    stored = ConversationStore.open().load(screen.conversation.id)
    assert stored.messages[1].thinking.strip() == THINKING and not stored.messages[3].thinking
    second = [r[2] for r in fake.requests if r[1] == "/api/chat"][-1]
    assert second["messages"][1] == {"role": "assistant", "content": REPLY, "thinking": reply.message.thinking}
    assert "<details><summary>Thinking</summary>" in stored.to_markdown()


async def test_escape_stops_the_reply_and_closes_the_stream(build: Callable[..., LocalAIApp],
                                                             fake: FakeDaemon) -> None:
    fake.hold = asyncio.Event()  # the fake sends one piece, then waits: a reply that never ends by itself
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        screen = await send(pilot, "Tell me a long story")
        reply = await first_piece(pilot, screen)
        assert screen.generating
        await pilot.press("escape")
        await settle(pilot)
        assert not screen.generating
        assert reply.message.stopped and reply.message.content == "Here "
        assert "stopped" in str(reply.query_one(".reply-stats").render())
        # The next message goes out normally.
        fake.hold = None
        await send(pilot, "Shorter, please")
        await settle(pilot)
        assert screen.query(Reply).last().message.content == REPLY


async def test_copy_reply_and_code_block_use_osc52(build: Callable[..., LocalAIApp], fake: FakeDaemon,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    copied: list[str] = []
    app = build(fake.client())
    monkeypatch.setattr(app, "copy_to_clipboard", copied.append)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await send(pilot, "Reverse a list")
        await settle(pilot)
        await pilot.press("ctrl+r", "ctrl+b")
        assert copied == [REPLY, "def reverse(items):\n    return items[::-1]\n"]


async def test_settings_change_the_system_prompt_and_options(build: Callable[..., LocalAIApp],
                                                             fake: FakeDaemon) -> None:
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2", "ctrl+t")
        await pilot.pause()
        app.screen.query_one("#system").text = "You are terse."  # type: ignore[attr-defined]
        app.screen.query_one("#parameters").text = "temperature 0.1\nnum_ctx 2048\nstop \"END\""  # type: ignore
        await pilot.press("ctrl+s")
        await pilot.pause()
        screen = await send(pilot, "Hi")
        await settle(pilot)
        assert screen.conversation.options == {"temperature": 0.1, "num_ctx": 2048, "stop": ["END"]}
        # A bad parameter is refused with a notification naming the line; the dialog stays open.
        await pilot.press("ctrl+t")
        await pilot.pause()
        app.screen.query_one("#parameters").text = "temprature 1"  # type: ignore[attr-defined]
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert any("line 1: unknown parameter 'temprature'" in n for n in notifications(app))
        await pilot.press("escape")
    body = next(r[2] for r in fake.requests if r[1] == "/api/chat")
    assert body["messages"][0] == {"role": "system", "content": "You are terse."}
    assert body["options"]["num_ctx"] == 2048


async def test_conversations_resume_rename_export_delete(build: Callable[..., LocalAIApp], fake: FakeDaemon,
                                                         tmp_path: Path) -> None:
    store_row("c0ffee00000000000000000000000001", "Lists", "smollm2", [
        {"role": "user", "content": "How do I reverse a list?"}, {"role": "assistant", "content": REPLY}])
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2", "ctrl+l")
        await pilot.pause()
        assert isinstance(app.screen, ConversationsScreen)
        await pilot.press("x")  # export
        exported = next(tmp_path.glob("lists-c0ffee00.md")).read_text()
        assert exported.startswith("# Lists\n") and "## Assistant" in exported and "items[::-1]" in exported
        await pilot.press("r")
        await pilot.pause()
        app.screen.query_one("#answer").value = "Reversing lists"  # type: ignore[attr-defined]
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("enter")  # open it
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        assert screen.conversation.title == "Reversing lists" and len(screen.query(Reply)) == 1
        await pilot.press("ctrl+l", "d", "y")
        await pilot.pause()
        assert ConversationStore.open().summaries() == []


async def test_broken_conversation_row_is_reported_not_fatal(build: Callable[..., LocalAIApp],
                                                              fake: FakeDaemon) -> None:
    store_row("bad00000000000000000000000000001", "Broken", "smollm2", "[{not json")
    store_row("bad00000000000000000000000000002", "Bad options", "smollm2", "[]", options="[1, 2]")
    store_row("900d0000000000000000000000000001", "Fine", "smollm2", [{"role": "user", "content": "hi"}],
              updated_at="2026-01-01T00:00:00+00:00")
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2", "ctrl+l")
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert table.row_count == 3
        assert any("2 damaged conversation(s)" in n and "delete it from the list (d)" in n for n in notifications(app))
        await pilot.press("enter")  # the broken one (most recent) cannot open: a notification, the list stays
        await pilot.pause()
        assert isinstance(app.screen, ConversationsScreen)
        assert any("Cannot open the conversation" in n for n in notifications(app))
        await pilot.press("d", "y")  # and it can be deleted
        await pilot.pause()
        assert table.row_count == 2
        # The command palette lists only the readable ones.
        await pilot.press("escape", "ctrl+p", *"Resume", "enter")
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen) and screen.conversation.title == "Fine"


async def test_no_daemon_is_a_notification_that_says_what_to_do(build: Callable[..., LocalAIApp]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused")

    app = build(AsyncClient(transport=httpx.MockTransport(refuse)))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await settle(pilot)
        assert not app.connected
        assert any("Daemon unavailable" in n and "localai serve" in n for n in notifications(app))
        await pilot.press("f2")
        screen = await send(pilot, "hello?")
        await settle(pilot)
        assert screen.query_one(PromptInput).text == "hello?"  # the prompt comes back to be sent again
        assert not screen.query(Reply) and screen.conversation.messages == []


async def test_missing_model_and_failed_pull_are_notifications(build: Callable[..., LocalAIApp],
                                                               fake: FakeDaemon) -> None:
    fake.pull_error = "hf.co/nobody/nothing-GGUF: repository not found on the hub"
    app = build(fake.client(), model="nothing-here")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        fake.models = []  # /api/chat answers as the daemon does for a model it does not have
        await send(pilot, "hi")
        await settle(pilot)
        await pilot.press("f3")
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        bar = screen.start_pull("hf.co/nobody/nothing-GGUF")
        await settle(pilot)
        assert bar.has_class("failed")
    assert any("Pull of hf.co/nobody/nothing-GGUF failed" in n and "repository not found" in n
               for n in notifications(app))


async def test_agents_launch_suspends_and_runs_localai_launch(build: Callable[..., LocalAIApp], fake: FakeDaemon,
                                                             launched: Launched,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    app = build(fake.client(), model="smollm2")
    suspended: list[bool] = []

    @contextlib.contextmanager
    def suspend() -> Iterator[None]:  # the headless test driver cannot give the terminal away
        suspended.append(True)
        yield

    monkeypatch.setattr(app, "suspend", suspend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f6")
        await settle(pilot)
        await pilot.press("down", "enter")
        await settle(pilot)
    assert suspended == [True]
    assert launched.argv[0][-4:] == ["launch", "codex", "--model", "smollm2"]
    assert any("codex exited with status 0" in n for n in notifications(app))


async def test_a_refresh_marks_the_library_installed_in_place(build: Callable[..., LocalAIApp],
                                                              fake: FakeDaemon) -> None:
    """Ctrl+R after a model appears: its library row says installed, and the table is updated in place (cleared and
    filled again, its columns fell back to their headers' widths, which a snapshot once caught half repainted)."""
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await settle(pilot)
        library = app.screen.query_one("#library", DataTable)
        await until(pilot, lambda: library.row_count > 0, "the library's rows")
        await settle(pilot)
        name = str(library.get_row_at(0)[0])
        assert str(library.get_row_at(0)[3]) == ""
        widths = [column.get_render_width(library) for column in library.columns.values()]
        cleared: list[int] = []
        real_clear = library.clear
        library.clear = lambda *a, **k: cleared.append(1) or real_clear(*a, **k)  # type: ignore[method-assign]
        fake.models.append({**fake.models[0], "name": name, "model": name})
        await pilot.press("ctrl+r")
        await settle(pilot)
        await until(pilot, lambda: str(library.get_row_at(0)[3]) == "yes", "the row marked installed")
        assert not cleared, "the library table was cleared and filled again for a refresh"
        assert [column.get_render_width(library) for column in library.columns.values()] == widths
        assert library.row_count > 1 and str(library.get_row_at(1)[3]) == ""
