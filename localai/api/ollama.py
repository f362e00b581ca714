"""Ollama-native inference (generate, chat, embed), so existing Ollama clients (and localai's own CLI) work
unchanged; the model administration beside it is in api/ollama_models.py."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from localai.api.common import (
    ParsedBodyRoute,
    PendingLogprobs,
    ToolDef,
    check_embedding_inputs,
    collect,
    generation_headers,
    keep_alive_seconds,
    parse_arguments,
    runtime_of,
    stream_response,
    tools_of,
    top_logprobs_field,
    truncated_vector,
)
from localai.api.media import from_base64
from localai.api.sessions import cache_partition, cache_salt_field, session_id
from localai.api.validation import json_typed
from localai.errors import InvalidRequest, LocalAIError
from localai.models.modelfile import (
    LOAD_PARAMETERS,
    PARAMETERS,
    coerce_parameter,
)
from localai.runtime.generation import Generation
from localai.runtime.local import SAMPLING_KEYS
from localai.schema import (
    Block,
    Finished,
    GenerationRequest,
    KeepAlive,
    LogprobsDelta,
    MediaBlock,
    Message,
    OllamaThink,
    ReasoningBlock,
    ReasoningDelta,
    ResponseFormat,
    SamplingOptions,
    TextBlock,
    TextDelta,
    ToolCallBlock,
    ToolCallEnd,
    ToolResultBlock,
    effort_of,
)

router = APIRouter(route_class=ParsedBodyRoute)


class OllamaFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str | None = None


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class LogprobsFields(BaseModel):
    """Ollama's logprobs fields, on /api/generate and /api/chat."""

    logprobs: bool | None = Field(default=None, description="Each generated token's logprob.")
    top_logprobs: StrictInt | None = top_logprobs_field("Alternatives per token (0-20); over 0 implies logprobs.")

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs or self.top_logprobs else None


class GenerateBody(LogprobsFields):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    prompt: str = ""
    system: str | None = None
    stream: bool = True
    raw: bool = False
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: str | float | None = None
    format: Any = None
    think: OllamaThink | None = None
    images: list[str] | None = None
    cache_salt: str | None = cache_salt_field()


class ChatBody(LogprobsFields):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolDef] | None = None
    stream: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: str | float | None = None
    format: Any = None
    think: OllamaThink | None = None
    cache_salt: str | None = cache_salt_field()


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[str] = ""
    prompt: str | None = None  # the older /api/embeddings field
    truncate: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: str | float | None = None
    dimensions: StrictInt | None = Field(default=None, ge=1)

    _inputs = field_validator("input")(check_embedding_inputs)


@dataclass
class Options:
    """Ollama's ``options``, each known one checked for type and range (unknown keys are ignored, as Ollama does)."""

    sampling: SamplingOptions
    load: dict[str, Any]
    num_predict: int | None
    stop: list[str] | None
    fit_context: bool | None
    speculative: bool | None


def request_options(options: dict[str, Any]) -> Options:
    known: dict[str, Any] = {}
    for key, value in options.items():
        if key in PARAMETERS and value is not None:
            if key == "rpc":  # the daemon would connect wherever a request said: the machines are the owner's choice
                raise InvalidRequest("options.rpc: the RPC servers a model spreads over are set by its Modelfile "
                                     "(PARAMETER rpc host:port) or LOCALAI_RPC_SERVERS, not per request",
                                     param="options.rpc")
            json_typed(key, value, f"options.{key}")
            try:
                known[key] = coerce_parameter(key, value, f"options.{key}")
            except LocalAIError as exc:
                raise InvalidRequest(exc.message, param=f"options.{key}") from exc
    num_predict = known.get("num_predict")
    stop = known.get("stop")
    fit = known.get("fit_context")
    return Options(
        sampling=SamplingOptions(**{k: v for k, v in known.items() if k in SAMPLING_KEYS}),
        load={k: v for k, v in known.items() if k in LOAD_PARAMETERS},
        num_predict=int(num_predict) if isinstance(num_predict, int) and num_predict >= 0 else None,
        stop=list(stop) if isinstance(stop, list) else None,
        fit_context=fit if isinstance(fit, bool) else None,
        speculative={"on": True, "off": False}.get(str(known.get("speculative", "auto"))),
    )


def response_format(value: Any) -> ResponseFormat | None:
    """Ollama's ``format``: ``"json"`` or a JSON schema object."""
    if value in (None, ""):
        return None
    if value == "json":
        return ResponseFormat("json_object")
    if isinstance(value, dict):
        return ResponseFormat("json_schema", value)
    raise InvalidRequest("'format' must be \"json\" or a JSON schema object", param="format")


def thinking(value: bool | str | None) -> bool | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value not in ("", "false", "none")
    return value


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _final(model: str, finished: Finished, started: float) -> dict[str, Any]:
    usage = finished.usage
    return {
        "model": model, "created_at": now_iso(), "done": True,
        "done_reason": "length" if finished.reason == "length" else "stop",
        "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": int(usage.prompt_ms * 1e6),
        "eval_count": usage.completion_tokens, "eval_duration": int(usage.decode_ms * 1e6),
        "prompt_cache_count": usage.cached_tokens,
        # localai extension: speculative decoding's guessed tokens, and those the model agreed with
        **({"draft_count": usage.drafted_tokens, "draft_accepted_count": usage.accepted_tokens}
           if usage.drafted_tokens else {}),
    }


def _tool_calls_json(calls: list[ToolCallEnd]) -> list[dict[str, Any]]:
    return [{"id": call.id, "function": {"index": call.index, "name": call.name,
                                         "arguments": call.parsed_arguments()}} for call in calls]


async def _respond(request: Request, generation: Generation, body_stream: bool, model: str, started: float,
                   piece: Callable[..., dict[str, Any]]) -> JSONResponse | StreamingResponse:
    """``piece(text, thinking=..., tool_calls=...)`` shapes each line's payload for chat or generate."""
    if not body_stream:
        result = await collect(generation, request)
        extra: dict[str, Any] = {}
        if result.reasoning:
            extra["thinking"] = result.reasoning
        if result.calls:
            extra["tool_calls"] = _tool_calls_json(result.calls)
        logprobs = {"logprobs": result.logprobs} if result.logprobs else {}
        return JSONResponse({**piece(result.text, **extra), **logprobs, **_final(model, result.finished, started)},
                            headers=generation_headers(generation))
    pending = PendingLogprobs()

    def line(payload: dict[str, Any]) -> bytes:
        if pending.entries and "error" not in payload:  # each line: the logprobs of the tokens since the last
            payload = {**payload, "logprobs": pending.take()}
        return (json.dumps(payload, ensure_ascii=False) + "\n").encode()

    async def stream() -> AsyncGenerator[bytes, None]:
        async for event in generation.stream_events():
            if isinstance(event, LogprobsDelta):
                pending.add(event)
            elif isinstance(event, TextDelta | KeepAlive):  # a keep-alive is an empty chunk: NDJSON has no comments
                text = event.text if isinstance(event, TextDelta) else ""
                yield line({"model": model, "created_at": now_iso(), **piece(text), "done": False})
            elif isinstance(event, ReasoningDelta):
                yield line({"model": model, "created_at": now_iso(), **piece("", thinking=event.text),
                            "done": False})
            elif isinstance(event, ToolCallEnd):  # Ollama sends each call whole
                yield line({"model": model, "created_at": now_iso(),
                            **piece("", tool_calls=_tool_calls_json([event])), "done": False})
            elif isinstance(event, Finished):
                yield line({**piece(""), **_final(model, event, started)})

    return stream_response(generation, stream(), lambda exc: line({"error": exc.message}),
                           headers=generation_headers(generation), media_type="application/x-ndjson")


async def _load_or_unload(request: Request, model: str, keep_alive: float | None, done_reason: str,
                          piece: dict[str, Any]) -> JSONResponse:
    """An empty prompt loads the model (or, with keep_alive 0, unloads it): Ollama's convention."""
    runtime = runtime_of(request)
    record = await runtime.record(model)
    if keep_alive is not None and keep_alive == 0:
        await runtime.unload(record.name)
        done_reason = "unload"
    else:
        await runtime.load(record.name, keep_alive)
    return JSONResponse({"model": model, "created_at": now_iso(), **piece, "done": True, "done_reason": done_reason})


@router.post("/api/generate", response_model=None)
async def generate(body: GenerateBody, request: Request) -> JSONResponse | StreamingResponse:
    format_ = response_format(body.format)
    if body.images and body.raw:
        raise InvalidRequest("'images' cannot go with 'raw' (a raw prompt is text the model gets as it is); "
                             "send them without 'raw'", param="images")
    keep_alive = keep_alive_seconds(body.keep_alive)
    if not body.prompt and not body.system:
        return await _load_or_unload(request, body.model, keep_alive, "load", {"response": ""})
    options = request_options(body.options)
    started = time.perf_counter()
    if body.raw:
        generation_request = GenerationRequest(model=body.model, prompt=body.prompt)
    else:
        messages = [Message("system", [TextBlock(body.system)])] if body.system else []
        messages.append(Message("user", [*images_of(body.images, "images"), TextBlock(body.prompt)]))
        generation_request = GenerationRequest(model=body.model, messages=messages)
    generation_request.sampling, generation_request.load_options = options.sampling, options.load
    generation_request.max_tokens, generation_request.stop = options.num_predict, options.stop
    generation_request.fit_context = options.fit_context
    generation_request.speculative = options.speculative
    generation_request.keep_alive = keep_alive
    generation_request.session_id = session_id(request.headers)
    generation_request.cache_partition = cache_partition(request, body.cache_salt)
    generation_request.response_format = format_
    generation_request.reasoning = thinking(body.think)
    generation_request.reasoning_effort = effort_of(body.think) if isinstance(body.think, str) else None
    generation_request.logprobs = body.logprobs_count()
    generation = await runtime_of(request).start(generation_request)

    def piece(text: str, thinking: str | None = None, **_: Any) -> dict[str, Any]:
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    return await _respond(request, generation, body.stream, body.model, started, piece)


ROLES = ("system", "user", "assistant", "tool", "developer")


def images_of(images: list[str] | None, param: str) -> list[MediaBlock]:
    """Ollama's ``images``: base64 strings (their type read from their bytes)."""
    return [from_base64(image, "image", f"{param}.{index}") for index, image in enumerate(images or [])]


def chat_messages(body: ChatBody) -> list[Message]:
    """Ollama messages (no call ids: results pair with the earliest open call of the same function)."""
    messages: list[Message] = []
    open_calls: list[tuple[str, str]] = []
    for index, message in enumerate(body.messages):
        param = f"messages.{index}"
        if message.role not in ROLES:
            raise InvalidRequest(f"unknown role '{message.role}' (use system, user, assistant or tool)",
                                 param=f"{param}.role")
        images = images_of(message.images, f"{param}.images")
        if message.role == "tool":
            match = next((c for c in open_calls if not message.tool_name or c[1] == message.tool_name), None)
            if match is not None:
                open_calls.remove(match)
            call_id = match[0] if match else f"call_{index}"
            messages.append(Message("tool", [ToolResultBlock(call_id, message.content,
                                                             name=message.tool_name or (match[1] if match else None),
                                                             media=[(0, image) for image in images])]))
            continue
        blocks: list[Block] = []
        if message.thinking:
            blocks.append(ReasoningBlock(message.thinking))
        blocks.extend(images)  # Ollama puts a message's images before its text
        if message.content or not message.tool_calls:
            blocks.append(TextBlock(message.content))
        for call_index, call in enumerate(message.tool_calls or []):
            call_id = call.id or f"call_{index}_{call_index}"
            arguments = parse_arguments(call.function.arguments, f"{param}.tool_calls.{call_index}.function.arguments")
            blocks.append(ToolCallBlock(call_id, call.function.name, arguments))
            open_calls.append((call_id, call.function.name))
        messages.append(Message(message.role, blocks))  # type: ignore[arg-type]
    return messages


@router.post("/api/chat", response_model=None)
async def chat(body: ChatBody, request: Request) -> JSONResponse | StreamingResponse:
    format_ = response_format(body.format)
    keep_alive = keep_alive_seconds(body.keep_alive)
    empty = {"message": {"role": "assistant", "content": ""}}
    if not body.messages:
        return await _load_or_unload(request, body.model, keep_alive, "load", empty)
    messages = chat_messages(body)
    options = request_options(body.options)
    started = time.perf_counter()
    generation = await runtime_of(request).start(GenerationRequest(
        model=body.model, messages=messages, sampling=options.sampling, load_options=options.load,
        max_tokens=options.num_predict, stop=options.stop, keep_alive=keep_alive,
        session_id=session_id(request.headers), fit_context=options.fit_context, speculative=options.speculative,
        tools=tools_of(body.tools), cache_partition=cache_partition(request, body.cache_salt),
        response_format=format_, reasoning=thinking(body.think),
        reasoning_effort=effort_of(body.think) if isinstance(body.think, str) else None,
        logprobs=body.logprobs_count(),
    ))

    def piece(text: str, thinking: str | None = None, tool_calls: list[Any] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"message": message}

    return await _respond(request, generation, body.stream, body.model, started, piece)


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request) -> dict[str, Any]:
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts or any(not text for text in texts):
        raise InvalidRequest("'input' needs at least one non-empty text", param="input")
    started = time.perf_counter()
    vectors, tokens = await runtime_of(request).embed(
        body.model, texts, truncate=body.truncate, keep_alive=keep_alive_seconds(body.keep_alive))
    if body.dimensions is not None:
        vectors = [truncated_vector(v, body.dimensions) for v in vectors]
    return {"model": body.model, "embeddings": vectors, "total_duration": int((time.perf_counter() - started) * 1e9),
            "load_duration": 0, "prompt_eval_count": tokens}


@router.post("/api/embeddings")
async def embeddings_legacy(body: EmbedBody, request: Request) -> dict[str, Any]:
    """The older single-text endpoint: ``prompt`` in, ``embedding`` out."""
    text = body.prompt if body.prompt is not None else (body.input if isinstance(body.input, str) else "")
    if not text:
        return {"embedding": []}
    vectors, _ = await runtime_of(request).embed(body.model, [text], keep_alive=keep_alive_seconds(body.keep_alive))
    return {"embedding": vectors[0]}
