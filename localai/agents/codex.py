"""OpenAI Codex CLI: Responses, configured with ``-c`` overrides and a model catalog localai generates.

Nothing is written under the user's ``~/.codex``: the provider, the model and its metadata all come from
``-c key=value`` flags, which take precedence over ``config.toml`` for this run only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from localai.agents.base import OPENAI_RESPONSES, Integration, Launch, Package, Target

PROVIDER = "localai"


def toml_value(value: object) -> str:
    """A TOML literal for ``-c``: JSON strings, numbers and booleans are valid TOML."""
    return json.dumps(value)


class Codex(Integration):
    name = "codex"
    title = "Codex CLI"
    binary = "codex"
    protocol = OPENAI_RESPONSES
    wiring = "-c overrides (provider, base URL, context window) and a generated model catalog; no ~/.codex edits"
    package = Package("npm", "@openai/codex@0.171.0")

    def catalog_path(self) -> Path:
        return self.files().root / "models.json"

    def catalog(self, target: Target) -> dict[str, object]:
        """Model metadata Codex would otherwise guess ("Defaulting to fallback metadata")."""
        return {"models": [{
            "slug": target.model, "display_name": target.model, "description": f"{target.model} on localai",
            "context_window": target.context_length, "shell_type": "default", "visibility": "list",
            "supported_in_api": True, "priority": 0, "truncation_policy": {"mode": "bytes", "limit": 10000},
            "input_modalities": ["text"],
            "base_instructions": "",  # Codex adds its developer messages; no extra system prompt on a small window
            "support_verbosity": False, "default_verbosity": None, "supports_parallel_tool_calls": False,
            "supports_reasoning_summaries": False, "supported_reasoning_levels": [],
            "experimental_supported_tools": [],
        }]}

    def configure(self, target: Target) -> list[Path]:
        return [self.files().write("models.json", json.dumps(self.catalog(target), indent=2) + "\n")]

    def overrides(self, target: Target) -> dict[str, object]:
        settings: dict[str, object] = {
            "model": target.model,
            "model_provider": PROVIDER,
            f"model_providers.{PROVIDER}.name": "localai",
            f"model_providers.{PROVIDER}.base_url": target.openai_base_url,
            f"model_providers.{PROVIDER}.wire_api": "responses",
            # one WebSocket per session (/v1/responses' WebSocket mode); Codex falls back to HTTPS on its own
            f"model_providers.{PROVIDER}.supports_websockets": True,
            "model_catalog_json": str(self.catalog_path()),
            "model_context_window": target.context_length,
            "check_for_update_on_startup": False,
            "analytics.enabled": False,
        }
        if target.api_key:
            settings[f"model_providers.{PROVIDER}.env_key"] = "LOCALAI_API_KEY"
        return settings

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        argv = [program]
        for key, value in self.overrides(target).items():
            argv += ["-c", f"{key}={toml_value(value)}"]
        env: dict[str, str] = {}
        if target.api_key:
            env["LOCALAI_API_KEY"] = target.api_key
        # Codex sends prompt_cache_key (its conversation id) on every request: one prompt cache per session.
        return Launch([*argv, *extra], env)
