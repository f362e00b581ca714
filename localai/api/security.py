"""Request guards: Host-header check (DNS rebinding), API keys on TCP (and whose key asked), which transport asked."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localai.api import limits
from localai.api.body_check import LARGE, BodyChecker, release_memory
from localai.api.limits import MAX_DEPTH, BodyProblem, check_json  # noqa: F401 - where they were before
from localai.errors import ServerBusy

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
OPEN_PATHS = frozenset({"/", "/health"})
PRINCIPAL = "localai.principal"  # the scope key holding whose key a request came with ("" for the machine's owner)


def key_id(key: str) -> str:
    """A key's principal id: names whose cache entries and stored responses are whose, never the key itself."""
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"localai-key").hexdigest()


class KeyRing:
    """The API keys TCP requests may carry: ``LOCALAI_API_KEY`` and the lines of ``LOCALAI_API_KEY_FILE``
    (llama-server's ``--api-key-file``). With more than one key, each key is a principal of its own: its requests
    share prompt-cache prefixes and stored responses only among themselves. With one key (or none) every caller is
    the machine's owner, as through the Unix socket."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = [key for key in dict.fromkeys(keys) if key]

    @classmethod
    def load(cls, api_key: str | None, key_file: Path | None) -> KeyRing:
        """The keys from the settings; a key file that cannot be read is a ValueError naming it (the daemon does
        not start without the keys it was told to require)."""
        keys = [api_key] if api_key else []
        if key_file is not None:
            try:
                text = key_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"LOCALAI_API_KEY_FILE {key_file}: {exc}") from exc
            lines = [line.strip() for line in text.splitlines()]
            keys += [line for line in lines if line and not line.startswith("#")]
            if not any(line and not line.startswith("#") for line in lines):
                raise ValueError(f"LOCALAI_API_KEY_FILE {key_file} holds no key (one key per line)")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    @property
    def distinct(self) -> bool:
        """Several keys: each its own principal."""
        return len(self.keys) > 1

    def principal(self, supplied: str) -> str | None:
        """The principal of ``supplied`` ("" when keys are not distinct), or None when it is no key. Every key is
        compared, in constant time each, so the time taken does not say which one matched."""
        found: str | None = None
        for key in self.keys:
            if hmac.compare_digest(supplied.encode(), key.encode()):
                found = key
        if found is None:
            return None
        return key_id(found) if self.distinct else ""


def principal_of(scope: Scope) -> str:
    """Whose key a request came with: a key's id when several keys are configured, "" for the machine's owner (the
    Unix socket, or every caller when keys are not distinct)."""
    return scope.get(PRINCIPAL) or ""


def has_key(scope: Scope) -> bool:
    """Whether the request may see more than liveness: it came through the Unix socket, no key is required, or it
    carried a right key (``/`` and ``/health`` are open to callers without one)."""
    return scope.get(PRINCIPAL, "") is not None


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


# Origins a browser-like client on this machine sends: desktop app shells and editor webviews (as Ollama allows).
LOCAL_APP_SCHEMES = frozenset({"app", "file", "tauri", "vscode-webview", "vscode-file"})


def is_allowed_origin(origin: str, configured: list[str]) -> bool:
    """A page may call the API when its origin is configured (LOCALAI_ORIGINS, ``*`` for any), is served from
    this machine's loopback, or is a local app shell; any other website is refused, whatever it sends."""
    if origin in configured or "*" in configured:
        return True
    scheme, sep, rest = origin.partition("://")
    if not sep:
        return False
    if scheme.lower() in LOCAL_APP_SCHEMES:
        return True
    return scheme.lower() in ("http", "https") and "/" not in rest and is_loopback_host(rest)


class GuardMiddleware:
    """Refuses foreign Host headers while bound to loopback, pages from foreign origins, and TCP requests
    without the API key."""

    def __init__(self, app: ASGIApp, *, loopback_only: bool, api_key: str | None = None,
                 keys: KeyRing | None = None, origins: list[str] | None = None) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.keys = keys if keys is not None else KeyRing([api_key] if api_key else [])
        self.origins = origins or []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or is_unix_socket(scope):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")

        async def refuse(status: int, kind: str, message: str) -> None:
            if scope["type"] == "websocket":  # closed before the handshake completes: the client sees a 403
                await receive()
                await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            else:
                await _refuse(scope, send, status, kind, message, close=has_body(headers))

        if self.loopback_only and not is_loopback_host(host):
            await refuse(403, "permission_error",
                         f"host {host!r} is not allowed: localai answers only loopback names (DNS rebinding guard)")
            return
        origin = headers.get("origin")
        if origin is not None and not is_allowed_origin(origin, self.origins):  # a web page's WebSocket too
            await refuse(403, "permission_error",
                         f"origin {origin[:200]!r} is not allowed: add it to LOCALAI_ORIGINS to let that page call "
                         "localai")
            return
        if self.keys.required:
            supplied = headers.get("x-api-key") or ""
            authorization = headers.get("authorization", "")
            if authorization.lower().startswith("bearer "):
                supplied = authorization[7:].strip()
            principal = self.keys.principal(supplied)
            if principal is None and scope.get("method") != "OPTIONS" and scope["path"] not in OPEN_PATHS:
                await refuse(401, "authentication_error",
                             "missing or wrong API key: send it as 'Authorization: Bearer <LOCALAI_API_KEY>'")
                return
            scope = {**scope, PRINCIPAL: principal}  # None on the open paths: a caller without a key
        await self.app(scope, receive, send)


def has_body(headers: dict[str, str]) -> bool:
    """Whether a request says a body follows its headers: a refusal that does not read it closes the connection,
    so none of its bytes (nor, where its length is ambiguous, a request smuggled in them) is read as the next
    request."""
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("", "0")


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


_THREADED_BODY = 256 << 10  # bodies larger than this are checked off the event loop
_RELEASE_EVERY = 1.0  # seconds after refusing a large body (the last of a burst) that its memory is handed back


async def checked_json(body: bytes | str, checker: BodyChecker) -> Any:
    """A JSON body (or WebSocket message) checked against ``limits.py`` and parsed, None when it is not JSON;
    raises BodyProblem or ServerBusy when it is refused. A large one is checked in ``checker``'s process first, so
    the event loop never waits on more than a small body's parse (or one within the limits)."""
    size = len(body)
    if size > LARGE:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        await checker.check(data)
        try:
            return await asyncio.to_thread(limits.parse, data)  # it passed the limits: its parse is bounded
        except ValueError as exc:  # refused here: the handler would parse all of it again on the event loop
            raise BodyProblem(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if size > _THREADED_BODY:
        return await asyncio.to_thread(check_json, body)
    return check_json(body)


class BodyGuardMiddleware:
    """Reads request bodies up to ``max_bytes`` (413 beyond) and refuses JSON no handler can use or that is too
    big in its counts (``limits.py``: 400 or 413), so a 65 MB message, a ``"\\ud800"`` or 200,000 messages never
    reach a handler, a template or a worker. A large body is checked in a checker process (``body_check.py``),
    a middling one on a thread, a small one here; what passes is parsed once and handed to the handlers
    (``ParsedBodyRoute``). The body is then replayed to the app, and later ``receive`` calls go to the server, so
    handlers still see the client disconnect."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, checker: BodyChecker | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.checker = checker or BodyChecker()
        self._release_pending = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and {b"content-length", b"transfer-encoding"} <= {k.lower() for k, _ in
                                                                                    scope["headers"]}:
            # where its body ends is ambiguous (a proxy may read it otherwise: request smuggling): refused, and the
            # connection closed, so bytes after it are never read as another request (RFC 9112 6.3)
            await _refuse(scope, send, 400, "invalid_request_error", "a request may not have both Content-Length and "
                          "Transfer-Encoding headers", close=True)
            return
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        if body and headers.get("content-type", "").startswith("application/json"):
            try:
                value = await checked_json(body, self.checker)
            except BodyProblem as exc:
                kind = "request_too_large" if exc.status == 413 else "invalid_request_error"
                await _refuse(scope, send, exc.status, kind, str(exc))
                self._release_after(len(body))
                return
            except ServerBusy as exc:
                await _refuse(scope, send, 503, "overloaded_error", exc.message)
                return
            if value is not None:
                scope = {**scope, limits.PARSED: value}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _release_after(self, size: int) -> None:
        """After refusing a large body, hand the memory it took back to the system: once, a moment after the last
        of a burst of them."""
        if size <= _THREADED_BODY or self._release_pending:
            return
        self._release_pending = True
        loop = asyncio.get_running_loop()

        def release() -> None:
            self._release_pending = False
            loop.run_in_executor(None, release_memory)

        loop.call_later(_RELEASE_EVERY, release)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        await _refuse(scope, send, 413, "request_too_large",
                      f"the request body is over {self.max_bytes} bytes (LOCALAI_MAX_REQUEST_BYTES)")


async def _refuse(scope: Scope, send: Send, status: int, kind: str, message: str, *, close: bool = False) -> None:
    from localai.api.errors import error_body

    body = json.dumps(error_body(scope["path"], message, kind, status)).encode()
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


