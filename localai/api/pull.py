"""``POST /api/pull`` (Ollama's shape: NDJSON progress, or one object with ``stream: false``; with localai's
``dry_run``, the plan alone: what the pull would fetch and the free disk) and
``GET /api/modelfiles`` (the user Modelfiles the daemon watches, with the error of each broken one)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from localai.api.common import ParsedBodyRoute
from localai.errors import InvalidRequest
from localai.models import pull as pulling
from localai.models.hub import TOKEN_HEADER
from localai.runtime.runtime import Runtime
from localai.settings import Settings

router = APIRouter(route_class=ParsedBodyRoute)
log = logging.getLogger("localai.server.pull")


class PullBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    stream: bool = True
    insecure: bool = False  # Ollama's field; the hub is always HTTPS (or HF_ENDPOINT)
    # localai's: only plan the pull (what it fetches, how many bytes, the free disk), fetch nothing
    dry_run: bool = False


@router.post("/api/pull", response_model=None)
async def pull(body: PullBody, request: Request) -> JSONResponse | StreamingResponse:
    name = body.model or body.name
    if not name:
        raise InvalidRequest("'model' is required", param="model")
    runtime: Runtime = request.app.state.runtime
    settings: Settings = request.app.state.settings
    token = request.headers.get(TOKEN_HEADER) or None
    # Planning raises every fixable error (bad name, missing repo or quant, disk) before streaming starts.
    plan = await asyncio.to_thread(pulling.plan, name, settings, token)
    if body.dry_run:
        return JSONResponse(await asyncio.to_thread(pulling.describe, plan))
    job = pulling.PullJob(plan, runtime.registry, token).start()
    watcher = getattr(request.app.state, "watcher", None)
    if not body.stream:
        await job.wait()
        if watcher is not None:
            watcher.poke()  # Modelfiles FROM these weights may now build
        return JSONResponse({"status": "success"})

    async def stream() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for event in job.events():
                yield (json.dumps(event) + "\n").encode()
            finished = True
            if job.record is not None and watcher is not None:
                watcher.poke()
        finally:
            if not finished:
                log.info("the client stopped pulling %s; the download stops, its bytes are kept", plan.name)
                job.cancel()

    return StreamingResponse(stream(), media_type="application/x-ndjson")


@router.get("/api/modelfiles")
async def modelfiles(request: Request) -> dict[str, Any]:
    watcher = getattr(request.app.state, "watcher", None)
    return {"modelfiles": watcher.report() if watcher is not None else []}
