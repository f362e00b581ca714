"""Agents: the ``localai launch --list`` table; Enter suspends the TUI, runs the agent in this terminal on the
chosen model, and comes back when it exits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Label, Static

from .base import LocalAIScreen, selected_key
from .dialogs import ChooseScreen


@dataclass(frozen=True)
class AgentRow:
    name: str
    title: str
    installed: str
    """``no``, or the version found (``(localai)`` when localai installed it)."""
    protocol: str
    wiring: str


def detect_agents() -> list[AgentRow]:
    """Every integration, with what is installed; each detection runs the agent's --version, so in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from localai.agents import INTEGRATIONS

    with ThreadPoolExecutor(max_workers=8) as pool:
        found = list(pool.map(lambda integration: integration.detect(), INTEGRATIONS.values()))
    rows = []
    for integration, installed in zip(INTEGRATIONS.values(), found, strict=True):
        state = "no" if installed is None else (installed.version or "yes") + (" (localai)" if installed.managed
                                                                                else "")
        rows.append(AgentRow(integration.name, integration.title, state, integration.protocol, integration.wiring))
    return rows


class AgentsScreen(LocalAIScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "launch", "Launch", priority=True),
        Binding("m", "choose_model", "Model"),
        Binding("ctrl+r", "refresh", "Refresh"),
        Binding("escape", "app.switch_mode('home')", "Home", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Label("Coding agents", classes="section-title")
        yield Static(id="agents-model")
        yield DataTable(id="agents", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("AGENT", "INSTALLED", "PROTOCOL", "WIRING")
        self.rows: dict[str, AgentRow] = {}
        self.action_refresh()

    def on_screen_resume(self) -> None:
        self._show_model()

    def _show_model(self) -> None:
        self.query_one("#agents-model", Static).update(
            f"Enter launches the highlighted agent on [b]{self.tui.model}[/b] (m picks another model); the TUI "
            "comes back when the agent exits. A missing agent is offered for installation first.")

    def action_refresh(self) -> None:
        self._show_model()
        self.detect()

    @work(exclusive=True, group="detect", exit_on_error=False)
    async def detect(self) -> None:
        table = self.query_one(DataTable)
        table.loading = True
        try:
            rows = await asyncio.to_thread(self.tui.agent_source)
        finally:
            table.loading = False
        self.rows = {row.name: row for row in rows}
        table.clear()
        for row in rows:
            table.add_row(row.name, row.installed, row.protocol, row.wiring, key=row.name)

    def action_launch(self) -> None:
        name = selected_key(self.query_one(DataTable))
        if name is None:
            return
        self.tui.launch_agent(name, self.tui.model)
        self.action_refresh()  # it may have been installed on the way

    @work(exclusive=True, group="models", exit_on_error=False)
    async def action_choose_model(self) -> None:
        models = await self.api.models(with_details=False)
        chosen = await self.app.push_screen_wait(
            ChooseScreen("Model for the agent", [(m.name, m.name) for m in models], current=self.tui.model))
        if chosen:
            self.tui.model = chosen
            self._show_model()
