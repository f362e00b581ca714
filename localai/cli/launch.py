"""``localai launch <agent>``: configure a coding agent for the daemon and run it in the foreground."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from localai.cli import cli, fail_cleanly

if TYPE_CHECKING:
    from pathlib import Path

    from localai.agents import Installed, Integration, Launch, Target

EPILOG = """Examples:

\b
  localai launch --list
  localai launch claude --model smollm2
  localai launch codex --model smollm2 --yes -- exec "explain this repo"
  localai launch aider --model smollm2 --config      # only write aider's configuration
  localai launch pi --restore                        # undo what localai wrote for pi
"""


@cli.command(epilog=EPILOG)
@click.argument("agent", required=False)
@click.argument("extra", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS]...")
@click.option("-m", "--model", help="The model the agent uses (an installed model or alias).")
@click.option("--config", "config_only", is_flag=True, help="Only write the agent's configuration; do not run it.")
@click.option("--restore", is_flag=True, help="Undo everything localai wrote for the agent.")
@click.option("-y", "--yes", is_flag=True, help="Install the agent and pull the model if they are missing, without "
              "asking.")
@click.option("--list", "list_agents", is_flag=True, help="List the supported agents and how each is wired.")
@fail_cleanly
def launch(agent: str | None, extra: tuple[str, ...], model: str | None, config_only: bool, restore: bool,
           yes: bool, list_agents: bool) -> None:
    """Run a coding agent against localai: Claude Code, Codex, OpenCode, Aider, and more (see --list).

    Starts the daemon if needed, points the agent at it with the model's real context window, and runs the
    agent in this terminal; arguments after -- go to the agent, and its exit code is returned.
    """
    from localai import agents

    if list_agents:
        _print_list()
        return
    if not agent:
        raise click.UsageError(f"name an agent: {', '.join(agents.names())} (or --list)")
    try:
        integration = agents.get(agent)
    except KeyError:
        raise click.UsageError(f"unknown agent '{agent}'; choose one of: {', '.join(agents.names())}") from None
    if restore:
        lines = integration.restore()
        for line in lines or [f"nothing to restore for {integration.title}"]:
            click.echo(line)
        return
    installed = None if config_only else _ensure_installed(integration, yes)
    target = _target(model, yes)
    written = integration.configure(target)
    for note in integration.notes(target):
        click.echo(f"localai: warning: {note}", err=True)
    program = str(installed.path) if installed else integration.binary
    plan = integration.command(target, program, list(extra))
    if config_only:
        _print_config(integration, target, written, plan)
        return
    version = f" {installed.version}" if installed and installed.version else ""
    click.echo(f"localai: starting {integration.title}{version} on {target.model} "
               f"({target.context_length}-token context) at {target.base_url}", err=True)
    sys.exit(_run(integration, plan))


def _ensure_installed(integration: Integration, yes: bool) -> Installed:
    from localai.agents.install import how_to_install, install
    from localai.errors import AgentNotInstalled

    installed = integration.detect()
    if installed is not None:
        return installed
    hint = how_to_install(integration)
    if not yes:
        agreed(f"{integration.title} is not installed; {hint}", f"Install {integration.title} now?",
               refused=AgentNotInstalled(f"{integration.title} is not installed; {hint}"),
               declined=AgentNotInstalled(f"{integration.title} is not installed"))
    install(integration)
    installed = integration.detect()
    if installed is None:
        raise AgentNotInstalled(f"{integration.title} is still not installed; {hint}")
    return installed


def agreed(said: str, question: str, *, refused: Exception, declined: Exception) -> None:
    """Say ``said`` and ask ``question`` on a terminal (raising ``declined`` on no); with no terminal to ask on,
    raise ``refused`` (its message says how to go on without asking)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise refused
    click.echo(said, err=True)
    if not click.confirm(question, default=True, err=True):
        raise declined


def _target(model: str | None, yes: bool) -> Target:
    """The daemon's address (started if needed) and the model's limits."""
    from localai.agents import Target
    from localai.cli.models import _client
    from localai.settings import Settings

    settings = Settings()
    client = _client()  # starts the daemon unless one answers
    if not model:
        model = _choose_model(client, yes)
    info = _show_or_pull(client, model, yes)
    advice = (info.get("memory") or {}).get("advice")
    if advice:
        click.echo(f"localai: {advice}", err=True)
    loaded = _loaded_context(client, model)
    if loaded:
        info = {**info, "num_ctx": loaded}  # the window the worker really has: the agent is told exactly that
    context_length, max_output = model_limits(info, settings.context_length)
    return Target(base_url=daemon_url(settings), model=model, context_length=context_length,
                  max_output_tokens=max_output, api_key=settings.api_key)


def _show_or_pull(client: Any, model: str, yes: bool) -> dict[str, Any]:
    """The model's ``/api/show``; a model that is not installed but can be pulled is offered (its download size and
    the free disk said first), pulled with ``--yes``, and refused with the commands that get it elsewhere."""
    from localai.cli.pull import show_pull
    from localai.client import APIError
    from localai.errors import HubUnreachable, ModelNotFound

    try:
        return dict(client.request("POST", "/api/show", {"model": model}))
    except ModelNotFound as exc:
        missing = exc
    try:
        plan = client.request("POST", "/api/pull", {"model": model, "dry_run": True})
    except ModelNotFound:
        raise missing from None  # nothing localai can pull by that name: the message says where to look
    except APIError as exc:
        if exc.status_code == 503:  # the hub cannot be reached: offline, or no network
            raise HubUnreachable(f"model '{model}' is not installed and cannot be pulled now: {exc.message}; "
                                 f"connect to the network (or unset HF_HUB_OFFLINE) and run this again, or pull it "
                                 f"where you are online (`localai pull {model}`)") from None
        raise
    what = (f"model '{model}' is not installed; pulling it downloads {_size(int(plan['download']))} from "
            f"{plan['source']} ({_size(int(plan['free']))} free in {plan['cache']})")
    if not yes:
        agreed(f"localai: {what}", f"Pull {model} now?",
               refused=ModelNotFound(f"{what}: run `localai pull {model}`, or launch with --yes to pull it"),
               declined=ModelNotFound(f"model '{model}' is not installed"))
    else:
        click.echo(f"localai: {what}; pulling it (--yes)", err=True)
    show_pull(client, model)
    return dict(client.request("POST", "/api/show", {"model": model}))


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 10**8 else f"{count / 1e6:.1f} MB"


def _loaded_context(client: Any, model: str) -> int:
    """Load the model (as its first request would) and read the window its worker was given; 0 when unknown (a
    remote model, or a load that failed: the agent's first request reports that)."""
    from localai.errors import LocalAIError
    from localai.models.registry import normalize

    try:
        client.request("POST", "/api/generate", {"model": model})
        for entry in client.request("GET", "/api/ps")["models"]:
            if entry["name"] == normalize(model) and entry.get("context_length"):
                return int(entry["context_length"])
    except LocalAIError:
        pass
    return 0


def _choose_model(client: Any, yes: bool) -> str:
    names = [m["name"] for m in client.request("GET", "/api/tags")["models"]]
    if not names:
        raise click.UsageError("no model is installed; create or pull one first")
    if len(names) == 1:
        return str(names[0])
    if yes or not sys.stdin.isatty():
        raise click.UsageError(f"--model is required here; installed: {', '.join(names)}")
    for index, name in enumerate(names, 1):
        click.echo(f"  {index}. {name}", err=True)
    choice = click.prompt("Model", type=click.IntRange(1, len(names)), default=1, err=True)
    return str(names[choice - 1])


def model_limits(show: dict[str, Any], default_context: int) -> tuple[int, int]:
    """The context window the daemon loads the model with, and the reply size worth asking for.

    The daemon's own ``num_ctx`` from ``/api/show`` (``models.loading.context_size``); from a daemon that does not
    report it, the same rule applied to the displayed parameters. Output: a quarter of the context, which is
    what the runtime reserves for the reply when it fits a long prompt, so the daemon never cuts a reply before
    the limit the agent was given. A Modelfile's ``num_predict`` is not used: it is the default for chats that
    ask for no limit, and agents treat a reply cut at their limit as an error (Claude Code: "response exceeded
    the N output token maximum").
    """
    parameters: dict[str, str] = {}
    for line in str(show.get("parameters") or "").splitlines():
        name, _, value = line.strip().partition(" ")
        parameters.setdefault(name, value.strip())
    context = int(show.get("num_ctx") or 0)  # what the daemon says it loads the model with
    if not context:  # an older daemon: the same rule, from the displayed parameters
        trained = next((int(v) for k, v in (show.get("model_info") or {}).items()
                        if k.endswith(".context_length") and v), 0)
        context = _int(parameters.get("num_ctx")) or min(trained or default_context, default_context)
        if trained:
            context = min(context, trained)  # the engine never goes beyond the trained context
    return context, max(1, context // 4)


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def daemon_url(settings: Any) -> str:
    """The running daemon's TCP URL as it wrote it at start (it may listen on a non-default port), else the
    URL ``LOCALAI_HOST`` gives."""
    from localai import paths

    try:
        written = paths.address_path().read_text().strip()
    except OSError:
        written = ""
    return written or str(settings.base_url)


def _run(integration: Integration, plan: Launch) -> int:
    """Run the agent with this terminal; on POSIX the agent replaces this process (signals and exit code are
    then the agent's own)."""
    import subprocess

    env = {**os.environ, **integration.runtime_env(), **plan.env}
    try:
        if os.name == "posix":
            sys.stdout.flush()
            sys.stderr.flush()
            os.execvpe(plan.argv[0], plan.argv, env)
        return subprocess.call(plan.argv, env=env)
    except OSError as exc:
        from localai.errors import AgentError

        raise AgentError(f"cannot run {plan.argv[0]}: {exc.strerror}") from exc


def _print_list() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from rich.console import Console
    from rich.table import Table

    from localai.agents import INTEGRATIONS

    table = Table(box=None, pad_edge=False, show_edge=False)
    for header in ("AGENT", "INSTALLED", "INSTALLS FROM", "PROTOCOL", "WIRING"):
        table.add_column(header, no_wrap=header != "WIRING")
    # Each detect() runs the agent's --version (Node agents take a second or more): ask them all at once.
    with ThreadPoolExecutor(max_workers=8) as pool:
        found = list(pool.map(lambda integration: integration.detect(), INTEGRATIONS.values()))
    for integration, installed in zip(INTEGRATIONS.values(), found, strict=True):
        state = "no" if installed is None else (installed.version or "yes") + (" (localai)" if installed.managed
                                                                                else "")
        table.add_row(integration.name, state, installs_from(integration), integration.protocol, integration.wiring)
    Console(width=200).print(table)


def installs_from(integration: Integration) -> str:
    """Where ``launch --yes`` gets the agent: npm or PyPI, and any other host its install downloads from (where
    only the registries are reachable, such an agent cannot be installed)."""
    package = integration.package
    registry = {"npm": "npm", "pip": "PyPI", "manual": "manual"}[package.manager]
    return f"{registry} + {package.downloads_from}" if package.downloads_from else registry


def _print_config(integration: Integration, target: Target, written: list[Path], plan: Launch) -> None:
    import shlex

    if written:
        click.echo(f"Wrote {integration.title}'s configuration for {target.model} at {target.base_url}:")
        for path in written:
            click.echo(f"  {path}")
    else:
        click.echo(f"{integration.title} is configured per process: nothing to write.")
    click.echo("Run it through `localai launch`, or yourself with:")
    assignments = [f"{key}={shlex.quote(value)}" for key, value in plan.env.items()]
    click.echo("  " + " ".join([*assignments, shlex.join(plan.argv)]))
