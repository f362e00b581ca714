"""Ollama-native API, so existing Ollama clients (and localai's own CLI) work unchanged."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from localai import __version__
from localai.api.common import (
    ParsedBodyRoute,
    PendingLogprobs,
    ToolDef,
    check_embedding_inputs,
    collect,
    generation_headers,
    keep_alive_seconds,
    parse_arguments,
    remote_descriptions,
    runtime_of,
    stream_response,
    tools_of,
    top_logprobs_field,
    truncated_vector,
)
from localai.api.media import from_base64
from localai.api.sessions import cache_partition, cache_salt_field, session_id
from localai.engines.descriptions import speculative_support, state_kind
from localai.errors import InvalidRequest, LocalAIError, ModelNotFound
from localai.models.gguf_meta import AttentionShape
from localai.models.loading import attention_of, chosen_engine, gguf_metadata, is_reranker, kv_bytes, window
from localai.models.modelfile import (
    LOAD_PARAMETERS,
    PARAMETERS,
    Modelfile,
    anchored_adapters,
    check_template,
    coerce_parameter,
    parse,
)
from localai.models.registry import ModelRecord
from localai.runtime.generation import Generation
from localai.runtime.local import SAMPLING_KEYS
from localai.runtime.prompt import Template, format_choice
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
from localai.settings import Settings

router = APIRouter(route_class=ParsedBodyRoute)


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    verbose: bool = False

    def model_name(self) -> str:
        value = self.model or self.name
        if not value:
            raise InvalidRequest("'model' is required", param="model")
        return value


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


class CopyBody(BaseModel):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class CreateBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    modelfile: str | None = None
    path: str | None = Field(default=None, description="Directory that relative FROM paths resolve against.")
    from_: str | None = Field(default=None, alias="from")
    parameters: dict[str, Any] | None = None
    template: str | None = None
    system: str | None = None
    stream: bool = False


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


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def details(record: ModelRecord) -> dict[str, Any]:
    return {"parent_model": "", "format": record.format, "family": record.family, "families": [record.family],
            "parameter_size": record.parameter_size, "quantization_level": record.quantization}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    settings: Settings = request.app.state.settings
    runtime = runtime_of(request)
    records = await runtime.registry.off_loop(lambda registry: registry.all())
    remote = await remote_descriptions(request, records)
    models = []
    for record in records:
        models.append({
            "name": record.name, "model": record.name, "modified_at": record.modified_at, "size": record.size,
            "digest": record.sha256, "details": details(record),
            "context_length": remote[record.name]["context_length"] if record.remote else record.context_length,
            "engine": chosen_engine(record, settings.engine),  # localai extension
            **({"remote": remote[record.name]} if record.remote else {}),  # localai extension
        })
    return {"models": models}



@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    models = []
    running = list(runtime_of(request).scheduler.loaded.values())
    # each model's attention shape comes from its GGUF header (a stat, a parse when the file changed): off the loop
    shapes = await asyncio.to_thread(lambda: [attention_of(loaded.record) for loaded in running])
    for loaded, shape in zip(running, shapes, strict=True):
        record, info = loaded.record, loaded.worker.info
        expires = (dt.datetime.fromtimestamp(loaded.expires_at, dt.UTC).isoformat()
                   if loaded.expires_at is not None else None)
        options = loaded.worker.options
        placed = _placement_of(request, loaded.name) or {}
        kv = kv_bytes(shape, int(options.get("num_ctx") or 0), int(options.get("n_parallel") or 1),
                      str(options.get("kv_type") or "f16"))
        models.append({
            "name": loaded.name, "model": loaded.name, "size": record.size + kv, "digest": record.sha256,
            "kv_bytes": kv, "kv_type": options.get("kv_type", "f16"),  # localai extensions: the KV cache's part
            "details": details(record), "expires_at": expires,
            "size_vram": placed["device_bytes"] if placed.get("layers") else 0,
            "context_length": info["n_ctx"] if info else None, "active_requests": loaded.active,
            "processor": placed.get("processor", "100% CPU"),
            "placement": placed,  # localai extension: layers on the GPU, the devices, and why
            "experts": placed.get("experts", ""),  # localai extension: where a mixture of experts' experts are
            "pid": loaded.worker.pid, "keep_alive": loaded.keep_alive,
            # localai extension: the models served by the same worker (one copy of the weights, one prompt cache)
            "shared_with": loaded.sharing_with(),
            "engine": loaded.worker.backend, "queued": runtime_of(request).scheduler.queued.get(loaded.name, 0),
        })
    for name, pool in runtime_of(request).remotes.pools.items():  # remote models in use: no process here
        if not pool.in_use:
            continue  # only listed, or idle long enough that its health checks stopped
        models.append({
            "name": name, "model": name, "size": 0, "digest": pool.spec.digest(), "expires_at": None,
            "details": {"parent_model": "", "format": "remote", "family": "remote", "families": ["remote"],
                        "parameter_size": "", "quantization_level": ""}, "size_vram": 0,
            "context_length": pool.context_length() or None, "active_requests": pool.active, "processor": "remote",
            "pid": None, "keep_alive": None, "engine": "remote", "queued": 0, "replicas": pool.status(),
        })
    return {"models": models}


async def _template_of(record: ModelRecord) -> Template:
    template = record.template
    if template is None and record.path and not record.remote:
        meta = await asyncio.to_thread(gguf_metadata, record.path)
        template = meta.chat_template if meta is not None else None
    return Template(template)


async def capabilities(record: ModelRecord) -> list[str]:
    """What the model can do, as Ollama clients read it: completion, tools, thinking, vision (a projector); a
    reranker only ``rerank``."""
    if await asyncio.to_thread(is_reranker, record):
        return ["rerank"]  # scores documents (POST /v1/rerank); it does not complete
    template = await _template_of(record)
    found = ["completion", "tools"]  # tools work with every template (described in the prompt when not native)
    if template.thinks or template.tool_format == "harmony":
        found.append("thinking")
    if record.projector:
        found.append("vision")
    return found


async def parser_of(record: ModelRecord) -> dict[str, str]:
    """How the model's tool calls are read: its Modelfile's PARSER, else what its chat template shows."""
    if record.remote and "parser" not in record.parameters:
        return {"name": "upstream", "from": "the upstream parses its own output"}
    name, source = format_choice(record.parameters, await _template_of(record))
    return {"name": name, "from": source}


@router.post("/api/show")
async def show(body: ModelRef, request: Request) -> dict[str, Any]:
    record = await runtime_of(request).record(body.model_name())
    modelfile = record.modelfile()
    parameters = "\n".join(
        f"{name:<20} {json.dumps(item) if isinstance(item, str) else item}"
        for name, value in record.parameters.items()
        for item in (value if isinstance(value, list) else [value])
    )
    remote = (await remote_descriptions(request, [record])).get(record.name)
    settings = request.app.state.settings
    fitted = None if remote else await asyncio.to_thread(window, record, settings)
    num_ctx = remote["context_length"] if remote else fitted.num_ctx  # type: ignore[union-attr]
    return {
        "modelfile": modelfile.render(), "parameters": parameters, "template": record.template or "",
        "system": record.system or "", "license": record.license or "", "details": details(record),
        "model_info": {"general.architecture": record.family,
                       f"{record.family}.context_length": num_ctx if remote else record.context_length},
        "capabilities": await capabilities(record), "modified_at": record.modified_at,
        "path": record.path,  # localai extension: the weights file (benchmarks run llama.cpp tools on it)
        **({"projector": record.projector} if record.projector else {}),  # localai extension: the mmproj file
        # localai extension: the context the daemon loads the model with (launch gives it to agents)
        "num_ctx": num_ctx,
        "engine": chosen_engine(record, request.app.state.settings.engine),  # localai extension
        # localai extension: what the prompt cache keeps of a sequence, and whether speculative decoding runs
        **_state_of(request, record, await asyncio.to_thread(attention_of, record)),
        "parser": await parser_of(record),  # localai extension: the tool-call format and where it came from
        # localai extension: the memory the model takes at that window, and how the window was chosen
        **({"memory": {"num_ctx": fitted.num_ctx, "kv_type": fitted.kv_type, "weights_bytes": fitted.weights_bytes,
                       "kv_bytes": fitted.kv_bytes, "total_bytes": fitted.total_bytes(),
                       "sequences": settings.num_parallel, "available_bytes": fitted.available_bytes,
                       "chosen_by": fitted.chosen_by, "advice": fitted.advice}} if fitted else {}),
        **({"remote": remote} if remote else {}),  # localai extension: upstream model, kind, replicas' health
        **({"placement": placement} if (placement := _placement_of(request, record.name)) else {}),
    }


def _state_of(request: Request, record: ModelRecord, shape: AttentionShape | None) -> dict[str, str]:
    """``state`` and ``speculative`` as the loaded worker reports them, else as the GGUF header says (``shape``,
    read off the loop)."""
    loaded = runtime_of(request).scheduler.loaded.get(record.name)
    info = loaded.worker.info if loaded is not None else None
    if info and info.get("speculative"):
        return {"state": str(info.get("state", "")), "speculative": str(info["speculative"])}
    if shape is None or chosen_engine(record, request.app.state.settings.engine) != "llama.cpp":
        return {}
    recurrent, window = shape.recurrent_bytes > 0, shape.sliding_window if shape.sliding_share else 0
    return {"state": state_kind(recurrent, window),
            "speculative": speculative_support(not recurrent and not window, recurrent, window)}


def _placement_of(request: Request, name: str) -> dict[str, Any] | None:
    """Where a loaded model's layers run (engines/placement.py), as its worker reported it; None when not loaded."""
    loaded = runtime_of(request).scheduler.loaded.get(name)
    info = loaded.worker.info if loaded is not None else None
    return dict(info["placement"]) if info and info.get("placement") else None


@router.delete("/api/delete")
async def delete(body: ModelRef, request: Request) -> JSONResponse:
    runtime = runtime_of(request)
    name = body.model_name()
    record = await runtime.record(name)
    removed = await runtime.registry.off_loop(lambda registry: registry.remove(name))  # deletes GB-sized blobs
    if record.name in removed:  # removing only an alias leaves the model loaded
        await runtime.unload(record.name)
    return JSONResponse({"deleted": removed})


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request) -> JSONResponse:
    source, destination = body.source, body.destination
    await runtime_of(request).registry.off_loop(lambda registry: registry.copy(source, destination))
    return JSONResponse({})


def _modelfile_of(body: CreateBody) -> Modelfile:
    """The Modelfile a create asks for (its text parsed, or built from ``from`` and its fields), templates checked."""
    if body.modelfile:
        modelfile = parse(body.modelfile, source="Modelfile")
        if body.path and not Path(modelfile.from_).is_absolute() and modelfile.from_.startswith("."):
            modelfile.from_ = str((Path(body.path) / modelfile.from_).resolve())
        if body.path:
            modelfile.adapters = anchored_adapters(modelfile.adapters, Path(body.path))
    elif body.from_:
        modelfile = Modelfile(from_=body.from_, template=body.template, system=body.system)
        for key, value in (body.parameters or {}).items():
            modelfile.parameters[key] = coerce_parameter(key, value, f"parameters.{key}")
    else:
        raise InvalidRequest("give 'modelfile' text or 'from'", param="modelfile")
    if body.template is not None:
        check_template(body.template, "template")
    return modelfile


@router.post("/api/create")
async def create(body: CreateBody, request: Request) -> JSONResponse:
    name = body.model or body.name
    if not name:
        raise InvalidRequest("'model' is required", param="model")
    # Jinja parses a TEMPLATE in pure Python (a second for a large one): off the event loop, or every stream and
    # /health waited for it
    modelfile = await asyncio.to_thread(_modelfile_of, body)
    try:  # hashing a new GGUF reads every byte: off the event loop
        record = await runtime_of(request).registry.off_loop(lambda registry: registry.create(name, modelfile))
    except ModelNotFound as exc:
        raise InvalidRequest(exc.message, param="from") from exc
    return JSONResponse({"status": "success", "model": record.name})
