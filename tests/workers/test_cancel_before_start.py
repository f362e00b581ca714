"""A request its reader leaves before the worker started it (queued behind a busy slot), against a real worker on the
scripted engine: the worker answers the cancel with the request's done frame, so the daemon's handle forgets it and
its outcome is counted (issue 60, item 1: the entry waited for a frame that never came, for the worker's life)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from localai.errors import RequestTooLarge
from localai.protocol import DoneFrame, GenerateOp
from localai.workers import handle as handle_module
from localai.workers.handle import Worker


def scripted_worker(tmp_path: Path) -> Worker:
    return Worker("scripted", "scripted", {"model_path": str(tmp_path / "none"), "num_ctx": 512, "n_parallel": 1,
                                           "cache_dir": None})


def op(request_id: str, prompt: str) -> GenerateOp:
    return GenerateOp(op="generate", id=request_id, prompt=prompt, max_tokens=50, stop=[], sampling={})


def test_a_queued_request_its_reader_left_is_answered_and_forgotten(tmp_path: Path) -> None:
    async def scenario() -> None:
        worker = scripted_worker(tmp_path)
        await worker.start(60)
        try:
            busy = worker.generate(op("busy", "[[slow]]"))
            assert (await anext(busy))["ev"] == "prompt"  # it holds the worker's one slot
            told: asyncio.Future[DoneFrame] = asyncio.get_running_loop().create_future()
            queued = worker.generate(op("queued", "[[say:never sent]]"), idle=0.01, abandoned=told.set_result)
            assert (await anext(queued))["ev"] == "idle"  # sent (the op goes before the first wait), not started
            await queued.aclose()  # type: ignore[attr-defined]
            assert "queued" in worker._abandoned  # waiting for the worker's answer to the cancel
            done = await asyncio.wait_for(told, 30)
            assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] == 0
            assert worker._abandoned == {}
            await busy.aclose()  # type: ignore[attr-defined]
            after = [frame async for frame in worker.generate(op("after", "[[say:still serving]]"))]
            assert after[-1]["ev"] == "done" and worker._abandoned == {}
        finally:
            await worker.stop()

    asyncio.run(scenario())


def test_an_op_too_large_to_send_leaves_nothing_waiting_for_its_end(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An op the handle could not write never reached the worker: no cancel goes for it and nothing waits for its
    done frame (before, its ``abandoned`` entry stayed for the worker's life)."""
    async def scenario() -> None:
        worker = scripted_worker(tmp_path)
        await worker.start(60)
        try:
            monkeypatch.setattr(handle_module.protocol, "MAX_FRAME", 4096)
            with pytest.raises(RequestTooLarge):
                async for _ in worker.generate(op("huge", "x" * 10_000), abandoned=lambda done: None):
                    pass
            assert worker._abandoned == {}
            monkeypatch.undo()
            after = [frame async for frame in worker.generate(op("after", "[[say:fine]]"))]
            assert after[-1]["ev"] == "done"
        finally:
            await worker.stop()

    asyncio.run(scenario())
