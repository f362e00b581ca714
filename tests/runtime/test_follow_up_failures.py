"""A reply's follow-up prefill that fails is logged once, naming its session and model (issue 60, item 5: every
failure of its stream was swallowed unlogged); one cancelled (the daemon stopping) ends quietly."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from localai.errors import WorkerCrashed
from localai.runtime.sessions import Sessions
from localai.schema import GenerationRequest, Message, TextBlock


class Worker:
    """A worker handle whose stream for the prefill gives its prompt frame, then ``ending``."""

    def __init__(self, ending: BaseException | dict[str, Any] | None) -> None:
        self.ending = ending
        self.started = asyncio.Event()

    async def generate(self, op: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"ev": "prompt", "id": op["id"], "prompt_tokens": 3, "cached_tokens": 0}
        self.started.set()
        if isinstance(self.ending, BaseException):
            raise self.ending
        if self.ending is None:
            await asyncio.Event().wait()  # until cancelled
        yield self.ending


def run(ending: BaseException | dict[str, Any] | None, *, cancel: bool = False) -> None:
    async def scenario() -> None:
        sessions = Sessions(registry=None)  # type: ignore[arg-type]
        worker = Worker(ending)

        async def next_turn_prefix(*_: Any) -> str:
            return "the conversation with the reply"

        target = SimpleNamespace(record=SimpleNamespace(name="coder"), loaded=SimpleNamespace(worker=worker),
                                 next_turn_prefix=next_turn_prefix)
        request = GenerationRequest(model="coder", session_id="s-42", messages=[Message("user", [TextBlock("hi")])])
        start = sessions.follow_up(target, request, request.messages, "the prompt")  # type: ignore[arg-type]
        await start("the reply", [], "")
        if cancel:
            await worker.started.wait()
            for task in set(sessions._background):
                task.cancel()
        await sessions.settle(30)

    asyncio.run(scenario())


@pytest.mark.parametrize(("ending", "level", "says"), [
    (WorkerCrashed("the worker serving 'coder' crashed during the request"), logging.WARNING, "crashed"),
    (RuntimeError("a bug"), logging.ERROR, "failed"),
    ({"ev": "error", "id": "x", "kind": "context_length", "message": "the prompt is 9000 tokens"}, logging.WARNING,
     "9000 tokens"),
])
def test_a_failed_follow_up_prefill_is_logged_once_with_its_session_and_model(
        caplog: pytest.LogCaptureFixture, ending: Any, level: int, says: str) -> None:
    with caplog.at_level(logging.INFO, logger="localai.runtime"):
        run(ending)
    records = [r for r in caplog.records if r.name == "localai.runtime"]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert records[0].levelno == level and "s-42" in message and "coder" in message and says in message


def test_a_cancelled_follow_up_prefill_ends_quietly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="localai.runtime"):
        run(None, cancel=True)
    assert not [r for r in caplog.records if r.name == "localai.runtime"]
