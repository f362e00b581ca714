"""llama.cpp's RPC backend: a model's layers on other machines' devices, each served by an ``rpc-server``.

The client side registers each server with ggml (``ggml_backend_rpc_add_server``, as llama-server's ``--rpc``
does); its devices then count as offload devices, so placement (``engines/placement.py``) spreads layers over them
by their reported free memory. ggml aborts the whole process when a server cannot be reached or speaks another
protocol version, so each one is first greeted here (the protocol's HELLO) and a failure is an error naming it.

The server side (``python -m localai.engines.llama_rpc``, behind ``localai rpc-server``) is the installed
llama.cpp's own ``ggml_backend_rpc_start_server`` serving this machine's devices. The protocol has no
authentication and no encryption: whoever reaches the port can run graphs on the devices and read their memory.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from localai.engines.llama_devices import libggml
from localai.settings import RPC_PORT, rpc_endpoint_of

# The RPC protocol this llama.cpp speaks: the vendored ggml-rpc.h's RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION (a test
# reads the installed header and checks these). A server answers the HELLO with its own; llama.cpp refuses a
# server whose major version differs or whose minor version is newer.
PROTOCOL = (7, 0, 0)
HELLO = 14  # RPC_CMD_HELLO: "must be always 14"
CAPS = 24  # RPC_CONN_CAPS_SIZE: the transport capabilities both sides send in the HELLO (zeros: plain TCP)
PROBE_TIMEOUT = 5.0

_REGISTERED: dict[str, int] = {}  # endpoint -> its ggml backend registry, once per process


class RpcServerError(RuntimeError):
    """An RPC server that cannot be used: down, not an RPC server, or another protocol version."""


def supported() -> bool:
    """Whether this llama.cpp was built with the RPC backend (``-DGGML_RPC=ON``)."""
    import llama_cpp as L

    return bool(L.llama_supports_rpc())


def _require() -> Any:
    if not supported():
        import llama_cpp as L

        raise RpcServerError(f"the llama.cpp in llama-cpp-python {L.__version__} was built without the RPC backend: "
                             "reinstall it with CMAKE_ARGS=\"-DGGML_RPC=ON\" (`make install` does) to use rpc servers")
    lib = libggml()
    registry = lib.ggml_backend_reg_by_name(b"RPC")
    if not registry:
        raise RpcServerError("llama.cpp says it supports RPC but has no RPC backend registered")
    return lib, registry


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _receive(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed before the answer")
        data += chunk
    return data


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT) -> tuple[int, int, int]:
    """Greet the RPC server at ``endpoint`` as llama.cpp does (its HELLO) and return the protocol version it
    answers; raise ``RpcServerError`` naming it when it is down, mute, not an RPC server, or incompatible."""
    host, port = _split(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.settimeout(timeout)
            connection.sendall(struct.pack("<BQ", HELLO, CAPS) + bytes(CAPS))
            (size,) = struct.unpack("<Q", _receive(connection, 8))
            if size != 4 + CAPS:
                raise RpcServerError(f"rpc server {endpoint} answered the greeting with {size} bytes, not "
                                     f"{4 + CAPS}: not a llama.cpp rpc-server of protocol {PROTOCOL[0]}.x")
            major, minor, patch = _receive(connection, size)[:3]
    except TimeoutError as exc:
        raise RpcServerError(f"rpc server {endpoint} did not answer within {timeout:g} s (an rpc-server serves one "
                             "client at a time: is another llama.cpp using it?)") from exc
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise RpcServerError(f"rpc server {endpoint} cannot be reached: {reason} (is `localai rpc-server` "
                             "running there, and the port open?)") from exc
    if major != PROTOCOL[0] or minor > PROTOCOL[1]:
        import llama_cpp as L

        raise RpcServerError(f"rpc server {endpoint} speaks RPC protocol {major}.{minor}.{patch}; this llama.cpp "
                             f"(llama-cpp-python {L.__version__}) speaks {'.'.join(map(str, PROTOCOL))}: run the "
                             "same llama.cpp version on every machine")
    return major, minor, patch


def add_servers(endpoints: list[str]) -> None:
    """Register each RPC server's devices with ggml (once per process), after greeting it: from then on llama.cpp
    places layers on them (RPC devices first in its list, as llama-server orders them)."""
    if not endpoints:
        return
    lib, registry = _require()
    add = lib.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_rpc_add_server")
    if not add:
        raise RpcServerError("this llama.cpp's RPC backend has no ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
    for endpoint in endpoints:
        if endpoint in _REGISTERED:
            continue
        probe(endpoint)
        server_registry = add_server(endpoint.encode())
        if not server_registry:
            raise RpcServerError(f"llama.cpp could not add rpc server {endpoint}")
        lib.ggml_backend_register(server_registry)
        _REGISTERED[endpoint] = int(server_registry)


def reachable(endpoints: list[str], timeout: float = 2.0) -> list[str]:
    """Why each of ``endpoints`` that cannot be used now cannot (a worker that died asks: did a server go?)."""
    found = []
    for endpoint in endpoints:
        try:
            probe(endpoint, timeout)
        except RpcServerError as exc:
            found.append(str(exc))
    return found


def served_devices(names: list[str]) -> list[int]:
    """The devices a server offers: those named, else every non-CPU device, else the CPU (as llama.cpp's
    rpc-server chooses)."""
    lib = libggml()
    handles = [lib.ggml_backend_dev_get(index) for index in range(lib.ggml_backend_dev_count())]
    by_name = {lib.ggml_backend_dev_name(handle).decode(errors="replace"): handle for handle in handles}
    if names:
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise RpcServerError(f"no device named {', '.join(unknown)}; this machine has {', '.join(by_name)}")
        return [by_name[name] for name in names]
    accelerators = [handle for handle in handles if lib.ggml_backend_dev_type(handle) not in (0, 3)]  # CPU, ACCEL
    return accelerators or [handle for handle in handles if lib.ggml_backend_dev_type(handle) == 0][:1]


def serve(host: str, port: int, *, threads: int, cache_dir: str | None, devices: list[str]) -> None:
    """Serve this machine's devices to other llama.cpp processes until killed (llama.cpp's own server loop)."""
    import llama_cpp as L

    lib, registry = _require()
    start = lib.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_rpc_start_server")
    if not start:
        raise RpcServerError("this llama.cpp's RPC backend has no ggml_backend_rpc_start_server")
    L.llama_backend_init()
    chosen = served_devices(devices)
    array = (ctypes.c_void_p * len(chosen))(*chosen)
    start_server = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_void_p))(start)
    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    endpoint = rpc_endpoint_of(host, port)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the C loop never returns to Python: Ctrl-C ends the process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()
    start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, len(chosen), array)
    raise RpcServerError(f"llama.cpp's RPC server stopped: could it bind {endpoint}? (see the lines above)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localai.engines.llama_rpc")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=RPC_PORT)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--device", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, threads=args.threads, cache_dir=args.cache_dir, devices=args.device)
    except RpcServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
