"""OpenClaw: Chat Completions, from a provider localai adds to ``~/.openclaw/openclaw.json`` (backed up)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target
from localai.agents.files import drop_empty, put_back

PROVIDER = "localai"


def config_path() -> Path:
    return Path.home() / ".openclaw" / "openclaw.json"


class OpenClaw(Integration):
    name = "openclaw"
    title = "OpenClaw"
    binary = "openclaw"
    protocol = OPENAI_CHAT
    wiring = "models.providers.localai and the default agent model in ~/.openclaw/openclaw.json (backed up)"
    # its engines field says >=24.16 <25 (or >=26.1), and its preinstall script checks it
    package = Package("npm", "openclaw@2026.9.6", node=(24, 16))

    def configure(self, target: Target) -> list[Path]:
        def change(data: dict[str, Any]) -> dict[str, Any]:
            providers = data.setdefault("models", {}).setdefault("providers", {})
            providers[PROVIDER] = {
                "baseUrl": target.openai_base_url, "apiKey": target.key, "api": "openai-completions",
                "models": [{"id": target.model, "name": f"{target.model} (localai)",
                            "contextWindow": target.context_length, "maxTokens": target.max_output_tokens}],
            }
            model = data.setdefault("agents", {}).setdefault("defaults", {}).setdefault("model", {})
            model["primary"] = f"{PROVIDER}/{target.model}"
            return data

        return [self.files().edit(config_path(), "json", change)]

    def unedit(self, path: Path, data: Any, original: Any) -> Any:
        before = original or {}
        put_back(data.get("models", {}).get("providers", {}), before.get("models", {}).get("providers"), PROVIDER)
        model = data.get("agents", {}).get("defaults", {}).get("model", {})
        if str(model.get("primary", "")).startswith(f"{PROVIDER}/"):
            put_back(model, before.get("agents", {}).get("defaults", {}).get("model"), "primary")
        drop_empty(data, before, "models", "providers")
        drop_empty(data, before, "agents", "defaults", "model")
        return data

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        return Launch([program, *extra])
