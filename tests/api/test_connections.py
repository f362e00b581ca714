"""Connections that never finish their headers are closed at a deadline, and only so many may wait: a real uvicorn
server with the daemon's protocol (``api/connections.py``), raw sockets as the slow clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from localai.api.connections import DeadlineProtocol
from tests.conftest import free_port, start_daemon
from tests.observe import wait_for


async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    if scope["type"] == "websocket":  # an echo socket
        while True:
            message = await receive()  # type: ignore[operator]
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.accept"})  # type: ignore[operator]
            elif message["type"] == "websocket.receive":
                await send({"type": "websocket.send", "text": message.get("text")})  # type: ignore[operator]
            else:
                return
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(DeadlineProtocol, "header_seconds", 1.0)
    monkeypatch.setattr(DeadlineProtocol, "body_seconds", 1.0)
    monkeypatch.setattr(DeadlineProtocol, "max_waiting", 5)
    port = free_port()
    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=DeadlineProtocol,
                                             log_level="warning", lifespan="off"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    wait_for(lambda: instance.started, "the server to start", timeout=10)
    yield port
    instance.should_exit = True
    thread.join(10)


def slow_client(port: int) -> socket.socket:
    """A connection that sends half a request line and never the rest."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    sock.settimeout(15)
    return sock


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection before the socket's timeout."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_never_finishes_its_headers_is_closed(server: int) -> None:
    sock = slow_client(server)
    assert closed(sock)  # within the deadline (1 s here), not never
    sock.close()
    assert httpx.get(f"http://127.0.0.1:{server}/").text == "ok"


def test_only_so_many_connections_wait_for_their_headers(server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight slow clients, room for five: the sixth, seventh and eighth close the three waiting longest. The header
    deadline is a minute here, so nothing else can close them during the test."""
    monkeypatch.setattr(DeadlineProtocol, "header_seconds", 60.0)
    clients = [slow_client(server) for _ in range(8)]
    for sock in clients[:3]:
        assert closed(sock)  # closed to make room (each recv returns once the server has taken a later client)
    assert len(DeadlineProtocol.waiting) == 5  # all eight were taken: the five latest wait
    for sock in clients[3:]:
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # still open, nothing sent: waiting for its headers
            sock.recv(1024)
    with httpx.Client() as http:  # a client that sends its request at once still gets in
        assert http.get(f"http://127.0.0.1:{server}/").text == "ok"
    for sock in clients:
        sock.close()


def test_a_keep_alive_connection_waits_for_its_next_headers_again(server: int) -> None:
    sock = socket.create_connection(("127.0.0.1", server))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(15)
    answer = b""
    while not answer.endswith(b"0\r\n\r\n"):  # the end of the chunked body
        answer += sock.recv(4096)
    assert b"200 OK" in answer
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127")  # the next request, never finished
    assert closed(sock)
    sock.close()


def test_a_body_that_never_finishes_arriving_is_cut_on_a_real_daemon(tmp_path: Path) -> None:
    """A client that sends its headers, then its body a byte at a time and never all of it: the daemon closes the
    connection at LOCALAI_BODY_TIMEOUT (1 s here), and keeps serving."""
    with start_daemon(tmp_path / "home", body_timeout="1") as daemon:
        sock = socket.create_connection(("127.0.0.1", daemon.port))
        sock.sendall(b"POST /api/show HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        sock.settimeout(1.0)
        cut = False
        for _ in range(60):  # a byte a second, as a slow client sends them; the deadline ends it long before
            try:
                if sock.recv(1024) == b"":
                    cut = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                cut = True
                break
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
        sock.close()
        assert cut, "the slow body's connection was never closed"
        assert "LOCALAI_BODY_TIMEOUT" in daemon.log()
        assert daemon.get("/health").status_code == 200


def test_a_request_with_both_content_length_and_transfer_encoding_is_refused_and_closed(tmp_path: Path) -> None:
    """RFC 9112: where such a body ends is ambiguous (request smuggling), so it gets a 400 and the connection is
    closed; the bytes after it are never answered as a second request."""
    with start_daemon(tmp_path / "home") as daemon:
        sock = socket.create_connection(("127.0.0.1", daemon.port))
        sock.sendall(b"POST /api/show HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"0\r\n\r\nGET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        sock.settimeout(30)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400 ") and b"Content-Length and Transfer-Encoding" in answer, answer
    assert answer.count(b"HTTP/1.1") == 1, answer  # the smuggled GET was not served


def test_a_websocket_outlives_the_header_and_body_deadlines(server: int) -> None:
    """The upgrade hands the connection to the WebSocket protocol while h11 still waits for the request's body: the
    deadlines end there (they closed every Codex socket 60 s after its handshake)."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server}/socket") as ws:
        time.sleep(2.5)  # past both deadlines (1 s each here): what is asserted is that nothing closes it
        ws.send("still here")
        assert ws.recv(timeout=5) == "still here"
