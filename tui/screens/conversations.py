"""The list of stored conversations: resume, rename, delete, export to Markdown."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, cast

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label

from localai.conversations import ConversationStore, ConversationSummary
from localai.errors import LocalAIError

from .base import selected_key
from .dialogs import AskScreen, ConfirmScreen

if TYPE_CHECKING:
    from ..app import LocalAIApp


class ConversationsScreen(ModalScreen[str | None]):
    """Returns the id of the conversation to open, "" for a new one, None to stay."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Open", priority=True),
        Binding("n", "new", "New"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("x", "export", "Export Markdown"),
        Binding("escape", "close", "Close"),
    ]

    def __init__(self, current: str | None = None) -> None:
        super().__init__(classes="dialog")
        self.current = current
        self.summaries: dict[str, ConversationSummary] = {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Conversations", classes="dialog-title")
            yield DataTable(id="conversations", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("TITLE", "MODEL", "MESSAGES", "UPDATED")
        self.reload()
        broken = [s for s in self.summaries.values() if s.error]
        if broken:
            self.notify(broken[0].error or "", title=f"{len(broken)} damaged conversation(s)", severity="warning",
                        timeout=8)

    @property
    def tui(self) -> LocalAIApp:
        return cast("LocalAIApp", self.app)

    def reload(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        try:
            summaries = self.tui.store.summaries()
        except Exception as exc:  # the database itself cannot be read: say so, show an empty list
            self.tui.report(exc, title="Cannot read the conversations")
            summaries = []
        self.summaries = {s.id: s for s in summaries}
        for summary in summaries:
            model = "⚠ damaged" if summary.error else summary.model
            table.add_row(summary.title, model, str(summary.messages), summary.updated_at.replace("T", " ")[:16],
                          key=summary.id)
        if self.current in self.summaries:
            table.move_cursor(row=table.get_row_index(self.current))

    @property
    def _selected(self) -> ConversationSummary | None:
        key = selected_key(self.query_one(DataTable))
        return self.summaries.get(key) if key else None

    def action_open(self) -> None:
        summary = self._selected
        if summary is None:
            return
        if summary.error:
            self.notify(summary.error, title="Cannot open the conversation", severity="error", timeout=8)
            return
        self.dismiss(summary.id)

    def action_new(self) -> None:
        self.dismiss("")

    def action_close(self) -> None:
        self.dismiss(None)

    def action_rename(self) -> None:
        summary = self._selected
        if summary is None:
            return

        def renamed(title: str | None) -> None:
            if title:
                self._store_call(lambda store: store.rename(summary.id, title))

        self.app.push_screen(AskScreen("New title", value=summary.title), renamed)

    def action_delete(self) -> None:
        summary = self._selected
        if summary is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._store_call(lambda store: store.delete(summary.id))
                self.notify(f"Deleted '{summary.title}'")

        self.app.push_screen(ConfirmScreen(f"Delete '{summary.title}'?"), confirmed)

    def action_export(self) -> None:
        summary = self._selected
        if summary is None:
            return
        try:
            path = self.tui.store.export(summary.id, self.tui.export_dir or Path.cwd())
        except (LocalAIError, OSError) as exc:
            self.tui.report(exc, title="Export failed")
            return
        self.notify(f"Exported to {path}", title="Exported")

    def _store_call(self, change: Callable[[ConversationStore], object]) -> None:
        try:
            change(self.tui.store)
        except Exception as exc:
            self.tui.report(exc)
        self.reload()
