"""``localai serve``: bind the Unix socket and the loopback TCP port, and serve the API on both."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import logging.handlers
import os
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType

import uvicorn
import uvicorn.config

from localai import paths
from localai.api.app import create_app
from localai.api.body_check import map_large_blocks
from localai.api.connections import HeaderDeadlineProtocol
from localai.errors import DaemonUnavailable
from localai.models import renderer
from localai.models.registry import Registry
from localai.runtime.runtime import Runtime
from localai.settings import Settings
from localai.workers.scheduler import Scheduler

log = logging.getLogger("localai.daemon")
# From SIGTERM (or Ctrl-C) to exit, whatever is still running: open connections get 5 s, replies being prefilled 10 s,
# then workers write their queued cache entries; what is not done by then is killed (systemd's unit allows 30 s).
SHUTDOWN_GRACE = 25.0


def bind_unix_socket(path: Path) -> socket.socket:
    """Bind the daemon's socket with mode 0600; refuse when another daemon answers on it."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: its daemon is gone
        else:
            raise DaemonUnavailable(f"another localai daemon is already serving on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP. Without it, Nagle holds a
    # stream's first chunk behind its headers until the client's delayed ACK (40 ms on Linux) on some requests.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DaemonUnavailable(
                f"{host}:{port} is already in use; is another localai running? set LOCALAI_HOST to another port"
            ) from exc
        raise DaemonUnavailable(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _discover(registry: Registry, sources: list[str]) -> None:
    """Register the models Ollama, LM Studio and the Hugging Face cache hold (on a thread: it may hash a file)."""
    from localai.models import discover

    try:
        discover.sync(registry.reopen(), sources)
    except Exception:
        log.exception("could not look for models already on this disk")


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)


class Server(uvicorn.Server):
    """uvicorn's server, with a deadline on its shutdown: ``SHUTDOWN_GRACE`` after the first signal the process
    kills its workers and render processes, removes its files and exits, whatever still runs (a wedged engine, a
    thread that never returns)."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._deadline: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is None:
            self._deadline = threading.Thread(target=self._exit_at_deadline, name="shutdown-deadline", daemon=True)
            self._deadline.start()
        super().handle_exit(sig, frame)

    def _exit_at_deadline(self) -> None:
        time.sleep(SHUTDOWN_GRACE)
        log.error("the daemon did not stop within %.0f s of the signal; killing its workers and exiting",
                  SHUTDOWN_GRACE)
        for loaded in list(self.runtime.scheduler.loaded.values()):
            pid = loaded.worker.pid
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            renderer.shutdown()
        _remove_files()
        logging.shutdown()
        os._exit(1)


def _remove_files() -> None:
    for path in (paths.socket_path(), paths.pid_path(), paths.address_path()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def serve(settings: Settings, log_file: Path | None = None) -> None:
    """Run the daemon until SIGINT/SIGTERM; workers are stopped on the way out. With ``log_file`` its log
    (uvicorn's included) goes to that file, rotated at 10 MiB with three old files kept."""
    handlers: list[logging.Handler] | None = None
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers = [logging.handlers.RotatingFileHandler(log_file, maxBytes=paths.LOG_MAX_BYTES,
                                                         backupCount=paths.LOG_BACKUPS)]
    logging.basicConfig(
        level=logging.DEBUG if settings.debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=handlers,
    )
    if not settings.debug:  # a line per upstream request (remote models, pulls) would drown the log
        logging.getLogger("httpx").setLevel(logging.WARNING)
    os.umask(0o077)  # conversations, prompt caches and logs are the user's alone (workers inherit this)
    map_large_blocks()  # a refused 20 MB body's memory goes back to the system
    paths.ensure_home()
    registry = Registry.open()
    try:
        registry.ensure_embedded()
    except Exception:
        log.exception("could not register the embedded model")
    if settings.discover:
        threading.Thread(target=_discover, args=(registry, settings.discover), name="discover", daemon=True).start()
    runtime = Runtime(settings, registry, Scheduler(settings))
    try:
        app = create_app(settings, runtime)
    except ValueError as exc:  # an API key file that cannot be read: never serve without the keys asked for
        raise DaemonUnavailable(str(exc)) from exc
    host, port = settings.bind
    tcp = bind_tcp(host, port)
    unix = bind_unix_socket(paths.socket_path())
    config = uvicorn.Config(app, http=HeaderDeadlineProtocol, log_level="debug" if settings.debug else "warning",
                            access_log=settings.debug,
                            timeout_graceful_shutdown=5, ws_max_size=settings.max_request_bytes,
                            log_config=None if log_file is not None else uvicorn.config.LOGGING_CONFIG)
    server = Server(config, runtime)
    paths.pid_path().write_text(str(os.getpid()))
    paths.address_path().write_text(settings.base_url)  # `localai launch` hands this URL to agents
    log.info("localai listening on http://%s:%s and %s", host, port, paths.socket_path())
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: with the
    # default one the process died there, leaving its pid file and socket behind (what a service manager sends)
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        asyncio.run(server.serve(sockets=[tcp, unix]))
    finally:
        renderer.shutdown()
        _remove_files()
