"""Goose: Chat Completions through its OpenAI provider, configured through its environment only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target

INSTALLER = ("curl -fsSL https://github.com/block/goose/releases/download/stable/download_cli.sh | bash "
             "(see https://block.github.io/goose/docs/getting-started/installation)")


class Goose(Integration):
    name = "goose"
    title = "Goose"
    binary = "goose"
    protocol = OPENAI_CHAT
    wiring = "environment: GOOSE_PROVIDER=openai, OPENAI_HOST, GOOSE_MODEL, GOOSE_CONTEXT_LIMIT"
    package = Package("manual", INSTALLER, downloads_from="github.com")  # a release binary: not on npm or PyPI
    extra_locations: ClassVar[tuple[str, ...]] = (".local/bin/goose",)

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {
            "GOOSE_PROVIDER": "openai",
            "GOOSE_MODEL": target.model,
            "OPENAI_HOST": target.base_url,  # Goose joins host and path itself
            "OPENAI_BASE_PATH": "v1/chat/completions",
            "OPENAI_API_KEY": target.key,
            "GOOSE_CONTEXT_LIMIT": str(target.context_length),
            "GOOSE_TELEMETRY_ENABLED": "false",
        }
        return Launch([program, *extra], env)
