"""User Modelfiles in ``$LOCALAI_HOME/modelfiles``, kept in step with the registry while the daemon runs.

``NAME.Modelfile`` is ``NAME:latest`` and ``NAME/TAG.Modelfile`` is ``NAME:TAG``. Adding or editing one
(re)creates that model; deleting it removes the model (never its weights). A broken one is logged and
reported by ``GET /api/modelfiles`` (``localai ps`` and ``show`` print it) and changes nothing else: the
other models, and the last good version of its own, stay. A loaded model whose weights or load settings
changed reloads on its next request (the scheduler compares them); other changes (sampling, SYSTEM)
apply to the next request as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from localai.errors import LocalAIError
from localai.models import library
from localai.models.modelfile import parse_file
from localai.models.registry import WATCHED, Registry

log = logging.getLogger("localai.watcher")
DEBOUNCE_MS = 400
TICK_MS = 1000  # how long watchfiles waits for a change before yielding an empty set


@dataclass(frozen=True)
class ModelfileStatus:
    path: str
    name: str | None
    error: str | None = None


class ModelfileWatcher:
    """Watches one directory with watchfiles and reconciles the registry with it on every change."""

    def __init__(self, root: Path, registry: Registry,
                 unload: Callable[[str], Awaitable[object]] | None = None) -> None:
        self.root = root
        self.registry = registry  # only reopened: reconciling runs on a worker thread
        self.unload = unload  # unloads a removed model that is still loaded
        self.statuses: list[ModelfileStatus] = []
        self._applied: dict[Path, bytes] = {}  # the content last applied successfully, per file
        self._reported: dict[Path, str] = {}  # the error last logged, per file (logged once each)
        self._lock = threading.Lock()
        self._stop: asyncio.Event | None = None
        self._pending: set[asyncio.Task[None]] = set()

    def report(self) -> list[dict[str, Any]]:
        return [asdict(status) for status in self.statuses]

    async def run(self) -> None:
        """Reconcile once, then after every change until ``stop()``; poll if the OS refuses a watch."""
        self._stop = asyncio.Event()
        self.root.mkdir(parents=True, exist_ok=True)
        await self._reconcile_and_unload()
        for force_polling in (None, True):
            try:
                await self._watch(force_polling)
                return
            except Exception:
                log.exception("watching %s failed%s", self.root, "; polling it instead" if not force_polling else "")

    async def _watch(self, force_polling: bool | None) -> None:
        from watchfiles import awatch

        armed = False
        async for changes in awatch(self.root, stop_event=self._stop, debounce=DEBOUNCE_MS, recursive=True,
                                    force_polling=force_polling, rust_timeout=TICK_MS, yield_on_timeout=True):
            # The first yield (a change or a tick) comes once the watch is in place: reconcile then too, or a
            # file written between the first reconcile and the watch starting would go unseen until edited.
            if changes or not armed:
                armed = True
                await self._reconcile_and_unload()

    async def _reconcile_and_unload(self) -> None:
        for name in await asyncio.to_thread(self.reconcile):
            if self.unload is not None:
                await self.unload(name)

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def poke(self) -> None:
        """Reconcile soon (after a pull: Modelfiles FROM the pulled weights may build now)."""
        task = asyncio.get_running_loop().create_task(self._reconcile_and_unload())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def reconcile(self) -> list[str]:
        """Bring the registry in line with the directory (blocking; one at a time); the names removed."""
        with self._lock:
            registry = self.registry.reopen()
            removed: list[str] = []
            try:
                self.statuses = self._reconcile(registry, removed)
            except Exception:
                log.exception("reconciling %s failed", self.root)
            finally:
                registry.close()
            return removed

    def _reconcile(self, registry: Registry, removed: list[str]) -> list[ModelfileStatus]:
        found: dict[str, Path] = {}
        errors: dict[Path, str] = {}
        for path in sorted(self.root.rglob(f"*{library.SUFFIX}")) if self.root.is_dir() else []:
            name = library.modelfile_name(self.root, path)
            if name is None:
                errors[path] = (f"a user Modelfile is NAME.Modelfile or NAME/TAG.Modelfile, with lowercase "
                                f"letters, digits, '.', '-' or '_' (got {path.relative_to(self.root)})")
            elif path.is_file():
                found.setdefault(name, path)
        pending = sorted(found.items())
        for _ in range(2):  # a Modelfile FROM another user model builds on the second pass
            failed = []
            for name, path in pending:
                try:
                    self._apply(registry, name, path)
                    errors.pop(path, None)
                except (LocalAIError, OSError) as exc:
                    errors[path] = getattr(exc, "message", None) or str(exc)
                    failed.append((name, path))
            if not failed or len(failed) == len(pending):
                break
            pending = failed
        for name, source in registry.watched().items():
            path = Path(source[len(WATCHED):])
            if found.get(name) != path:
                removed += registry.remove(name, delete_weights=False)
                self._applied.pop(path, None)
                log.info("removed %s: its Modelfile %s is gone", name, path)
        for path, message in errors.items():
            if self._reported.get(path) != message:
                log.warning("Modelfile %s is broken: %s", path, message)
        self._reported = dict(errors)
        names = {path: name for name, path in found.items()}
        every = sorted(set(names) | set(errors))
        return [ModelfileStatus(str(path), names.get(path), errors.get(path)) for path in every]

    def _apply(self, registry: Registry, name: str, path: Path) -> None:
        content = path.read_bytes()
        if self._applied.get(path) == content and registry.exists(name):
            return
        record = registry.sync(name, parse_file(path), source=f"{WATCHED}{path}")
        self._applied[path] = content
        if record is not None:
            log.info("created %s from %s", record.name, path)


async def stop_quietly(watcher: ModelfileWatcher, task: asyncio.Task[None]) -> None:
    watcher.stop()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(task, 5)
