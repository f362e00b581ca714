"""What every dialect shares: the runtime handle, collecting a generation, SSE framing, tool checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import HTTPConnection

from localai.api.limits import PARSED
from localai.errors import ClientDisconnected, InvalidRequest, LocalAIError
from localai.models.registry import ModelRecord
from localai.runtime import admission, media
from localai.runtime.generation import Generation
from localai.runtime.runtime import Runtime
from localai.schema import (
    MAX_TOP_LOGPROBS,
    Finished,
    LogprobsDelta,
    Message,
    ReplyParts,
    TokenLogprob,
    Tool,
    ToolCallBlock,
    ToolCallEnd,
    ToolResultBlock,
)
from localai.settings import parse_duration
from localai.upstreams.pool import PROBE

T = TypeVar("T")
_MISSING = object()


class ParsedBodyRoute(APIRoute):
    """A route that takes the JSON body the body guard already checked and parsed (off the event loop, for a
    large one), instead of parsing it again here; and watches for its client leaving while its handler runs
    (``ClientWatch``), so that a request still waiting to be admitted stops waiting then."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed(request: Request) -> Response:
            value = request.scope.get(PARSED, _MISSING)
            if value is not _MISSING:
                request._json = value  # what Starlette's Request.json() returns once it has parsed
            await request.body()  # read (replayed) and kept now: the watch's first message is then the disconnect
            watch = request.scope[WATCH] = ClientWatch(request)
            told = admission.client_left.set(watch.left)
            try:
                return await handler(request)
            finally:
                admission.client_left.reset(told)
                watch.stop()  # a streamed response's body watches for itself (Starlette's StreamingResponse)

        return parsed


WATCH = "localai.client_watch"  # the scope key of a request's ClientWatch


class ClientWatch:
    """Sets ``left`` when the request's client goes away. It alone reads the request's messages while its handler
    runs (the body is read before, so the next message is the disconnect), and everything that must stop when the
    client goes waits on ``left``: admission (``runtime/admission.client_left``), a collected reply
    (``unless_disconnected``)."""

    def __init__(self, request: Request) -> None:
        self.left = asyncio.Event()
        self._reading = asyncio.ensure_future(self._read(request))

    async def _read(self, request: Request) -> None:
        with contextlib.suppress(Exception):  # a server whose receive fails says nothing of its client
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.left.set()
                    return

    def stop(self) -> None:
        self._reading.cancel()


def runtime_of(request: HTTPConnection) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


@dataclass
class Collected:
    """A whole (non-streamed) generation: its text, reasoning, tool calls and how it ended."""

    text: str
    reasoning: str
    calls: list[ToolCallEnd]
    finished: Finished
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the request asked for them


def keep_alive_seconds(value: str | float | None) -> float | None:
    """A request's ``keep_alive`` (Ollama's durations: "5m", seconds, -1 forever) in seconds; bad is a 400."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="keep_alive") from exc


async def until_disconnected(request: Request) -> None:
    """Return when the client goes away (the body is already read, so the next ASGI message is the disconnect)."""
    watch = request.scope.get(WATCH)
    if isinstance(watch, ClientWatch):  # its route's watch reads the messages: one reader for the request
        await watch.left.wait()
        return
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Closable(Protocol):
    """What a response stops when its client goes: a generation, or a request's choices (``api/choices.py``)."""

    async def aclose(self) -> None: ...


async def unless_disconnected(request: Request, work: Awaitable[T], generation: Closable) -> T:
    """Await ``work`` (a whole, non-streamed generation), stopping the generation if the client disconnects
    first: a streamed reply stops at its next write, a collected one would otherwise run to its end."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request cancelled: its generation stops too, not left running unread
        await _stop(task, generation)
        raise
    finally:
        watcher.cancel()
    if task not in done:
        await _stop(task, generation)
        raise ClientDisconnected("the client disconnected; the generation was stopped")
    return task.result()


async def _stop(task: asyncio.Future[Any], generation: Closable) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    await generation.aclose()


async def collect(generation: Generation, request: Request | None = None) -> Collected:
    """The whole generation; with ``request``, stopped as soon as that client disconnects."""
    if request is not None:
        return await unless_disconnected(request, collect(generation), generation)
    reply = ReplyParts()
    finished: Finished | None = None
    async for event in generation.events():
        reply.add(event)
        if isinstance(event, Finished):
            finished = event
    if finished is None:
        raise LocalAIError("the generation ended without finishing")
    return Collected(reply.text, reply.reasoning, reply.calls, finished, reply.logprobs)


async def remote_descriptions(request: Request, records: list[ModelRecord]) -> dict[str, dict[str, Any]]:
    """What each remote model's upstream reports (context length, model id, replicas), probed concurrently
    (not when another localai's probe asks: see ``PROBE``)."""
    remote = [record for record in records if record.remote]
    probe = PROBE.lower() not in request.headers
    found = await asyncio.gather(*(runtime_of(request).remotes.describe(record, probe=probe) for record in remote))
    return {record.name: info for record, info in zip(remote, found, strict=True)}


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event; ``event`` names it (Anthropic and Responses streams do)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


KEEPALIVE_COMMENT = b": keep-alive\n\n"  # an SSE comment: clients skip it, idle timers restart
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_response(generation: Closable, frames: AsyncGenerator[bytes, None],
                    error: Callable[[LocalAIError], bytes], *, headers: Mapping[str, str],
                    media_type: str = "text/event-stream") -> StreamingResponse:
    """The tail every dialect's stream shares: send the dialect's frames; an error once the stream has begun (the
    status line is out) becomes the dialect's error frame; the generation is closed however the stream ends, a
    client that went away included."""
    async def body() -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    yield frame
        except LocalAIError as exc:
            yield error(exc)
        finally:
            await generation.aclose()

    return StreamingResponse(body(), media_type=media_type, headers=dict(headers))


def generation_headers(generation: Generation) -> dict[str, str]:
    """Tells the client when its conversation was shortened to fit the context, which replica of a remote model
    serves it, and where the prompt's reused prefix came from: ``X-LocalAI-Cache`` is live (the sequence was still
    in the engine), ram or disk (restored from the prompt cache's tiers) or miss; with the tokens restored and the
    restore's milliseconds. ``X-LocalAI-Omitted`` names the images, audio and documents the model did not get
    (each became a short text stand-in in the prompt), and why."""
    headers = {"X-LocalAI-Context-Fitted": generation.fit.header()} if generation.fit else {}
    if generation.omitted:
        headers["X-LocalAI-Omitted"] = media.header(generation.omitted)
    if generation.replica:
        headers["X-LocalAI-Replica"] = generation.replica
    if generation.cache:
        headers["X-LocalAI-Cache"] = str(generation.cache.get("source", "miss"))
        headers["X-LocalAI-Cache-Tokens"] = str(generation.cached_tokens)
        if generation.cache.get("restored"):
            headers["X-LocalAI-Cache-Restored"] = str(generation.cache["restored"])
            headers["X-LocalAI-Cache-Restore-Ms"] = f"{float(generation.cache.get('restore_ms', 0)):.1f}"
    return headers


def parse_arguments(text: str | dict[str, Any] | None, param: str) -> dict[str, Any]:
    """A tool call's arguments from the JSON text (or object) a client sent back."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        return text
    if not isinstance(text, str):
        raise InvalidRequest("the tool call's arguments must be a JSON object or its JSON text", param=param)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"the tool call's arguments are not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, dict):
        raise InvalidRequest("the tool call's arguments must be a JSON object", param=param)
    return value


def check_tool_schema(tool: Tool, param: str) -> None:
    if not isinstance(tool.parameters, dict):
        raise InvalidRequest(f"the parameters of tool '{tool.name}' must be a JSON schema object", param=param)
    kind = tool.parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequest(f"the parameters of tool '{tool.name}' must describe an object, not {kind!r}",
                             param=param)


def check_tool_results(messages: list[Message], param: str = "messages") -> None:
    """Every tool result must answer a call made earlier in the conversation (as OpenAI and Anthropic require)."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        for block in message.content:
            if isinstance(block, ToolCallBlock):
                called.add(block.id)
            elif isinstance(block, ToolResultBlock) and block.tool_call_id not in called:
                raise InvalidRequest(
                    f"a tool result answers call '{block.tool_call_id}', which no earlier assistant message made",
                    param=f"{param}.{index}",
                )


# Function tools and embedding inputs as OpenAI shapes them (Ollama's /api/chat and /api/embed take the same).


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: FunctionDef | None = None


def tools_of(tools: list[ToolDef] | None, param: str = "tools") -> list[Tool]:
    """Function tools (other tool types are ignored: there is nothing local to run them)."""
    result: list[Tool] = []
    for index, tool in enumerate(tools or []):
        if tool.type != "function":
            continue
        if tool.function is None:
            raise InvalidRequest("a function tool needs 'function'", param=f"{param}.{index}.function")
        parsed = Tool(tool.function.name, tool.function.description or "",
                      tool.function.parameters or {"type": "object", "properties": {}})
        check_tool_schema(parsed, f"{param}.{index}.function.parameters")
        result.append(parsed)
    return result


EmbeddingInput = str | list[str] | list[int] | list[list[int]]
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit per request


def top_logprobs_field(description: str) -> Any:
    """A dialect's count of alternatives per token (``top_logprobs``): 0 to 20, as OpenAI's."""
    return Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description=description)


class PendingLogprobs:
    """A stream's logprobs waiting for the next chunk that carries text: each chunk gives the entries of the tokens
    received since the last one (``take``), the rest go in a chunk of their own before the stream ends."""

    def __init__(self) -> None:
        self.entries: list[TokenLogprob] = []

    def add(self, event: LogprobsDelta) -> None:
        self.entries.extend(event.entries)

    def take(self) -> list[TokenLogprob]:
        entries, self.entries = self.entries, []
        return entries


def check_embedding_inputs(value: EmbeddingInput) -> EmbeddingInput:
    """At most ``MAX_EMBEDDING_INPUTS`` texts per request (a pydantic validator: raises ValueError)."""
    if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}")
    return value


def truncated_vector(vector: list[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` values, normalised again (Matryoshka-style shortening)."""
    if dimensions > len(vector):
        raise InvalidRequest(f"the model's embeddings have {len(vector)} dimensions", param="dimensions")
    head = vector[:dimensions]
    norm = sum(v * v for v in head) ** 0.5 or 1.0
    return [v / norm for v in head]
