"""The serving loop's admission, driven op by op on the scripted engine (no worker process): a request that fails
while it starts gives its slot back, and a warm prefill holds back only its own conversation's next turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localai.engines.engine import LoadOptions
from localai.engines.scripted import ScriptedEngine
from localai.engines.serving import Serving


def serving(tmp_path: Path, n_parallel: int = 2) -> Serving:
    load = LoadOptions(model_path="scripted", num_ctx=4096, n_parallel=n_parallel, cache_dir=str(tmp_path / "cache"))
    return Serving(ScriptedEngine(load), load)


def generate(request_id: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "id": request_id, "prompt": prompt, "sampling": {"temperature": 0}, "max_tokens": 4,
            **extra}


def test_a_request_that_fails_while_starting_gives_its_slot_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    loop = serving(tmp_path)
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize",
                        lambda text: (_ for _ in ()).throw(RuntimeError("tokenizer broke")) if text == "SYS"
                        else real(text))
    events: list[dict[str, Any]] = []
    for n in range(3):  # more than the two slots: a leaked slot would keep the third waiting forever
        loop._handle(generate(f"r{n}", "SYS and the rest of the prompt", system_prefix="SYS"), events.append)
        loop._admit(events.append)
    assert [e["id"] for e in events if e["ev"] == "error"] == ["r0", "r1", "r2"]
    assert not any(slot.busy for slot in loop.slots) and not loop.requests and not loop.waiting


def test_a_warm_prefill_without_a_session_holds_back_only_its_own_next_turn(tmp_path: Path) -> None:
    loop = serving(tmp_path, n_parallel=3)
    events: list[dict[str, Any]] = []
    loop._handle(generate("warm", "conversation A so far", warm=True), events.append)
    loop._admit(events.append)
    assert "warm" in loop.requests  # prefilling (no decode step has run)
    loop._handle(generate("other", "an unrelated prompt from another client"), events.append)
    loop._handle(generate("next", "conversation A so far, and the next turn"), events.append)
    loop._handle(generate("again", "conversation A so far"), events.append)  # the same prompt sent again
    loop._handle(generate("mine", "session work", session="s1"), events.append)
    loop._admit(events.append)
    assert "other" in loop.requests  # before: held back by any warm prefill without a session
    assert [op["id"] for op in loop.waiting] == ["next", "again"]  # wait for the prefill they start from
    assert "mine" in loop.requests  # another session is never held back
