"""OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from localai import __version__
from localai.api.choices import MAX_CHOICES, Choices, merged_usage
from localai.api.common import (
    KEEPALIVE_COMMENT,
    SSE_HEADERS,
    EmbeddingInput,
    ParsedBodyRoute,
    PendingLogprobs,
    ToolDef,
    check_embedding_inputs,
    check_tool_results,
    generation_headers,
    parse_arguments,
    remote_descriptions,
    runtime_of,
    sse,
    stream_response,
    tools_of,
    top_logprobs_field,
    truncated_vector,
    unless_disconnected,
)
from localai.api.media import openai_part, tool_result
from localai.api.sessions import cache_partition, cache_salt_field, session_id
from localai.errors import InvalidRequest, LocalAIError, ModelNotFound
from localai.models.loading import chosen_engine, context_size
from localai.models.registry import ModelRecord
from localai.schema import (
    MAX_TOP_LOGPROBS,
    Block,
    Event,
    Finished,
    GenerationRequest,
    KeepAlive,
    LogprobsDelta,
    MediaBlock,
    Message,
    OpenAIEffort,
    ReasoningBlock,
    ReasoningDelta,
    ReplyParts,
    ResponseFormat,
    SamplingOptions,
    TextBlock,
    TextDelta,
    TokenLogprob,
    ToolCallBlock,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    Usage,
    effort_of,
)
from localai.settings import Settings

router = APIRouter(route_class=ParsedBodyRoute)


def content_blocks(content: str | list[dict[str, Any]] | None, param: str) -> list[TextBlock | MediaBlock]:
    """A message's content: a string, or parts (text, images, audio, files), in order."""
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(content)]
    blocks = []
    for index, part in enumerate(content):
        block = openai_part(part, f"{param}.{index}")
        if block is not None:
            blocks.append(block)
    return blocks


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(min_length=1)
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_message(self, index: int) -> Message:
        param = f"messages.{index}"
        content = content_blocks(self.content, f"{param}.content")
        if self.role == "tool":
            if not self.tool_call_id:
                raise InvalidRequest("a tool message needs 'tool_call_id'", param=f"{param}.tool_call_id")
            return Message("tool", [tool_result(self.tool_call_id, content, self.name)])
        blocks: list[Block] = []
        if self.reasoning_content:
            blocks.append(ReasoningBlock(self.reasoning_content))
        if any(isinstance(block, MediaBlock) or block.text for block in content) or not self.tool_calls:
            blocks.extend(content or [TextBlock("")])
        for call_index, call in enumerate(self.tool_calls or []):
            arguments = parse_arguments(call.function.arguments,
                                        f"{param}.tool_calls.{call_index}.function.arguments")
            blocks.append(ToolCallBlock(call.id, call.function.name, arguments))
        return Message(self.role, blocks, name=self.name if self.role != "assistant" else None)


class NamedFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def to_format(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequest("response_format json_schema needs 'json_schema.schema'",
                                 param="response_format.json_schema")
        return ResponseFormat("json_schema", self.json_schema.schema_)


def tool_choice_of(value: str | NamedToolChoice | None) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        return ToolChoice("required")
    if isinstance(value, NamedToolChoice):
        return ToolChoice("function", value.function.name)
    raise InvalidRequest(f"tool_choice must be none, auto, required or a named function, not {value!r}",
                         param="tool_choice")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions. Unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, ge=0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES, description=f"Choices to generate (1-{MAX_CHOICES}): "
                         "parallel sequences that start from the first's evaluated prompt; the others sample with "
                         "seed + index.")
    prompt_cache_key: str | None = None
    cache_salt: str | None = cache_salt_field()
    ignore_eos: bool = False
    fit_context: bool | None = Field(
        default=None, description="Fit an over-long conversation into the context (default on; false: 400)."
    )
    speculative: Literal["auto", "on", "off"] | None = Field(
        default=None, description="Draft tokens from the context and verify them in one batch (default: the "
        "model's PARAMETER speculative, else auto: where that leaves the output bit-identical).")
    logprobs: StrictBool | StrictInt | None = Field(
        default=None, description="Each generated token's logprob: true (chat), or how many alternatives per token, "
        "0-20 (completions).")
    top_logprobs: StrictInt | None = top_logprobs_field("Chat: alternatives per token (0-20), with logprobs: true.")
    lora: Any = Field(default=None, description="llama-server's per-request LoRA scales: refused (a 400 saying "
                      "why); a model's adapters and scales are its Modelfile's ADAPTER lines.")

    @field_validator("lora")
    @classmethod
    def _no_request_lora(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("per-request LoRA scales are not supported: a model's requests decode together in "
                             "one batch of one llama.cpp context, and its adapters apply to the whole context; "
                             "give the scale in the Modelfile (ADAPTER ./lora.gguf 0.5) and create a model for each "
                             "scale you use")
        return value

    def logprobs_count(self) -> int | None:
        """How many alternatives per token the request wants (None: no logprobs)."""
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError(f"at most 16 stop sequences are allowed (got {len(value)})")
        return value

    def generation(self, request: Request, **kwargs: Any) -> GenerationRequest:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return GenerationRequest(
            model=self.model,
            sampling=SamplingOptions(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                seed=self.seed, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repeat_penalty=self.repeat_penalty,
            ),
            max_tokens=max_tokens, stop=stop, ignore_eos=self.ignore_eos, fit_context=self.fit_context,
            speculative={"on": True, "off": False}.get(self.speculative or "auto"),
            session_id=session_id(request.headers, self.prompt_cache_key),
            cache_partition=cache_partition(request, self.cache_salt), logprobs=self.logprobs_count(), **kwargs,
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormatSpec | None = None
    reasoning_effort: OpenAIEffort | None = None

    def logprobs_count(self) -> int | None:
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise InvalidRequest("logprobs is true or false in chat completions (top_logprobs says how many "
                                 "alternatives)", param="logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"exactly one prompt is taken per request (got {len(value)}); send each on its own")
        return value

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None:
            raise InvalidRequest("completions take logprobs: N (alternatives per token), not top_logprobs",
                                 param="top_logprobs")
        if self.logprobs is None:
            return None
        if isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs is how many alternatives per token, 0-{MAX_TOP_LOGPROBS}, in completions "
                                 f"(got {self.logprobs!r})", param="logprobs")
        return self.logprobs


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        # speculative decoding's drafts in the words OpenAI's schema has for guessed tokens (Predicted Outputs)
        **({"completion_tokens_details": {"accepted_prediction_tokens": usage.accepted_tokens,
                                          "rejected_prediction_tokens": usage.drafted_tokens - usage.accepted_tokens}}
           if usage.drafted_tokens else {}),
    }


def sse_error(error: LocalAIError) -> bytes:
    return sse({"error": {"message": error.message, "type": error.error_type, "param": error.param,
                          "code": error.code}})


def finish_reason(reason: str) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


def tool_calls_json(calls: list[ToolCallEnd]) -> list[dict[str, Any]]:
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    messages = [message.to_message(index) for index, message in enumerate(body.messages)]
    check_tool_results(messages)
    generation_request = body.generation(request, messages=messages)
    generation_request.tools = tools_of(body.tools)
    generation_request.tool_choice = tool_choice_of(body.tool_choice)
    generation_request.response_format = body.response_format.to_format() if body.response_format else None
    if body.reasoning_effort in ("none", "minimal"):
        generation_request.reasoning = False
    generation_request.reasoning_effort = effort_of(body.reasoning_effort)
    wants_logprobs = generation_request.logprobs
    choices = await Choices.start(runtime_of(request), generation_request, body.n)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    headers = generation_headers(choices.first)
    fingerprint = system_fingerprint(body.model)
    if not body.stream:
        replies, finished = await unless_disconnected(request, collect_choices(choices), choices)
        return JSONResponse(headers=headers, content={
            "id": completion_id, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [{"index": index, "message": chat_message(replies[index]),
                         "logprobs": None if wants_logprobs is None
                         else {"content": replies[index].logprobs, "refusal": None},
                         "finish_reason": finish_reason(finished[index].reason)} for index in range(body.n)],
            "usage": usage_json(merged_usage({i: f.usage for i, f in finished.items()})),
            "system_fingerprint": fingerprint,
        })
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    pending = {index: PendingLogprobs() for index in range(body.n)}

    def chunk(index: int, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        # with logprobs asked for: each chunk carries those of its choice's tokens received since the last
        logprobs = None if wants_logprobs is None else {"content": pending[index].take(), "refusal": None}
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "system_fingerprint": fingerprint,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    async def stream() -> AsyncGenerator[bytes, None]:
        usages: dict[int, Usage] = {}
        announced = {0}  # the choices whose first chunk (the role) is out
        yield sse(chunk(0, {"role": "assistant", "content": ""}))
        async for index, event in choices.events(keepalive=True):
            if index not in announced:
                announced.add(index)
                yield sse(chunk(index, {"role": "assistant", "content": ""}))
            delta = chat_delta(event)
            if isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(event, LogprobsDelta):
                pending[index].add(event)
            elif delta is not None:
                yield sse(chunk(index, delta))
            elif isinstance(event, Finished):
                usages[index] = event.usage
                if pending[index].entries:  # tokens whose text no chunk carried (held back, then parsed away)
                    yield sse(chunk(index, {}))
                yield sse(chunk(index, {}, finish_reason(event.reason)))
        if include_usage and len(usages) == body.n:
            yield sse({**chunk(0, {}), "choices": [], "usage": usage_json(merged_usage(usages))})
        yield sse("[DONE]")

    return stream_response(choices, stream(), sse_error, headers={**SSE_HEADERS, **headers})


async def collect_choices(choices: Choices) -> tuple[dict[int, ReplyParts], dict[int, Finished]]:
    """Every choice whole: its text, reasoning, tool calls and logprobs, and how it ended."""
    replies = {index: ReplyParts() for index in range(choices.n)}
    finished: dict[int, Finished] = {}
    async for index, event in choices.events():
        if isinstance(event, KeepAlive):
            continue
        replies[index].add(event)
        if isinstance(event, Finished):
            finished[index] = event
    if len(finished) != choices.n:
        raise LocalAIError("the generation ended without finishing")
    return replies, finished


def chat_message(reply: ReplyParts) -> dict[str, Any]:
    """A whole chat completion's message: its text (null when it only calls tools), reasoning and tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if reply.text or not reply.calls
                               else None, "refusal": None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = tool_calls_json(reply.calls)
    return message


def chat_delta(event: Event | KeepAlive) -> dict[str, Any] | None:
    """A streamed chat chunk's delta for a text, reasoning or tool-call event (None for the others)."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ToolCallDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
    return None


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """Legacy completions' logprobs object for ``entries`` (tokens, their logprobs, each position's alternatives
    as token -> logprob, and where each token's text begins, from ``offset``: in the prompt and the reply together,
    as OpenAI counts); and the offset after them."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [entry["token"] for entry in entries],
            "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
            "text_offset": offsets}, offset


def system_fingerprint(model: str) -> str:
    """OpenAI's backend-configuration fingerprint (a string the schema requires): localai's version and the model."""
    digest = hashlib.blake2b(f"localai {__version__} {model}".encode(), digest_size=6).hexdigest()
    return f"fp_{digest}"


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    generation_request = body.generation(request, prompt=prompt)
    wants_logprobs = generation_request.logprobs
    choices = await Choices.start(runtime_of(request), generation_request, body.n)
    completion_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    prefix = prompt if body.echo else ""
    if not body.stream:
        replies, finished = await unless_disconnected(request, collect_choices(choices), choices)
        return JSONResponse({
            "id": completion_id, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"index": index, "text": prefix + replies[index].text,
                         "logprobs": None if wants_logprobs is None
                         else completion_logprobs(replies[index].logprobs, len(prompt))[0],
                         "finish_reason": finish_reason(finished[index].reason)} for index in range(body.n)],
            "usage": usage_json(merged_usage({i: f.usage for i, f in finished.items()})),
        })
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    pending = {index: PendingLogprobs() for index in range(body.n)}
    offsets = dict.fromkeys(range(body.n), len(prompt))  # text_offset counts the prompt, echoed or not (OpenAI's)

    def chunk(index: int, text: str, reason: str | None = None) -> dict[str, Any]:
        logprobs = None
        if wants_logprobs is not None:
            logprobs, offsets[index] = completion_logprobs(pending[index].take(), offsets[index])
        return {"id": completion_id, "object": "text_completion", "created": created, "model": body.model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}

    async def stream() -> AsyncGenerator[bytes, None]:
        usages: dict[int, Usage] = {}
        echoed = {0}  # the choices whose echoed prompt is out
        if prefix:
            yield sse(chunk(0, prefix))
        async for index, event in choices.events(keepalive=True):
            if index not in echoed:
                echoed.add(index)
                if prefix:
                    yield sse(chunk(index, prefix))
            if isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(event, LogprobsDelta):
                pending[index].add(event)
            elif isinstance(event, TextDelta):
                yield sse(chunk(index, event.text))
            elif isinstance(event, Finished):
                usages[index] = event.usage
                if pending[index].entries:
                    yield sse(chunk(index, ""))
                yield sse(chunk(index, "", finish_reason(event.reason)))
        if include_usage and len(usages) == body.n:
            yield sse({"id": completion_id, "object": "text_completion", "created": created,
                       "model": body.model, "choices": [], "usage": usage_json(merged_usage(usages))})
        yield sse("[DONE]")

    return stream_response(choices, stream(), sse_error, headers=SSE_HEADERS)


def model_json(name: str, record: ModelRecord, settings: Settings, remote: dict[str, Any] | None) -> dict[str, Any]:
    """An OpenAI model object, with localai's extensions: the context it serves and the engine (``remote`` for a
    model served elsewhere)."""
    modified_at = record.modified_at
    created = int(time.mktime(time.strptime(modified_at[:19], "%Y-%m-%dT%H:%M:%S"))) if modified_at else 0
    context = remote["context_length"] if remote else context_size(record, settings)
    return {"id": name, "object": "model", "created": created, "owned_by": "localai",
            "context_length": context or None, "engine": chosen_engine(record, settings.engine)}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    records = await runtime.registry.off_loop(lambda registry: registry.all())
    remote = await remote_descriptions(request, records)
    settings = request.app.state.settings
    # each local model's window reads its GGUF header and the free memory: off the loop
    data = await asyncio.to_thread(lambda: [model_json(r.name, r, settings, remote.get(r.name)) for r in records])
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    try:
        record = await runtime.record(model_id)
    except ModelNotFound as exc:
        exc.param = "model_id"
        raise
    remote = (await remote_descriptions(request, [record])).get(record.name)
    return await asyncio.to_thread(model_json, model_id, record, request.app.state.settings, remote)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text or texts, or token ids (one array, or one per input) of this model's own tokenizer.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: EmbeddingInput) -> EmbeddingInput:
        if isinstance(value, list) and not value:
            raise ValueError("at least one input is required")
        return check_embedding_inputs(value)

    def token_ids(self) -> list[list[int]] | None:
        """The inputs as token id arrays, when they were sent so (None for text)."""
        if isinstance(self.input, list) and self.input and isinstance(self.input[0], int):
            return [self.input]
        if isinstance(self.input, list) and self.input and isinstance(self.input[0], list):
            return self.input
        return None


# What to do when token ids come from another tokenizer: LangChain's OpenAIEmbeddings tokenizes with tiktoken
# before it sends (check_embedding_ctx_length, on by default), other clients send the text.
FOREIGN_IDS_FIX = ("send the text instead (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False; it "
                   "tokenizes with OpenAI's tiktoken before sending)")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """Embeddings of texts, or of token ids where they are this model's own (a detokenize-retokenize round trip
    gives them back); ids from another tokenizer are a 400 saying so."""
    ids = body.token_ids()
    if ids is not None:
        try:
            vectors, tokens = await runtime_of(request).embed(body.model, [], tokens=ids)
        except InvalidRequest as exc:
            if exc.code == "foreign_token_ids":
                exc.message = f"{exc.message}; {FOREIGN_IDS_FIX}"
            raise
    else:
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors, tokens = await runtime_of(request).embed(body.model, texts)  # type: ignore[arg-type]
    if body.dimensions is not None:
        vectors = [truncated_vector(v, body.dimensions) for v in vectors]
    data = []
    for index, vector in enumerate(vectors):
        value: list[float] | str = vector
        if body.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
