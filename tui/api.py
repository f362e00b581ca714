"""What the TUI reads from the daemon, as typed records, through :class:`localai.client.AsyncClient`.

Every screen goes through :class:`DaemonAPI`; it never imports an engine and never opens the daemon's files.
Fields the daemon does not send yet (a model's ``engine``, a loaded model's ``queued`` count, a cache entry's
``model``) are read when present and shown as unknown otherwise.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from localai.client import AsyncClient
from localai.conversations import Conversation

SESSION_HEADER = "X-Session-Id"


def engine_of(item: dict[str, Any]) -> str:
    """The engine that runs a model: the daemon's ``engine`` field, else derived from the weights' format."""
    engine = item.get("engine")
    if isinstance(engine, str) and engine:
        return engine
    details = item.get("details") if isinstance(item.get("details"), dict) else {}
    return "mlx" if (details or {}).get("format") == "mlx" else "llama.cpp"


@dataclass(frozen=True)
class InstalledModel:
    """A row of ``/api/tags``, with the capabilities ``/api/show`` adds."""

    name: str
    size: int
    quantization: str
    family: str
    parameter_size: str
    context_length: int | None
    engine: str
    digest: str = ""
    capabilities: tuple[str, ...] = ()

    @classmethod
    def from_tags(cls, item: dict[str, Any], show: dict[str, Any] | None = None) -> InstalledModel:
        details = item.get("details") or {}
        show = show or {}
        return cls(name=item["name"], size=int(item.get("size") or 0),
                   quantization=str(details.get("quantization_level") or ""), family=str(details.get("family") or ""),
                   parameter_size=str(details.get("parameter_size") or ""),
                   context_length=show.get("num_ctx") or item.get("context_length"),
                   engine=engine_of({**item, **({"engine": show["engine"]} if show.get("engine") else {})}),
                   digest=str(item.get("digest") or ""),
                   capabilities=tuple(c for c in show.get("capabilities", ()) if c != "completion"))


@dataclass(frozen=True)
class LoadedModel:
    """A row of ``/api/ps``: a model with a live worker."""

    name: str
    pid: int | None
    context_length: int | None
    active: int
    queued: int | None
    expires_at: dt.datetime | None
    keep_alive: float
    engine: str
    processor: str
    size_vram: int = 0
    shared_with: tuple[str, ...] = ()  # the other models its worker serves (one copy of the weights)

    @classmethod
    def from_ps(cls, item: dict[str, Any]) -> LoadedModel:
        expires = item.get("expires_at")
        queued = item.get("queued", item.get("queued_requests"))
        return cls(name=item["name"], pid=item.get("pid"), context_length=item.get("context_length"),
                   active=int(item.get("active_requests") or 0), queued=None if queued is None else int(queued),
                   expires_at=dt.datetime.fromisoformat(expires.replace("Z", "+00:00")) if expires else None,
                   keep_alive=float(item.get("keep_alive") or 0), engine=engine_of(item),
                   processor=str(item.get("processor") or ""), size_vram=int(item.get("size_vram") or 0),
                   shared_with=tuple(str(m) for m in item.get("shared_with") or ()))

    def until(self, now: dt.datetime) -> str:
        """When the model unloads, as ``localai ps`` says it."""
        if self.expires_at is None:
            return "forever" if self.keep_alive < 0 else "busy"
        return "in " + duration(max(0.0, (self.expires_at - now).total_seconds()))


@dataclass(frozen=True)
class CacheEntry:
    """One persisted prompt-cache entry (``/api/cache``)."""

    id: str
    fingerprint: str
    tokens: int
    bytes: int
    session: str | None
    kind: str
    last_used: float
    pinned_until: float | None
    model: str | None = None  # the model its session asked for, or its cache folder's only model
    models: tuple[str, ...] = ()  # every model that used its cache folder (models sharing a worker share one)

    @classmethod
    def from_api(cls, item: dict[str, Any]) -> CacheEntry:
        return cls(id=item["id"], fingerprint=item.get("fingerprint", ""), tokens=int(item.get("tokens") or 0),
                   bytes=int(item.get("bytes") or 0), session=item.get("session"), kind=item.get("kind", "history"),
                   last_used=float(item.get("last_used") or 0), pinned_until=item.get("pinned_until"),
                   model=item.get("model"), models=tuple(str(m) for m in item.get("models") or ()))


@dataclass
class ModelCacheMetrics:
    """One model's prompt-cache counters from ``/metrics`` (cumulative since the daemon started)."""

    hits: float = 0
    misses: float = 0
    tokens_restored: float = 0
    prompt_cached: float = 0
    prompt_computed: float = 0
    requests: float = 0

    @property
    def token_hit_ratio(self) -> float | None:
        """The share of prompt tokens the engine did not compute (live KV or restored)."""
        total = self.prompt_cached + self.prompt_computed
        return self.prompt_cached / total if total else None


@dataclass
class DaemonMetrics:
    models: dict[str, ModelCacheMetrics] = field(default_factory=dict)
    queue_waiting: int = 0
    loaded_models: int = 0


_METRIC_FIELDS = {
    "localai_prompt_cache_hits_total": "hits", "localai_prompt_cache_misses_total": "misses",
    "localai_prompt_cache_tokens_restored_total": "tokens_restored",
    "localai_prompt_tokens_cached_total": "prompt_cached", "localai_prompt_tokens_computed_total": "prompt_computed",
    "localai_requests_total": "requests",
}


def parse_metrics(text: str) -> DaemonMetrics:
    """The counters the TUI shows, from Prometheus text (other samples are ignored)."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = DaemonMetrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "localai_queue_waiting":
                metrics.queue_waiting = int(sample.value)
            elif sample.name == "localai_loaded_models":
                metrics.loaded_models = int(sample.value)
            elif sample.name in _METRIC_FIELDS and "model" in sample.labels:
                model = metrics.models.setdefault(sample.labels["model"], ModelCacheMetrics())
                name = _METRIC_FIELDS[sample.name]
                setattr(model, name, getattr(model, name) + sample.value)
    return metrics


@dataclass
class PullProgress:
    """The state of one pull, folded from Ollama's progress objects."""

    name: str
    status: str = "starting"
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # digest -> (completed, total)
    done: bool = False

    def update(self, event: dict[str, Any]) -> None:
        self.status = str(event.get("status") or self.status)
        digest, total = event.get("digest"), event.get("total")
        if digest and total is not None:
            self.files[digest] = (int(event.get("completed") or 0), int(total))
        if self.status == "success":
            self.done = True
            self.files = {digest: (total, total) for digest, (_, total) in self.files.items()}

    @property
    def completed(self) -> int:
        return sum(completed for completed, _ in self.files.values())

    @property
    def total(self) -> int | None:
        return sum(total for _, total in self.files.values()) or None


class DaemonAPI:
    """The daemon's endpoints the TUI uses, each returning typed records."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def version(self) -> str:
        return str((await self.client.request("GET", "/api/version")).get("version", ""))

    async def models(self, *, with_details: bool = True) -> list[InstalledModel]:
        tags = (await self.client.request("GET", "/api/tags"))["models"]
        if not with_details:
            return [InstalledModel.from_tags(item) for item in tags]
        shows = await asyncio.gather(*(self.show(item["name"]) for item in tags), return_exceptions=True)
        return [InstalledModel.from_tags(item, show if isinstance(show, dict) else None)
                for item, show in zip(tags, shows, strict=True)]

    async def show(self, model: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.request("POST", "/api/show", {"model": model})
        return result

    async def delete(self, model: str) -> list[str]:
        return list((await self.client.request("DELETE", "/api/delete", {"model": model})).get("deleted", []))

    async def loaded(self) -> list[LoadedModel]:
        return [LoadedModel.from_ps(item) for item in (await self.client.request("GET", "/api/ps"))["models"]]

    async def unload(self, model: str) -> None:
        await self.client.request("POST", "/api/generate", {"model": model, "keep_alive": 0})

    async def cache(self) -> tuple[dict[str, Any], list[CacheEntry]]:
        result = await self.client.request("GET", "/api/cache")
        return result.get("stats", {}), [CacheEntry.from_api(item) for item in result.get("entries", [])]

    async def metrics(self) -> DaemonMetrics:
        return parse_metrics(await self.client.text("/metrics"))

    async def pin(self, *, session: str | None = None, entry: str | None = None, ttl: str = "1h") -> float:
        result = await self.client.request("POST", "/api/cache/pin", {"session": session, "entry": entry, "ttl": ttl})
        return float(result.get("expires_at") or 0)

    async def unpin(self, *, session: str | None = None, entry: str | None = None) -> bool:
        result = await self.client.request("DELETE", "/api/cache/pin", {"session": session, "entry": entry})
        return bool(result.get("removed"))

    async def remove_entry(self, entry: str) -> int:
        return int((await self.client.request("DELETE", f"/api/cache/{entry}")).get("removed") or 0)

    async def prune(self) -> int:
        return int((await self.client.request("POST", "/api/cache/prune", {})).get("removed") or 0)

    def pull(self, model: str) -> AsyncIterator[dict[str, Any]]:
        return self.client.stream("/api/pull", {"model": model, "stream": True})

    def chat(self, conversation: Conversation) -> AsyncIterator[dict[str, Any]]:
        """Stream a reply to the conversation; its id is the prompt-cache session."""
        body = {"model": conversation.model, "messages": conversation.api_messages(), "stream": True,
                "options": conversation.options}
        return self.client.stream("/api/chat", body, {SESSION_HEADER: conversation.id})


def duration(seconds: float) -> str:
    """``4m 10s``, ``2h 5m``, ``12s``."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h {seconds % 3600 // 60}m"
    if seconds >= 60:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds}s"

