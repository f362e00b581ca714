"""The request body guard, without a daemon."""

from __future__ import annotations

import pytest

from localai.api.security import BodyProblem, check_json, is_allowed_origin


@pytest.mark.parametrize(("body", "message"), [
    (b'{"a":"\\ud800"}', "surrogate"),
    (b'{"a":["\\udc00x"]}', "surrogate"),
    (b'{"\\ud800":1}', "surrogate"),
    (b'{"a":1e400}', "out of range"),
    (b'{"a":-1e400}', "out of range"),
    (b'{"a":NaN}', "not a JSON number"),
    (b'{"a":Infinity}', "not a JSON number"),
    (b'{"a":' + b"9" * 30 + b"}", "out of range"),
    (b"[" * 150 + b"]" * 150, "nested"),
    (b"[" * 50_000 + b"]" * 50_000, "nested"),
])
def test_unusable_json_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(BodyProblem, match=message):
        check_json(body)


@pytest.mark.parametrize("body", [
    b'{"a":"\\\\ud800"}',  # an escaped backslash: the text \ud800, not a surrogate
    b'{"a":"\\ud83d\\ude00"}',  # a proper pair: an emoji
    b'{"a":1.5e300,"b":-7,"c":true,"d":null}',
    b"[" * 99 + b"]" * 99,
    b"not json at all",  # left to the handler's own validation
])
def test_usable_json_passes(body: bytes) -> None:
    check_json(body)


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://localhost:3000", True),
    ("https://127.0.0.1", True),
    ("http://[::1]:8080", True),
    ("http://app.localhost", True),
    ("vscode-webview://abc123", True),
    ("tauri://localhost", True),
    ("http://configured.test", True),
    ("http://evil.example", False),
    ("https://localhost.evil.example", False),
    ("http://127.0.0.1.evil.example", False),
    ("http://localhost/../evil", False),
    ("null", False),  # sandboxed iframes and data: pages
    ("", False),
    ("localhost", False),
])
def test_origins_from_this_machine_pass_and_websites_do_not(origin: str, allowed: bool) -> None:
    assert is_allowed_origin(origin, ["http://configured.test"]) is allowed
    assert is_allowed_origin(origin, ["*"]) is True


def test_a_websocket_without_the_api_key_is_refused_at_the_handshake() -> None:
    """The guard runs for WebSocket scopes too: over TCP, no key (or a wrong one) closes with 1008 before the
    handshake completes; the right key (as a bearer token) reaches the app."""
    import asyncio

    from localai.api.security import GuardMiddleware

    reached: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        reached.append(scope["path"])

    def attempt(headers: list[tuple[bytes, bytes]]) -> list[dict]:  # type: ignore[type-arg]
        sent: list[dict] = []  # type: ignore[type-arg]

        async def receive() -> dict:  # type: ignore[type-arg]
            return {"type": "websocket.connect"}

        async def send(message: dict) -> None:  # type: ignore[type-arg]
            sent.append(message)

        scope = {"type": "websocket", "path": "/v1/responses", "server": ("127.0.0.1", 11434),
                 "headers": [(b"host", b"127.0.0.1:11434"), *headers]}
        asyncio.run(GuardMiddleware(app, loopback_only=True, api_key="sekret")(scope, receive, send))  # type: ignore[arg-type]
        return sent

    for headers in ([], [(b"authorization", b"Bearer wrong")]):
        sent = attempt(headers)
        assert sent and sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1008
        assert "API key" in sent[0]["reason"]
    assert not reached
    assert attempt([(b"authorization", b"Bearer sekret")]) == [] and reached == ["/v1/responses"]
