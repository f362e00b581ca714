"""The interface every launchable agent implements, and what it is given: the daemon's address and the model.

An integration is four steps: ``detect()`` finds the agent's program, ``configure()`` writes whatever files the
agent needs (preferably files localai owns), ``command()`` builds the command line and environment of one run,
and ``restore()`` undoes everything ``configure()`` wrote.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from localai import paths
from localai.agents.files import AgentFiles

# What agents send as their API key when the daemon has none configured (it accepts anything then).
PLACEHOLDER_KEY = "localai"

ANTHROPIC_MESSAGES = "Anthropic Messages"
OPENAI_RESPONSES = "OpenAI Responses"
OPENAI_CHAT = "OpenAI Chat Completions"


@dataclass(frozen=True)
class Target:
    """Where an agent sends its requests, and what it may assume about the model."""

    base_url: str
    """The daemon's root URL on TCP, e.g. ``http://127.0.0.1:11435`` (Anthropic clients append ``/v1/...``)."""
    model: str
    context_length: int
    """The model's real context window in tokens, as the daemon loads it."""
    max_output_tokens: int
    """The longest reply worth asking for."""
    api_key: str | None = None
    """``LOCALAI_API_KEY`` when the daemon requires one."""
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """One id per launch, sent by agents that have no session id of their own."""

    @property
    def openai_base_url(self) -> str:
        """The base URL OpenAI clients want (they append ``/chat/completions`` or ``/responses``)."""
        return f"{self.base_url}/v1"

    @property
    def key(self) -> str:
        """The API key to give the agent: the daemon's, or a placeholder the daemon ignores."""
        return self.api_key or PLACEHOLDER_KEY


@dataclass(frozen=True)
class Package:
    """How an agent is installed."""

    manager: Literal["npm", "pip", "manual"]
    spec: str
    """The package with the version localai is tested against, e.g. ``@openai/codex@0.169.0``; for
    ``manual``, the command or page that installs the agent."""
    node: tuple[int, int] = (0, 0)
    """The oldest Node.js version (major, minor) the agent runs on ((0, 0) for programs that need no Node.js)."""
    python_below: tuple[int, int] | None = None
    """For pip packages: the first Python version the package does not support."""
    downloads_from: str = ""
    """A host outside npm and PyPI that the install downloads the agent's program from (e.g. ``github.com``), or
    ''; where it cannot be reached, ``launch --yes`` says so before installing anything."""

    @property
    def name(self) -> str:
        """The package without its version: ``@openai/codex`` from ``@openai/codex@0.169.0``."""
        if "==" in self.spec:
            return self.spec.split("==", 1)[0]
        return self.spec.rsplit("@", 1)[0] if self.spec.rfind("@") > 0 else self.spec


@dataclass
class Launch:
    """One run of an agent: its command line and the environment variables set for it."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Installed:
    """An agent's program as found on this machine."""

    path: Path
    version: str | None
    managed: bool
    """True when it lives in localai's agents directory (installed by ``launch --yes`` or ``make``)."""


_VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?(?:[-+.][0-9A-Za-z.]+)?")


class Integration(ABC):
    """One launchable coding agent."""

    name: ClassVar[str]
    """The name on the command line: ``localai launch <name>``."""
    title: ClassVar[str]
    binary: ClassVar[str]
    protocol: ClassVar[str]
    """The wire protocol the agent speaks to the daemon."""
    wiring: ClassVar[str]
    """How localai points the agent at the daemon, in a few words (``launch --list``, README)."""
    package: ClassVar[Package]
    extra_locations: ClassVar[tuple[str, ...]] = ()
    """Places an agent's own installer puts it, relative to the home directory."""

    # -- detect -----------------------------------------------------------------------------------

    def managed_path(self) -> Path:
        """Where the agent's program is when localai installed it."""
        root = paths.agents_dir()
        if self.package.manager == "pip":
            return root / f"{self.name}-venv" / "bin" / self.binary
        return root / "node_modules" / ".bin" / self.binary

    def find(self) -> tuple[Path, bool] | None:
        """The agent's program (localai's own install first, then ``PATH``) and whether localai manages it."""
        managed = self.managed_path()
        if managed.exists() and os.access(managed, os.X_OK):
            return managed, True
        found = shutil.which(self.binary)
        if found:
            return Path(found), False
        for relative in self.extra_locations:
            candidate = Path.home() / relative
            if candidate.exists() and os.access(candidate, os.X_OK):
                return candidate, False
        return None

    def detect(self) -> Installed | None:
        """The installed agent and its version, or None when it is not installed."""
        found = self.find()
        if found is None:
            return None
        path, managed = found
        return Installed(path=path, version=self._version(path), managed=managed)

    def _version(self, path: Path) -> str | None:
        try:
            result = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=20,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **self.runtime_env()})
        except (OSError, subprocess.SubprocessError):
            return None
        match = _VERSION.search(result.stdout or result.stderr or "")
        return match.group(0) if match else None

    def runtime_env(self) -> dict[str, str]:
        """Environment every run of the agent needs: localai's agent directory first on ``PATH``, so a Node
        program installed there runs on the Node.js installed beside it."""
        if self.package.manager != "npm":
            return {}
        bin_dir = paths.agents_dir() / "node_modules" / ".bin"
        if not bin_dir.is_dir():
            return {}
        return {"PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", os.defpath)])}

    # -- configure, command, restore ------------------------------------------------------------------

    def files(self) -> AgentFiles:
        """What localai writes for this agent, recorded so ``restore()`` can undo it."""
        return AgentFiles(self.name)

    def configure(self, target: Target) -> list[Path]:
        """Write the files the agent needs to reach ``target``; returns their paths. Default: none."""
        return []

    @abstractmethod
    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        """The command line and environment of one run; ``extra`` are the user's arguments, passed last."""

    def notes(self, target: Target) -> list[str]:
        """Warnings worth showing before the agent starts (e.g. a model too small for it)."""
        return []

    def unedit(self, path: Path, data: Any, original: Any) -> Any:
        """Remove localai's entries from a user file that changed since localai edited it (``original`` is
        the file as it was before, or None). Only integrations that edit user files override this."""
        return data

    def restore(self) -> list[str]:
        """Undo everything ``configure()`` wrote; returns one line per file put back or removed."""
        return self.files().restore(self.unedit)
