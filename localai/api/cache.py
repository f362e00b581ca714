"""``/api/cache``: the persisted prompt cache's entries, statistics, pins, removal and pruning.

The handlers are plain functions: they scan and delete files, so FastAPI runs them on its thread pool,
off the event loop that streams everyone's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from localai.errors import InvalidRequest
from localai.promptcache import admin, divergences, pins
from localai.runtime.runtime import Runtime
from localai.settings import Settings, parse_duration

router = APIRouter()


class PinBody(BaseModel):
    session: str | None = Field(default=None, description="Pin every entry of this session.")
    entry: str | None = Field(default=None, description="Pin one entry (a prefix), by id.")
    ttl: str | float = Field(default="1h", description="How long the pin holds: seconds or 30m/1h.")


class PruneBody(BaseModel):
    older_than: str | float | None = None
    max_bytes: int | None = Field(default=None, ge=0)


def seconds(value: str | float, field: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=field) from exc


@router.get("/api/cache")
def list_cache(request: Request) -> dict[str, Any]:
    totals, entries = admin.overview()
    namer = model_namer(request.app.state.runtime)
    return {"stats": totals, "entries": [{**asdict(e), **namer(e.fingerprint, e.session)} for e in entries],
            "divergences": [asdict(d) for d in divergences.read()[-50:]]}


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
    sessions = dict(runtime.session_models)

    def name(fingerprint: str, session: str | None) -> dict[str, Any]:
        models = sorted(used.get(fingerprint, ()))
        asked = sessions.get(session) if session else None
        model = asked if asked in models else (models[0] if len(models) == 1 else None)
        return {"model": model, "models": models}

    return name


@router.post("/api/cache/pin")
def pin(body: PinBody) -> dict[str, Any]:
    created = pins.add_pin(session=body.session, entry=body.entry, ttl=seconds(body.ttl, "ttl"))
    return asdict(created)


@router.delete("/api/cache/pin")
def unpin(body: PinBody) -> dict[str, Any]:
    return {"removed": pins.remove_pin(session=body.session, entry=body.entry)}


@router.delete("/api/cache/{entry_id}")
def remove(entry_id: str) -> dict[str, Any]:
    return {"removed": admin.remove_entries(entry=entry_id)}


@router.post("/api/cache/prune")
def prune(body: PruneBody, request: Request) -> dict[str, Any]:
    settings: Settings = request.app.state.settings
    older = seconds(body.older_than, "older_than") if body.older_than is not None else None
    limit = body.max_bytes if body.max_bytes is not None else settings.cache_max_bytes
    return {"removed": admin.prune(max_bytes=limit, older_than=older)}
