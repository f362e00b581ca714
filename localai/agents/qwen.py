"""Qwen Code: Chat Completions, configured through its environment, flags and a defaults file localai owns.

``QWEN_CODE_SYSTEM_DEFAULTS_PATH`` names a settings file Qwen Code reads below the user's own settings, so
``~/.qwen/settings.json`` is never edited and still wins where it says something.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target


class QwenCode(Integration):
    name = "qwen"
    title = "Qwen Code"
    binary = "qwen"
    protocol = OPENAI_CHAT
    wiring = "environment (OPENAI_BASE_URL, ...) and --auth-type openai; defaults file for context and session"
    package = Package("npm", "@qwen-code/qwen-code@0.24.4", node=(22, 0))

    def defaults(self, target: Target) -> dict[str, Any]:
        return {
            "model": {"generationConfig": {
                "contextWindowSize": target.context_length,
                # Qwen Code expands ${session_id} per request once dynamic header values are allowed.
                "customHeaders": {"X-Session-Id": "${session_id}"},
            }},
            "outboundCorrelation": {"allowDynamicHeaderValues": True},
            "privacy": {"usageStatisticsEnabled": False},
            "general": {"enableAutoUpdate": False},
        }

    def configure(self, target: Target) -> list[Path]:
        return [self.files().write("settings.json", json.dumps(self.defaults(target), indent=2) + "\n")]

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {
            "OPENAI_BASE_URL": target.openai_base_url,
            "OPENAI_API_KEY": target.key,
            "OPENAI_MODEL": target.model,
            "QWEN_CODE_MAX_OUTPUT_TOKENS": str(target.max_output_tokens),
            "QWEN_CODE_SYSTEM_DEFAULTS_PATH": str(self.files().root / "settings.json"),
        }
        return Launch([program, "--auth-type", "openai", "--model", target.model, *extra],
                      env)
