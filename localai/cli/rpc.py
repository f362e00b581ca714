"""``localai rpc-server``: this machine's devices served to another localai (llama.cpp's RPC backend)."""

from __future__ import annotations

import ipaddress
import os
import sys

import click

from localai.cli import cli, fail_cleanly
from localai.settings import RPC_PORT, rpc_endpoint_of

WARNING = """\
WARNING: llama.cpp's RPC protocol has no authentication and no encryption. Anyone who can reach {endpoint} can
run computations on this machine's devices, read and overwrite their memory, and may crash or exploit the
server. Never expose it to a network you do not control. To pool machines, reach it through a tunnel and keep it
on loopback:
  SSH:        on the main machine: ssh -N -L 50052:127.0.0.1:{port} user@this-machine
              then PARAMETER rpc 127.0.0.1:50052 there (one local port per server)
  WireGuard / Tailscale: bind only to this machine's tunnel address (--host 100.x.y.z), never 0.0.0.0
"""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_unsafe_host(host: str, expose: bool, option: str = "--host") -> None:
    """A host that is not loopback only with ``--expose``: the protocol has no authentication or encryption."""
    if not _loopback(host) and not expose:
        raise click.ClickException(
            f"{option} {host} would serve this machine's devices to the network without authentication or "
            "encryption; add --expose if that is meant (a tunnel's own address), or keep the default 127.0.0.1 "
            "and reach it through an SSH tunnel (localai rpc-server --help, docs/src/machines.md)")


@cli.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --expose.")
@click.option("--port", type=click.IntRange(1, 65535), default=RPC_PORT, show_default=True)
@click.option("--threads", "-t", type=click.IntRange(1, 1024), default=None,
              help="Threads for the CPU device (default: half the cores, as llama.cpp's rpc-server).")
@click.option("--device", "-d", "devices", multiple=True,
              help="A device to serve, by llama.cpp's name (CUDA0, Vulkan0, CPU); repeatable. Default: every GPU, "
                   "else the CPU.")
@click.option("--cache", is_flag=True,
              help="Keep the tensors clients send in a local cache (~/.localai/rpc-cache): a client's next load "
                   "sends hashes instead of the weights (llama.cpp's rpc-server -c).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="The tensor cache's folder "
              "(implies --cache).")
@click.option("--expose", is_flag=True,
              help="Allow a non-loopback --host, knowing the protocol has no authentication or encryption.")
@fail_cleanly
def rpc_server(host: str, port: int, threads: int | None, devices: tuple[str, ...], cache: bool,
               cache_dir: str | None, expose: bool) -> None:
    """Serve this machine's devices to another localai: its models' layers run here (PARAMETER rpc host:port)."""
    from localai import paths

    endpoint = rpc_endpoint_of(host, port)
    refuse_unsafe_host(host, expose)
    if not _loopback(host):
        click.echo(WARNING.format(endpoint=endpoint, port=port), err=True)
    if cache_dir is None and cache:
        cache_dir = str(paths.rpc_cache_dir())
    command = [sys.executable, "-m", "localai.engines.llama_rpc", "--host", host, "--port", str(port)]
    command += ["--threads", str(threads)] if threads else []
    command += ["--cache-dir", cache_dir] if cache_dir else []
    for device in devices:
        command += ["--device", device]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)  # the server is llama.cpp's C loop: it gets the process to itself
