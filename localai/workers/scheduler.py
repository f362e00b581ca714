"""Which models are loaded, for how long, and who waits: Ollama's scheduling rules in one place.

- A model loads on first use into its own worker process.
- ``keep_alive`` after its last request: 0 unloads at once, negative keeps it forever.
- At most ``max_loaded_models`` at once; loading another unloads the idlest idle one first.
- Each loaded model serves ``num_parallel`` requests at once; others wait in a bounded queue,
  and past ``max_queue`` waiting requests a request is refused with 503.
- A worker that dies is forgotten; the next request loads the model again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from localai.errors import ServerBusy
from localai.metrics import Metrics
from localai.models.loading import available_memory, engine_for, load_options
from localai.models.registry import ModelRecord
from localai.settings import Settings
from localai.workers.handle import Worker

log = logging.getLogger("localai.scheduler")


@dataclass
class LoadedModel:
    """A model with a live worker."""

    name: str
    record: ModelRecord
    load_key: tuple[Any, ...]
    worker: Worker
    slots: asyncio.Semaphore
    keep_alive: float
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None
    loaded_at: float = field(default_factory=time.time)
    _expiry: asyncio.TimerHandle | None = None


class Scheduler:
    """Loads, shares and unloads workers."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.loaded: dict[str, LoadedModel] = {}
        self.waiting = 0
        self.queued: dict[str, int] = {}  # requests waiting for a slot (or a load), per model
        self._load_lock = asyncio.Lock()
        # Models whose worker is stopping (up to the stop's timeout): their memory is not free yet, so a load of
        # the same model waits for the stop, and they count against max_loaded_models.
        self.stopping: dict[str, asyncio.Event] = {}

    @contextlib.asynccontextmanager
    async def lease(
        self, record: ModelRecord, *, keep_alive: float | None = None, overrides: dict[str, Any] | None = None
    ) -> AsyncIterator[LoadedModel]:
        """Hold one of a loaded model's sequence slots for the duration of a request."""
        if self.waiting >= self.settings.max_queue:
            raise ServerBusy(f"server busy: {self.waiting} requests are already waiting; retry shortly")
        self.waiting += 1
        self.queued[record.name] = self.queued.get(record.name, 0) + 1
        model: LoadedModel | None = None
        try:
            while True:
                model = await self._ensure_loaded(record, overrides)
                await model.slots.acquire()
                if model.worker.alive:
                    break
                model.slots.release()  # it died while we waited: load it again
        finally:
            self.waiting -= 1
            self.queued[record.name] -= 1
            if not self.queued[record.name]:
                del self.queued[record.name]
        model.active += 1
        if model._expiry is not None:
            model._expiry.cancel()
            model._expiry = None
        model.expires_at = None
        try:
            yield model
        finally:
            model.active -= 1
            model.slots.release()
            model.last_used = time.monotonic()
            if keep_alive is not None:
                model.keep_alive = keep_alive
            if model.active == 0:
                self._schedule_expiry(model)

    async def _ensure_loaded(self, record: ModelRecord, overrides: dict[str, Any] | None) -> LoadedModel:
        engine = engine_for(record, self.settings.engine)
        options = load_options(record, self.settings, overrides)
        key = (engine, *sorted(options.items()))  # the weights' digest is among the options
        current = self.loaded.get(record.name)
        if current is not None and current.worker.alive and current.load_key == key:
            return current
        async with self._load_lock:
            current = self.loaded.get(record.name)
            if current is not None and current.worker.alive and current.load_key == key:
                return current
            if current is not None:
                log.info("reloading %s (its settings changed or its worker died)", record.name)
                await self._unload(current, wait_idle=True)
            stopping = self.stopping.get(record.name)
            if stopping is not None:
                await stopping.wait()  # its previous worker is still stopping: never two in memory at once
            await self._make_room()
            # the system's free memory now, for placement's check that the model fits (not a reason to reload)
            worker = Worker(record.name, engine, {**options, "host_free": available_memory()},
                            debug=self.settings.debug)
            worker.on_exit = self._worker_exited
            worker.on_stats = lambda w, stats: self.metrics.worker_cache_stats(w.name, w.reported_cache_stats, stats)
            await worker.start(self.settings.load_timeout)
            assert worker.info is not None
            model = LoadedModel(
                name=record.name, record=record, load_key=key, worker=worker,
                slots=asyncio.Semaphore(worker.info["n_parallel"]), keep_alive=self.settings.keep_alive,
            )
            self.loaded[record.name] = model
            return model

    async def _make_room(self) -> None:
        while len(self.loaded) + len(self.stopping) >= self.settings.max_loaded_models:
            idle = [m for m in self.loaded.values() if m.active == 0]
            if idle:
                await self._unload(min(idle, key=lambda m: m.last_used))
                continue
            await asyncio.sleep(0.05)  # every loaded model is busy, or one is still stopping: wait

    def _worker_exited(self, worker: Worker) -> None:
        for name, model in list(self.loaded.items()):
            if model.worker is worker:
                del self.loaded[name]
                if model._expiry is not None:
                    model._expiry.cancel()

    def _schedule_expiry(self, model: LoadedModel) -> None:
        if model.keep_alive < 0:
            return
        model.expires_at = time.time() + model.keep_alive
        loop = asyncio.get_running_loop()
        model._expiry = loop.call_later(
            model.keep_alive, lambda: asyncio.ensure_future(self._expire(model))
        )

    async def _expire(self, model: LoadedModel) -> None:
        if model.active == 0 and self.loaded.get(model.name) is model:
            log.info("unloading %s after keep_alive", model.name)
            await self._unload(model)

    async def _unload(self, model: LoadedModel, *, wait_idle: bool = False) -> None:
        if self.loaded.get(model.name) is not model:
            return  # already unloading (keep_alive, `localai stop` and a reload can each ask)
        del self.loaded[model.name]
        # One stop per model at a time: a load of the model waits for it, so no second worker exists to stop.
        stopped = self.stopping[model.name] = asyncio.Event()
        try:
            if model._expiry is not None:
                model._expiry.cancel()
            if wait_idle:
                while model.active and model.worker.alive:
                    await asyncio.sleep(0.05)
            await model.worker.stop()
        finally:
            stopped.set()
            del self.stopping[model.name]

    async def unload(self, name: str) -> bool:
        """Unload a model now (``localai stop``); True when it was loaded."""
        model = self.loaded.get(name)
        if model is None:
            return False
        await self._unload(model)
        return True

    async def shutdown(self) -> None:
        await asyncio.gather(*(self._unload(m) for m in list(self.loaded.values())), return_exceptions=True)
