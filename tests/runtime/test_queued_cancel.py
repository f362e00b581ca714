"""Admission gives up on a request as soon as its client leaves (issue 60, item 8): what it was waiting for is
cancelled (its place in the queue, a worker's slot), a generation admitted just then is closed, and an op already
sent to its worker is cancelled there (its frames closed) rather than left waiting for a slot. Driven with fakes:
the interleavings are set up with events, the HTTP side is tests/api/test_queued_disconnect.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from localai.errors import ClientDisconnected
from localai.runtime import admission
from localai.runtime.fitting import FitMemory
from localai.schema import GenerationRequest


class Frames:
    """A worker's frames for an op it holds in its queue: idle frames until closed (the handle then cancels it)."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.closed = False

    def __aiter__(self) -> Frames:
        return self

    async def __anext__(self) -> dict[str, Any]:
        self.waiting.set()
        await asyncio.Event().wait()  # no slot comes
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


class Target:
    retries_on_crash = True

    def __init__(self) -> None:
        self.frames = Frames()

    async def operation(self, request: GenerationRequest, messages: Any) -> dict[str, Any]:
        return {"id": "req-1", "prompt": "hi"}

    def size(self, op: Any) -> int:
        return 2

    def generate(self, op: Any) -> Frames:
        return self.frames


class Admitted:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


def test_a_request_whose_client_leaves_while_its_op_waits_in_the_worker_is_cancelled_there() -> None:
    async def scenario() -> None:
        left = asyncio.Event()
        admission.client_left.set(left)
        target = Target()

        async def admitting() -> Any:
            await admission.admit(GenerationRequest(model="m", prompt="hi"), target, reopen, model="m",
                                  session=None, fitting=False, memory=FitMemory())
            raise AssertionError("admitted without a slot")

        async def reopen() -> Any:
            raise AssertionError("no second worker")

        waiting = asyncio.ensure_future(admission.unless_client_left(admitting()))
        await target.frames.waiting.wait()
        left.set()
        with pytest.raises(ClientDisconnected):
            await waiting
        assert target.frames.closed  # before: left open, so the worker kept the op queued and ran it for nobody

    asyncio.run(scenario())


def test_a_generation_admitted_as_its_client_leaves_is_closed() -> None:
    async def scenario() -> None:
        left = asyncio.Event()
        admission.client_left.set(left)
        admitted, started, cancelled = Admitted(), asyncio.Event(), asyncio.Event()

        async def admitting() -> Any:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # the admission completes as it is cancelled: nobody takes the result
                cancelled.set()
            return admitted

        waiting = asyncio.ensure_future(admission.unless_client_left(admitting()))
        await started.wait()
        left.set()
        with pytest.raises(ClientDisconnected):
            await waiting
        assert cancelled.is_set() and admitted.closed

    asyncio.run(scenario())


def test_without_a_client_to_watch_a_request_waits_as_long_as_it_must() -> None:
    async def scenario() -> None:
        admitted = Admitted()

        async def admitting() -> Any:
            await asyncio.sleep(0)
            return admitted

        assert await admission.unless_client_left(admitting()) is admitted  # type: ignore[arg-type]

    asyncio.run(scenario())
