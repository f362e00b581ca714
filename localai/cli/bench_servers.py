"""Servers that ``localai bench agents`` starts and stops itself: a localai daemon and llama-cpp-python's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import TracebackType

import httpx

from localai.errors import DaemonUnavailable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DaemonUnavailable(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise DaemonUnavailable(f"the server at {url} did not start within {timeout:.0f} s")


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ManagedDaemon:
    """A ``localai serve`` with its own home and port, which the benchmark can restart."""

    def __init__(self, home: str, source: str | None = None) -> None:
        self.home = home
        self.source = source  # a FROM for models this fresh home does not have (an MLX folder, a GGUF)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.last_load_seconds = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        env = {**os.environ, "LOCALAI_HOME": self.home, "LOCALAI_HOST": f"127.0.0.1:{self.port}",
               "LOCALAI_KEEP_ALIVE": "-1"}
        os.makedirs(self.home, exist_ok=True)
        log = open(os.path.join(self.home, "daemon.log"), "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen([sys.executable, "-m", "localai", "serve"], env=env, stdout=log, stderr=log)
        wait_healthy(f"http://127.0.0.1:{self.port}/health", self.process)

    def restart(self) -> None:
        stop_process(self.process)
        self.start()

    def warm_up(self, model: str) -> None:
        with httpx.Client(timeout=300) as http:
            if self.source and http.post(f"http://127.0.0.1:{self.port}/api/show",
                                         json={"model": model}).status_code == 404:
                http.post(f"http://127.0.0.1:{self.port}/api/create",
                          json={"model": model, "modelfile": f"FROM {self.source}"}).raise_for_status()
        started = time.perf_counter()
        with httpx.Client(timeout=300) as http:
            http.post(f"http://127.0.0.1:{self.port}/api/generate", json={"model": model}).raise_for_status()
        self.last_load_seconds = time.perf_counter() - started

    def model_path(self, model: str) -> str:
        response = httpx.post(f"http://127.0.0.1:{self.port}/api/show", json={"model": model}, timeout=30)
        return str(response.json()["path"])

    def __enter__(self) -> ManagedDaemon:
        self.start()
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        stop_process(self.process)


class LlamaCppPythonServer:
    """``python -m llama_cpp.server`` on the same GGUF, context and threads (needs llama-cpp-python[server])."""

    def __init__(self, model_path: str, n_ctx: int = 8192) -> None:
        self.model_path = model_path
        self.n_ctx = n_ctx
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> LlamaCppPythonServer:
        threads = os.environ.get("LOCALAI_NUM_THREAD") or str(os.cpu_count() or 1)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", self.model_path, "--n_ctx", str(self.n_ctx),
             "--n_threads", threads, "--n_threads_batch", threads, "--port", str(self.port), "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_healthy(f"http://127.0.0.1:{self.port}/v1/models", self.process)
        return self

    def warm_up(self) -> None:
        httpx.post(f"{self.base_url}/chat/completions", timeout=300,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).raise_for_status()

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        stop_process(self.process)


class MlxLmServer:
    """mlx-lm's own server (``python -m mlx_lm server``, with its LRU prompt cache) on the same MLX folder.

    Its requests name the folder as the model (mlx-lm loads the ``model`` a request names)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> MlxLmServer:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm", "server", "--model", self.model_path, "--port", str(self.port),
             "--host", "127.0.0.1", "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_healthy(f"http://127.0.0.1:{self.port}/v1/models", self.process)
        return self

    def warm_up(self) -> None:
        httpx.post(f"{self.base_url}/chat/completions", timeout=300,
                   json={"model": self.model_path, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 1}).raise_for_status()

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        stop_process(self.process)
