"""A remote model's definition: the replicas' URLs and how to talk to them, read from its Modelfile.

``FROM http://HOST:PORT/v1`` names the first replica; ``PARAMETER replica URL`` adds more; ``upstream_model`` is the
model's id there (default: the only one the upstream lists); ``api_key_env`` names the daemon's environment variable
that holds the key (the key itself is never stored); ``timeout`` and ``connect_timeout`` bound each request.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from localai.errors import ModelfileError, UpstreamFailed
from localai.models.modelfile import ParameterValue

REMOTE_FORMAT = "remote"
DEFAULT_TIMEOUT = 600.0  # seconds to the first byte and between chunks: a long prefill on a big model is slow
DEFAULT_CONNECT_TIMEOUT = 5.0


def is_remote_url(reference: str) -> bool:
    return reference.strip().lower().startswith(("http://", "https://"))


def check_url(url: str, where: str) -> str:
    """``url`` without its trailing slash, or ModelfileError: http(s) with a host, no credentials, no query."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ModelfileError(f"{where}: {text[:80]!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ModelfileError(f"{where}: {text[:80]!r} is not an http(s) URL with a host, e.g. http://gpu-box:8000/v1")
    if parts.username or parts.password:
        raise ModelfileError(f"{where}: the URL holds credentials, which would be stored in clear; put the key in an "
                             "environment variable and name it with PARAMETER api_key_env")
    if parts.query or parts.fragment:
        raise ModelfileError(f"{where}: the URL has a query or fragment; give the API's base URL, e.g. http://host:8000/v1")
    return text.rstrip("/")


@dataclass(frozen=True)
class RemoteSpec:
    """How to reach a remote model; equal specs share one pool of replicas."""

    replicas: tuple[str, ...]
    upstream_model: str | None = None
    api_key_env: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    routing: str = "session"
    kind: str = "auto"
    num_ctx: int | None = None
    priority: int | None = None  # Dynamo's nvext.agent_hints.priority

    @classmethod
    def of(cls, first: str, parameters: dict[str, ParameterValue]) -> RemoteSpec:
        extra = parameters.get("replica", [])
        urls = [first, *(extra if isinstance(extra, list) else [str(extra)])]
        replicas = tuple(dict.fromkeys(check_url(url, "replica") for url in urls))
        model, key_env = parameters.get("upstream_model"), parameters.get("api_key_env")
        num_ctx, priority = parameters.get("num_ctx"), parameters.get("priority")
        return cls(
            replicas=replicas, upstream_model=str(model) if model else None,
            api_key_env=str(key_env) if key_env else None,
            timeout=float(parameters.get("timeout", DEFAULT_TIMEOUT)),  # type: ignore[arg-type]
            connect_timeout=float(parameters.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)),  # type: ignore[arg-type]
            routing=str(parameters.get("routing", "session")), kind=str(parameters.get("upstream_kind", "auto")),
            num_ctx=int(num_ctx) if isinstance(num_ctx, int) and not isinstance(num_ctx, bool) else None,
            priority=int(priority) if isinstance(priority, int) and not isinstance(priority, bool) else None,
        )

    def digest(self) -> str:
        """Identifies the definition (what ``list`` shows as the digest): a change means a new pool."""
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True, default=list).encode()).hexdigest()

    def api_key(self) -> str | None:
        """The key from the daemon's environment; an error naming the variable when it is not set."""
        if self.api_key_env is None:
            return None
        value = os.environ.get(self.api_key_env)
        if not value:
            raise UpstreamFailed(f"PARAMETER api_key_env names {self.api_key_env}, which is not set in the daemon's "
                                 f"environment; set it and restart the daemon (localai serve)")
        return value

    def headers(self) -> dict[str, Any]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}
