"""A scripted stand-in for the daemon's API (an httpx MockTransport), with fixed data for snapshot tests and
fast Pilot tests. The same paths run against the real daemon in test_live.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from localai.client import AsyncClient

NOW = dt.datetime(2026, 1, 15, 12, 0, 0, tzinfo=dt.UTC)
SMOLLM2_DIGEST = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_DIGEST = "7c3a1f0b5e2d4c6a8b9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d"
FINGERPRINT = "4f1c2a9e0b7d3c5e6f8a9b0c1d2e3f40"

REPLY = """Here is a function that reverses a list:

```python
def reverse(items):
    return items[::-1]
```

It returns a new list and leaves `items` as it was."""


def tag(name: str, digest: str, size: int, quant: str, params: str, family: str, context: int) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": "2026-01-14T09:30:00Z", "size": size, "digest": digest,
            "details": {"parent_model": "", "format": "gguf", "family": family, "families": [family],
                        "parameter_size": params, "quantization_level": quant},
            "context_length": context}


@dataclass
class FakeDaemon:
    """What the fake answers; tests change it and read ``requests`` back."""

    models: list[dict[str, Any]] = field(default_factory=lambda: [
        tag("qwen2.5-coder:1.5b", QWEN_DIGEST, 986_048_768, "Q4_K_M", "1.5B", "qwen2", 32768),
        tag("smollm2:135m", SMOLLM2_DIGEST, 98_362_432, "Q4_1", "135M", "llama", 8192),
        tag("smollm2:latest", SMOLLM2_DIGEST, 98_362_432, "Q4_1", "135M", "llama", 8192),
    ])
    loaded: list[dict[str, Any]] = field(default_factory=lambda: [{
        "name": "smollm2:135m", "model": "smollm2:135m", "size": 98_362_432, "digest": SMOLLM2_DIGEST,
        "details": {"format": "gguf"}, "expires_at": (NOW + dt.timedelta(minutes=4, seconds=10)).isoformat(),
        "size_vram": 51_380_224, "context_length": 8192, "active_requests": 1, "processor": "48%/52% CPU/GPU",
        "pid": 4242, "shared_with": ["pirate:latest"],
        "keep_alive": 300.0,
    }, {  # a persona FROM smollm2 (its own SYSTEM): the same worker
        "name": "pirate:latest", "model": "pirate:latest", "size": 98_362_432, "digest": SMOLLM2_DIGEST,
        "details": {"format": "gguf"}, "expires_at": (NOW + dt.timedelta(minutes=2)).isoformat(),
        "size_vram": 51_380_224, "context_length": 8192, "active_requests": 0, "processor": "48%/52% CPU/GPU",
        "pid": 4242, "shared_with": ["smollm2:135m"], "keep_alive": 300.0,
    }])
    entries: list[dict[str, Any]] = field(default_factory=lambda: [
        {"id": "a1b2c3d4e5f60718293a4b5c", "fingerprint": FINGERPRINT, "tokens": 1187, "bytes": 27_410_000,
         "session": "5e551on0000000000000000000000001", "kind": "history",
         "last_used": (NOW - dt.timedelta(minutes=3)).timestamp(), "pinned_until": None},
        {"id": "0f9e8d7c6b5a493827161504", "fingerprint": FINGERPRINT, "tokens": 412, "bytes": 9_520_000,
         "session": None, "kind": "system", "last_used": (NOW - dt.timedelta(hours=2)).timestamp(),
         "pinned_until": (NOW + dt.timedelta(hours=1)).timestamp()},
    ])
    metrics: str = (
        'localai_prompt_cache_hits_total{model="smollm2:135m"} 3.0\n'
        'localai_prompt_cache_misses_total{model="smollm2:135m"} 2.0\n'
        'localai_prompt_cache_tokens_restored_total{model="smollm2:135m"} 1100.0\n'
        'localai_prompt_tokens_cached_total{model="smollm2:135m"} 2950.0\n'
        'localai_prompt_tokens_computed_total{model="smollm2:135m"} 650.0\n'
        'localai_requests_total{model="smollm2:135m",outcome="ok"} 5.0\n'
        "localai_queue_waiting 0.0\nlocalai_loaded_models 1.0\n"
    )
    reply: str = REPLY
    thinking: str = ""  # streamed first, as Ollama's message.thinking (a thinking model's reasoning)
    reply_delay: float = 0.0
    """Seconds between streamed pieces; with ``hold`` the stream stops after the first piece until released."""
    hold: asyncio.Event | None = None
    pull_error: str | None = None
    requests: list[tuple[str, str, Any]] = field(default_factory=list)

    def client(self) -> AsyncClient:
        return AsyncClient(transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        path, method = request.url.path, request.method
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/api/version":
            return httpx.Response(200, json={"version": "0.1.0"})
        if path == "/api/tags":
            return httpx.Response(200, json={"models": self.models})
        if path == "/api/show":
            return self._show(body["model"])
        if path == "/api/ps":
            return httpx.Response(200, json={"models": self.loaded})
        if path == "/api/generate" and body.get("keep_alive") == 0:
            self.loaded = [m for m in self.loaded if m["name"] != body["model"]]
            return httpx.Response(200, json={"done": True, "done_reason": "unload"})
        if path == "/api/cache":
            return httpx.Response(200, json={"stats": self._stats(), "entries": self.entries})
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        if path == "/api/cache/pin":
            return httpx.Response(200, json={"removed": True} if method == "DELETE" else
                                  {"session": body["session"], "entry": body["entry"], "expires_at": 0})
        if path == "/api/cache/prune":
            return httpx.Response(200, json={"removed": 0})
        if path == "/api/delete":
            self.models = [m for m in self.models if m["name"] != body["model"]]
            return httpx.Response(200, json={"deleted": [body["model"]]})
        if path == "/api/chat":
            return httpx.Response(200, stream=ChatStream(self), headers={"content-type": "application/x-ndjson"})
        if path == "/api/pull":
            if self.pull_error:
                return httpx.Response(404, json={"error": self.pull_error})
            return httpx.Response(200, stream=PullStream(body["model"]))
        return httpx.Response(404, json={"error": f"no route {path}"})

    def _show(self, name: str) -> httpx.Response:
        full = name if ":" in name else f"{name}:latest"
        model = next((m for m in self.models if m["name"] == full), None)
        if model is None:
            return httpx.Response(404, json={"error": f"model '{name}' is not installed; run: localai pull {name}"})
        return httpx.Response(200, json={
            "modelfile": "FROM /models/weights.gguf\n", "parameters": 'num_ctx              8192\nstop "<|im_end|>"',
            "template": "{{ messages }}", "system": "", "license": "Apache 2.0", "details": model["details"],
            "model_info": {}, "capabilities": ["completion", "tools"], "path": "/models/weights.gguf",
            "num_ctx": model["context_length"],
        })

    def _stats(self) -> dict[str, Any]:
        return {"entries": len(self.entries), "bytes": sum(e["bytes"] for e in self.entries),
                "tokens": sum(e["tokens"] for e in self.entries),
                "sessions": len({e["session"] for e in self.entries if e["session"]}),
                "pinned": sum(1 for e in self.entries if e["pinned_until"]), "fingerprints": 1, "pins": 1}


class ChatStream(httpx.AsyncByteStream):
    """The reply in word-sized pieces, then Ollama's final object with localai's ``prompt_cache_count``."""

    def __init__(self, daemon: FakeDaemon) -> None:
        self.daemon = daemon
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for word in self.daemon.thinking.split(" ") if self.daemon.thinking else []:
            yield _line({"message": {"role": "assistant", "content": "", "thinking": word + " "}, "done": False})
        words = self.daemon.reply.split(" ")
        for index, word in enumerate(words):
            piece = word if index == len(words) - 1 else word + " "
            yield _line({"message": {"role": "assistant", "content": piece}, "done": False})
            if self.daemon.hold is not None:
                await self.daemon.hold.wait()
            if self.daemon.reply_delay:
                await asyncio.sleep(self.daemon.reply_delay)
        yield _line({"message": {"role": "assistant", "content": ""}, "done": True, "prompt_eval_count": 120,
                     "prompt_cache_count": 96, "eval_count": 32, "eval_duration": 400_000_000})

    async def aclose(self) -> None:
        self.closed = True


class PullStream(httpx.AsyncByteStream):
    def __init__(self, name: str) -> None:
        self.name = name

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield _line({"status": "pulling manifest"})
        for completed in (0, 40_000_000, 92_000_000):
            yield _line({"status": "pulling 9c8d2e", "digest": "sha256:9c8d2e", "total": 92_000_000,
                         "completed": completed})
        yield _line({"status": "verifying sha256 digest"})
        yield _line({"status": "success"})


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item) + "\n").encode()
