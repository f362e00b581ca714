"""The TUI in a real terminal: tmux runs ``localai tui`` (and bare ``localai``), send-keys types, capture-pane
reads the screen, ctrl+q exits with status 0. Without a TTY, bare ``localai`` prints the help as before."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Daemon, start_daemon
from tests.observe import wait_for


@pytest.fixture(autouse=True)
def tmux() -> None:
    """The tier needs tmux: missing, it is a failure (a skip went unnoticed), as for the project's other tiers."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: `make test` installs it (make install-tmux; apt-get install tmux)")


@pytest.fixture
def daemon_home(tmp_path: Path, smollm2_path: Path) -> Iterator[Daemon]:
    with start_daemon(tmp_path / "daemon", keep_alive="-1") as daemon:
        yield daemon


class Terminal:
    """A detached tmux session running one command; the command's exit status lands in a file."""

    def __init__(self, command: list[str], env: dict[str, str], status: Path) -> None:
        self.name = f"localai-tui-{uuid.uuid4().hex[:8]}"
        self.status = status
        exports = " ".join(f"{key}={_quote(value)}" for key, value in env.items())
        line = f"env {exports} {' '.join(_quote(part) for part in command)}; echo $? > {_quote(str(status))}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "120", "-y", "40", line], check=True)

    def screen(self) -> str:
        result = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return result.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        try:
            return str(wait_for(lambda: self.screen() if text in self.screen() else "", f"{text!r} on screen",
                                  timeout))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n{self.screen()}") from None

    def exit_status(self, timeout: float = 30) -> int:
        wait_for(lambda: self.status.exists() and self.status.read_text().strip(), "the exit status", timeout)
        return int(self.status.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def run_in_tmux(daemon: Daemon, tmp_path: Path, *args: str) -> Terminal:
    env = {"LOCALAI_HOME": str(daemon.home), "LOCALAI_HOST": f"127.0.0.1:{daemon.port}", "TERM": "xterm-256color",
           "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    return Terminal([sys.executable, "-m", "localai", *args], env, tmp_path / f"status-{uuid.uuid4().hex[:6]}")


def test_tui_chats_in_a_real_terminal_and_quits_with_zero(daemon_home: Daemon, tmp_path: Path) -> None:
    terminal = run_in_tmux(daemon_home, tmp_path, "tui", "smollm2", "-o", "num_predict=16", "-o", "temperature=0")
    try:
        terminal.wait_for("Send a message")
        terminal.keys("-l", "Say hello to the terminal.")
        terminal.keys("Enter")
        screen = terminal.wait_for("tokens/s")
        assert "Say hello to the terminal." in screen and "from cache" in screen
        terminal.keys("C-q")
        assert terminal.exit_status() == 0
    finally:
        terminal.close()


def test_bare_localai_opens_the_home_screen_in_a_terminal(daemon_home: Daemon, tmp_path: Path) -> None:
    terminal = run_in_tmux(daemon_home, tmp_path)
    try:
        screen = terminal.wait_for("Launch an agent")
        assert "Models" in screen and "Running" in screen and "Cache" in screen
        terminal.wait_for("daemon 0.1.0")  # it found the running daemon
        terminal.keys("C-q")
        assert terminal.exit_status() == 0
    finally:
        terminal.close()


def test_bare_localai_without_a_terminal_prints_help(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run([str(Path(sys.executable).parent / "localai")], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""  # click's usage error for a group without a command
    assert result.stderr.startswith("Usage: localai [OPTIONS] COMMAND [ARGS]...")
    assert "  tui " in result.stderr and "  run " in result.stderr
    assert time.monotonic() - started < 60
