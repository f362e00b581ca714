"""Models: what is installed, what the library offers, pulls with live progress (cancellable), details, removal."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Label

from localai.client import human_size

from ..api import InstalledModel, PullProgress
from ..widgets.pull import PullBar
from .base import LocalAIScreen, selected_key
from .dialogs import AskScreen, ConfirmScreen, TextScreen

PULL_QUESTION = "Pull which model? A library name (the Library table lists them), hf.co/OWNER/REPO:QUANT or OWNER/REPO"


def library_rows() -> list[tuple[str, str, str, str]]:
    """The library's models: name, FROM, context (num_ctx or the trained context), description."""
    from localai.models import library

    return [(row.name, row.source, row.context, row.description) for row in library.rows()]


def details_text(name: str, show: dict[str, Any]) -> str:
    """What ``localai show`` prints, plus capabilities, engine and the weights' path."""
    details = show.get("details") or {}
    lines = [
        f"architecture    {details.get('family', '')}", f"parameters      {details.get('parameter_size', '')}",
        f"quantization    {details.get('quantization_level', '')}",
        f"engine          {show.get('engine') or ('mlx' if details.get('format') == 'mlx' else 'llama.cpp')}",
        f"context         {show.get('num_ctx', '')}",
        f"capabilities    {', '.join(show.get('capabilities') or [])}", f"weights         {show.get('path', '')}",
    ]
    for title, key in (("Parameters", "parameters"), ("System", "system"), ("Template", "template"),
                       ("License", "license")):
        value = str(show.get(key) or "").strip()
        if value:
            lines += ["", title, *("  " + line for line in value.splitlines())]
    return "\n".join(lines)


class ModelsScreen(LocalAIScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pull", "Pull"),
        Binding("x", "cancel_pulls", "Cancel pulls"),
        Binding("enter", "details", "Details"),
        Binding("d", "delete", "Remove"),
        Binding("c", "chat", "Chat with it"),
        Binding("ctrl+r", "refresh", "Refresh"),
        Binding("escape", "app.switch_mode('home')", "Home", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Label("Installed", classes="section-title")
        yield DataTable(id="installed", cursor_type="row", zebra_stripes=True)
        yield Label("Library (p pulls the highlighted one)", classes="section-title")
        yield DataTable(id="library", cursor_type="row", zebra_stripes=True)
        yield Vertical(id="pulls")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#installed", DataTable).add_columns(
            "NAME", "SIZE", "QUANT", "PARAMS", "ENGINE", "CONTEXT", "CAPABILITIES")
        columns = self.query_one("#library", DataTable).add_columns("NAME", "FROM", "TRAINED", "INSTALLED",
                                                                     "DESCRIPTION")
        self._installed_column = columns[3]
        self.library: list[tuple[str, str, str, str]] = []
        self.installed: list[InstalledModel] = []
        self.load_library()

    def on_screen_resume(self) -> None:
        self.action_refresh()

    def action_refresh(self) -> None:
        self.refresh_installed()

    @work(exclusive=True, group="library", exit_on_error=False)
    async def load_library(self) -> None:
        self.library = await asyncio.to_thread(library_rows)
        self._fill_library()

    @work(exclusive=True, group="installed", exit_on_error=False)
    async def refresh_installed(self) -> None:
        await self.tui.ready()
        self.installed = await self.api.models()
        table = self.query_one("#installed", DataTable)
        selected = selected_key(table)
        table.clear()
        for model in self.installed:
            table.add_row(model.name, human_size(model.size), model.quantization, model.parameter_size,
                          model.engine, str(model.context_length or ""), ", ".join(model.capabilities), key=model.name)
        if selected in {m.name for m in self.installed}:
            table.move_cursor(row=table.get_row_index(selected))
        self._fill_library()

    def _fill_library(self) -> None:
        table = self.query_one("#library", DataTable)
        installed = {m.name for m in self.installed}
        if [key.value for key in table.rows] == [name for name, *_ in self.library]:
            # the same rows (a refresh): only what is installed changes, in place. Cleared and filled again, the
            # table's columns fell back to their headers' widths and grew again, its header lagging a repaint
            for name, *_ in self.library:
                table.update_cell(name, self._installed_column, "yes" if name in installed else "")
            return
        selected = selected_key(table)
        table.clear()
        for name, source, context, description in self.library:
            table.add_row(name, source, context, "yes" if name in installed else "", description, key=name)
        if selected:
            table.move_cursor(row=table.get_row_index(selected))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_details()

    def _selected_model(self) -> str | None:
        """The highlighted model of whichever table has focus (the installed table otherwise)."""
        focused = self.focused
        table = focused if isinstance(focused, DataTable) else self.query_one("#installed", DataTable)
        return selected_key(table)

    # -- pulls ----------------------------------------------------------------------------------

    def action_pull(self) -> None:
        library = self.query_one("#library", DataTable)
        suggestion = selected_key(library) if self.focused is library else ""

        def answered(name: str | None) -> None:
            if name:
                self.start_pull(name)

        self.app.push_screen(AskScreen(PULL_QUESTION, value=suggestion or "", placeholder="e.g. qwen2.5-coder:1.5b",
                                       required="Type a model's name first (a library name, or hf.co/OWNER/REPO)"),
                             answered)

    def start_pull(self, name: str) -> PullBar:
        bar = PullBar(PullProgress(name))
        self.query_one("#pulls", Vertical).mount(bar)
        self.pull(bar)
        return bar

    @work(group="pull", exit_on_error=False)
    async def pull(self, bar: PullBar) -> None:
        """Follow one pull's progress objects. Cancelling this worker closes the stream: the daemon stops the
        download and keeps its bytes, so pulling again resumes."""
        progress = bar.progress
        try:
            async for event in self.api.pull(progress.name):
                progress.update(event)
                bar.show()
        except asyncio.CancelledError:
            bar.finish(f"cancelled: what was downloaded is kept; pull {progress.name} again to resume")
            raise
        except Exception as exc:
            bar.finish(f"failed: {exc}", failed=True)
            self.tui.report(exc, title=f"Pull of {progress.name} failed")
            return
        bar.finish("done" if progress.done else progress.status)
        self.notify(f"Pulled {progress.name}", title="Pull finished")
        self.refresh_installed()

    def action_cancel_pulls(self) -> None:
        running = [w for w in self.workers if w.group == "pull" and w.is_running]
        for worker in running:
            worker.cancel()
        if not running:
            self.notify("No pull is running")

    # -- details, removal, chat -------------------------------------------------------------------

    @work(group="details", exit_on_error=False)
    async def action_details(self) -> None:
        name = self._selected_model()
        if name is None:
            return
        if self.focused is self.query_one("#library", DataTable) and name not in {m.name for m in self.installed}:
            self.notify(f"{name} is not installed yet: p pulls it")
            return
        show = await self.api.show(name)
        self.app.push_screen(TextScreen(name, details_text(name, show)))

    def action_delete(self) -> None:
        name = selected_key(self.query_one("#installed", DataTable))
        if name is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete(name)

        self.app.push_screen(ConfirmScreen(f"Remove {name}? (pulled weights no other model uses are deleted)"),
                             confirmed)

    @work(group="delete", exit_on_error=False)
    async def delete(self, name: str) -> None:
        removed = await self.api.delete(name)
        self.notify(f"Removed {', '.join(removed) or name}")
        self.refresh_installed()

    def action_chat(self) -> None:
        name = self._selected_model()
        if name:
            self.tui.open_chat(model=name)
