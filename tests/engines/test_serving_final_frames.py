"""Every generate op the serving loop takes ends with exactly one final frame (done or error), whatever happens to it:
one cancelled while it waits for a slot, one held behind its conversation's warm prefill, one still waiting when the
worker stops. Before (issue 60, item 1), those were dropped without a frame, and the daemon's handle waited for one
for the worker's life (its ``_abandoned`` entry and its usage never reached /metrics)."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

from localai.engines.engine import LoadOptions
from localai.engines.scripted import ScriptedEngine
from localai.engines.serving import Serving


def serving(tmp_path: Path, n_parallel: int = 1) -> Serving:
    load = LoadOptions(model_path="scripted", num_ctx=4096, n_parallel=n_parallel, cache_dir=str(tmp_path / "cache"))
    return Serving(ScriptedEngine(load), load)


def generate(request_id: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "id": request_id, "prompt": prompt, "sampling": {"temperature": 0}, "max_tokens": 400,
            **extra}


def final_frames(events: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each request's final frames: the finish reason of each done frame, "error" for each error frame."""
    ends: dict[str, list[str]] = {}
    for event in events:
        if event["ev"] in ("done", "error"):
            ends.setdefault(event["id"], []).append(event.get("finish_reason", "error"))
    return ends


def test_a_request_cancelled_while_it_waits_for_a_slot_gets_its_done_frame(tmp_path: Path) -> None:
    loop = serving(tmp_path)
    events: list[dict[str, Any]] = []
    loop._handle(generate("busy", "[[slow]]"), events.append)
    loop._handle(generate("queued", "[[say:never]]"), events.append)
    loop._admit(events.append)
    assert "busy" in loop.requests and [op["id"] for op in loop.waiting] == ["queued"]
    loop._handle({"op": "cancel", "id": "queued"}, events.append)
    assert final_frames(events) == {"queued": ["cancelled"]}
    done = events[-1]
    assert done["usage"]["prompt_tokens"] == 0 and done["usage"]["completion_tokens"] == 0  # it never started
    assert not loop.waiting
    loop._handle({"op": "cancel", "id": "queued"}, events.append)  # a second cancel: no second frame
    loop._handle({"op": "cancel", "id": "busy"}, events.append)
    assert final_frames(events) == {"queued": ["cancelled"], "busy": ["cancelled"]}


def test_a_request_held_behind_its_conversations_warm_prefill_gets_its_done_frame_when_cancelled(
        tmp_path: Path) -> None:
    loop = serving(tmp_path, n_parallel=2)
    events: list[dict[str, Any]] = []
    loop._handle(generate("warm", "session s1 so far", warm=True, session="s1", max_tokens=0), events.append)
    loop._admit(events.append)
    loop._handle(generate("next", "session s1 so far, and the next turn", session="s1"), events.append)
    loop._admit(events.append)
    assert "warm" in loop.requests and [op["id"] for op in loop.waiting] == ["next"]  # held, a slot free
    loop._handle({"op": "cancel", "id": "next"}, events.append)
    assert final_frames(events) == {"next": ["cancelled"]}
    assert not loop.waiting


def test_requests_still_waiting_when_the_worker_stops_each_get_their_done_frame(tmp_path: Path) -> None:
    """The real loop (``serve``) on its own thread: the stop arrives while one request runs, two wait for the slot
    and a warm prefill waits too. The two are cancelled with a frame each; the warm one is still prefilled."""
    loop = serving(tmp_path)
    inbox: queue.Queue[Any] = queue.Queue()
    events: list[dict[str, Any]] = []

    def emit(frame: Any) -> None:
        events.append(frame)
        if frame["ev"] == "prompt" and frame["id"] == "running":  # it has the slot: the others queue, then the stop
            for op in (generate("second", "[[say:two]]"), generate("third", "[[say:three]]"),
                       generate("warm", "a reply to save", warm=True, max_tokens=0)):
                inbox.put(op)
            inbox.put(None)

    inbox.put(generate("running", "[[slow]]"))
    thread = threading.Thread(target=loop.serve, args=(inbox, emit), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert final_frames(events) == {"running": ["cancelled"], "second": ["cancelled"], "third": ["cancelled"],
                                    "warm": ["stop"]}
