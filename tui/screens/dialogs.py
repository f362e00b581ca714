"""Modal dialogs: a question with one line of answer, a yes/no confirmation, a choice from a list, and a
read-only text (a model's details)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option


class AskScreen(ModalScreen[str | None]):
    """One line of text (a name, a TTL); Enter answers, Esc cancels (None). With ``required``, Enter on an empty
    line says what to type and keeps the dialog open (a placeholder is an example, never an answer)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]
    HINT = "Enter to confirm · Esc to cancel"

    def __init__(self, title: str, *, value: str = "", placeholder: str = "", required: str = "") -> None:
        super().__init__(classes="dialog")
        self.question = title
        self.value = value
        self.placeholder = placeholder
        self.required = required  # what to say when Enter comes on an empty line ("" lets it answer None)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.question, classes="dialog-title")
            yield Input(value=self.value, placeholder=self.placeholder, id="answer")
            yield Label(self.HINT, classes="dialog-hint", id="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        answer = event.value.strip()
        if not answer and self.required:
            hint = self.query_one("#hint", Label)
            hint.update(f"{self.required} · Esc to cancel")
            hint.add_class("dialog-error")
            return
        self.dismiss(answer or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; ``y``/Enter on Yes confirms, ``n``/Esc declines."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__(classes="dialog")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.question, classes="dialog-title")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class ChooseScreen(ModalScreen[str | None]):
    """A choice from a list (the model picker); returns the chosen option's id."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, options: list[tuple[str, str]], *, current: str | None = None) -> None:
        super().__init__(classes="dialog")
        self.question = title
        self.options = options
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.question, classes="dialog-title")
            yield OptionList(*(Option(label, id=key) for key, label in self.options), id="choices")
            yield Label("Enter to choose · Esc to cancel", classes="dialog-hint")

    def on_mount(self) -> None:
        choices = self.query_one(OptionList)
        keys = [key for key, _ in self.options]
        if self.current in keys:
            choices.highlighted = keys.index(self.current)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class TextScreen(ModalScreen[None]):
    """Read-only text in a scrolling box (a model's details); Esc or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "Close")]

    def __init__(self, title: str, text: str) -> None:
        super().__init__(classes="dialog")
        self.heading = title
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label(self.heading, classes="dialog-title")
            with VerticalScroll():
                yield Static(self.text, markup=False)
            yield Label("Esc to close", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
