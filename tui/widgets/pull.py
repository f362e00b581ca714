"""One pull on the Models screen: its name, status and a progress bar over all of its files."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from localai.client import human_size

from ..api import PullProgress


class PullBar(Horizontal):
    def __init__(self, progress: PullProgress) -> None:
        super().__init__(classes="pull")
        self.progress = progress
        self.finished = False

    def compose(self) -> ComposeResult:
        yield Label(self.progress.name, classes="pull-name")
        yield ProgressBar(total=None, show_eta=False, classes="pull-bar")
        yield Label(self.progress.status, classes="pull-status")

    def show(self) -> None:
        progress = self.progress
        bar = self.query_one(ProgressBar)
        if progress.total:
            bar.update(total=progress.total, progress=progress.completed)
            status = f"{progress.status[:24]}  {human_size(progress.completed)} / {human_size(progress.total)}"
        else:
            status = progress.status
        self.query_one(".pull-status", Label).update(status)

    def finish(self, status: str, *, failed: bool = False) -> None:
        self.finished = True
        self.add_class("failed" if failed else "finished")
        bar = self.query_one(ProgressBar)
        if self.progress.done and self.progress.total:
            bar.update(total=self.progress.total, progress=self.progress.total)
        elif bar.total is None:  # nothing was measured: an indeterminate bar would keep animating after the end
            bar.display = False
        self.query_one(".pull-status", Label).update(status)
