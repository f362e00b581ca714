"""The Textual app: one mode per screen (home, chat, models, running, cache, agents), a command palette for
models and conversations, and the one place where errors become notifications."""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.reactive import var
from textual.screen import Screen

from localai.client import APIError, AsyncClient
from localai.conversations import ConversationStore
from localai.errors import DaemonUnavailable, LocalAIError, ModelNotFound

from .api import DaemonAPI
from .commands import ConversationCommands, ModelCommands
from .screens.agents import AgentRow, AgentsScreen, detect_agents
from .screens.cache import CacheScreen
from .screens.chat import ChatScreen
from .screens.home import HomeScreen
from .screens.models import ModelsScreen
from .screens.running import RunningScreen

Clock = Callable[[], dt.datetime]
AgentSource = Callable[[], list[AgentRow]]
Launcher = Callable[[list[str]], int]

DEFAULT_MODEL = "smollm2"
REPEAT_WINDOW = 10.0  # seconds in which the same error is not shown twice (live screens refresh every second)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def run_in_terminal(argv: list[str]) -> int:
    return subprocess.call(argv)


class LocalAIApp(App[None]):
    """localai's terminal UI. Build it with :func:`make_tui`."""

    CSS_PATH = "app.tcss"
    TITLE = "localai"
    MODES: ClassVar[dict[str, str | Callable[[], Screen[Any]]]] = {
        "home": HomeScreen, "chat": ChatScreen, "models": ModelsScreen, "running": RunningScreen,
        "cache": CacheScreen, "agents": AgentsScreen,
    }
    DEFAULT_MODE = "home"
    COMMANDS = App.COMMANDS | {ModelCommands, ConversationCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f1", "switch_mode('home')", "Home", priority=True),
        # Shown on the Home screen's menu rather than in every footer.
        Binding("f2", "switch_mode('chat')", "Chat", priority=True, show=False),
        Binding("f3", "switch_mode('models')", "Models", priority=True, show=False),
        Binding("f4", "switch_mode('running')", "Running", priority=True, show=False),
        Binding("f5", "switch_mode('cache')", "Cache", priority=True, show=False),
        Binding("f6", "switch_mode('agents')", "Agents", priority=True, show=False),
    ]

    connected: var[bool] = var(False)
    """True once the daemon answered (it is started in the background when none runs)."""

    def __init__(self, api: DaemonAPI, *, model: str | None = None, options: dict[str, Any] | None = None,
                 store: Callable[[], ConversationStore] = ConversationStore.open, clock: Clock = utc_now,
                 export_dir: Path | None = None, agents: AgentSource = detect_agents,
                 launcher: Launcher = run_in_terminal, live_refresh: float | None = 1.0) -> None:
        super().__init__()
        self.api = api
        self.model = model or DEFAULT_MODEL
        """The model new conversations (and launched agents) use."""
        self.open_chat_first = model is not None
        self.default_options = dict(options or {})
        self.clock = clock
        self.export_dir = export_dir
        self.agent_source = agents
        self.launcher = launcher
        self.live_refresh = live_refresh
        """Seconds between refreshes of the live screens (Running, Cache); None refreshes on demand only."""
        self._store_factory = store
        self._store: ConversationStore | None = None
        self._reported: dict[str, float] = {}
        self._connecting = asyncio.Event()
        self._connect_error: LocalAIError | None = None

    @property
    def store(self) -> ConversationStore:
        """The conversations, opened on first use so the first screen does not wait for SQLite."""
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def on_mount(self) -> None:
        if self.open_chat_first:
            self.switch_mode("chat")
        self.connect()

    async def on_unmount(self) -> None:
        await self.api.client.aclose()
        if self._store is not None:
            self._store.close()

    @work(exclusive=True, group="connect", exit_on_error=False)
    async def connect(self) -> None:
        """Reach the daemon, starting ``localai serve`` in the background when none answers."""
        try:
            await self.api.client.ensure_running()
        except LocalAIError as exc:
            self._connect_error = exc
            self.report(exc)
            return
        finally:
            self._connecting.set()
        self.connected = True

    async def ready(self) -> None:
        """Wait while the daemon is being reached (or started) at launch, so screens do not race it; raises
        the launch's error, if any, once (the next call tries again)."""
        await self._connecting.wait()
        if self._connect_error is not None:
            error, self._connect_error = self._connect_error, None
            raise error

    # -- navigation -----------------------------------------------------------------------------

    def open_chat(self, *, model: str | None = None, conversation_id: str | None = None) -> None:
        """Show the chat: a new conversation with ``model``, or a stored one resumed."""
        self.switch_mode("chat")
        screen = self.screen
        if isinstance(screen, ChatScreen):
            if conversation_id is not None:
                screen.resume(conversation_id)
            else:
                screen.new_conversation(model)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for mode, title in (("home", "Home"), ("chat", "Chat"), ("models", "Models"), ("running", "Running"),
                            ("cache", "Cache"), ("agents", "Agents")):
            yield SystemCommand(title, f"Go to the {title} screen", lambda mode=mode: self.switch_mode(mode))

    def launch_agent(self, name: str, model: str) -> None:
        """Run ``localai launch NAME --model MODEL`` in this terminal; the TUI comes back when it exits."""
        argv = [sys.executable, "-m", "localai", "launch", name, "--model", model]
        try:
            with self.suspend():
                code = self.launcher(argv)
        except Exception as exc:  # SuspendNotSupported (no real terminal) or the program could not start
            self.report(exc)
            return
        self.notify(f"{name} exited with status {code}", severity="information" if code == 0 else "warning")

    # -- errors ---------------------------------------------------------------------------------

    def report(self, error: BaseException, *, title: str | None = None) -> None:
        """Show an error as a notification that says what to do; the same one at most once per few seconds."""
        heading, message = explain(error)
        key = f"{title or heading}:{message}"
        moment = time.monotonic()
        if moment - self._reported.get(key, -REPEAT_WINDOW) < REPEAT_WINDOW:
            return
        self._reported[key] = moment
        self.notify(message, title=title or heading, severity="error", timeout=8)


def explain(error: BaseException) -> tuple[str, str]:
    """A notification's title and text for an error: what happened, then what to do."""
    if isinstance(error, DaemonUnavailable):
        return "Daemon unavailable", (f"{error.message}. Start it with `localai serve`, or send a chat message: "
                                      "the TUI starts it when none runs.")
    if isinstance(error, ModelNotFound):
        return "Model missing", f"{error.message}. Or pull it on the Models screen (F3, then p)."
    if isinstance(error, APIError) and ("worker" in error.message or "crash" in error.message):
        return "Worker crashed", f"{error.message}. Send again: the daemon loads the model anew."
    if isinstance(error, LocalAIError):
        return "Error", error.message
    return "Unexpected error", f"{type(error).__name__}: {error}"


def make_tui(client: AsyncClient | None = None, **options: Any) -> LocalAIApp:
    """The app, talking to the daemon through ``client`` (default: the Unix socket of ``$LOCALAI_HOME``)."""
    return LocalAIApp(DaemonAPI(client or AsyncClient()), **options)
