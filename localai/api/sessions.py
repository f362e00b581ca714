"""Which agent session a request belongs to, from the fields and headers agents actually send."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pydantic import Field
from starlette.requests import HTTPConnection

from localai.api.security import principal_of

# In priority order: localai's own header, then each agent's own.
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id")


def cache_salt_field() -> str | None:
    """``cache_salt``: the field every dialect's body takes (vLLM's name)."""
    return Field(
        default=None, min_length=1, max_length=1024,
        description="Reuse cached prompt prefixes only with requests that send the same salt (and the same API "
        "key): a guess sent without it learns nothing from the timing or cached tokens of this request's prompt.")


def cache_partition(connection: HTTPConnection, salt: str | None) -> str:
    """Whose prompt-cache prefixes a request may reuse: its principal (an API key's id when several keys are
    configured; "" for the machine's owner) and, with a ``cache_salt``, the salt's hash after a dot. "" is the
    default partition, the one every request shared before partitions existed."""
    principal = principal_of(connection.scope)
    if not salt:
        return principal
    return f"{principal}.{hashlib.blake2b(salt.encode(), digest_size=8, person=b'localai-salt').hexdigest()}"


def session_id(headers: Mapping[str, str], prompt_cache_key: str | None = None) -> str | None:
    """``prompt_cache_key`` (OpenAI, sent by Codex and Pi) first, then the session headers."""
    if prompt_cache_key:
        return prompt_cache_key
    for header in SESSION_HEADERS:
        value = headers.get(header)
        if value:
            return value
    return None
