"""Servers that ``localai bench agents`` starts and stops itself: a localai daemon and llama-cpp-python's."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import TracebackType
from typing import IO

import httpx

from localai.errors import DaemonUnavailable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 120,
                 statuses: tuple[int, ...] = (200,)) -> None:
    """Wait until ``url`` answers with one of ``statuses`` (401 too for a server that wants a key)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DaemonUnavailable(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code in statuses:
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

    def __init__(self, home: str, source: str | None = None, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = env or {}  # more LOCALAI_* settings
        self.source = source  # a FROM for models this fresh home does not have (an MLX folder, a GGUF)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.last_load_seconds = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        env = {**os.environ, "LOCALAI_HOME": self.home, "LOCALAI_HOST": f"127.0.0.1:{self.port}",
               "LOCALAI_KEEP_ALIVE": "-1", **self.env}
        os.makedirs(self.home, exist_ok=True)
        with open(os.path.join(self.home, "daemon.log"), "ab") as log:  # the child has its own copy
            self.process = subprocess.Popen([sys.executable, "-m", "localai", "serve"], env=env, stdout=log,
                                            stderr=log)
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


def require_program(binary: str, install_hint: str) -> None:
    """A reference server's program is there to start, asked before a benchmark spends minutes on localai's side."""
    if shutil.which(binary) is None:
        raise DaemonUnavailable(f"could not start {binary}: no such program ({install_hint})")


class ReferenceServer:
    """Another project's OpenAI-compatible server, started on a free port for the length of a ``with`` block."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    install_hint = ""

    def threads_arg(self, threads: int | None) -> str:
        """Threads for the server: the benchmark's, else LOCALAI_NUM_THREAD's, else every core."""
        return str(threads or os.environ.get("LOCALAI_NUM_THREAD") or os.cpu_count() or 1)

    def command(self) -> list[str]:
        raise NotImplementedError

    def request_model(self) -> str | None:
        """The ``model`` its requests name (None: it serves one model whatever a request says)."""
        return None

    def __enter__(self) -> ReferenceServer:
        self.start()
        return self

    def start(self) -> None:
        """Start the server (again, on the same port, after ``kill``) and wait until it answers."""
        if self.log is None:
            # the child's stderr: for the error if it does not start, and its statistics
            self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __exit__
        try:
            self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=self.log)
        except OSError as exc:  # not there, or not a program
            self.__exit__()
            raise DaemonUnavailable(f"could not start {self.command()[0]}: {exc.strerror} ({self.install_hint})") \
                from exc
        try:
            wait_healthy(f"http://127.0.0.1:{self.port}/v1/models", self.process, statuses=(200, 401))
        except DaemonUnavailable as exc:
            last = (self.stderr().strip().splitlines() or [""])[-1]
            self.__exit__()
            command = self.command()
            name = command[2] if command[0] == sys.executable else os.path.basename(command[0])
            raise DaemonUnavailable(f"{name}: {exc.message}: {last} ({self.install_hint})") from exc

    def stderr(self) -> str:
        """What the server has written to stderr so far."""
        if self.log is None:
            return ""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode(errors="replace")
        self.log.seek(0, os.SEEK_END)
        return text

    def stop(self) -> None:
        """SIGTERM, waited for; ``start`` brings it back on the same port (its log is kept)."""
        stop_process(self.process)

    def kill(self) -> None:
        """SIGKILL: the server dies the way a crashed machine's does, without closing anything."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def warm_up(self) -> None:
        body: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        if self.request_model() is not None:
            body["model"] = self.request_model()
        httpx.post(f"{self.base_url}/chat/completions", timeout=300, json=body).raise_for_status()

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        stop_process(self.process)
        if self.log is not None:
            self.log.close()
            self.log = None


class LlamaCppPythonServer(ReferenceServer):
    """``python -m llama_cpp.server`` on the same GGUF, context and threads (needs llama-cpp-python[server])."""

    install_hint = "it needs llama-cpp-python[server]: pip install -e '.[bench]', or make bench"

    def __init__(self, model_path: str, n_ctx: int = 8192, *, threads: int | None = None, alias: str | None = None,
                 api_key: str | None = None) -> None:
        super().__init__(model_path)
        self.n_ctx = n_ctx
        self.threads = threads
        self.alias = alias
        self.api_key = api_key

    def command(self) -> list[str]:
        threads = self.threads_arg(self.threads)
        command = [sys.executable, "-m", "llama_cpp.server", "--model", self.model_path, "--n_ctx", str(self.n_ctx),
                   "--n_threads", threads, "--n_threads_batch", threads, "--port", str(self.port),
                   "--host", "127.0.0.1"]
        if self.alias:
            command += ["--model_alias", self.alias]
        if self.api_key:
            command += ["--api_key", self.api_key]
        return command

    def prompt_tokens_evaluated(self) -> int:
        """Prompt tokens the server computed so far (llama.cpp's timing lines; a reused prefix is not counted)."""
        return sum(int(n) for n in re.findall(r"prompt eval time =.*?/\s*(\d+) tokens", self.stderr()))


class LlamaServer(ReferenceServer):
    """llama.cpp's own ``llama-server`` on the same GGUF and threads, with ``parallel`` slots of ``n_ctx`` tokens
    each (``make llama-server`` builds it from the llama.cpp that llama-cpp-python vendors)."""

    install_hint = "build it with `make llama-server` (from the llama.cpp llama-cpp-python vendors)"

    def __init__(self, binary: str, model_path: str, n_ctx: int = 4096, *, threads: int | None = None,
                 parallel: int = 1, extra: tuple[str, ...] = ()) -> None:
        super().__init__(model_path)
        self.binary = binary
        self.n_ctx = n_ctx
        self.threads = threads
        self.parallel = parallel
        self.extra = extra

    def command(self) -> list[str]:
        threads = self.threads_arg(self.threads)
        return [self.binary, "-m", self.model_path, "--host", "127.0.0.1", "--port", str(self.port),
                "-t", threads, "-tb", threads, "-c", str(self.n_ctx * self.parallel), "-np", str(self.parallel),
                "-b", "512", "-ub", "512", "-fa", "off", "--no-webui", *self.extra]


class MlxLmServer(ReferenceServer):
    """mlx-lm's own server (``python -m mlx_lm server``, with its LRU prompt cache) on the same MLX folder.

    Its requests name the folder as the model (mlx-lm loads the ``model`` a request names)."""

    install_hint = "it needs mlx-lm: pip install -e '.[mlx]'"

    def __init__(self, model_path: str, *, decode_concurrency: int | None = None) -> None:
        super().__init__(model_path)
        self.decode_concurrency = decode_concurrency  # its BatchGenerator's sequences at once (None: its default)

    def command(self) -> list[str]:
        concurrency = ["--decode-concurrency", str(self.decode_concurrency)] if self.decode_concurrency else []
        return [sys.executable, "-m", "mlx_lm", "server", "--model", self.model_path, "--port", str(self.port),
                "--host", "127.0.0.1", "--log-level", "WARNING", *concurrency]

    def request_model(self) -> str | None:
        return self.model_path
