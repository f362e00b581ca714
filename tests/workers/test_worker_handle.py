"""The daemon's handle on a worker process, against real workers: failures end the worker, never wedge it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from localai import protocol
from localai.errors import RequestTooLarge, WorkerCrashed
from localai.protocol import MAX_FRAME, GenerateOp
from localai.workers.handle import Worker
from localai.workers.worker import EXIT_ENGINE_FAILED
from tests.parallel import threads

pytestmark = pytest.mark.model


def smollm2_worker(path: Path) -> Worker:
    return Worker("smollm2", "llama.cpp", {"model_path": str(path), "num_ctx": 512, "n_parallel": 1,
                                           "n_threads": threads(), "cache_dir": None})


def op(request_id: str, **fields: object) -> GenerateOp:
    base = {"op": "generate", "id": request_id, "prompt": "Hello", "max_tokens": 4, "stop": [],
            "sampling": {"temperature": 0.0}}
    return GenerateOp(**{**base, **fields})  # type: ignore[typeddict-item]


async def drain(worker: Worker, generate: GenerateOp) -> list[dict[str, object]]:
    return [frame async for frame in worker.generate(generate)]


def test_an_engine_failure_ends_the_worker_and_the_request_says_why(smollm2_path: Path) -> None:
    async def scenario() -> None:
        worker = smollm2_worker(smollm2_path)
        await worker.start(120)
        frames = await drain(worker, op("ok"))
        assert frames[-1]["ev"] == "done"
        # Unvalidated input that only fails mid-decode (the daemon validates `stop`; the engine must not hang on it)
        with pytest.raises(WorkerCrashed, match="TypeError"):
            await drain(worker, op("bad", stop=[1]))
        assert worker.process is not None
        assert await asyncio.wait_for(worker.process.wait(), 30) == EXIT_ENGINE_FAILED
        assert not worker.alive

    asyncio.run(scenario())


def test_an_answer_too_large_for_a_frame_is_an_error_not_a_dead_worker(smollm2_path: Path) -> None:
    async def scenario() -> None:
        worker = smollm2_worker(smollm2_path)
        await worker.start(120)
        try:
            text = "a b " * (9 << 20)  # ~18M tokens: their list would be a frame of more than 64 MiB
            with pytest.raises(RequestTooLarge):
                await worker.tokenize(text)
            assert await worker.count_tokens(text[: 1 << 20]) > 100_000  # counting never ships the list
            assert worker.alive and (await drain(worker, op("after")))[-1]["ev"] == "done"
            with pytest.raises(RequestTooLarge):  # and the daemon never sends a frame the worker would refuse
                await worker.tokenize("x" * (MAX_FRAME + 1))
            assert worker.alive
        finally:
            await worker.stop()

    asyncio.run(scenario())


BAD_WORKER = r"""
import json, socket, struct, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
body = json.dumps({"ev": "ready", "info": {"n_parallel": 1}}).encode()
sock.sendall(struct.pack(">I", len(body)) + body)
sock.recv(1 << 20)  # the generate op
ANSWER
time.sleep(3600)  # and would sit on its memory forever
"""
BAD_ANSWERS = {
    # announces a 100 MiB frame: a broken protocol
    "oversized frame": 'sock.sendall(struct.pack(">I", 100 << 20))',
    # a kind of frame the protocol does not have (protocol.decode_frame refuses it): a broken peer too
    "unknown frame kind": 'body = json.dumps({"ev": "tokenz", "id": "x"}).encode(); '
                          'sock.sendall(struct.pack(">I", len(body)) + body)',
}


class BadWorker(Worker):
    def __init__(self, script: Path) -> None:
        super().__init__("bad", "llama.cpp", {})
        self.script = script

    def command(self, fd: int) -> list[str]:
        return [sys.executable, str(self.script), str(fd)]


@pytest.mark.parametrize("answer", list(BAD_ANSWERS))
def test_a_worker_the_daemon_gives_up_on_is_killed(tmp_path: Path, answer: str) -> None:
    script = tmp_path / "bad_worker.py"
    script.write_text(BAD_WORKER.replace("ANSWER", BAD_ANSWERS[answer]))

    async def scenario() -> None:
        worker = BadWorker(script)
        await worker.start(30)
        with pytest.raises(WorkerCrashed):
            await drain(worker, op("x"))
        assert worker.process is not None
        assert await asyncio.wait_for(worker.process.wait(), 30) is not None  # killed, not left running

    asyncio.run(scenario())


def test_a_frame_over_the_limit_reaches_the_daemon_as_a_too_large_error_for_its_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving loop's frames go through FrameSocket.emit: one the daemon would refuse is replaced by an error
    naming the request (it would otherwise wait for an answer that never comes); frames without a request are
    dropped; a daemon that is gone is no error for the engine thread."""
    monkeypatch.setattr(protocol, "MAX_FRAME", 4096)
    ours, theirs = socket.socketpair()
    worker_side, daemon_side = protocol.FrameSocket(ours), theirs.makefile("rb")
    worker_side.emit(protocol.TextFrame(ev="text", id="req-1", text="x" * 5000))
    worker_side.emit(protocol.StatsFrame(ev="stats", cache={"x" * 5000: 1}))
    worker_side.emit(protocol.TextFrame(ev="text", id="req-2", text="fits"))
    first, second = (protocol.decode_frame(protocol.read_frame(daemon_side) or b"") for _ in range(2))
    assert first["ev"] == "error" and first["id"] == "req-1" and first["kind"] == "too_large"
    assert "too large for one response" in first["message"]
    assert second == {"ev": "text", "id": "req-2", "text": "fits"}
    daemon_side.close()
    theirs.close()
    worker_side.emit(protocol.TextFrame(ev="text", id="req-3", text="nobody listens"))  # no exception
    ours.close()


def test_only_the_protocol_s_frame_kinds_decode() -> None:
    assert protocol.decode_frame(b'{"ev": "text", "id": "a", "text": "b"}') == {"ev": "text", "id": "a", "text": "b"}
    for body in (b'{"ev": "crashed"}', b'{"kind": "text"}', b'{"ev": ["text"]}'):
        with pytest.raises(ValueError, match="unknown frame kind"):
            protocol.decode_frame(body)
    with pytest.raises(ValueError):
        protocol.decode_frame(b"[1, 2]")
    assert protocol.decode_op(b'{"op": "cancel", "id": "a"}') == {"op": "cancel", "id": "a"}
    for body in (b'{"op": "reboot"}', b'{"ev": "text"}', b'{"op": {"generate": 1}}'):
        with pytest.raises(ValueError, match="unknown op"):
            protocol.decode_op(body)


def test_a_worker_sent_an_op_the_protocol_does_not_have_stops_cleanly(tmp_path: Path) -> None:
    """The worker reads ops through decode_op: a peer sending something else is broken, and the worker ends as it
    does when the daemon goes away (exit 0), rather than feeding the serving loop what it cannot handle."""
    async def scenario() -> None:
        worker = Worker("scripted", "scripted", {"model_path": str(tmp_path / "none"), "num_ctx": 512,
                                                 "n_parallel": 1, "cache_dir": None})
        await worker.start(60)
        try:
            await worker._send({"op": "reboot", "id": "x"})
            assert worker.process is not None
            assert await asyncio.wait_for(worker.process.wait(), 30) == 0
        finally:
            await worker.stop()

    asyncio.run(scenario())


STARTS_BADLY = {
    "exits at once": "import sys; sys.exit(3)",
    "garbage frame": "import os, struct, sys; fd = int(sys.argv[1]); os.write(fd, struct.pack('<I', 5) + b'{nope')"
                     "; import time; time.sleep(60)",
    "oversized frame": "import os, struct, sys; os.write(int(sys.argv[1]), struct.pack('<I', 2**31)); "
                       "import time; time.sleep(60)",
    "silent": "import time; time.sleep(60)",
}


@pytest.mark.parametrize("behaviour", list(STARTS_BADLY))
def test_a_worker_that_fails_to_start_leaves_no_socket_and_no_process(tmp_path: Path, behaviour: str) -> None:
    """Every way a load can fail closes the daemon's end of the socket and ends the process (before, a bad first
    frame escaped as a ValueError with both left open, and the other paths left the socket open)."""
    from localai.errors import WorkerLoadFailed

    script = tmp_path / "starts_badly.py"
    script.write_text(STARTS_BADLY[behaviour])

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def scenario() -> None:
        worker = BadWorker(script)
        before = open_fds()
        with pytest.raises(WorkerLoadFailed):
            await worker.start(2)
        assert worker.process is not None and worker.process.returncode is not None
        assert open_fds() <= before and worker._writer is None

    asyncio.run(scenario())


def test_a_crashed_workers_cache_owner_file_is_removed(smollm2_path: Path, tmp_path: Path) -> None:
    """A worker registers in its prompt-cache folder (``owners/<pid>``) and removes itself on a clean exit; one
    killed outright cannot, so the daemon removes the file when it sees the worker die."""
    async def scenario() -> None:
        worker = Worker("smollm2", "llama.cpp", {"model_path": str(smollm2_path), "num_ctx": 512, "n_parallel": 1,
                                                 "n_threads": threads(), "cache_dir": str(tmp_path / "cache")})
        exited = asyncio.Event()
        worker.on_exit = lambda _: exited.set()
        await worker.start(120)
        assert worker.pid is not None
        owners = list((tmp_path / "cache").glob(f"*/owners/{worker.pid}"))
        assert owners, "the worker did not register in its cache folder"
        os.kill(worker.pid, signal.SIGKILL)
        await asyncio.wait_for(exited.wait(), 60)
        assert not any(path.exists() for path in owners)

    asyncio.run(scenario())


def test_a_request_its_reader_left_still_reports_its_usage(smollm2_path: Path) -> None:
    """A stream whose client went away is cancelled; the worker's last frame for it (its usage) reaches the
    ``abandoned`` callback, so what it computed and generated is counted (in /metrics), not lost."""
    async def scenario() -> None:
        worker = smollm2_worker(smollm2_path)
        await worker.start(120)
        try:
            told: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
            frames = worker.generate(op("left", max_tokens=4000, ignore_eos=True, prompt="Count to a thousand:"),
                                     abandoned=lambda done: told.set_result(dict(done)))
            seen = [await anext(frames), await anext(frames)]
            assert [frame["ev"] for frame in seen] == ["prompt", "text"]
            await frames.aclose()  # type: ignore[attr-defined]
            done = await asyncio.wait_for(told, 60)
            assert done["finish_reason"] == "cancelled"
            usage = done["usage"]
            assert isinstance(usage, dict) and usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 1
            again = await drain(worker, op("after"))  # the worker serves on
            assert again[-1]["ev"] == "done"
        finally:
            await worker.stop()

    asyncio.run(scenario())
