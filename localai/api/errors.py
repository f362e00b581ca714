"""Each error becomes a response once, here, in the shape of the dialect that was asked."""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from localai import paths
from localai.api.validation import describe_validation
from localai.errors import LocalAIError, storage_full

log = logging.getLogger("localai.server")


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error"}.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(path: str, message: str, kind: str, status: int, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The error object in the dialect of ``path``: Ollama's ``{"error": str}``, Anthropic's or OpenAI's shape.
    The two without a field for it name the bad field at the start of the message."""
    if (is_ollama_path(path) or is_anthropic_path(path)) and param and param not in message:
        message = f"{param}: {message}"
    if is_ollama_path(path):
        return {"error": message}
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(request: Request, error: LocalAIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    body = error_body(request.url.path, error.message, error.error_type, error.status_code,
                      param=error.param, code=error.code)
    return JSONResponse(body, status_code=error.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LocalAIError)
    async def _localai(request: Request, exc: LocalAIError) -> JSONResponse:
        if exc.status_code >= 500:
            log.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
        return error_response(request, exc)

    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.OperationalError)
    async def _storage(request: Request, exc: Exception) -> JSONResponse:
        # a write that met a full disk outside the registry's thread (pins, a copy): the dialect's 507, not a
        # plain-text 500; any other such error is a 500 in the dialect's shape
        full = storage_full(exc, f"localai's files in {paths.home()}")
        if full is not None:
            log.warning("%s %s failed: %s", request.method, request.url.path, full.message)
            return error_response(request, full)
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(request, LocalAIError(f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = describe_validation(exc)
        body = error_body(request.url.path, message, "invalid_request_error", 400, param=field)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        body = error_body(request.url.path, message, kind, exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))
