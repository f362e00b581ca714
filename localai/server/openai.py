"""OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from localai.errors import InvalidRequest, LocalAIError, ModelNotFound
from localai.runtime import Generation, Runtime
from localai.schema import Finished, GenerationRequest, Message, SamplingOptions, TextBlock, TextDelta, Usage
from localai.server.sessions import session_id

router = APIRouter()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_message(self, index: int) -> Message:
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            texts = []
            for part_index, part in enumerate(self.content):
                if part.type not in ("text", "input_text", "output_text"):
                    raise InvalidRequest(
                        f"content part type '{part.type}' is not supported (text only)",
                        param=f"messages.{index}.content.{part_index}.type",
                    )
                texts.append(part.text or "")
            text = "".join(texts)
        return Message(role=self.role, content=[TextBlock(text)], name=self.name)


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
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=1, description="Only one choice is supported.")
    prompt_cache_key: str | None = None
    ignore_eos: bool = False
    fit_context: bool | None = Field(
        default=None, description="Fit an over-long conversation into the context (default on; false: 400)."
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
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
            session_id=session_id(request.headers, self.prompt_cache_key), **kwargs,
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt is supported")
        return value


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def sse_error(error: LocalAIError) -> bytes:
    return sse({"error": {"message": error.message, "type": error.error_type, "param": error.param,
                          "code": error.code}})


async def collect(generation: Generation) -> tuple[str, Finished]:
    parts: list[str] = []
    finished: Finished | None = None
    async for event in generation.events():
        if isinstance(event, TextDelta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    if finished is None:
        raise LocalAIError("the generation ended without finishing")
    return "".join(parts), finished


def fit_headers(generation: Generation) -> dict[str, str]:
    """Tells the client when its conversation was shortened to fit the context."""
    return {"X-LocalAI-Context-Fitted": generation.fit.header()} if generation.fit else {}


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    messages = [message.to_message(index) for index, message in enumerate(body.messages)]
    generation = await runtime_of(request).start(body.generation(request, messages=messages))
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    headers = fit_headers(generation)
    if not body.stream:
        text, finished = await collect(generation)
        return JSONResponse(headers=headers, content={
            "id": completion_id, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason(finished.reason)}],
            "usage": usage_json(finished.usage), "system_fingerprint": None,
        })
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    async def stream() -> AsyncIterator[bytes]:
        try:
            yield sse(chunk({"role": "assistant", "content": ""}))
            async for event in generation.events():
                if isinstance(event, TextDelta):
                    yield sse(chunk({"content": event.text}))
                elif isinstance(event, Finished):
                    yield sse(chunk({}, finish_reason(event.reason)))
                    if include_usage:
                        yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                   "model": body.model, "choices": [], "usage": usage_json(event.usage)})
            yield sse("[DONE]")
        except LocalAIError as exc:
            yield sse_error(exc)
        finally:
            await generation.aclose()

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **headers})


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    generation = await runtime_of(request).start(body.generation(request, prompt=prompt))
    completion_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    prefix = prompt if body.echo else ""
    if not body.stream:
        text, finished = await collect(generation)
        return JSONResponse({
            "id": completion_id, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"index": 0, "text": prefix + text, "logprobs": None,
                         "finish_reason": finish_reason(finished.reason)}],
            "usage": usage_json(finished.usage),
        })
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str, reason: str | None = None) -> dict[str, Any]:
        return {"id": completion_id, "object": "text_completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

    async def stream() -> AsyncIterator[bytes]:
        try:
            if prefix:
                yield sse(chunk(prefix))
            async for event in generation.events():
                if isinstance(event, TextDelta):
                    yield sse(chunk(event.text))
                elif isinstance(event, Finished):
                    yield sse(chunk("", finish_reason(event.reason)))
                    if include_usage:
                        yield sse({"id": completion_id, "object": "text_completion", "created": created,
                                   "model": body.model, "choices": [], "usage": usage_json(event.usage)})
            yield sse("[DONE]")
        except LocalAIError as exc:
            yield sse_error(exc)
        finally:
            await generation.aclose()

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def model_json(name: str, modified_at: str) -> dict[str, Any]:
    created = int(time.mktime(time.strptime(modified_at[:19], "%Y-%m-%dT%H:%M:%S"))) if modified_at else 0
    return {"id": name, "object": "model", "created": created, "owned_by": "localai"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    records = runtime_of(request).registry.all()
    return {"object": "list", "data": [model_json(r.name, r.modified_at) for r in records]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    try:
        record = runtime_of(request).registry.get(model_id)
    except ModelNotFound as exc:
        exc.param = "model_id"
        raise
    return model_json(model_id, record.modified_at)
