"""Which agent session a request belongs to, from the fields and headers agents actually send."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from pydantic import Field
from starlette.requests import HTTPConnection

from localai.api.security import principal_of
from localai.schema import child_session

# In priority order: localai's own header, then each agent's own.
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id")
# A sub-agent's own id, sent beside its parent's session id (Claude Code's Task/Agent tool)
AGENT_HEADERS = ("x-claude-code-agent-id",)
# Codex's per-request metadata (a JSON object); its request_kind says what a request is for
CODEX_METADATA = "x-codex-turn-metadata"
# Codex's request kinds that are the conversation itself; others (memory, review, compaction...) are side requests
CONVERSATION_KINDS = frozenset({"", "turn", "prewarm"})
MAX_CHILD_NAME = 128


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
    """``prompt_cache_key`` (OpenAI, sent by Codex and Pi) first, then the session headers. A sub-agent's request
    (its agent id beside the session's) and an agent's side request (Codex's ``request_kind`` other than a turn)
    get a session of their own under it (``schema.child_session``), so they neither take the main agent's slot nor
    read as its conversation changing."""
    session = prompt_cache_key or next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None)
    if session is None:
        return None
    agent = next((headers[h] for h in AGENT_HEADERS if headers.get(h)), None)
    if agent and agent != session:
        return child_session(session, f"agent:{agent[:MAX_CHILD_NAME]}")
    kind = codex_request_kind(headers)
    if kind not in CONVERSATION_KINDS:
        return child_session(session, kind[:MAX_CHILD_NAME])
    return session


def codex_request_kind(headers: Mapping[str, str]) -> str:
    """``request_kind`` from Codex's turn metadata header ("" when absent or not the JSON object Codex sends)."""
    raw = headers.get(CODEX_METADATA)
    if not raw or len(raw) > 65536:
        return ""
    try:
        metadata = json.loads(raw)
    except ValueError:
        return ""
    kind = metadata.get("request_kind") if isinstance(metadata, dict) else None
    return kind if isinstance(kind, str) and kind.isprintable() else ""
