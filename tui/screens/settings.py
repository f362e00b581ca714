"""A conversation's system prompt and parameters, edited as text: one ``name value`` per line, the names and
types of a Modelfile's PARAMETER lines (temperature, num_ctx, num_predict, top_p, seed, stop, ...)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, TextArea

from localai.errors import ModelfileError
from localai.models.modelfile import LIST_PARAMETERS, PARAMETERS, coerce_parameter

EXAMPLE = "temperature 0.7\nnum_ctx 4096\nnum_predict 256"


def parse_parameters(text: str) -> dict[str, Any]:
    """``name value`` lines into options; raises ModelfileError naming the line. Repeated list parameters
    (``stop``) collect into a list."""
    options: dict[str, Any] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.partition(" ")
        name, value = name.strip().lower(), value.strip()
        where = f"line {number}"
        if name not in PARAMETERS:
            raise ModelfileError(f"{where}: unknown parameter '{name}' (known: {', '.join(sorted(PARAMETERS))})")
        if not value:
            raise ModelfileError(f"{where}: '{name}' needs a value")
        if len(value) > 1 and value[0] == value[-1] == '"':
            value = _unquote(value)
        coerced = coerce_parameter(name, value, where)
        if name in LIST_PARAMETERS:
            items = coerced if isinstance(coerced, list) else [coerced]
            options.setdefault(name, []).extend(items)
        else:
            options[name] = coerced
    return options


def format_parameters(options: dict[str, Any]) -> str:
    lines = []
    for name, value in sorted(options.items()):
        for item in value if isinstance(value, list) else [value]:
            lines.append(f"{name} {json.dumps(item) if isinstance(item, str) else item}")
    return "\n".join(lines)


def _unquote(value: str) -> str:
    """A quoted value as JSON reads it (``"\\n"`` is a newline), else just without its quotes."""
    try:
        loaded = json.loads(value)
    except ValueError:
        return value[1:-1]
    return loaded if isinstance(loaded, str) else value[1:-1]


class SettingsScreen(ModalScreen[tuple[str, dict[str, Any]] | None]):
    """Returns (system prompt, options), or None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Save", priority=True), Binding("escape", "cancel", "Cancel"),
    ]
    # Under 34 rows both text areas and the buttons do not fit at their full heights: the screen gets -short.
    VERTICAL_BREAKPOINTS = [(0, "-short"), (34, "-tall")]

    def __init__(self, system: str, options: dict[str, Any]) -> None:
        super().__init__(classes="dialog")
        self.system = system
        self.options = options

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("System prompt", classes="dialog-title")
            yield TextArea(self.system, id="system", soft_wrap=True)
            yield Label("Parameters: one 'name value' per line, e.g. temperature 0.7 · num_ctx 4096",
                        classes="dialog-title", id="parameters-title")
            yield TextArea(format_parameters(self.options), id="parameters")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (ctrl+s)", id="save", variant="primary")
                yield Button("Cancel (esc)", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def action_save(self) -> None:
        try:
            options = parse_parameters(self.query_one("#parameters", TextArea).text)
        except (ModelfileError, ValueError) as exc:
            message = exc.message if isinstance(exc, ModelfileError) else str(exc)
            self.notify(message, title="Parameters not saved", severity="error", timeout=8)
            return
        self.dismiss((self.query_one("#system", TextArea).text.strip(), options))

    def action_cancel(self) -> None:
        self.dismiss(None)
