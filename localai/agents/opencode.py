"""OpenCode: Chat Completions, configured through ``OPENCODE_CONFIG_CONTENT`` (no files)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target

PROVIDER = "localai"


class OpenCode(Integration):
    name = "opencode"
    title = "OpenCode"
    binary = "opencode"
    protocol = OPENAI_CHAT
    wiring = "OPENCODE_CONFIG_CONTENT: an openai-compatible provider with the model's context and output limits"
    package = Package("npm", "opencode-ai@1.18.33")
    extra_locations: ClassVar[tuple[str, ...]] = (".opencode/bin/opencode",)

    def config(self, target: Target) -> dict[str, Any]:
        """Merged by OpenCode over the user's own config files, for this run only."""
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",  # bundled with OpenCode: nothing is downloaded
                "name": "localai",
                "options": {"baseURL": target.openai_base_url, "apiKey": target.key},
                "models": {target.model: {
                    "name": target.model, "tool_call": True,
                    "limit": {"context": target.context_length, "output": target.max_output_tokens},
                }},
            }},
            "model": f"{PROVIDER}/{target.model}",
            "small_model": f"{PROVIDER}/{target.model}",  # titles and summaries: the same local model
            "autoupdate": False,
            "share": "disabled",
        }

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {
            "OPENCODE_CONFIG_CONTENT": json.dumps(self.config(target)),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",  # they are fetched from npm at start
        }
        # OpenCode sends its session id as x-session-id on every request.
        return Launch([program, *extra], env)
