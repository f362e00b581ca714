"""The Responses API's WebSocket mode on ``/v1/responses`` (Codex's transport): ``response.create`` events in,
each response's events out, one response at a time, as many turns as the client likes."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from localai.api.body_check import BodyChecker
from localai.api.common import runtime_of
from localai.api.limits import BodyProblem
from localai.api.responses import ResponseRun, ResponsesRequest, start_response
from localai.api.security import checked_json
from localai.api.validation import describe_validation
from localai.errors import InvalidRequest, LocalAIError, RequestTooLarge
from localai.schema import KeepAlive
from localai.settings import Settings

router = APIRouter()
log = logging.getLogger("localai.server")

SOCKET_REMEMBERS = 16  # responses a connection keeps for previous_response_id, stored or not (newest last)


def socket_error(exc: LocalAIError) -> dict[str, Any]:
    """An error event: the request's problem in the HTTP error's shape, with its status."""
    return {"type": "error", "status": exc.status_code,
            "error": {"type": exc.error_type, "code": exc.code or exc.error_type, "message": exc.message,
                      "param": exc.param}}


async def socket_request(text: str | None, limit: int, checker: BodyChecker) -> ResponsesRequest:
    """A client message as a request: one ``response.create`` event holding POST /v1/responses' fields, checked
    as an HTTP body is (``limits.py``; a large one in the checker process), so what is a 400 over HTTP is a 400
    error event here."""
    if text is None:
        raise InvalidRequest("messages must be text frames holding JSON")
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise RequestTooLarge(f"the message is over the limit of {limit} bytes (LOCALAI_MAX_REQUEST_BYTES)")
    try:
        message = await checked_json(text, checker)
    except BodyProblem as exc:
        raise (RequestTooLarge if exc.status == 413 else InvalidRequest)(str(exc)) from None
    if message is None:
        raise InvalidRequest("the message is not valid JSON")
    if not isinstance(message, dict) or message.get("type") != "response.create":
        raise InvalidRequest("the only client event is {\"type\": \"response.create\", ...}", param="type")
    fields = {key: value for key, value in message.items() if key not in ("type", "stream")}
    if isinstance(fields.get("response"), dict):  # the fields nested under "response", as some clients send them
        fields = {**fields.pop("response"), **fields}
    try:
        return ResponsesRequest.model_validate(fields)
    except ValidationError as exc:
        problem, where = describe_validation(exc)
        raise InvalidRequest(problem, param=where) from exc


@router.websocket("/v1/responses")
async def responses_socket(websocket: WebSocket) -> None:
    """WebSocket mode: the client sends ``response.create`` events (POST /v1/responses' fields; streaming is
    implicit) and receives each response's events on the same socket, one response at a time, as many turns as
    it likes. ``previous_response_id`` also finds the connection's own recent responses when ``store`` is false.
    A bad message gets an ``error`` event and the connection stays; a client idle for LOCALAI_WS_IDLE_TIMEOUT is
    closed (1000), and one that stops answering the protocol's pings (every 20 s, uvicorn's) is dropped; no HTTP
    deadline applies once the socket is open (``api/connections.py``); the Host/Origin/API-key guards ran before
    the handshake. ``generate: false`` (Codex's prewarm, ``input`` empty included) evaluates and caches the prompt
    (the instructions and tools when there is no message yet) and completes with no output: its id continues."""
    settings: Settings = websocket.app.state.settings
    metrics = runtime_of(websocket).scheduler.metrics
    await websocket.accept()
    metrics.websockets.inc()
    reason = "client"
    try:
        reason = await _serve(websocket, settings)
    finally:
        metrics.websocket_closes.labels(reason).inc()


async def _serve(websocket: WebSocket, settings: Settings) -> str:
    """The connection's turns until it ends; returns who ended it (client, idle)."""
    earlier: dict[str, list[dict[str, Any]]] = {}
    try:
        while True:
            try:
                text = (await asyncio.wait_for(websocket.receive(), timeout=settings.ws_idle_timeout))
            except TimeoutError:
                log.info("closing a /v1/responses WebSocket idle for %g s (LOCALAI_WS_IDLE_TIMEOUT)",
                         settings.ws_idle_timeout)
                await websocket.close(code=1000, reason="idle")
                return "idle"
            if text["type"] == "websocket.disconnect":
                return "client"
            run: ResponseRun | None = None
            body: ResponsesRequest | None = None
            made = False
            try:
                body = await socket_request(text.get("text"), settings.max_request_bytes,
                                            websocket.app.state.body_checker)
                run = await start_response(body, websocket, earlier)
                async for out in run.events():
                    if not isinstance(out, KeepAlive):
                        await websocket.send_text(json.dumps(out[1]))
                made = True
            except Exception as exc:
                if isinstance(exc, WebSocketDisconnect):
                    raise
                if not isinstance(exc, LocalAIError):  # a bug: the client gets a 500 event, the socket stays
                    log.exception("the WebSocket response failed")
                    exc = LocalAIError(f"internal error: {type(exc).__name__}")
                if body is not None and body.previous_response_id:
                    earlier.pop(body.previous_response_id, None)  # a failed continuation does not leave it behind
                events = run.failed(exc) if run is not None else []
                for _, data in events:
                    await websocket.send_text(json.dumps(data))
                if run is None:
                    await websocket.send_text(json.dumps(socket_error(exc)))
            finally:
                if run is not None:
                    await run.generation.aclose()
            if run is not None and made:  # only a response that completed can be continued
                earlier[run.id] = [*run.conversation, *run.builder.items]
                while len(earlier) > SOCKET_REMEMBERS:
                    earlier.pop(next(iter(earlier)))
    except WebSocketDisconnect:
        return "client"  # the client went away: its generation was closed above
