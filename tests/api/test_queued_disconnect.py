"""Requests whose clients leave while they wait for a slot (issue 60, item 8), in-process on the scripted engine: each
leaves the queue as its client goes, in every dialect, rather than keeping its place in ``LOCALAI_MAX_QUEUE`` until
it is admitted and run for nobody. The clients are ASGI peers driven by hand: each sends its body, then disconnects
when the test says so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Message

from localai.runtime.runtime import Runtime
from localai.schema import GenerationRequest, TextBlock
from localai.schema import Message as Turn
from localai.settings import Settings
from tests.api.conftest import scripted_settings

QUEUED = [  # one of each dialect, streamed and not
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "[[say:a]]"}]}),
    ("/v1/messages", {"model": "smollm2", "max_tokens": 20, "stream": True,
                      "messages": [{"role": "user", "content": "[[say:b]]"}]}),
    ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": "[[say:c]]"}]}),
    ("/v1/responses", {"model": "smollm2", "input": "[[say:d]]", "stream": False}),
]


@pytest.fixture(scope="module")
def api_settings() -> Settings:
    # one slot, and a queue that the requests whose clients left would fill
    return scripted_settings(num_parallel=1, max_queue=len(QUEUED))


async def post(app: ASGIApp, path: str, body: dict[str, Any], leave: asyncio.Event) -> tuple[int, bytes]:
    """POST ``body`` as a client that disconnects when ``leave`` is set; the status and body the app answered."""
    data = json.dumps(body).encode()
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    status, answer = 0, b""

    async def send(message: Message) -> None:
        nonlocal status, answer
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            answer += message.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 50000), "server": ("localhost", 80),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())]}
    await app(scope, receive, send)
    return status, answer


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (something the app's tasks do), failing after a generous while."""
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.01)


def test_requests_whose_clients_left_while_queued_leave_the_queue_at_once(api: TestClient) -> None:
    runtime: Runtime = api.app.state.runtime  # type: ignore[attr-defined]
    scheduler = runtime.scheduler

    async def scenario() -> None:
        # the one slot, busy for minutes (the scripted engine's slow reply)
        busy = await runtime.start(GenerationRequest(model="smollm2",
                                                     messages=[Turn("user", [TextBlock("[[slow]]")])]))
        leave, stay = asyncio.Event(), asyncio.Event()
        clients = [asyncio.ensure_future(post(api.app, path, body, leave)) for path, body in QUEUED]
        await until(lambda: scheduler.waiting == len(QUEUED))  # the queue is full
        leave.set()
        answers = await asyncio.wait_for(asyncio.gather(*clients), 30)  # before: waited for the slow reply's end
        assert [status for status, _ in answers] == [499] * len(QUEUED)
        assert scheduler.waiting == 0 and scheduler.queued == {}
        assert sum(shared.active for shared in scheduler.workers.values()) == 1  # the slot is still busy
        # the next request gets a place in the queue (before: 503, the queue full of clients that had left) and
        # the slot as soon as the slow reply stops
        following = asyncio.ensure_future(post(api.app, "/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": "[[say:admitted]]"}]}, stay))
        await until(lambda: scheduler.waiting == 1)
        await busy.aclose()
        status, answer = await asyncio.wait_for(following, 30)
        assert status == 200, answer
        assert json.loads(answer)["choices"][0]["message"]["content"] == "admitted"

    assert api.portal is not None
    api.portal.call(scenario)
    assert "localai_queue_waiting 0.0" in api.get("/metrics").text
