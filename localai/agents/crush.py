"""Crush: Chat Completions, from a provider localai adds to the user's ``crush.json`` (backed up).

Crush reads providers from ``$XDG_CONFIG_HOME/crush/crush.json`` (``~/.config/crush``) or a project's
``crush.json``; localai edits the global file: ``providers.localai`` and the ``large``/``small`` model
choices, undone by ``--restore``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target
from localai.agents.files import drop_empty, put_back

PROVIDER = "localai"
ROLES = ("large", "small")


def config_path() -> Path:
    configured = os.environ.get("XDG_CONFIG_HOME")
    root = Path(configured).expanduser() if configured else Path.home() / ".config"
    return root / "crush" / "crush.json"


class Crush(Integration):
    name = "crush"
    title = "Crush"
    binary = "crush"
    protocol = OPENAI_CHAT
    wiring = "providers.localai and models.large/small in ~/.config/crush/crush.json (backed up)"
    # The npm package's postinstall downloads Crush's binary from GitHub's releases.
    package = Package("npm", "@charmland/crush@0.96.1", downloads_from="github.com")

    def configure(self, target: Target) -> list[Path]:
        def change(data: dict[str, Any]) -> dict[str, Any]:
            providers = data.setdefault("providers", {})
            providers[PROVIDER] = {
                "name": "localai", "type": "openai-compat", "base_url": target.openai_base_url,
                "api_key": target.key,
                "models": [{"id": target.model, "name": f"{target.model} (localai)",
                            "context_window": target.context_length,
                            "default_max_tokens": target.max_output_tokens}],
            }
            models = data.setdefault("models", {})
            for role in ROLES:
                models[role] = {"model": target.model, "provider": PROVIDER}
            return data

        return [self.files().edit(config_path(), "json", change)]

    def unedit(self, path: Path, data: Any, original: Any) -> Any:
        before = original or {}
        put_back(data.get("providers") or {}, before.get("providers"), PROVIDER)
        models = data.get("models") or {}
        for role in ROLES:
            if (models.get(role) or {}).get("provider") == PROVIDER:
                put_back(models, before.get("models"), role)
        drop_empty(data, before, "providers")
        drop_empty(data, before, "models")
        return data

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {"CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1", "CRUSH_DISABLE_METRICS": "1", "DO_NOT_TRACK": "1"}
        return Launch([program, *extra], env)
