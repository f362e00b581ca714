"""``localai pull NAME``: download a model through the daemon, with a progress bar per file."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from localai.cli import cli, fail_cleanly


@cli.command()
@click.argument("model")
@fail_cleanly
def pull(model: str) -> None:
    """Download a model: a library name (see `list --library`), hf.co/OWNER/REPO:QUANT or OWNER/REPO.

    Interrupted pulls resume where they stopped. HF_TOKEN is passed on for gated repositories.
    """
    from localai.client import Client

    client = Client()
    client.ensure_running()
    show_pull(client, model)


def show_pull(client: Any, model: str) -> None:
    """Pull ``model`` through the daemon with a progress bar per file on stderr (``localai pull``, and ``localai
    launch`` when its model is missing); Ctrl-C stops the download and keeps what it fetched."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

    from localai.models.hub import TOKEN_HEADER

    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    stream = client.stream("/api/pull", {"model": model, "stream": True}, {TOKEN_HEADER: token} if token else None)
    console = Console(stderr=True)  # like ollama: progress on stderr, stdout stays clean
    bars: dict[str, TaskID] = {}
    progress: Progress | None = None  # started at the first download, so errors print alone
    try:
        for event in stream:
            digest, total = event.get("digest"), event.get("total")
            if digest and total is not None:
                if progress is None:
                    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                        TransferSpeedColumn(), console=console)
                    progress.start()
                if digest not in bars:
                    bars[digest] = progress.add_task(event["status"], total=total)
                progress.update(bars[digest], completed=event.get("completed", 0))
            else:
                console.print(event.get("status", ""))
    except KeyboardInterrupt:
        stream.close()  # closing the connection stops the download in the daemon
        if progress is not None:
            progress.stop()
        click.echo(f"interrupted: what was downloaded is kept; run `localai pull {model}` again to resume", err=True)
        sys.exit(130)
    finally:
        if progress is not None:
            progress.stop()
