"""The chat's input: a multi-line TextArea where Enter sends and Ctrl+J (or Alt/Shift+Enter) starts a new line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


class PromptInput(TextArea):
    """Multi-line input. Pasted text keeps its newlines."""

    # Shown in the footer; the keys themselves are handled in _on_key, before TextArea inserts a newline.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "Send"), Binding("ctrl+j", "newline", "New line"),
    ]

    @dataclass
    class Submitted(Message):
        prompt: PromptInput
        text: str

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         placeholder="Send a message (Enter sends, Ctrl+J for a new line)")

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
        else:
            await super()._on_key(event)

    def action_submit(self) -> None:
        self.post_message(self.Submitted(self, self.text))

    def action_newline(self) -> None:
        self.insert("\n")
