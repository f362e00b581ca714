"""The ASGI app: ``create_app(settings, runtime)``, called by the daemon and by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import localai.api.pull as pull_api
from localai import __version__, paths
from localai.api import (
    anthropic,
    cache,
    info,
    ollama,
    ollama_models,
    openai,
    rerank,
    responses,
    responses_compaction,
    responses_socket,
)
from localai.api.body_check import BodyChecker
from localai.api.errors import install_error_handlers
from localai.api.security import (
    BodyGuardMiddleware,
    GuardMiddleware,
    JsonBodyMiddleware,
    KeyRing,
    has_key,
    is_loopback_host,
)
from localai.models import renderer
from localai.models.watcher import ModelfileWatcher, stop_quietly
from localai.runtime.runtime import Runtime
from localai.settings import Settings


def create_app(settings: Settings, runtime: Runtime) -> FastAPI:
    """The app; raises ValueError when LOCALAI_API_KEY_FILE cannot be read (the daemon must not start open)."""
    keys = KeyRing.load(settings.api_key, settings.api_key_file)
    checker = BodyChecker()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        renderer.pool()  # the render processes start now, not on the first chat
        watcher = app.state.watcher = ModelfileWatcher(paths.user_modelfiles_dir(), runtime.registry,
                                                       unload=runtime.unload)
        watching = asyncio.create_task(watcher.run(), name="modelfile-watcher")
        yield
        await stop_quietly(watcher, watching)
        await runtime.settle()  # replies still being prefilled reach their workers before the workers stop
        await runtime.scheduler.shutdown()
        await runtime.remotes.shutdown()
        renderer.shutdown()
        checker.close()

    app = FastAPI(title="localai", version=__version__, lifespan=lifespan)
    app.state.runtime = runtime
    app.state.settings = settings
    app.state.keys = keys
    app.state.body_checker = checker
    app.state.devices = info.DeviceReport()  # /api/info's device probe, kept
    install_error_handlers(app)

    started_at = time.time()
    host, _ = settings.bind
    loopback = is_loopback_host(host)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness; the version and the loaded models only for a caller who may see them (open without a key)."""
        if not has_key(request.scope):
            return JSONResponse({"status": "ok"})
        body: dict[str, Any] = {"status": "ok", "version": __version__,
                                "loaded_models": list(runtime.scheduler.loaded)}
        server = request.scope.get("server")
        over_socket = server is None or server[1] is None  # the Unix socket has no port
        # Who this daemon is, for `localai status`/`stop` and for a second `serve` on its port: told to this
        # machine only (loopback, or the socket), never to a network the daemon was opened to.
        if loopback or over_socket:
            body.update(pid=os.getpid(), home=str(paths.home()), url=settings.base_url, started_at=started_at)
        return JSONResponse(body)

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("localai is running")

    app.add_api_route("/", root, methods=["HEAD"], include_in_schema=False)  # one operation id per schema path

    @app.get("/metrics")
    async def metrics() -> Response:
        scheduler = runtime.scheduler
        body = scheduler.metrics.render(len(scheduler.loaded), scheduler.waiting)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(responses_compaction.router)
    app.include_router(responses_socket.router)
    app.include_router(anthropic.router)
    app.include_router(ollama.router)
    app.include_router(ollama_models.router)
    app.include_router(cache.router)
    app.include_router(info.router)
    app.include_router(pull_api.router)
    app.include_router(rerank.router)
    if settings.origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.origins, allow_methods=["*"], allow_headers=["*"],
        )
    app.add_middleware(BodyGuardMiddleware, max_bytes=settings.max_request_bytes, checker=checker)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(GuardMiddleware, loopback_only=loopback, keys=keys, origins=settings.origins)
    return app
