"""``localai serve``."""

from __future__ import annotations

from pathlib import Path

import click

from localai.cli import cli, fail_cleanly


@cli.command()
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Log to this file (rotated at 10 MiB, three kept) instead of stderr.")
@fail_cleanly
def serve(log_file: Path | None) -> None:
    """Start the daemon in the foreground (Unix socket + loopback TCP)."""
    from localai.daemon import serve as run_daemon
    from localai.settings import Settings

    try:
        settings = Settings()
    except ValueError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from exc
    run_daemon(settings, log_file=log_file)
