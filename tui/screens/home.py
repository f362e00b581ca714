"""Home: one key for each thing the TUI does, and the daemon's state in one line."""

from __future__ import annotations

from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Center, Vertical
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from .base import LocalAIScreen

LOGO = "localai"
ENTRIES = (  # mode, key here, key anywhere, title, what it is
    ("chat", "c", "F2", "Chat", "talk to a model; conversations are kept"),
    ("agents", "a", "F6", "Launch an agent", "Claude Code, Codex, OpenCode, Aider... on a local model"),
    ("models", "m", "F3", "Models", "installed models, the library, pull and remove"),
    ("running", "r", "F4", "Running", "loaded models, workers, requests, keep-alive"),
    ("cache", "k", "F5", "Cache", "the prompt cache: entries, hit ratio, pins"),
)


class HomeScreen(LocalAIScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(key, f"app.switch_mode('{mode}')", title, show=False) for mode, key, _, title, _ in ENTRIES
    ]

    def compose(self) -> ComposeResult:
        with Center(), Vertical(id="home"):
            yield Static(LOGO, id="logo")
            yield Static("run models and coding agents on your own machine", id="tagline")
            yield OptionList(*(Option(f"[b]{key}[/b]  {title:<16} [dim]{hint:<56} {anywhere}[/dim]", id=mode)
                               for mode, key, anywhere, title, hint in ENTRIES), id="menu")
            yield Static("F1 comes back here from anywhere · ctrl+p finds models and conversations · ctrl+q quits",
                         id="home-hint")
            yield Static("connecting to the daemon…", id="daemon-status")
        yield Footer()

    def on_mount(self) -> None:
        self.watch(self.tui, "connected", self._connected)

    def on_screen_resume(self) -> None:
        if self.tui.connected:
            self.refresh_status()

    def _connected(self, connected: bool) -> None:
        if connected:
            self.refresh_status()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id:
            self.app.switch_mode(event.option.id)

    @work(exclusive=True, group="status", exit_on_error=False)
    async def refresh_status(self) -> None:
        await self.tui.ready()
        version = await self.api.version()
        loaded = await self.api.loaded()
        names = ", ".join(model.name for model in loaded) or "none"
        conversations = len(self.tui.store.summaries())
        self.query_one("#daemon-status", Static).update(
            f"daemon {version} · loaded: {names} · {conversations} conversation{'s' if conversations != 1 else ''}"
            f" · new chats use {self.tui.model}")
