"""The ``localai`` command: Ollama's verbs. Heavy modules are imported inside commands so --help is fast."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from localai import __version__

F = TypeVar("F", bound=Callable[..., Any])


def fail_cleanly(function: F) -> F:
    """Turn localai errors into one line on stderr and exit code 1."""
    import functools

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from localai.errors import LocalAIError

        try:
            return function(*args, **kwargs)
        except LocalAIError as exc:
            click.echo(f"Error: {exc.message}", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="localai")
def cli() -> None:
    """localai: run coding agents and chat models on your own machine."""


def main() -> None:
    # importing them registers their commands
    from localai.cli import bench, cache, daemon, launch, models, pull, rpc, run, serve, service, tui  # noqa: F401

    if len(sys.argv) == 1 and sys.stdin.isatty() and sys.stdout.isatty():
        cli(["tui"], prog_name="localai")  # bare `localai` in a terminal opens the TUI, as `ollama` opens its menu
    else:
        cli()  # without a terminal, bare `localai` prints the help as it always has
