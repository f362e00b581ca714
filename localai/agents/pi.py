"""Pi: Chat Completions, from a provider entry localai adds to the user's ``models.json``.

Pi reads custom providers only from ``<agent dir>/models.json`` (``~/.pi/agent`` or ``$PI_CODING_AGENT_DIR``);
relocating that directory would hide the user's sessions and settings, so localai edits the file instead:
only ``providers.localai``, with a backup, undone by ``--restore``. The model is chosen per run with
``--provider``/``--model``, so the user's default model is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target
from localai.agents.files import drop_empty, put_back

PROVIDER = "localai"
# Resolved by Pi when it sends a request: the launch's session id, or one per Pi process when Pi is run
# without localai (a fixed value would merge unrelated conversations in the daemon's cache bookkeeping).
SESSION_HEADER = '!printf %s "${LOCALAI_SESSION_ID:-pi-$PPID}"'


def agent_dir() -> Path:
    configured = os.environ.get("PI_CODING_AGENT_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".pi" / "agent"


class Pi(Integration):
    name = "pi"
    title = "Pi"
    binary = "pi"
    protocol = OPENAI_CHAT
    wiring = "provider 'localai' added to ~/.pi/agent/models.json (backed up); --provider/--model per run"
    package = Package("npm", "@earendil-works/pi-coding-agent@1.6.0", node=(22, 0))

    def provider(self, target: Target) -> dict[str, Any]:
        return {
            "baseUrl": target.openai_base_url,
            "api": "openai-completions",
            # Pi reads the environment variable of that name, else sends the name itself (any key works
            # when the daemon has none).
            "apiKey": "LOCALAI_API_KEY",
            "headers": {"X-Session-Id": SESSION_HEADER},
            "models": [{
                "id": target.model, "name": f"{target.model} (localai)", "input": ["text"], "reasoning": False,
                "contextWindow": target.context_length, "maxTokens": target.max_output_tokens,
            }],
        }

    def configure(self, target: Target) -> list[Path]:
        def change(data: dict[str, Any]) -> dict[str, Any]:
            providers = data.setdefault("providers", {})
            providers[PROVIDER] = self.provider(target)
            return data

        return [self.files().edit(agent_dir() / "models.json", "json", change)]

    def unedit(self, path: Path, data: Any, original: Any) -> Any:
        put_back(data.get("providers", {}), (original or {}).get("providers"), PROVIDER)
        drop_empty(data, original, "providers")
        return data

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {
            "LOCALAI_SESSION_ID": target.session_id,
            "PI_OFFLINE": "1",  # no update checks or other startup network calls
            "PI_SKIP_VERSION_CHECK": "1",
            "PI_TELEMETRY": "0",
        }
        if target.api_key:
            env["LOCALAI_API_KEY"] = target.api_key
        return Launch([program, "--provider", PROVIDER, "--model", target.model, *extra],
                      env)
