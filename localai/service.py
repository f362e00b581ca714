"""``localai service``: the daemon as a user service that starts at login.

Linux gets a systemd user unit (``~/.config/systemd/user/localai.service``, its log in the journal, which rotates
it); macOS a launchd agent (``~/Library/LaunchAgents/dev.localai.daemon.plist``, logging to a file the daemon
rotates). Both are written from the templates in ``packaging/`` with this user's interpreter and ``LOCALAI_*``
settings, so the service runs the localai that installed it, on the same home.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from localai import paths
from localai.errors import LocalAIError

Manager = Literal["systemd", "launchd"]
MANAGERS: tuple[Manager, ...] = ("systemd", "launchd")
UNIT = "localai.service"
LABEL = "dev.localai.daemon"
RPC_UNIT = "localai-rpc.service"  # `localai service install --rpc`: this machine's devices for other localai daemons
RPC_LABEL = "dev.localai.rpc-server"
MARKER = "# Written by `localai service install`; `localai service uninstall` removes it."
PLIST_MARKER = "LocalAIServiceVersion"  # a key in the plist: the file is ours to replace
# What the service copies from the installing environment besides LOCALAI_*: where models already on disk are,
# and which GPUs the engines may use (CUDA, Vulkan: llama.cpp's GGML_VK_VISIBLE_DEVICES, ROCm/HIP).
PASSED_ENV = ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "XDG_CACHE_HOME", "CUDA_VISIBLE_DEVICES",
              "GGML_VK_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


class ServiceError(LocalAIError):
    """The service manager refused or is not reachable."""


def default_manager() -> Manager:
    return "launchd" if sys.platform == "darwin" else "systemd"


def command_line(rpc_args: tuple[str, ...] | None = None) -> list[str]:
    """The daemon's command line (or, with ``rpc_args``, ``localai rpc-server``'s): this interpreter, so the
    service runs the localai that installed it."""
    if rpc_args is not None:
        return [sys.executable, "-m", "localai", "rpc-server", *rpc_args]
    return [sys.executable, "-m", "localai", "serve"]


def environment() -> dict[str, str]:
    """The service's environment: every ``LOCALAI_*`` variable set now, with the home pinned to this one."""
    env = {key: value for key, value in os.environ.items()
           if key.startswith("LOCALAI_") or key in PASSED_ENV}
    env["LOCALAI_HOME"] = str(paths.home())
    return dict(sorted(env.items()))


def _systemd_word(word: str) -> str:
    """One ExecStart word: plain or double-quoted, with systemd's specifier (%) and variable ($) signs doubled."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _systemd_assignment(key: str, value: str) -> str:
    text = f"{key}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'Environment="{text}"'


@dataclass(frozen=True)
class Service:
    manager: Manager
    rpc_args: tuple[str, ...] | None = None  # the rpc-server unit (its arguments), not the daemon's

    @property
    def unit(self) -> str:
        return UNIT if self.rpc_args is None else RPC_UNIT

    @property
    def label(self) -> str:
        return LABEL if self.rpc_args is None else RPC_LABEL

    @property
    def path(self) -> Path:
        if self.manager == "launchd":
            return Path.home() / "Library" / "LaunchAgents" / f"{self.label}.plist"
        config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(config).expanduser() / "systemd" / "user" / self.unit

    @property
    def log_path(self) -> Path:
        """Where a launchd service logs (systemd's goes to the journal)."""
        return paths.logs_dir() / ("service.log" if self.rpc_args is None else "rpc-server.log")

    def render(self) -> bytes:
        """The unit or plist for this user, from the template in packaging/."""
        template = paths.shipped_dir("packaging")
        if self.manager == "systemd":
            text = (template / UNIT).read_text()
            body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
            if self.rpc_args is not None:
                body = re.sub(r"^Description=.*$", "Description=localai rpc-server (this machine's devices for the "
                              "models of other localai daemons)", body, flags=re.MULTILINE)
            body = body.replace("@EXEC_START@", " ".join(_systemd_word(word)
                                                         for word in command_line(self.rpc_args)))
            body = body.replace("@ENVIRONMENT@", "\n".join(_systemd_assignment(k, v)
                                                           for k, v in environment().items()))
            return f"{MARKER}\n{body.strip()}\n".encode()
        with open(template / f"{LABEL}.plist", "rb") as handle:
            plist = plistlib.load(handle)
        plist["Label"] = self.label
        plist["ProgramArguments"] = ([*command_line(), "--log-file", str(self.log_path)] if self.rpc_args is None
                                     else command_line(self.rpc_args))
        plist["EnvironmentVariables"] = environment()
        plist["StandardOutPath"] = plist["StandardErrorPath"] = str(
            paths.logs_dir() / "service.err" if self.rpc_args is None else self.log_path)
        plist[PLIST_MARKER] = 1
        return plistlib.dumps(plist)

    def ours(self) -> bool:
        """Whether the file at ``path`` was written by ``localai service install``."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False
        if self.manager == "systemd":
            return data.startswith(MARKER.encode())
        try:
            return PLIST_MARKER in plistlib.loads(data)
        except Exception:
            return False

    def write(self, force: bool = False) -> Path:
        """Write the unit (atomically, private: it may hold LOCALAI_API_KEY); never over a stranger's file."""
        from localai.agents.files import write_atomic

        if self.path.exists() and not self.ours() and not force:
            raise ServiceError(f"{self.path} exists and was not written by localai; move it away or pass --force")
        paths.logs_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, self.render(), mode=0o600)
        return self.path

    def remove(self) -> bool:
        if not self.path.exists():
            return False
        if not self.ours():
            raise ServiceError(f"{self.path} was not written by localai; not removing it")
        self.path.unlink()
        return True

    # -- the service manager ----------------------------------------------------------------------

    def start(self) -> None:
        if self.manager == "systemd":
            _run(["systemctl", "--user", "daemon-reload"])
            _run(["systemctl", "--user", "enable", "--now", self.unit])
        else:
            _run(["launchctl", "bootout", self.launchd_target()], check=False)
            _run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(self.path)])

    def start_hint(self) -> list[str]:
        if self.manager == "systemd":
            return ["systemctl", "--user", "enable", "--now", self.unit]
        return ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(self.path)]

    def stop(self) -> None:
        if self.manager == "systemd":
            _run(["systemctl", "--user", "disable", "--now", self.unit], check=False)
            _run(["systemctl", "--user", "daemon-reload"], check=False)
        else:
            _run(["launchctl", "bootout", self.launchd_target()], check=False)

    def state(self) -> str:
        """The manager's word for the service: active, inactive, failed... or why it cannot tell."""
        try:
            if self.manager == "systemd":
                said = _run(["systemctl", "--user", "is-active", self.unit], check=False, errors=True).strip()
                return said.splitlines()[0] if said else "unknown"
            output = _run(["launchctl", "print", self.launchd_target()], check=False)
        except ServiceError as exc:
            return f"unknown ({exc.message})"
        match = re.search(r"^\s*state = (\S+)", output, re.MULTILINE)
        return match.group(1) if match else "not loaded"

    def logs_command(self, lines: int, follow: bool) -> list[str]:
        if self.manager == "systemd":
            return ["journalctl", "--user", "-u", self.unit, "-n", str(lines), "--no-pager",
                    *(["-f"] if follow else [])]
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), str(self.log_path)]

    def launchd_target(self) -> str:
        return f"gui/{os.getuid()}/{self.label}"


def _run(command: list[str], check: bool = True, errors: bool = False) -> str:
    """Run a service-manager command; a missing command or a refusal is a ServiceError with its output.
    Returns its stdout (or, with ``errors``, its stdout or else its stderr)."""
    if shutil.which(command[0]) is None:
        raise ServiceError(f"{command[0]} is not installed here")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"{' '.join(command)} did not answer within 60 s") from exc
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ServiceError(f"{' '.join(command)} failed: {said[-1] if said else f'exit {done.returncode}'}")
    return done.stdout if done.stdout.strip() or not errors else done.stderr
