"""What every screen shares: a typed handle on the app, and worker errors turned into notifications."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from textual.screen import Screen
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist
from textual.worker import Worker, WorkerState

if TYPE_CHECKING:
    from ..api import DaemonAPI
    from ..app import LocalAIApp


class LocalAIScreen(Screen[None]):
    """A screen of the localai app. Its workers run with ``exit_on_error=False``; a failure becomes a
    notification (via ``LocalAIApp.report``) and the app carries on."""

    @property
    def tui(self) -> LocalAIApp:
        return cast("LocalAIApp", self.app)

    @property
    def api(self) -> DaemonAPI:
        return self.tui.api

    def busy(self, group: str) -> bool:
        """Whether one of this screen's workers in ``group`` is still running: a periodic refresh then waits for the
        next tick instead of cancelling it mid-request (on a loaded machine a refresh can take longer than a tick)."""
        return any(worker.group == group and not worker.is_finished and worker.node is self
                   for worker in self.workers)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR and event.worker.error is not None:
            self.tui.report(event.worker.error)


def selected_key(table: DataTable[Any]) -> str | None:
    """The row key under a DataTable's cursor, or None for an empty table."""
    if not table.row_count:
        return None
    try:
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    except CellDoesNotExist:  # the cursor points past a table that just shrank
        return None
    return str(key) if key is not None else None
