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
from localai.api.connections import DeadlineProtocol
from localai.client import probe
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
            raise DaemonUnavailable(port_taken(host, port)) from exc
        raise DaemonUnavailable(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(128)
    sock.setblocking(False)
    return sock


def port_taken(host: str, port: int) -> str:
    """Who holds ``host:port``, said so that the user knows what to stop: a localai (its pid and home, which its
    ``/health`` tells loopback clients) or another program (its name and pid, where this system shows it)."""
    other_port = f"or run this one on another port: LOCALAI_HOST=127.0.0.1:{port + 1} localai serve"
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    health = probe(f"http://[{probe_host}]:{port}" if ":" in probe_host else f"http://{probe_host}:{port}")
    if health is not None:
        pid, home = health.get("pid"), health.get("home")
        if not pid or not home:
            return (f"{host}:{port} is already in use by another localai ({health.get('version', '')}, which did not "
                    f"say its pid); stop it where it runs, {other_port}")
        if Path(str(home)) == paths.home():
            return (f"localai is already running for this home (pid {pid}, {home}) on {host}:{port}; "
                    "`localai status` shows it, `localai daemon stop` stops it")
        return (f"{host}:{port} is already in use by another localai (pid {pid}, home {home}); stop it with: "
                f"LOCALAI_HOME={home} localai daemon stop, {other_port}")
    holder = listener(port)
    named = f": {holder[1]} (pid {holder[0]})" if holder else " (not a localai)"
    return f"{host}:{port} is already in use by another program{named}; stop it, {other_port}"


def listener(port: int) -> tuple[int, str] | None:
    """The process listening on TCP ``port``, with its command, when this system lets us see it (Linux's /proc:
    our own processes, or all of them as root); None otherwise."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return int(proc.name), command[:200] or (proc / "comm").read_text().strip()
        except OSError:  # another user's process, or one that just exited
            continue
    return None


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


def write_own_file(path: Path, text: str) -> None:
    """Write one of the daemon's files in its home through a temp file renamed over it: a link planted at ``path``
    is replaced, never followed (its target is left as it was)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)  # a crashed start's (unlink removes a link, never its target)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(temp, path)


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
    config = uvicorn.Config(app, http=DeadlineProtocol.with_body_deadline(settings.body_timeout),
                            log_level="debug" if settings.debug else "warning", access_log=settings.debug,
                            timeout_graceful_shutdown=5, ws_max_size=settings.max_request_bytes,
                            log_config=None if log_file is not None else uvicorn.config.LOGGING_CONFIG)
    server = Server(config, runtime)
    write_own_file(paths.pid_path(), str(os.getpid()))
    write_own_file(paths.address_path(), settings.base_url)  # `localai launch` hands this URL to agents
    log.info("localai listening on http://%s:%s and %s", host, port, paths.socket_path())
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: with the
    # default one the process died there, leaving its pid file and socket behind (what a service manager sends)
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        asyncio.run(server.serve(sockets=[tcp, unix]))
    finally:
        renderer.shutdown()
        _remove_files()
