"""Hermes Agent: Chat Completions, from its ``config.yaml`` (backed up, restored by ``--restore``).

Hermes reads providers and its model only from ``$HERMES_HOME/config.yaml`` (``~/.hermes``); relocating
``HERMES_HOME`` would hide the user's memories, skills and sessions, so localai edits the file: the ``model``
block and ``providers.localai``. Hermes refuses models with less than 64K tokens of context.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target
from localai.agents.files import drop_empty, put_back

PROVIDER = "localai"
MIN_CONTEXT = 64_000


def config_path() -> Path:
    configured = os.environ.get("HERMES_HOME")
    root = Path(configured).expanduser() if configured else Path.home() / ".hermes"
    return root / "config.yaml"


class Hermes(Integration):
    name = "hermes"
    title = "Hermes Agent"
    binary = "hermes"
    protocol = OPENAI_CHAT
    wiring = "model and providers.localai in ~/.hermes/config.yaml (backed up)"
    package = Package("pip", "hermes-agent==0.19.0", python_below=(3, 14))

    def configure(self, target: Target) -> list[Path]:
        def change(data: dict[str, Any]) -> dict[str, Any]:
            data["model"] = {"provider": PROVIDER, "default": target.model, "base_url": target.openai_base_url,
                             "api_key": target.key, "context_length": target.context_length}
            providers: dict[str, Any] = data["providers"] if isinstance(data.get("providers"), dict) else {}
            providers[PROVIDER] = {"name": "localai", "api": target.openai_base_url, "api_key": target.key,
                                   "default_model": target.model, "models": [target.model]}
            data["providers"] = providers
            return data

        return [self.files().edit(config_path(), "yaml", change)]

    def unedit(self, path: Path, data: Any, original: Any) -> Any:
        before = original or {}
        model = data.get("model")
        if isinstance(model, dict) and model.get("provider") == PROVIDER:  # still localai's: put the old one back
            put_back(data, before, "model")
        put_back(data.get("providers") or {}, before.get("providers"), PROVIDER)
        drop_empty(data, before, "providers")
        return data

    def notes(self, target: Target) -> list[str]:
        if target.context_length < MIN_CONTEXT:
            return [f"Hermes refuses models with less than {MIN_CONTEXT} tokens of context; {target.model} has "
                    f"{target.context_length} (raise it with PARAMETER num_ctx in a Modelfile)"]
        return []

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        return Launch([program, *extra], {})
