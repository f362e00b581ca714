"""Continue's CLI (``cn``): Chat Completions, from a config file localai generates (``cn --config``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target


class ContinueCLI(Integration):
    name = "continue"
    title = "Continue CLI (cn)"
    binary = "cn"
    protocol = OPENAI_CHAT
    wiring = "cn --config <config.yaml localai owns>; ~/.continue untouched"
    package = Package("npm", "@continuedev/cli@1.5.47", node=(22, 0))

    def config(self, target: Target) -> dict[str, Any]:
        return {"name": "localai", "version": "1.0.0", "schema": "v1", "models": [{
            "name": f"{target.model} (localai)", "provider": "openai", "model": target.model,
            "apiBase": target.openai_base_url, "apiKey": target.key,
            "roles": ["chat", "edit", "apply"], "capabilities": ["tool_use"],
            "defaultCompletionOptions": {"contextLength": target.context_length,
                                         "maxTokens": target.max_output_tokens},
            "requestOptions": {"headers": {"X-Session-Id": target.session_id}},  # cn sends no session id
        }]}

    def configure(self, target: Target) -> list[Path]:
        # JSON is YAML: cn reads it as its config.yaml.
        return [self.files().write("config.yaml", json.dumps(self.config(target), indent=2) + "\n")]

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {"CONTINUE_CLI_ENABLE_TELEMETRY": "0", "CONTINUE_METRICS_ENABLED": "0"}
        return Launch([program, "--config", str(self.files().root / "config.yaml"), *extra],
                      env)
