"""Factory Droid: Chat Completions, from a settings file localai owns, merged with ``--settings`` per run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target


class Droid(Integration):
    name = "droid"
    title = "Droid (Factory)"
    binary = "droid"
    protocol = OPENAI_CHAT
    wiring = "--settings <file localai owns>: a custom model as the session default; ~/.factory untouched"
    package = Package("npm", "droid@0.215.0")

    def model_id(self, target: Target) -> str:
        return f"custom:localai-{target.model}"

    def settings(self, target: Target) -> dict[str, Any]:
        return {
            "customModels": [{
                "id": self.model_id(target), "index": 0, "model": target.model,
                "displayName": f"{target.model} (localai)", "provider": "generic-chat-completion-api",
                "baseUrl": target.openai_base_url, "apiKey": target.key,
                "maxOutputTokens": target.max_output_tokens,
                "extraHeaders": {"X-Session-Id": target.session_id},  # Droid sends no session id of its own
            }],
            "sessionDefaultSettings": {"model": self.model_id(target)},
        }

    def configure(self, target: Target) -> list[Path]:
        return [self.files().write("settings.json", json.dumps(self.settings(target), indent=2) + "\n")]

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {"FACTORY_DROID_AUTO_UPDATE_ENABLED": "false"}
        return Launch([program, "--settings", str(self.files().root / "settings.json"), *extra],
                      env)
