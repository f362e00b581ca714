"""Real failures against real daemons: a pull from the hub stand-in with live progress to completion, a pull of
a missing model, and the daemon killed while a reply streams. Each must end in a notification, never a dead app."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from textual.widgets import DataTable

from localai.client import AsyncClient
from localai.tui.app import LocalAIApp
from localai.tui.screens.models import ModelsScreen
from localai.tui.widgets.messages import Reply
from localai.tui.widgets.prompt import PromptInput
from tests.conftest import Daemon, start_daemon
from tests.hubserver import HubServer
from tests.tui.conftest import until
from tests.tui.test_live import start_long_reply

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
SIZE = (120, 36)
SMOL_REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def hub_daemon(smollm2_path: Path, isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A daemon whose Hugging Face endpoint is the local hub stand-in serving the real smollm2 GGUF."""
    with HubServer() as hub:
        hub.add(SMOL_REPO, {SMOL_FILE: smollm2_path, "README.md": b"# SmolLM2 135M"})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with start_daemon(isolated_home) as daemon:
            yield daemon


def client(daemon: Daemon) -> AsyncClient:
    return AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(daemon.socket_path)))


async def test_pull_shows_progress_to_completion_and_a_missing_model_fails_cleanly(
        hub_daemon: Daemon, build: Callable[..., LocalAIApp], smollm2_path: Path) -> None:
    app = build(client(hub_daemon))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        seen: list[int] = []
        bar = screen.start_pull(f"hf.co/{SMOL_REPO}:Q4_1")
        await until(pilot, lambda: seen.append(bar.progress.completed) or bar.finished, "the pull to finish")
        assert bar.progress.done and not bar.has_class("failed")
        assert bar.progress.total == smollm2_path.stat().st_size == bar.progress.completed
        assert len(set(seen)) > 2  # the bar moved through intermediate values
        installed = screen.query_one("#installed", DataTable)
        name = f"hf.co/{SMOL_REPO.lower()}:q4_1"
        await until(pilot, lambda: name in {str(installed.get_row_at(i)[0]) for i in range(installed.row_count)},
                    "the pulled model in the installed table")

        missing = screen.start_pull("hf.co/test-org/no-such-model-GGUF:Q4_K_M")
        await until(pilot, lambda: missing.finished, "the missing pull to fail")
        assert missing.has_class("failed")
        notes = [f"{n.title}: {n.message}" for n in app._notifications]
        assert any(note.startswith("Pull of hf.co/test-org/no-such-model-GGUF:Q4_K_M failed") for note in notes)
        assert app.is_running


async def test_daemon_killed_while_a_reply_streams(fresh_daemon: Daemon, build: Callable[..., LocalAIApp]) -> None:
    app = build(client(fresh_daemon), model="smollm2", options={"num_predict": 2000, "temperature": 0})
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connected, "the daemon")
        screen = await start_long_reply(pilot)
        fresh_daemon.process.send_signal(signal.SIGKILL)
        await until(pilot, lambda: not screen.generating, "the reply to end")
        reply = screen.query(Reply).last()
        assert reply.message.stopped and reply.message.content  # what arrived is kept
        notes = [f"{n.title}: {n.message}" for n in app._notifications]
        assert any(note.startswith("Daemon unavailable: lost the connection") and "localai serve" in note
                   for note in notes)
        # The app goes on: the next message says the daemon is gone and hands the prompt back.
        screen.query_one(PromptInput).text = "Are you there?"
        await pilot.press("enter")
        await until(pilot, lambda: not screen.generating and screen.query_one(PromptInput).text, "the prompt back")
        assert screen.query_one(PromptInput).text == "Are you there?"
        assert screen.conversation.messages[-1].role == "assistant"


async def test_worker_crash_mid_reply_is_a_notification_and_the_next_message_works(
        fresh_daemon: Daemon, build: Callable[..., LocalAIApp]) -> None:
    app = build(client(fresh_daemon), model="smollm2", options={"num_predict": 2000, "temperature": 0})
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connected, "the daemon")
        screen = await start_long_reply(pilot)
        with fresh_daemon.unix() as http:
            (model,) = http.get("/api/ps").json()["models"]
        os.kill(model["pid"], signal.SIGKILL)  # the worker process running llama.cpp dies
        await until(pilot, lambda: not screen.generating, "the reply to end")
        assert screen.query(Reply).last().message.stopped
        # the notification is a message the app handles after the reply ends (a fresh clone's run looked between)
        notes = await until(pilot, lambda: [f"{n.title}: {n.message}" for n in app._notifications], "a notification")
        assert any(note.startswith("Worker crashed:") and "Send again" in note for note in notes), notes
        screen.conversation.options = {"num_predict": 8, "temperature": 0}
        screen.query_one(PromptInput).text = "Say hello."
        await pilot.press("enter")
        await until(pilot, lambda: len(screen.query(Reply)) == 2 and not screen.generating, "the next reply")
        last = screen.query(Reply).last().message
        assert last.content and last.stats is not None  # the daemon loaded the model again
