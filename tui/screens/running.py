"""Running: what ``localai ps`` shows, refreshed live; unload a model."""

from __future__ import annotations

from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Label, Static

from localai.client import human_size

from ..api import LoadedModel
from .base import LocalAIScreen, selected_key
from .dialogs import ConfirmScreen


class RunningScreen(LocalAIScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("u", "unload", "Unload"),
        Binding("ctrl+r", "refresh", "Refresh"),
        Binding("escape", "app.switch_mode('home')", "Home", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Label("Loaded models", classes="section-title")
        yield DataTable(id="loaded", cursor_type="row", zebra_stripes=True)
        yield Static(id="running-summary")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("NAME", "ENGINE", "WORKER", "CONTEXT", "ACTIVE", "QUEUED", "PROCESSOR",
                                              "ON GPU", "UNLOADS")
        self.loaded: list[LoadedModel] = []
        if self.tui.live_refresh:
            self.set_interval(self.tui.live_refresh, self._tick)

    def on_screen_resume(self) -> None:
        self.action_refresh()

    def _tick(self) -> None:
        if self.is_current and not self.busy("refresh"):  # refresh only what is on screen
            self.action_refresh()

    def action_refresh(self) -> None:
        self.refresh_loaded()

    @work(exclusive=True, group="refresh", exit_on_error=False)
    async def refresh_loaded(self) -> None:
        await self.tui.ready()
        self.loaded = await self.api.loaded()
        metrics = await self.api.metrics()
        table = self.query_one(DataTable)
        selected = selected_key(table)
        table.clear()
        now = self.tui.clock()
        for model in self.loaded:
            worker = f"pid {model.pid}" + (f" +{len(model.shared_with)}" if model.shared_with else "") \
                if model.pid else ""
            table.add_row(model.name, model.engine, worker, str(model.context_length or ""),
                          str(model.active), "" if model.queued is None else str(model.queued), model.processor,
                          human_size(model.size_vram) if model.size_vram else "-", model.until(now), key=model.name)
        if selected in {m.name for m in self.loaded}:
            table.move_cursor(row=table.get_row_index(selected))
        count = len(self.loaded)
        shared = sorted({", ".join(sorted([m.name, *m.shared_with])) for m in self.loaded if m.shared_with})
        sharing = "".join(f"\n{names} share one worker (one copy of the weights, one prompt cache)"
                          for names in shared)
        self.query_one("#running-summary", Static).update(
            f"{count} model{'s' if count != 1 else ''} loaded · {metrics.queue_waiting} request"
            f"{'s' if metrics.queue_waiting != 1 else ''} waiting (all models) · u unloads the highlighted model"
            + sharing if count else "No model is loaded: the first request to a model loads it.")

    def action_unload(self) -> None:
        name = selected_key(self.query_one(DataTable))
        if name is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.unload(name)

        self.app.push_screen(ConfirmScreen(f"Unload {name}? (requests in flight are cancelled)"), confirmed)

    @work(group="unload", exit_on_error=False)
    async def unload(self, name: str) -> None:
        await self.api.unload(name)
        self.notify(f"Unloaded {name}")
        self.refresh_loaded()
