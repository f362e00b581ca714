"""``/api/cache``: the persisted prompt cache's entries, statistics, pins, removal and pruning.

The handlers are plain functions: they scan and delete files, so FastAPI runs them on its thread pool,
off the event loop that streams everyone's tokens. With several API keys, a key sees and removes only its own
entries (its cache partitions) and divergences; the machine's owner (the Unix socket) sees them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictInt

from localai.api.common import ParsedBodyRoute
from localai.api.security import KeyRing, principal_of
from localai.errors import Forbidden, InvalidRequest
from localai.promptcache import admin, divergences, pins
from localai.runtime.runtime import Runtime
from localai.settings import Settings, parse_duration

router = APIRouter(route_class=ParsedBodyRoute)


class PinBody(BaseModel):
    session: str | None = Field(default=None, description="Pin every entry of this session.")
    entry: str | None = Field(default=None, description="Pin one entry (a prefix), by id.")
    ttl: str | float = Field(default="1h", description="How long the pin holds: seconds or 30m/1h.")


class PruneBody(BaseModel):
    older_than: str | float | None = None
    max_bytes: StrictInt | None = Field(default=None, ge=0)


def seconds(value: str | float, field: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=field) from exc


def visible(request: Request) -> admin.Visible | None:
    """Which cache partitions the caller may see: all (None) for the machine's owner, or when keys are not
    distinct; else those of its own key (its salted ones included)."""
    keys: KeyRing = request.app.state.keys
    principal = principal_of(request.scope)
    if not keys.distinct or not principal:
        return None
    return lambda partition: partition.split(".", 1)[0] == principal


@router.get("/api/cache")
def list_cache(request: Request) -> dict[str, Any]:
    shown = visible(request)
    totals, entries = admin.overview(visible=shown)
    recent = [d for d in divergences.read() if shown is None or shown(d.partition)][-50:]
    namer = model_namer(request.app.state.runtime)
    return {"stats": totals, "entries": [{**asdict(e), **namer(e.fingerprint, e.session)} for e in entries],
            "divergences": [asdict(d) for d in recent]}


def model_namer(runtime: Runtime) -> Callable[[str, str | None], dict[str, Any]]:
    """Names an entry's model: ``models``, every model that used its cache folder (workers' folders now, and those
    recorded before); ``model``, the one its session asked for, else the folder's only model (None when models
    that share a worker share the folder and the session is not known)."""
    used: dict[str, set[str]] = {}
    for fingerprint, names in runtime.registry.for_this_thread().cache_models().items():
        used.setdefault(fingerprint, set()).update(names)
    for shared in list(runtime.scheduler.workers.values()):
        if shared.fingerprint is not None:
            used.setdefault(shared.fingerprint, set()).update(list(shared.models))
    sessions = dict(runtime.sessions.models)

    def name(fingerprint: str, session: str | None) -> dict[str, Any]:
        models = sorted(used.get(fingerprint, ()))
        asked = sessions.get(session) if session else None
        model = asked if asked in models else (models[0] if len(models) == 1 else None)
        return {"model": model, "models": models}

    return name


def owner(request: Request) -> str | None:
    """Whose pins the caller makes and removes: its key's id when several keys share the daemon; None for the
    machine's owner (who removes anyone's)."""
    return principal_of(request.scope) if visible(request) is not None else None


def _own_entry(request: Request, entry: str) -> bool:
    shown = visible(request)
    return shown is None or any(e.id == entry for e in admin.list_entries(visible=shown))


@router.post("/api/cache/pin")
def pin(body: PinBody, request: Request) -> dict[str, Any]:
    if body.entry and not _own_entry(request, body.entry):
        raise InvalidRequest(f"no cache entry '{body.entry[:100]}' of this API key", param="entry")
    created = pins.add_pin(session=body.session, entry=body.entry, ttl=seconds(body.ttl, "ttl"),
                           owner=owner(request) or "")
    return asdict(created)


@router.delete("/api/cache/pin")
def unpin(body: PinBody, request: Request) -> dict[str, Any]:
    """A key removes its own session pins and the pins of its own entries; another key's and an unknown one get
    the same answer (nothing tells a key which names are pinned)."""
    if body.entry and not _own_entry(request, body.entry):
        return {"removed": False}
    return {"removed": pins.remove_pin(session=body.session, entry=body.entry, owner=owner(request))}


@router.delete("/api/cache/{entry_id}")
def remove(entry_id: str, request: Request) -> dict[str, Any]:
    return {"removed": admin.remove_entries(entry=entry_id, visible=visible(request))}


@router.post("/api/cache/prune")
def prune(body: PruneBody, request: Request) -> dict[str, Any]:
    if visible(request) is not None:
        raise Forbidden("pruning the whole cache is for the machine's owner when several API keys share the daemon: "
                        "use the Unix socket or `localai cache prune`; a key removes its own entries with "
                        "DELETE /api/cache/{id}")
    settings: Settings = request.app.state.settings
    older = seconds(body.older_than, "older_than") if body.older_than is not None else None
    limit = body.max_bytes if body.max_bytes is not None else settings.cache_max_bytes
    return {"removed": admin.prune(max_bytes=limit, older_than=older)}
