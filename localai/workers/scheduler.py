"""Which models are loaded, for how long, and who waits: Ollama's scheduling rules in one place.

- A model loads on first use into a worker process; models that load the same way (the same weights and load
  options: personas FROM one model with their own SYSTEM or sampling) share one worker and its prompt cache.
- ``keep_alive`` after its last request: 0 unloads at once, negative keeps it forever.
- At most ``max_loaded_models`` workers at once; loading another unloads the idlest idle one first.
- Each worker serves ``num_parallel`` requests at once (whichever of its models they ask for); others wait in a
  bounded queue, and past ``max_queue`` waiting requests a request is refused with 503.
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

from localai import paths
from localai.errors import ServerBusy
from localai.metrics import Metrics
from localai.models.loading import available_memory, load_key, load_options
from localai.models.registry import ModelRecord
from localai.settings import Settings
from localai.workers.handle import Worker

log = logging.getLogger("localai.scheduler")


LoadKey = tuple[Any, ...]


@dataclass
class SharedWorker:
    """A worker process and its sequence slots, shared by every model that loads the same way (``load_key``):
    agent personas FROM one model cost their system prompts, not another copy of the weights, and their prompts
    share one prompt cache."""

    key: LoadKey
    worker: Worker
    slots: asyncio.Semaphore
    models: dict[str, LoadedModel] = field(default_factory=dict)  # the models it serves now
    served: set[str] = field(default_factory=set)  # every model it has served (a stop holds back their loads)
    active: int = 0  # requests holding a slot, whatever model they asked for
    last_used: float = field(default_factory=time.monotonic)
    fingerprint: str | None = None  # its prompt-cache folder (None with the cache off)


@dataclass
class LoadedModel:
    """A model served by a live worker (its own, or one it shares)."""

    name: str
    record: ModelRecord
    load_key: LoadKey
    shared: SharedWorker
    keep_alive: float
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None
    loaded_at: float = field(default_factory=time.time)
    _expiry: asyncio.TimerHandle | None = None

    @property
    def worker(self) -> Worker:
        return self.shared.worker

    @property
    def slots(self) -> asyncio.Semaphore:
        return self.shared.slots

    def sharing_with(self) -> list[str]:
        """The other models its worker serves now."""
        return sorted(name for name in self.shared.models if name != self.name)


@dataclass
class Stopping:
    """A worker on its way out: loads of its models (or its key) wait for it, and it still counts as loaded."""

    names: set[str]
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Scheduler:
    """Loads, shares and unloads workers."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.loaded: dict[str, LoadedModel] = {}
        self.workers: dict[LoadKey, SharedWorker] = {}
        self.waiting = 0
        self.queued: dict[str, int] = {}  # requests waiting for a slot (or a load), per model
        self._load_lock = asyncio.Lock()
        # Loads in progress: a load runs in a task of its own, so a request whose client leaves while its model loads
        # stops waiting without killing the load (the next request finds the model loaded, not a new start)
        self._loads: dict[tuple[str, LoadKey], asyncio.Task[LoadedModel]] = {}
        # Workers stopping (up to the stop's timeout): their memory is not free yet, so a load of the same key or of
        # a model they served waits for the stop, and they count against max_loaded_models.
        self.stopping: dict[LoadKey, Stopping] = {}

    @contextlib.asynccontextmanager
    async def lease(
        self, record: ModelRecord, *, keep_alive: float | None = None, overrides: dict[str, Any] | None = None
    ) -> AsyncIterator[LoadedModel]:
        """Hold one of a loaded model's sequence slots (its worker's) for the duration of a request."""
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
        shared = model.shared
        model.active += 1
        shared.active += 1
        if model._expiry is not None:
            model._expiry.cancel()
            model._expiry = None
        model.expires_at = None
        try:
            yield model
        finally:
            model.active -= 1
            shared.active -= 1
            model.slots.release()
            model.last_used = shared.last_used = time.monotonic()
            if keep_alive is not None:
                model.keep_alive = keep_alive
            if model.active == 0 and self.loaded.get(model.name) is model:
                self._schedule_expiry(model)

    async def _ensure_loaded(self, record: ModelRecord, overrides: dict[str, Any] | None) -> LoadedModel:
        key = load_key(record, self.settings, overrides)
        current = self.loaded.get(record.name)
        if current is not None and current.worker.alive and current.load_key == key:
            return current
        load = self._loads.get((record.name, key))
        if load is None:
            load = self._loads[(record.name, key)] = asyncio.ensure_future(self._load(record, key, overrides))
            load.add_done_callback(lambda done: self._load_done((record.name, key), done))
        return await asyncio.shield(load)

    def _load_done(self, which: tuple[str, LoadKey], load: asyncio.Task[LoadedModel]) -> None:
        if self._loads.get(which) is load:
            del self._loads[which]
        if not load.cancelled():
            load.exception()  # a failed load's error went to the requests waiting; read, so none is left unread

    async def _load(self, record: ModelRecord, key: LoadKey, overrides: dict[str, Any] | None) -> LoadedModel:
        async with self._load_lock:
            current = self.loaded.get(record.name)
            if current is not None and current.worker.alive and current.load_key == key:
                return current
            if current is not None:
                log.info("reloading %s (its settings changed or its worker died)", record.name)
                await self._detach(current, wait_idle=True)
            shared = self.workers.get(key)
            if shared is not None and not shared.worker.alive:
                await self._stop_worker(shared)  # it died and has not been told yet: forget it and its models
                shared = None
            if shared is None:
                shared = await self._start_worker(record, key, overrides)
            elif shared.models:
                log.info("%s shares the worker of %s (pid %s)", record.name, ", ".join(sorted(shared.models)),
                         shared.worker.pid)
            model = LoadedModel(name=record.name, record=record, load_key=key, shared=shared,
                                keep_alive=self.settings.keep_alive)
            shared.models[record.name] = model
            shared.served.add(record.name)
            self.loaded[record.name] = model
            return model

    async def _start_worker(self, record: ModelRecord, key: LoadKey,
                            overrides: dict[str, Any] | None) -> SharedWorker:
        for stopping in [s for k, s in self.stopping.items() if k == key or record.name in s.names]:
            await stopping.done.wait()  # its previous worker is still stopping: never two in memory at once
        await self._make_room()
        options = load_options(record, self.settings, overrides)
        # the system's free memory now, for placement's check that the model fits (not a reason to reload)
        worker = Worker(record.name, key[0], {**options, "host_free": available_memory()}, debug=self.settings.debug)
        worker.on_exit = self._worker_exited
        worker.on_stats = lambda w, stats: self.metrics.worker_cache_stats(w.name, w.reported_cache_stats, stats)
        await worker.start(self.settings.load_timeout)
        assert worker.info is not None
        shared = SharedWorker(key=key, worker=worker, slots=asyncio.Semaphore(worker.info["n_parallel"]),
                              fingerprint=cache_folder_of(worker.pid))
        self.workers[key] = shared
        return shared

    async def _make_room(self) -> None:
        while len(self.workers) + len(self.stopping) >= self.settings.max_loaded_models:
            idle = [w for w in self.workers.values() if w.active == 0]
            if idle:
                await self._stop_worker(min(idle, key=lambda w: w.last_used))
                continue
            await asyncio.sleep(0.05)  # every loaded worker is busy, or one is still stopping: wait

    def _worker_exited(self, worker: Worker) -> None:
        for key, shared in list(self.workers.items()):
            if shared.worker is worker:
                del self.workers[key]
                self._forget_models(shared)

    def _forget_models(self, shared: SharedWorker) -> None:
        """Every model a worker served is no longer loaded (the worker is gone or going)."""
        for name, model in shared.models.items():
            if self.loaded.get(name) is model:
                del self.loaded[name]
            if model._expiry is not None:
                model._expiry.cancel()
        shared.models.clear()

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
            await self._detach(model)

    async def _detach(self, model: LoadedModel, *, wait_idle: bool = False) -> None:
        """The model stops being loaded; its worker stops once no other model uses it."""
        if self.loaded.get(model.name) is not model:
            return  # already unloading (keep_alive, `localai stop` and a reload can each ask)
        del self.loaded[model.name]
        if model._expiry is not None:
            model._expiry.cancel()
        shared = model.shared
        shared.models.pop(model.name, None)
        if not shared.models:
            await self._stop_worker(shared, wait_idle=wait_idle)

    async def _stop_worker(self, shared: SharedWorker, *, wait_idle: bool = False) -> None:
        if self.workers.get(shared.key) is not shared:
            return  # already stopping
        del self.workers[shared.key]
        self._forget_models(shared)  # the worker goes, and every model it served with it
        # One stop per key at a time: a load of it waits for the stop, so no second worker exists to stop.
        stopping = self.stopping[shared.key] = Stopping(set(shared.served))
        try:
            if wait_idle:
                while shared.active and shared.worker.alive:
                    await asyncio.sleep(0.05)
            await shared.worker.stop()
        finally:
            stopping.done.set()
            del self.stopping[shared.key]

    async def unload(self, name: str) -> bool:
        """Unload a model now (``localai stop``); True when it was loaded. Its worker stops unless another model
        still uses it."""
        model = self.loaded.get(name)
        if model is None:
            return False
        await self._detach(model)
        return True

    async def shutdown(self) -> None:
        for load in list(self._loads.values()):
            load.cancel()  # a load nobody waits for any more ends with the daemon
        await asyncio.gather(*self._loads.values(), return_exceptions=True)
        await asyncio.gather(*(self._stop_worker(w) for w in list(self.workers.values())), return_exceptions=True)


def cache_folder_of(pid: int | None) -> str | None:
    """The prompt-cache folder (its fingerprint) a worker registered in when its store opened, before it said it was
    ready: ``<cache>/<fingerprint>/owners/<pid>`` (promptcache/blocks.py). None with the cache off."""
    if pid is None:
        return None
    with contextlib.suppress(OSError):
        for owner in paths.cache_dir().glob(f"*/owners/{pid}"):
            return owner.parent.parent.name
    return None
