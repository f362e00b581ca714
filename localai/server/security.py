"""Request guards: Host-header check (DNS rebinding), API key on TCP, and which transport asked."""

from __future__ import annotations

import hmac
import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
OPEN_PATHS = frozenset({"/", "/health"})


def is_unix_socket(scope: Scope) -> bool:
    """True when the request came through the Unix socket (uvicorn reports no port for it)."""
    server = scope.get("server")
    return server is not None and server[1] is None


def is_loopback_host(host: str) -> bool:
    """Whether a Host header's name is this machine's loopback (a name or an IP)."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if not name or name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class GuardMiddleware:
    """Refuses foreign Host headers while bound to loopback, and TCP requests without the API key."""

    def __init__(self, app: ASGIApp, *, loopback_only: bool, api_key: str | None) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_unix_socket(scope):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.loopback_only and not is_loopback_host(host):
            await _refuse(scope, send, 403, "permission_error",
                          f"host {host!r} is not allowed: localai answers only loopback names (DNS rebinding guard)")
            return
        if self.api_key and scope["method"] != "OPTIONS" and scope["path"] not in OPEN_PATHS:
            supplied = headers.get("x-api-key") or ""
            authorization = headers.get("authorization", "")
            if authorization.lower().startswith("bearer "):
                supplied = authorization[7:].strip()
            if not hmac.compare_digest(supplied.encode(), self.api_key.encode()):
                await _refuse(scope, send, 401, "authentication_error",
                              "missing or wrong API key: send it as 'Authorization: Bearer <LOCALAI_API_KEY>'")
                return
        await self.app(scope, receive, send)


class JsonBodyMiddleware:
    """Reads POST bodies as JSON even without a JSON content type, as Ollama does (``curl -d`` sends a form type).

    Only for requests without an ``Origin`` header: a browser page may send text/plain cross-origin without
    a preflight, so coercing its body would open the API to any website.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "DELETE"):
            headers = [(k, v) for k, v in scope["headers"]]
            names = {k.lower() for k, _ in headers}
            content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            if b"origin" not in names and (not content_type
                                           or content_type.startswith(b"application/x-www-form-urlencoded")):
                headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
                headers.append((b"content-type", b"application/json"))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send, status: int, kind: str, message: str) -> None:
    from localai.server.errors import error_body

    body = json.dumps(error_body(scope["path"], message, kind, status)).encode()
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


