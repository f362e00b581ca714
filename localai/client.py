"""The CLI's and TUI's client: httpx over the daemon's Unix socket, starting the daemon when needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Generator
from typing import Any

import httpx

from localai import paths
from localai.errors import DaemonUnavailable, LocalAIError, ModelNotFound

START_TIMEOUT = 60.0


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

    def ensure_running(self) -> None:
        """Start ``localai serve`` in the background unless a daemon already answers."""
        if self.is_running():
            return
        if self.transport is not None:
            raise DaemonUnavailable("the daemon is not answering")
        paths.ensure_home()
        paths.logs_dir().mkdir(parents=True, exist_ok=True)
        log_path = paths.server_log_path()
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "localai", "serve"], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, env=os.environ.copy(),
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.is_running():
                return
            if process.poll() is not None:
                raise DaemonUnavailable(f"the daemon exited with code {process.returncode}; see {log_path}")
            time.sleep(0.1)
        raise DaemonUnavailable(f"the daemon did not start within {START_TIMEOUT:.0f} s; see {log_path}")

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
