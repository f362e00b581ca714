"""Pilot tests against a real daemon running smollm2 (loaded once for the module): a streamed reply, Esc
stopping a long one in the daemon, conversations after a restart, Running with unload, and the Cache screen
after two turns. Replies are capped with num_predict; waits are deadlines, never timing assertions."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from localai.client import AsyncClient
from localai.tui.app import LocalAIApp
from localai.tui.screens.cache import CacheScreen
from localai.tui.screens.chat import ChatScreen
from localai.tui.screens.conversations import ConversationsScreen
from localai.tui.widgets.messages import Reply
from localai.tui.widgets.prompt import PromptInput
from tests.conftest import Daemon, start_daemon
from tests.tui.conftest import until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
SIZE = (120, 36)
SHORT = {"num_predict": 12, "temperature": 0}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    with start_daemon(tmp_path_factory.mktemp("tui-daemon"), keep_alive="-1") as daemon:
        yield daemon


def client(daemon: Daemon) -> AsyncClient:
    return AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(daemon.socket_path)))


async def chat_turn(pilot: Pilot[Any], text: str) -> Reply:
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    screen.query_one(PromptInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: screen.query(Reply) and not screen.generating, "the reply")
    return screen.query(Reply).last()


LONG_PROMPT = "Write a very long story about a dragon."


async def start_long_reply(pilot: Pilot[Any]) -> ChatScreen:
    """Sends a prompt that runs to the cap (with num_predict 2000, greedy) and waits for its first words."""
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    screen.query_one(PromptInput).text = LONG_PROMPT
    await pilot.press("enter")
    await until(pilot, lambda: screen.query(Reply) and len(screen.query(Reply).last().message.content) > 20,
                "the reply to start")
    return screen


def loaded(daemon: Daemon) -> list[dict[str, Any]]:
    with daemon.unix() as http:
        return list(http.get("/api/ps").json()["models"])


async def test_streamed_reply_persists_across_restarts(live: Daemon, build: Callable[..., LocalAIApp]) -> None:
    app = build(client(live), model="smollm2", options=SHORT)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connected, "the daemon")
        reply = await chat_turn(pilot, "Say hello.")
        assert reply.message.content.strip() and reply.message.stats is not None
        assert reply.message.stats.completion_tokens > 0
        assert "tokens/s" in str(reply.query_one(".reply-stats").render())
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        conversation_id, content = screen.conversation.id, reply.message.content

    again = build(client(live), options=SHORT)  # a new app: what it shows comes from SQLite
    async with again.run_test(size=SIZE) as pilot:
        await pilot.press("f2", "ctrl+l")
        await pilot.pause()
        assert isinstance(again.screen, ConversationsScreen)
        await pilot.press("enter")
        await pilot.pause()
        screen = again.screen
        assert isinstance(screen, ChatScreen) and screen.conversation.id == conversation_id
        assert [r.message.content for r in screen.query(Reply)] == [content]
        second = await chat_turn(pilot, "And goodbye?")
        assert second.message.stats is not None
        assert second.message.stats.cached_tokens > 0  # the conversation's session: the first turn was reused


async def test_escape_stops_decoding_in_the_daemon(live: Daemon, build: Callable[..., LocalAIApp]) -> None:
    # Greedy, this prompt runs to the cap (2,000 tokens take ~40 s here): long enough to be stopped midway.
    app = build(client(live), model="smollm2", options={"num_predict": 2000, "temperature": 0})
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connected, "the daemon")
        await pilot.press("f2")
        screen = await start_long_reply(pilot)
        await until(pilot, lambda: any(m["active_requests"] for m in loaded(live)), "the daemon to be decoding")
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating, "the reply to stop")
        reply = screen.query(Reply).last()
        assert reply.message.stopped and reply.message.stats is None
        # The daemon stopped decoding: no request is left active (it would run to 2,000 tokens otherwise).
        await until(pilot, lambda: not any(m["active_requests"] for m in loaded(live)), "the daemon to stop")
        kept = len(reply.message.content)
        await pilot.pause(0.5)
        assert len(reply.message.content) == kept


async def test_running_shows_the_loaded_model_and_unloads_it(live: Daemon,
                                                           build: Callable[..., LocalAIApp]) -> None:
    with live.unix() as http:  # make sure it is loaded (an empty prompt loads)
        http.post("/api/generate", json={"model": "smollm2"}).raise_for_status()
    app = build(client(live), live_refresh=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        table = app.screen.query_one(DataTable)
        await until(pilot, lambda: table.row_count == 1, "the loaded model")
        row = table.get_row_at(0)
        assert row[0] == "smollm2:135m" and row[1] == "llama.cpp"
        assert row[2] == f"pid {loaded(live)[0]['pid']}" and row[3] == "4096" and row[8] == "forever"
        assert (row[6], row[7]) == ("100% CPU", "-")  # the CPU build: nothing on a GPU
        await pilot.press("u")
        await pilot.pause()
        await pilot.press("y")
        await until(pilot, lambda: not loaded(live), "the daemon to unload it")
        await until(pilot, lambda: table.row_count == 0, "the table to follow")
        await until(pilot, lambda: any("Unloaded smollm2:135m" in str(n.message) for n in app._notifications),
                    "the confirmation")


async def test_cache_screen_after_two_turns(live: Daemon, build: Callable[..., LocalAIApp]) -> None:
    app = build(client(live), model="smollm2", options=SHORT)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connected, "the daemon")
        await pilot.press("f2")
        await chat_turn(pilot, "Name a colour.")
        second = await chat_turn(pilot, "Another one?")
        assert second.message.stats is not None and second.message.stats.cached_tokens > 0
        chat = app.screen
        assert isinstance(chat, ChatScreen)
        session = chat.conversation.id
        await pilot.press("f5")
        screen = app.screen
        assert isinstance(screen, CacheScreen)
        entries = screen.query_one("#cache-entries", DataTable)

        def has_session_entry() -> bool:
            screen.action_refresh()
            return any(entry.session == session for entry in screen.entries.values())

        await until(pilot, has_session_entry, "the conversation's cache entry on disk")
        await until(pilot, lambda: entries.row_count >= 1, "the entries table")
        models = screen.query_one("#cache-models", DataTable)
        row = models.get_row("smollm2:135m")
        assert int(row[1]) >= 1 and int(row[2]) >= 1  # entries, sessions
        assert row[6].endswith("%") and int(row[6][:-1]) > 0  # hit ratio
        titles = [str(entries.get_row_at(i)[4]) for i in range(entries.row_count)]
        assert any(title.startswith("Name a colour.") for title in titles)  # entries named by conversation
