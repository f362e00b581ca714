"""Aider: Chat Completions through LiteLLM, configured with flags and two files localai generates."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target


class Aider(Integration):
    name = "aider"
    title = "Aider"
    binary = "aider"
    protocol = OPENAI_CHAT
    wiring = "OPENAI_API_BASE and --model openai/<model>; generated model metadata and settings files"
    package = Package("pip", "aider-chat==0.86.2", python_below=(3, 13))

    def model_id(self, target: Target) -> str:
        return f"openai/{target.model}"  # LiteLLM's prefix for any OpenAI-compatible server

    def metadata(self, target: Target) -> dict[str, Any]:
        """LiteLLM model metadata: without it Aider warns about an unknown model and asks what to do."""
        return {self.model_id(target): {
            "max_input_tokens": target.context_length, "max_output_tokens": target.max_output_tokens,
            "max_tokens": target.max_output_tokens, "input_cost_per_token": 0, "output_cost_per_token": 0,
            "litellm_provider": "openai", "mode": "chat",
        }}

    def settings(self, target: Target) -> list[dict[str, Any]]:
        """Aider model settings (JSON, which is YAML too); the extra header gives the daemon one session per
        launch, since Aider sends no session id."""
        return [{"name": self.model_id(target), "extra_params": {
            "max_tokens": target.max_output_tokens,
            "extra_headers": {"X-Session-Id": target.session_id},
        }}]

    def configure(self, target: Target) -> list[Path]:
        files = self.files()
        return [files.write("model-metadata.json", json.dumps(self.metadata(target), indent=2) + "\n"),
                files.write("model-settings.yml", json.dumps(self.settings(target), indent=2) + "\n")]

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        root = self.files().root
        argv = [program, "--model", self.model_id(target),
                # Aider also reads its own .aider.model.* files; these are added to them.
                "--model-metadata-file", str(root / "model-metadata.json"),
                "--model-settings-file", str(root / "model-settings.yml"),
                "--no-check-update", "--no-analytics", "--no-show-model-warnings"]
        env = {
            "OPENAI_API_BASE": target.openai_base_url,  # LiteLLM's name, not OPENAI_BASE_URL
            "OPENAI_API_KEY": target.key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no price-map download from GitHub at start
        }
        return Launch([*argv, *extra], env)
