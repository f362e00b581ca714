"""Smaller checks, in-process on the scripted engine: reasoning efforts are validated per dialect, and /api/info
probes the devices once however many ask (again only when asked to refresh)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest
from starlette.testclient import TestClient

from localai.api import info

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "ultra"}, "reasoning_effort"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "ultra"}}, "reasoning"),
    ("/v1/messages", {"max_tokens": 4, "messages": HI, "thinking": {"type": "ultra"}}, "thinking"),
    ("/v1/messages", {"max_tokens": 4, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": -5}},
     "thinking"),
    ("/api/chat", {"stream": False, "messages": HI, "think": "ultra"}, "think"),
    ("/api/generate", {"stream": False, "prompt": "hi", "think": "ultra"}, "think"),
])
def test_an_unknown_reasoning_effort_is_a_400_naming_it(api: TestClient, path: str, body: dict[str, Any],
                                                         param: str) -> None:
    response = api.post(path, json={"model": "smollm2", **body})
    assert response.status_code == 400 and param in response.text, response.text


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "xhigh", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "none", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "minimal", "summary": "auto"}, "max_output_tokens": 2}),
    ("/v1/messages", {"max_tokens": 2, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}}),
    ("/v1/messages", {"max_tokens": 2, "messages": HI, "thinking": {"type": "adaptive"}}),
    ("/api/chat", {"stream": False, "messages": HI, "think": "high", "options": {"num_predict": 2}}),
    ("/api/chat", {"stream": False, "messages": HI, "think": False, "options": {"num_predict": 2}}),
])
def test_every_known_effort_is_taken(api: TestClient, path: str, body: dict[str, Any]) -> None:
    response = api.post(path, json={"model": "smollm2", **body})
    assert response.status_code == 200, response.text


def test_the_device_probe_runs_once_however_many_ask(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[int] = []

    async def probe() -> dict[str, Any]:
        probes.append(1)
        await asyncio.sleep(0.3)  # a GPU backend's first initialisation takes a while
        return {"devices": [], "backends": ["CPU"]}

    monkeypatch.setattr(info, "llama_cpp_report", probe)
    api.app.state.devices = info.DeviceReport()  # type: ignore[attr-defined]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: api.get("/api/info").json(), range(20)))
    assert len(probes) == 1 and all(a["llama_cpp"]["backends"] == ["CPU"] for a in answers)
    assert api.get("/api/info").json()["llama_cpp"]["probed_at"] == answers[0]["llama_cpp"]["probed_at"]
    refreshed = api.get("/api/info", params={"refresh": "true"}).json()
    assert len(probes) == 2 and refreshed["llama_cpp"]["probed_at"] > answers[0]["llama_cpp"]["probed_at"]
