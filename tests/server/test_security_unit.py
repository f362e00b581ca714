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
