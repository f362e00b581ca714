"""``localai tui [MODEL]``: the Textual terminal UI (also what bare ``localai`` opens in a terminal)."""

from __future__ import annotations

import sys
from typing import Any

import click

from localai.cli import cli, fail_cleanly


def parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs into typed options (the Modelfile's PARAMETER names and types)."""
    from localai.errors import InvalidRequest, ModelfileError
    from localai.models.modelfile import LIST_PARAMETERS, PARAMETERS, coerce_parameter

    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lower()
        if not sep or name not in PARAMETERS:
            raise InvalidRequest(f"--option {pair!r}: give NAME=VALUE with a parameter name such as "
                                 "num_predict, temperature or num_ctx", param="option")
        try:
            coerced = coerce_parameter(name, value.strip(), f"--option {name}")
        except ModelfileError as exc:
            raise InvalidRequest(exc.message, param="option") from exc
        if name in LIST_PARAMETERS:
            options.setdefault(name, []).extend(coerced if isinstance(coerced, list) else [coerced])
        else:
            options[name] = coerced
    return options


@cli.command()
@click.argument("model", required=False)
@click.option("-o", "--option", "options", multiple=True, metavar="NAME=VALUE",
              help="A parameter for new conversations, e.g. -o num_predict=64 -o temperature=0.2 (repeatable).")
@fail_cleanly
def tui(model: str | None, options: tuple[str, ...]) -> None:
    """The terminal UI: chat (with MODEL, if given), models and pulls, running models, the cache, agents.

    Starts the daemon in the background when none runs. Keys: F1 home, F2 chat, F3 models, F4 running,
    F5 cache, F6 agents, ctrl+p commands, ctrl+q quit.
    """
    from localai.tui.app import make_tui

    app = make_tui(model=model, options=parse_options(options))
    app.run()
    sys.exit(app.return_code or 0)
