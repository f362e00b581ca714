"""llama.cpp's RPC backend, the parts that need no model: the greeting that finds a server down, mute, foreign or
of another protocol version before ggml would abort the worker over it; the protocol version against the installed
header; the addresses a Modelfile and LOCALAI_RPC_SERVERS take."""

from __future__ import annotations

import re
import socket
import struct
import sysconfig
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from localai.engines import llama_rpc
from localai.errors import ModelfileError
from localai.models.modelfile import parse
from localai.settings import Settings, rpc_endpoint


@contextmanager
def fake_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback server whose one connection gets ``answer``; yields its endpoint."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def serve() -> None:
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        with connection:
            answer(connection)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        listener.close()
        thread.join(timeout=5)


def hello_answer(major: int, minor: int, patch: int) -> Callable[[socket.socket], None]:
    """An rpc-server's answer to the HELLO with the given version (what llama.cpp's own sends, caps zero)."""
    def answer(connection: socket.socket) -> None:
        request = b""
        while len(request) < 1 + 8 + llama_rpc.CAPS:
            request += connection.recv(64)
        command, size = struct.unpack("<BQ", request[:9])
        assert (command, size) == (llama_rpc.HELLO, llama_rpc.CAPS)
        connection.sendall(struct.pack("<Q", 4 + llama_rpc.CAPS) + bytes([major, minor, patch, 0])
                           + bytes(llama_rpc.CAPS))
    return answer


def test_the_protocol_version_is_the_installed_headers() -> None:
    header = Path(sysconfig.get_paths()["purelib"]) / "include" / "ggml-rpc.h"
    if not header.exists():
        pytest.skip(f"llama-cpp-python installed no {header}")
    text = header.read_text()
    found = tuple(int(re.search(rf"RPC_PROTO_{part}_VERSION\s+(\d+)", text)[1])  # type: ignore[index]
                  for part in ("MAJOR", "MINOR", "PATCH"))
    assert found == llama_rpc.PROTOCOL
    assert "RPC_CONN_CAPS_SIZE" not in text  # private to ggml-rpc; CAPS is checked against a live server below


def test_a_server_of_this_version_answers_the_greeting() -> None:
    with fake_server(hello_answer(*llama_rpc.PROTOCOL)) as endpoint:
        assert llama_rpc.probe(endpoint) == llama_rpc.PROTOCOL


def test_another_major_version_or_a_newer_minor_is_refused_naming_both() -> None:
    major, minor, _ = llama_rpc.PROTOCOL
    for version in ((major + 1, 0, 0), (major - 1, 9, 1), (major, minor + 1, 0)):
        with fake_server(hello_answer(*version)) as endpoint, pytest.raises(llama_rpc.RpcServerError) as caught:
            llama_rpc.probe(endpoint)
        message = str(caught.value)
        assert endpoint in message and ".".join(map(str, version)) in message
        assert ".".join(map(str, llama_rpc.PROTOCOL)) in message and "same llama.cpp version" in message


def test_an_older_minor_version_is_accepted_as_llama_cpp_accepts_it() -> None:
    major, _, _ = llama_rpc.PROTOCOL
    with fake_server(hello_answer(major, 0, 7)) as endpoint:
        assert llama_rpc.probe(endpoint) == (major, 0, 7)


def test_a_server_that_is_down_is_named_with_the_reason() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(llama_rpc.RpcServerError, match=rf"rpc server 127.0.0.1:{port} cannot be reached: .*refused"):
        llama_rpc.probe(f"127.0.0.1:{port}")
    assert llama_rpc.reachable([f"127.0.0.1:{port}"]) != []


def test_a_server_that_never_answers_times_out_naming_the_likely_cause() -> None:
    held = threading.Event()
    with fake_server(lambda connection: held.wait(5)) as endpoint:
        with pytest.raises(llama_rpc.RpcServerError, match=r"did not answer within 0\.3 s.*one client at a time"):
            llama_rpc.probe(endpoint, timeout=0.3)
        held.set()


def test_something_that_is_not_an_rpc_server_is_refused() -> None:
    def http(connection: socket.socket) -> None:
        connection.recv(64)
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    with fake_server(http) as endpoint, pytest.raises(llama_rpc.RpcServerError, match=r"not a llama\.cpp rpc-server"):
        llama_rpc.probe(endpoint)

    def hang_up(connection: socket.socket) -> None:
        connection.recv(64)

    with fake_server(hang_up) as endpoint, pytest.raises(llama_rpc.RpcServerError, match="cannot be reached"):
        llama_rpc.probe(endpoint)


@pytest.mark.parametrize("text, expected", [("127.0.0.1:50052", "127.0.0.1:50052"),
                                            (" gpu-box:50053 ", "gpu-box:50053"),
                                            ("[::1]:50052", "[::1]:50052"), ("10.0.0.2:0050052", "10.0.0.2:50052")])
def test_an_endpoint_is_host_and_port(text: str, expected: str) -> None:
    assert rpc_endpoint(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1", ":50052", "host:", "host:port", "host:70000", "host:0", "::1:50052",
                                  "a b:1", "http://h:1", "h,i:1", "[]:1"])
def test_a_malformed_endpoint_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected host:port"):
        rpc_endpoint(text)


def test_modelfile_rpc_lines_are_checked_and_kept_in_order_once() -> None:
    parsed = parse("FROM x.gguf\nPARAMETER rpc 10.0.0.2:50052\nPARAMETER rpc 10.0.0.3:50052\n"
                   "PARAMETER rpc 10.0.0.2:50052\n")
    assert parsed.parameters["rpc"] == ["10.0.0.2:50052", "10.0.0.3:50052", "10.0.0.2:50052"]
    with pytest.raises(ModelfileError, match="line 2: rpc server 'nowhere': expected host:port"):
        parse("FROM x.gguf\nPARAMETER rpc nowhere\n")


def test_the_setting_is_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALAI_RPC_SERVERS", "10.0.0.2:50052, 10.0.0.3:50053")
    assert Settings().rpc_servers == ["10.0.0.2:50052", "10.0.0.3:50053"]
    monkeypatch.setenv("LOCALAI_RPC_SERVERS", "10.0.0.2")
    with pytest.raises(ValueError, match="expected host:port"):
        Settings()
