"""The CLI's and TUI's clients: httpx over the daemon's Unix socket, starting the daemon when needed.

``Client`` is synchronous (the CLI); ``AsyncClient`` is its asyncio twin (the TUI, whose screens must never
block). Both take an httpx transport, so tests can swap the I/O seam.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from typing import Any

import httpx

from localai import paths
from localai.errors import DaemonUnavailable, LocalAIError, ModelNotFound

START_TIMEOUT = 60.0
STOP_TIMEOUT = 90.0  # the daemon gives its workers up to 60 s each to write their queued cache entries


def human_size(size: int) -> str:
    """Bytes as a person reads them (decimal units, as Ollama shows sizes): the CLI's and the TUI's tables."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


class APIError(LocalAIError):
    """An error response from the daemon, carrying its status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status


class Client:
    """Talks to the daemon. Takes an httpx transport so tests can swap the I/O seam."""

    def __init__(self, transport: httpx.BaseTransport | None = None, base_url: str = "http://localhost") -> None:
        self.transport = transport
        self.base_url = base_url

    def _http(self, timeout: float | None = 30.0) -> httpx.Client:
        transport = self.transport or httpx.HTTPTransport(uds=str(paths.socket_path()))
        return httpx.Client(transport=transport, base_url=self.base_url, timeout=timeout)

    # -- daemon lifecycle -------------------------------------------------------------------------

    def is_running(self) -> bool:
        if self.transport is None and not paths.socket_path().exists():
            return False
        try:
            with self._http(timeout=2.0) as http:
                return http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict[str, Any] | None:
        """The daemon's ``/health`` (its pid, home, URL and start time among it), or None when none answers."""
        if self.transport is None and not paths.socket_path().exists():
            return None
        try:
            with self._http(timeout=2.0) as http:
                response = http.get("/health")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            body = response.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def stop_daemon(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """Stop the daemon of this home as a service manager does (SIGTERM: it unloads its workers, which write
        their queued cache entries first), and wait until it has exited. Returns its pid; None when none ran."""
        health = self.health()
        pid = health.get("pid") if health is not None else _unanswering_daemon()
        if health is None and pid is None:
            return None
        if not isinstance(pid, int) or pid <= 0:
            raise DaemonUnavailable("the daemon did not say its pid (a localai older than this one?); stop it "
                                    f"where it runs, or: kill $(cat {paths.pid_path()})")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return pid  # it exited just now
        except PermissionError as exc:
            raise DaemonUnavailable(f"the daemon (pid {pid}) belongs to another user; stop it as that user") from exc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not paths.process_alive(pid):
                return pid
            time.sleep(0.1)
        raise DaemonUnavailable(f"the daemon (pid {pid}) is still stopping after {timeout:.0f} s (its workers "
                                f"write their prompt caches first); see {paths.server_log_path()}, or end it "
                                f"at once: kill -9 {pid}")

    def ensure_running(self) -> None:
        """Start ``localai serve`` in the background unless a daemon already answers."""
        if self.is_running():
            return
        if self.transport is not None:
            raise DaemonUnavailable("the daemon is not answering")
        process = spawn_daemon()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.is_running():
                return
            _check_alive(process)
            time.sleep(0.1)
        raise _start_timeout()

    # -- requests -------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            with self._http(timeout=None) as http:
                response = http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc}") from exc
        if response.status_code >= 400:
            raise _api_error(response.status_code, response.read())
        return response.json() if response.content else {}

    def stream(self, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> Generator[dict[str, Any], None, None]:
        """Yield NDJSON objects from a streaming Ollama-native endpoint. Closing it cancels the request."""
        try:
            with self._http(timeout=None) as http, http.stream("POST", path, json=body,
                                                               headers=headers) as response:
                if response.status_code >= 400:
                    raise _api_error(response.status_code, response.read())
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if "error" in item:
                        raise APIError(500, item["error"])
                    yield item
        except httpx.HTTPError as exc:
            raise DaemonUnavailable(f"lost the connection to the daemon: {exc}") from exc


class AsyncClient:
    """The asyncio twin of :class:`Client`, for the TUI: one pooled connection set, closed by ``aclose()``.

    Cancelling the task that iterates :meth:`stream` closes the response, which cancels the request in the
    daemon (a generation stops decoding, a pull stops downloading).
    """

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None, base_url: str = "http://localhost",
                 timeout: float = 30.0) -> None:
        self.transport = transport
        self.base_url = base_url
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            transport = self.transport or httpx.AsyncHTTPTransport(uds=str(paths.socket_path()))
            self._client = httpx.AsyncClient(transport=transport, base_url=self.base_url,
                                             timeout=httpx.Timeout(self.timeout, connect=5.0))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- daemon lifecycle -------------------------------------------------------------------------

    async def is_running(self) -> bool:
        if self.transport is None and not paths.socket_path().exists():
            return False
        try:
            response = await self._http().get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def ensure_running(self) -> None:
        """Start ``localai serve`` in the background unless a daemon already answers."""
        if await self.is_running():
            return
        if self.transport is not None:
            raise DaemonUnavailable("the daemon is not answering")
        process = await asyncio.to_thread(spawn_daemon)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if await self.is_running():
                return
            _check_alive(process)
            await asyncio.sleep(0.1)
        raise _start_timeout()

    # -- requests -------------------------------------------------------------------------------

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                      timeout: float | None = None) -> Any:
        """One JSON request; ``timeout`` None keeps the client's default."""
        response = await self._send(method, path, body, timeout)
        return response.json() if response.content else {}

    async def text(self, path: str) -> str:
        """A GET whose answer is text (``/metrics``)."""
        return (await self._send("GET", path, None, None)).text

    async def _send(self, method: str, path: str, body: dict[str, Any] | None, timeout: float | None) -> httpx.Response:
        try:
            response = await self._http().request(method, path, json=body,
                                                  timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {_describe(exc)}") from exc
        if response.status_code >= 400:
            raise _api_error(response.status_code, response.content)
        return response

    async def stream(self, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Yield NDJSON objects from a streaming Ollama-native endpoint, with no read timeout."""
        try:
            async with self._http().stream("POST", path, json=body, headers=headers,
                                           timeout=httpx.Timeout(None, connect=5.0)) as response:
                if response.status_code >= 400:
                    raise _api_error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if "error" in item:
                        raise APIError(500, item["error"])
                    yield item
        except httpx.HTTPError as exc:
            raise DaemonUnavailable(f"lost the connection to the daemon: {_describe(exc)}") from exc


def spawn_daemon() -> subprocess.Popen[bytes]:
    """``localai serve`` in the background, in its own session, logging to the server log."""
    paths.ensure_home()
    paths.logs_dir().mkdir(parents=True, exist_ok=True)
    paths.rotate_log(paths.server_log_path())
    with open(paths.server_log_path(), "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "localai", "serve"], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, env=os.environ.copy(),
        )


def _unanswering_daemon() -> int | None:
    """The pid in this home's pid file when it is this home's live daemon that does not answer (stopped, or stuck):
    the process holds this home's socket. None otherwise: no file, a stale one, a pid reused by another program or
    by another home's daemon (Linux only, where /proc tells)."""
    try:
        pid = int(paths.pid_path().read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if paths.process_alive(pid) and holds_socket(pid, paths.socket_path()) else None


def holds_socket(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has the Unix socket bound at ``path`` open (Linux's /proc; False elsewhere)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return False
    inodes = {f"socket:[{fields[6]}]" for fields in (line.split() for line in lines)
              if len(fields) >= 8 and fields[7] == str(path)}
    if not inodes:
        return False
    try:
        return any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # another user's process, or one that just exited
        return False


def probe(url: str) -> dict[str, Any] | None:
    """What answers ``/health`` at a daemon URL (``http://HOST:PORT``): a localai's health body, or None."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/health", timeout=2.0)
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("status") == "ok" and "version" in body else None


def _check_alive(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        raise DaemonUnavailable(f"the daemon exited with code {process.returncode}; see {paths.server_log_path()}")


def _start_timeout() -> DaemonUnavailable:
    return DaemonUnavailable(f"the daemon did not start within {START_TIMEOUT:.0f} s; see {paths.server_log_path()}")


def _describe(exc: httpx.HTTPError) -> str:
    return str(exc) or type(exc).__name__


def _api_error(status: int, content: bytes) -> LocalAIError:
    try:
        payload = json.loads(content)
        error = payload.get("error", payload)
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = content.decode(errors="replace") or f"HTTP {status}"
    if status == 404:
        return ModelNotFound(message)
    return APIError(status, message)
