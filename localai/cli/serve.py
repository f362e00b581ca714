"""``localai serve``."""

from __future__ import annotations

import click

from localai.cli import cli, fail_cleanly


@cli.command()
@fail_cleanly
def serve() -> None:
    """Start the daemon in the foreground (Unix socket + loopback TCP)."""
    from localai.daemon import serve as run_daemon
    from localai.settings import Settings

    try:
        settings = Settings()
    except ValueError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from exc
    run_daemon(settings)
