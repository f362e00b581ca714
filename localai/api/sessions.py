"""Which agent session a request belongs to, from the fields and headers agents actually send."""

from __future__ import annotations

from collections.abc import Mapping

# In priority order: localai's own header, then each agent's own.
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id")


def session_id(headers: Mapping[str, str], prompt_cache_key: str | None = None) -> str | None:
    """``prompt_cache_key`` (OpenAI, sent by Codex and Pi) first, then the session headers."""
    if prompt_cache_key:
        return prompt_cache_key
    for header in SESSION_HEADERS:
        value = headers.get(header)
        if value:
            return value
    return None
