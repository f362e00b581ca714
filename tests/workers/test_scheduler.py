"""The scheduler's load/unload/expire races, with a stand-in worker whose stop is held open by the test (a real
worker's stop can take up to its timeout): the interleavings are forced, not hoped for. No test sleeps: the
scheduler's own polls (``asyncio.sleep`` in its module) take no time and are counted, a stop's ``done`` event says
when someone waits on it, and ``until`` lets the loop's other tasks run, a bounded number of turns, until what the
test waits for has happened (a load that should wait and does not makes a condition false forever: it fails)."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from localai.models.registry import ModelRecord
from localai.settings import Settings
from localai.workers import scheduler as scheduling
from localai.workers.scheduler import Scheduler


class HeldWorker:
    """Starts at once; ``stop`` waits for the test's gate. Fails the test if two run for one model at once."""

    instances: list[HeldWorker] = []
    gate: asyncio.Event
    fail_start = False

    def __init__(self, name: str, backend: str, options: dict[str, Any], *, debug: bool = False) -> None:
        self.name = name
        self.pid = 1000 + len(HeldWorker.instances)
        self.alive = False
        self.info: dict[str, Any] | None = None
        self.on_exit: Any = None
        self.on_stats: Any = None
        self.stops = 0

    async def start(self, timeout: float) -> dict[str, Any]:
        if HeldWorker.fail_start:
            from localai.errors import WorkerCrashed

            raise WorkerCrashed("the engine could not load the model")
        running = [w for w in HeldWorker.instances if w.alive and w.name == self.name]
        assert not running, f"a second worker for {self.name} while one is still running or stopping"
        HeldWorker.instances.append(self)
        self.alive = True
        self.info = {"n_parallel": 2}
        return self.info

    async def stop(self) -> None:
        self.stops += 1
        await HeldWorker.gate.wait()
        self.alive = False


class SeenEvent(asyncio.Event):
    """An event that knows whether anyone waits on it (a load held back by a stop)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = False

    async def wait(self) -> bool:  # type: ignore[override]
        self.waited = True
        return await super().wait()


@dataclass
class SeenStopping(scheduling.Stopping):
    done: asyncio.Event = field(default_factory=SeenEvent)


class Polls:
    """The scheduler module's ``asyncio.sleep``: counted, and a turn of the loop instead of 50 ms."""

    count = 0
    real = asyncio.sleep

    @staticmethod
    async def sleep(_: float) -> None:
        Polls.count += 1
        await Polls.real(0)


@pytest.fixture(autouse=True)
def held_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    HeldWorker.instances = []
    Polls.count = 0
    monkeypatch.setattr(scheduling, "Worker", HeldWorker)
    monkeypatch.setattr(scheduling, "Stopping", SeenStopping)
    monkeypatch.setattr(scheduling, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": Polls.sleep}))


async def until(condition: Callable[[], Any], what: str) -> None:
    """Let the other tasks run until ``condition()`` holds: turns of the loop, no clock."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def stop_awaited(schedule: Scheduler) -> bool:
    """Whether a load waits for a worker's stop."""
    return any(getattr(stop.done, "waited", False) for stop in schedule.stopping.values())


def record(name: str, *, weights: str | None = None, **parameters: Any) -> ModelRecord:
    """A model; ``weights`` names another model's file (a Modelfile FROM it), ``parameters`` its own."""
    return ModelRecord(name=name, source="test", path=f"/models/{weights or name}.gguf", format="gguf",
                       sha256="0" * 64, size=1, family="", quantization="", parameter_size="", context_length=4096,
                       parameters={"engine": "scripted", **parameters})


def stopping(schedule: Scheduler) -> set[str]:
    """The models whose worker is stopping."""
    return {name for stop in schedule.stopping.values() for name in stop.names}


def settings(**values: Any) -> Settings:
    return Settings(**{"keep_alive": 300, "max_loaded_models": 3, **values})


async def use(schedule: Scheduler, model: ModelRecord, *, keep_alive: float | None = None) -> None:
    async with schedule.lease(model, keep_alive=keep_alive):
        pass


def test_a_request_during_keep_alive_expiry_waits_for_the_stop_instead_of_loading_twice() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings())
        model = record("m")
        await use(schedule, model, keep_alive=0)  # expires at once: its stop starts and is held
        await until(lambda: stopping(schedule) == {"m"}, "m's stop")
        assert "m" not in schedule.loaded
        second = asyncio.create_task(use(schedule, model))
        await until(lambda: stop_awaited(schedule), "the second request waiting for the stop")
        assert len(HeldWorker.instances) == 1 and not second.done()  # waiting, not loading beside it
        HeldWorker.gate.set()
        await second
        assert len(HeldWorker.instances) == 2 and not HeldWorker.instances[0].alive
        assert schedule.loaded["m"].worker is HeldWorker.instances[1] and not schedule.stopping

    asyncio.run(run())


def test_stop_and_expiry_at_once_stop_the_worker_once() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings())
        model = record("m")
        await use(schedule, model)
        loaded = schedule.loaded["m"]
        first = asyncio.create_task(schedule.unload("m"))
        await until(lambda: loaded.worker.stops == 1, "the unload's stop")
        # while it is held: the expiry and a reload's detach find it going and return (a second stop would be
        # held by the gate too, and fail the count below)
        second = asyncio.create_task(schedule._expire(loaded))
        third = asyncio.create_task(schedule._detach(loaded))
        await until(lambda: second.done() and third.done(), "the expiry and the detach to return")
        assert loaded.worker.stops == 1 and not first.done()
        HeldWorker.gate.set()
        assert await first is True
        await second  # neither failed
        await third
        assert loaded.worker.stops == 1 and not schedule.stopping and not schedule.loaded

    asyncio.run(run())


def test_a_model_still_stopping_counts_against_max_loaded_models() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings(max_loaded_models=1))
        await use(schedule, record("a"), keep_alive=0)
        await until(lambda: stopping(schedule) == {"a"}, "a's stop")
        other = asyncio.create_task(use(schedule, record("b")))
        await until(lambda: Polls.count >= 3, "b's load waiting for room")
        assert not other.done() and [w.name for w in HeldWorker.instances] == ["a"]  # a's memory is not free yet
        HeldWorker.gate.set()
        await other
        assert [w.name for w in HeldWorker.instances] == ["a", "b"] and list(schedule.loaded) == ["b"]

    asyncio.run(run())


def test_a_load_that_fails_leaves_no_count_behind_and_the_next_request_loads() -> None:
    from localai.errors import WorkerCrashed

    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        HeldWorker.gate.set()
        schedule = Scheduler(settings())
        HeldWorker.fail_start = True
        try:
            with pytest.raises(WorkerCrashed):
                await use(schedule, record("m"))
        finally:
            HeldWorker.fail_start = False
        assert schedule.waiting == 0 and not schedule.queued and not schedule.loaded and not schedule.stopping
        await use(schedule, record("m"))
        assert "m" in schedule.loaded

    asyncio.run(run())


def personas() -> list[ModelRecord]:
    """Three agent personas FROM one model: their own system prompts and sampling, the same weights and load."""
    return [record("base"),
            replace(record("pirate", weights="base", temperature=1.2, stop=["Arr"]), system="You are a pirate."),
            replace(record("critic", weights="base", num_predict=64), system="You review code.",
                    template="{{ messages }}")]


def test_models_from_the_same_weights_and_load_options_share_one_worker() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings(max_loaded_models=1))  # one worker fits: three personas must not evict
        for model in personas():
            await use(schedule, model)
        assert len(HeldWorker.instances) == 1 and len(schedule.workers) == 1
        worker = HeldWorker.instances[0]
        assert {name: m.worker for name, m in schedule.loaded.items()} == {
            "base": worker, "pirate": worker, "critic": worker}
        assert schedule.loaded["pirate"].sharing_with() == ["base", "critic"]

    asyncio.run(run())


def test_options_that_change_the_load_get_their_own_worker() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        HeldWorker.gate.set()
        schedule = Scheduler(settings())
        await use(schedule, record("base"))
        await use(schedule, record("long", weights="base", num_ctx=2048))
        await use(schedule, record("other"))  # other weights
        async with schedule.lease(record("base"), overrides={"num_gpu": 0}):  # a request's load option
            pass
        assert [w.name for w in HeldWorker.instances] == ["base", "long", "other", "base"]
        assert len({id(m.worker) for m in schedule.loaded.values()}) == 3  # base moved to the num_gpu worker

    asyncio.run(run())


def test_a_shared_worker_stops_only_when_its_last_model_goes() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        HeldWorker.gate.set()
        schedule = Scheduler(settings())
        base, pirate, critic = personas()
        await use(schedule, base)
        await use(schedule, pirate, keep_alive=0)  # expires at once: the worker stays for the others
        await use(schedule, critic)
        await until(lambda: "pirate" not in schedule.loaded, "pirate's expiry")
        worker = HeldWorker.instances[0]
        assert set(schedule.loaded) == {"base", "critic"} and worker.alive and worker.stops == 0
        assert await schedule.unload("base") is True
        assert worker.alive and list(schedule.loaded) == ["critic"]
        assert await schedule.unload("critic") is True
        assert not worker.alive and worker.stops == 1 and not schedule.loaded and not schedule.workers
        await use(schedule, pirate)  # loads one worker again
        assert len(HeldWorker.instances) == 2 and list(schedule.loaded) == ["pirate"]

    asyncio.run(run())


def test_models_sharing_a_worker_share_its_slots() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings())
        release = asyncio.Event()
        held: list[str] = []

        async def hold(model: ModelRecord) -> None:
            async with schedule.lease(model):
                held.append(model.name)
                await release.wait()

        base, pirate, critic = personas()
        tasks = [asyncio.create_task(hold(m)) for m in (base, pirate, critic)]
        # the worker has 2 sequences, not 2 per model: critic waits for one (with slots per model it would hold one)
        await until(lambda: len(held) == 2 and schedule.queued == {"critic": 1}, "two held and critic queued")
        assert not tasks[2].done() and held == ["base", "pirate"]
        release.set()
        await asyncio.gather(*tasks)
        assert sorted(held) == ["base", "critic", "pirate"] and len(HeldWorker.instances) == 1

    asyncio.run(run())


def test_a_shared_worker_that_dies_takes_its_models_with_it_and_loads_once_again() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        HeldWorker.gate.set()
        schedule = Scheduler(settings())
        base, pirate, critic = personas()
        for model in (base, pirate):
            await use(schedule, model)
        dead = HeldWorker.instances[0]
        dead.alive = False
        schedule._worker_exited(dead)  # type: ignore[arg-type]
        assert not schedule.loaded and not schedule.workers
        await use(schedule, critic)
        await use(schedule, base)
        assert len(HeldWorker.instances) == 2 and schedule.loaded["base"].worker is HeldWorker.instances[1]

    asyncio.run(run())


def test_a_persona_waits_for_its_shared_worker_to_stop_before_loading_it_again() -> None:
    async def run() -> None:
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings())
        base, pirate, _ = personas()
        await use(schedule, base, keep_alive=0)  # its stop is held
        await until(lambda: stopping(schedule) == {"base"}, "base's stop")
        second = asyncio.create_task(use(schedule, pirate))  # the same key: waits, never two copies in memory
        await until(lambda: stop_awaited(schedule), "pirate's load waiting for the stop")
        assert not second.done() and len(HeldWorker.instances) == 1
        HeldWorker.gate.set()
        await second
        assert len(HeldWorker.instances) == 2 and list(schedule.loaded) == ["pirate"]

    asyncio.run(run())


def test_a_request_that_leaves_while_its_model_loads_does_not_stop_the_load() -> None:
    """A client whose request is cancelled while queued (issue 60, item 8) may be the one whose request started its
    model's load: the load goes on without it (before, Worker.start was cancelled and the next request loaded the
    model again from the start), and a load that fails still reaches the requests waiting for it."""
    async def run() -> None:
        opened = asyncio.Event()
        starts: list[SlowStart] = []

        class SlowStart(HeldWorker):
            async def start(self, timeout: float) -> dict[str, Any]:
                starts.append(self)
                await opened.wait()
                return await super().start(timeout)

        scheduling.Worker = SlowStart  # type: ignore[misc]  # undone by the fixture's monkeypatch
        HeldWorker.gate = asyncio.Event()
        schedule = Scheduler(settings())
        model = record("m")
        first = asyncio.create_task(use(schedule, model))
        await until(lambda: starts, "the load to start")
        first.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.create_task(use(schedule, model))
        opened.set()
        await second
        assert len(starts) == 1 and schedule.loaded["m"].worker is starts[0]  # one load, carried on
        assert not schedule._loads
        # a load that fails: its waiters get the error, and nothing is left behind
        other = record("n")
        HeldWorker.fail_start = True
        try:
            from localai.errors import WorkerCrashed

            with pytest.raises(WorkerCrashed):
                await use(schedule, other)
        finally:
            HeldWorker.fail_start = False
        assert not schedule._loads and "n" not in schedule.loaded

    asyncio.run(run())
