"""A child session (a sub-agent's or a side request's, ``schema.child_session``) whose prompt extends its parent's
sequence never takes the parent's slot while another is free: it copies the shared prefix and the parent's slot stays
as it was, so the parent's next turn continues live (a real serving loop on the scripted engine, two slots)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localai.engines.engine import LoadOptions
from localai.engines.scripted import ScriptedEngine
from localai.engines.serving import Serving
from localai.schema import child_session

PARENT = "You are the main agent. " * 20 + "user: compact this conversation."


def run(loop: Serving, events: list[dict[str, Any]], op: dict[str, Any]) -> dict[str, Any]:
    """Serve one op to its end; its prompt frame."""
    loop._handle({"op": "generate", "sampling": {"temperature": 0}, "max_tokens": 4, **op}, events.append)
    loop._admit(events.append)
    for _ in range(10_000):
        if op["id"] not in loop.requests:
            break
        loop._step(events.append)
    assert any(e["ev"] == "done" and e["id"] == op["id"] for e in events), events[-3:]
    return next(e for e in events if e["ev"] == "prompt" and e["id"] == op["id"])


def test_a_child_session_extending_its_parent_copies_the_prefix_and_leaves_the_parents_slot(tmp_path: Path) -> None:
    load = LoadOptions(model_path="scripted", num_ctx=4096, n_parallel=2, cache_dir=str(tmp_path / "cache"))
    loop = Serving(ScriptedEngine(load), load)
    events: list[dict[str, Any]] = []
    run(loop, events, {"id": "p1", "prompt": PARENT + " [[say:ok]]", "session": "s1"})
    parent_slot = next(slot for slot in loop.slots if slot.session == "s1")
    held = list(parent_slot.tokens)
    # a side request (Codex's compaction, say) whose prompt extends all the parent's slot holds (its reply too)
    extended = bytes(held).decode() + " and summarise it [[say:sum]]"
    side = run(loop, events, {"id": "c1", "prompt": extended, "session": child_session("s1", "compaction")})
    first_prompt = len((PARENT + " [[say:ok]]").encode())  # the scripted engine's tokens are the prompt's bytes
    assert side["cached_tokens"] >= first_prompt - 1  # the shared prefix was copied, not computed
    assert parent_slot.session == "s1" and parent_slot.tokens == held  # the parent's slot is as it was
    again = run(loop, events, {"id": "p2", "prompt": bytes(held).decode() + " next turn", "session": "s1"})
    assert again["cache"]["source"] == "live" and again["cached_tokens"] >= first_prompt - 1
    # with one slot only, the child takes what there is (a request is never refused for it)
    load1 = LoadOptions(model_path="scripted", num_ctx=4096, n_parallel=1, cache_dir=str(tmp_path / "cache1"))
    single = Serving(ScriptedEngine(load1), load1)
    run(single, events, {"id": "q1", "prompt": PARENT, "session": "s2"})
    assert run(single, events, {"id": "q2", "prompt": PARENT + " more", "session": child_session("s2", "memory")})[
        "cached_tokens"] > 0
