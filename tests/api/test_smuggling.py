"""A refusal that leaves a request's body unread closes the connection, whichever guard answers: the bytes after
it (a request smuggled in an ambiguous body, or the body itself) are never read as a next request. A real daemon on
a real socket, raw requests pipelined after the refused one."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest

from tests.conftest import Daemon, start_daemon

SMUGGLED = b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n\r\n"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with start_daemon(tmp_path_factory.mktemp("keyed"), api_key="k") as daemon:
        yield daemon


def exchange(daemon: Daemon, data: bytes) -> list[int]:
    """Send ``data`` on one connection and read until the daemon closes it: the statuses it answered, in order. A
    connection left open fails the test at the socket's timeout instead of hanging it."""
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:
        sock.sendall(data)
        sock.settimeout(30)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the connection was left open after: {answer[:300]!r}")
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


def smuggling(host: bytes, key: bytes) -> bytes:
    """A POST whose body ends at its chunked terminator for one reader and 60 bytes later for another, the second
    request inside it."""
    auth = b"Authorization: Bearer " + key + b"\r\n" if key else b""
    return (b"POST /api/show HTTP/1.1\r\nHost: " + host + b"\r\n" + auth + b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(5 + len(SMUGGLED)).encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\n" + SMUGGLED)


def test_a_smuggling_request_refused_by_the_host_guard_closes_the_connection(keyed: Daemon) -> None:
    assert exchange(keyed, smuggling(b"evil.example", b"k")) == [403]


def test_a_smuggling_request_refused_by_the_key_guard_closes_the_connection(keyed: Daemon) -> None:
    assert exchange(keyed, smuggling(b"127.0.0.1", b"")) == [401]
    assert exchange(keyed, smuggling(b"127.0.0.1", b"wrong")) == [401]


def test_a_smuggling_request_past_the_guards_is_refused_and_closed(keyed: Daemon) -> None:
    assert exchange(keyed, smuggling(b"127.0.0.1", b"k")) == [400]


def test_a_refused_request_with_a_plain_body_closes_the_connection(keyed: Daemon) -> None:
    """Malformed in a quieter way: a body that declares a length longer than what came, the next request's bytes
    inside that length. The refusal does not wait for the rest of it (nor read what came as a request)."""
    body = b'{"model": "x"}' + SMUGGLED
    request = (b"POST /api/show HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body) + 100).encode() + b"\r\n\r\n" + body)
    assert exchange(keyed, request) == [401]


def test_a_refused_request_without_a_body_keeps_the_connection(keyed: Daemon) -> None:
    """Nothing is left unread: the pipelined request after it is answered (the connection is not closed for
    nothing)."""
    assert exchange(keyed, b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                           b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n") == [401, 200]


def test_the_daemon_serves_after_refusing(keyed: Daemon) -> None:
    assert keyed.get("/api/version", headers={"Authorization": "Bearer k"}).status_code == 200
