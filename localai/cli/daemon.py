"""``localai daemon start|stop|status`` (and ``localai status``): the background daemon that ``run``, ``launch`` and
the TUI start when none answers."""

from __future__ import annotations

import time
from typing import Any

import click

from localai.cli import cli, fail_cleanly

NOT_RUNNING = 3  # what `systemctl status` and LSB init scripts answer for a service that is not running


@cli.group()
def daemon() -> None:
    """Start, stop or look at the background daemon (`localai serve` runs one in the foreground)."""


def _uptime(started_at: float | None) -> str:
    if not started_at:
        return ""
    seconds = max(0, int(time.time() - started_at))
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = seconds // size
            return f"up {count} {unit}{'s' if count != 1 else ''}"
    return f"up {seconds} s"


def _report(health: dict[str, Any] | None) -> None:
    from localai import paths

    if health is None:
        click.echo(f"localai is not running (home {paths.home()})")
        click.echo("  `localai daemon start` starts it in the background; `localai run`, `launch` and the TUI do too")
        raise SystemExit(NOT_RUNNING)
    facts = [f"pid {health['pid']}" if health.get("pid") else "", _uptime(health.get("started_at"))]
    said = ", ".join(fact for fact in facts if fact)
    click.echo(f"localai {health.get('version', '')} is running" + (f" ({said})" if said else ""))
    click.echo(f"  home    {health.get('home') or paths.home()}")
    click.echo(f"  API     {health.get('url') or '(bound beyond loopback)'} and {paths.socket_path()}")
    models = health.get("loaded_models") or []
    click.echo(f"  models  {', '.join(models) if models else 'none loaded'}")
    click.echo(f"  log     {paths.server_log_path()} (when started in the background)")
    click.echo("stop it with: localai daemon stop")


@daemon.command("status")
@fail_cleanly
def daemon_status() -> None:
    """Whether the daemon runs: its pid, home, address and loaded models (exit code 3 when it does not)."""
    from localai.client import Client

    _report(Client().health())


@cli.command("status")
@fail_cleanly
def status() -> None:
    """Whether the daemon runs (the same as `localai daemon status`)."""
    from localai.client import Client

    _report(Client().health())


@daemon.command("start")
@fail_cleanly
def start() -> None:
    """Start the daemon in the background, unless one already runs."""
    from localai import paths
    from localai.client import Client

    client = Client()
    running = client.health()
    if running is None:
        client.ensure_running()
        running = client.health() or {}
        click.echo(f"started localai in the background (pid {running.get('pid', '?')}); its log: "
                   f"{paths.server_log_path()}")
    else:
        click.echo(f"localai is already running (pid {running.get('pid', '?')})")
    click.echo("stop it with: localai daemon stop")


@daemon.command("stop")
@click.option("--timeout", type=click.FloatRange(min=1), default=90.0, show_default=True,
              help="Seconds to wait for it to exit (its workers write their prompt caches first).")
@fail_cleanly
def stop(timeout: float) -> None:
    """Stop the background daemon (and its model workers); models, caches and settings stay."""
    from localai import paths
    from localai.client import Client

    click.echo("stopping localai (its workers save their prompt caches first)...")
    pid = Client().stop_daemon(timeout)
    if pid is None:
        click.echo(f"localai is not running (home {paths.home()})")
        return
    click.echo(f"stopped localai (pid {pid})")
    hint = _service_hint()
    if hint:
        click.echo(hint)


def _service_hint() -> str:
    """Where `localai service install` set it up to start at login, a word that it will come back."""
    from localai import service

    try:
        unit = service.Service(service.default_manager())
        if not unit.path.exists() or not unit.ours():
            return ""
    except Exception:  # a unit that cannot be read tells nothing worth failing a stop for
        return ""
    return (f"note: it is installed as a user service ({unit.path}) and starts again at your next login; "
            "`localai service uninstall` removes that")
