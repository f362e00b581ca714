"""Coding agents that ``localai launch`` configures and runs against the daemon, one module per agent."""

from __future__ import annotations

from localai.agents.aider import Aider
from localai.agents.base import Installed, Integration, Launch, Package, Target
from localai.agents.claude import ClaudeCode
from localai.agents.cline import Cline
from localai.agents.codex import Codex
from localai.agents.continue_cli import ContinueCLI
from localai.agents.crush import Crush
from localai.agents.droid import Droid
from localai.agents.goose import Goose
from localai.agents.hermes import Hermes
from localai.agents.openclaw import OpenClaw
from localai.agents.opencode import OpenCode
from localai.agents.pi import Pi
from localai.agents.qwen import QwenCode

INTEGRATIONS: dict[str, Integration] = {
    integration.name: integration
    for integration in (
        ClaudeCode(), Codex(), OpenCode(), Aider(), QwenCode(), Pi(), Droid(), Cline(), ContinueCLI(), Hermes(),
        Goose(), Crush(), OpenClaw(),
    )
}

__all__ = ["INTEGRATIONS", "Installed", "Integration", "Launch", "Package", "Target", "get", "names"]


ALIASES = {"cn": "continue", "claude-code": "claude", "qwen-code": "qwen"}


def names() -> list[str]:
    return list(INTEGRATIONS)


def get(name: str) -> Integration:
    """The integration called ``name``; KeyError when there is none."""
    key = name.lower()
    return INTEGRATIONS[ALIASES.get(key, key)]
