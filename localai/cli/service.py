"""``localai service install|uninstall|status|logs``: the daemon as a user service (systemd or launchd)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from localai.cli import cli, fail_cleanly

if TYPE_CHECKING:
    from localai.service import Service

MANAGER_OPTION = click.option(
    "--manager", type=click.Choice(["systemd", "launchd"]), default=None,
    help="Service manager (default: launchd on macOS, systemd elsewhere).",
)


RPC_OPTION = click.option("--rpc", is_flag=True,
                          help="The rpc-server unit (`localai rpc-server`: this machine's devices for another "
                               "localai), not the daemon's.")


def _service(manager: str | None, rpc_args: tuple[str, ...] | None = None) -> Service:
    from localai import service

    chosen = service.default_manager() if manager is None else manager
    return service.Service(chosen, rpc_args)  # type: ignore[arg-type]


@cli.group()
def service() -> None:
    """Run the daemon as a service that starts at login."""


@service.command()
@MANAGER_OPTION
@click.option("--no-start", is_flag=True, help="Write the unit only; do not enable or start it.")
@click.option("--force", is_flag=True, help="Replace a unit file that localai did not write.")
@click.option("--print", "show", is_flag=True, help="Print the unit to stdout and write nothing.")
@RPC_OPTION
@click.option("--rpc-host", default="127.0.0.1", show_default=True,
              help="With --rpc: the address it listens on (anything but loopback needs --expose).")
@click.option("--rpc-port", type=click.IntRange(1, 65535), default=None, help="With --rpc: its port (50052).")
@click.option("--expose", is_flag=True, help="With --rpc: allow a non-loopback --rpc-host (no authentication, "
              "no encryption: see `localai rpc-server --help`).")
@fail_cleanly
def install(manager: str | None, no_start: bool, force: bool, show: bool, rpc: bool, rpc_host: str,
            rpc_port: int | None, expose: bool) -> None:
    """Write the service unit for this user and start it (now and at every login)."""
    from localai.cli.rpc import refuse_unsafe_host
    from localai.client import Client
    from localai.settings import RPC_PORT

    rpc_args = None
    if rpc:
        refuse_unsafe_host(rpc_host, expose, "--rpc-host")
        rpc_args = ("--host", rpc_host, "--port", str(rpc_port or RPC_PORT), *(("--expose",) if expose else ()))
    elif rpc_port is not None or rpc_host != "127.0.0.1" or expose:
        raise click.UsageError("--rpc-host, --rpc-port and --expose are for the rpc-server unit: add --rpc")
    unit = _service(manager, rpc_args)
    if show:
        sys.stdout.buffer.write(unit.render())
        return
    if rpc_args is None and Client().is_running():
        click.echo("note: a localai daemon already answers; unless it is this service, the service starts only once it "
                   "stops (end its `localai serve`)", err=True)
    path = unit.write(force=force)
    click.echo(f"wrote {path}")
    if no_start:
        return
    from localai.service import ServiceError

    try:
        unit.start()
    except ServiceError as exc:
        raise ServiceError(f"the unit is written but could not be started: {exc.message}. Start it from a login "
                           f"session: {' '.join(unit.start_hint())}") from exc
    what = "`localai serve`" if rpc_args is None else f"`localai rpc-server` on {rpc_host}:{rpc_port or RPC_PORT}"
    flag = "" if rpc_args is None else " --rpc"
    click.echo(f"started: the {unit.manager} service runs {what} now and at every login "
               f"(localai service status{flag}, localai service logs{flag})")


@service.command()
@MANAGER_OPTION
@RPC_OPTION
@fail_cleanly
def uninstall(manager: str | None, rpc: bool) -> None:
    """Stop the service and remove its unit (models, cache and settings are kept)."""
    from localai.service import ServiceError

    unit = _service(manager, () if rpc else None)
    if not unit.path.exists():
        click.echo(f"not installed ({unit.path} does not exist)")
        return
    if not unit.ours():
        raise ServiceError(f"{unit.path} was not written by localai; not touching it")
    try:
        unit.stop()
    except ServiceError as exc:
        click.echo(f"warning: {exc.message}", err=True)
    unit.remove()
    click.echo(f"removed {unit.path}")


@service.command()
@MANAGER_OPTION
@RPC_OPTION
@fail_cleanly
def status(manager: str | None, rpc: bool) -> None:
    """Whether the unit is installed, what the service manager says of it, and whether the daemon answers."""
    from localai.client import Client

    unit = _service(manager, () if rpc else None)
    installed = unit.path.exists()
    click.echo(f"manager:  {unit.manager}")
    click.echo(f"unit:     {unit.path} ({'installed' if installed else 'not installed'}"
               f"{'' if not installed or unit.ours() else ', not written by localai'})")
    click.echo(f"service:  {unit.state() if installed else '-'}")
    if not rpc:
        click.echo(f"daemon:   {'answering' if Client().is_running() else 'not answering'}")
    if installed and unit.manager == "launchd":
        click.echo(f"log:      {unit.log_path}")


@service.command()
@MANAGER_OPTION
@click.option("-n", "--lines", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@RPC_OPTION
@fail_cleanly
def logs(manager: str | None, lines: int, follow: bool, rpc: bool) -> None:
    """Show the service's log (the journal under systemd, the rotated log file under launchd)."""
    import shutil

    from localai.service import ServiceError

    unit = _service(manager, () if rpc else None)
    if not unit.path.exists():
        raise ServiceError(f"the service is not installed ({unit.path} does not exist): localai service install")
    command = unit.logs_command(lines, follow)
    if shutil.which(command[0]) is None:
        raise ServiceError(f"{command[0]} is not installed here")
    sys.stdout.flush()
    os.execvp(command[0], command)
