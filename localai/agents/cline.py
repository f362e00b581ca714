"""Cline CLI: Chat Completions, with its state in a data directory localai owns (``--data-dir``).

Cline's per-run flags cannot set a base URL and its provider settings live in its data directory, so
localai gives it one of its own: ``~/.cline`` is never edited; tasks run through localai are kept there.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localai.agents.base import OPENAI_CHAT, Integration, Launch, Package, Target

PROVIDER = "openai-compatible"


class Cline(Integration):
    name = "cline"
    title = "Cline CLI"
    binary = "cline"
    protocol = OPENAI_CHAT
    wiring = "--data-dir <dir localai owns> holding an openai-compatible provider; ~/.cline untouched"
    package = Package("npm", "cline@3.0.65", node=(22, 0))

    def data_dir(self) -> Path:
        return self.files().root / "data"

    def providers(self, target: Target) -> dict[str, Any]:
        """``settings/providers.json`` as ``cline auth`` writes it (Cline ignores the file without
        ``modes`` and ``updatedAt``)."""
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        return {"version": 1, "lastUsedProvider": PROVIDER, "modes": {}, "providers": {PROVIDER: {
            "settings": {"provider": PROVIDER, "apiKey": target.key, "model": target.model,
                         "baseUrl": target.openai_base_url},
            "updatedAt": stamp, "tokenSource": "manual",
        }}}

    def configure(self, target: Target) -> list[Path]:
        return [self.files().write("data/settings/providers.json", json.dumps(self.providers(target), indent=2))]

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        env = {"CLINE_LOG_ENABLED": "0"}
        return Launch([program, "--data-dir", str(self.data_dir()), *extra], env)
