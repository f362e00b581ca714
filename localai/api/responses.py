"""OpenAI Responses API: ``POST /v1/responses`` (Codex's only protocol) and ``GET /v1/responses/{id}``; the
WebSocket mode is ``responses_socket.py``, storage ``response_store.py``.

With ``store`` (the default, as at OpenAI) each response is kept in SQLite, so a later request can
continue it with ``previous_response_id`` instead of resending the conversation.

``include: ["message.output_text.logprobs"]`` (or ``top_logprobs`` over 0) gives the output text each generated
token's logprob. Accepted and ignored: ``include``'s other values, ``parallel_tool_calls``, ``truncation``,
``metadata``, ``user``, ``safety_identifier``, ``client_metadata``, ``service_tier``, ``text.verbosity``,
``reasoning.summary``, and tool types other than ``function`` and ``namespace`` (``web_search``,
``image_generation``, ``file_search``, ``custom``...), which have nothing local to run them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from starlette.requests import HTTPConnection

from localai.api.common import (
    KEEPALIVE_COMMENT,
    SSE_HEADERS,
    ParsedBodyRoute,
    PendingLogprobs,
    check_tool_results,
    check_tool_schema,
    generation_headers,
    parse_arguments,
    runtime_of,
    sse,
    stream_response,
    top_logprobs_field,
    unless_disconnected,
)
from localai.api.media import file_data, from_url, openai_part, reference, tool_result
from localai.api.response_store import ResponseStore
from localai.api.sessions import cache_partition, cache_salt_field, session_id
from localai.errors import InvalidRequest, LocalAIError, NotFound
from localai.protocol import DEFAULT_SAMPLING
from localai.runtime.generation import Generation
from localai.schema import (
    OPENAI_EFFORTS,
    Finished,
    GenerationRequest,
    KeepAlive,
    LogprobsDelta,
    MediaBlock,
    Message,
    ReasoningBlock,
    ReasoningDelta,
    ResponseFormat,
    SamplingOptions,
    TextBlock,
    TextDelta,
    Tool,
    ToolCallBlock,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    effort_of,
)

router = APIRouter(route_class=ParsedBodyRoute)
log = logging.getLogger("localai.server")
IGNORED_ITEMS = frozenset({"item_reference", "web_search_call", "image_generation_call", "file_search_call",
                           "mcp_list_tools"})
# A compaction item (api/responses_compaction.py) carries the model's summary of the turns it replaced, marked, as its
# "encrypted_content" (nothing here is secret: the client had it all); a later request's input reads it back.
COMPACTED_MARK = "localai-compaction-v1:"
COMPACTED_HEADER = "Summary of the conversation so far (earlier turns were compacted into it):\n\n"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # effort (checked), summary (accepted, ignored)
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = cache_salt_field()
    background: bool = False
    parallel_tool_calls: bool = True
    max_tool_calls: StrictInt | None = Field(default=None, ge=1)
    top_logprobs: StrictInt | None = top_logprobs_field("Alternatives per token (0-20) in the output text's logprobs.")
    include: list[Any] | None = Field(default=None, description="message.output_text.logprobs: each generated "
                                      "token's logprob in the output text; the other values are accepted and "
                                      "ignored.")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    generate: bool = True  # False: only evaluate and cache the prompt (Codex's WebSocket prewarm), no output

    def logprobs_count(self) -> int | None:
        """Alternatives per token when the output text's logprobs are asked for (the include value, or a
        top_logprobs over 0); None: no logprobs."""
        if "message.output_text.logprobs" in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    @field_validator("reasoning")
    @classmethod
    def _effort(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        effort = (value or {}).get("effort")
        if effort is not None and effort not in OPENAI_EFFORTS:
            raise ValueError(f"reasoning.effort must be one of {', '.join(OPENAI_EFFORTS)}, not {str(effort)[:40]!r}")
        return value


# -- input ----------------------------------------------------------------------------------------

TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _blocks_of(content: Any, param: str) -> list[TextBlock | MediaBlock]:
    """A message's (or a tool output's) content: text, images, files and audio, in order."""
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(content)]
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of parts", param=param)
    blocks: list[TextBlock | MediaBlock] = []
    for index, part in enumerate(content):
        where = f"{param}.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            blocks.append(TextBlock(str(part.get("text", ""))))
        elif kind == "input_image":
            assert isinstance(part, dict)
            if part.get("image_url") is not None:
                blocks.append(from_url(part["image_url"], "image", f"{where}.image_url"))
            elif part.get("file_id") is not None:
                blocks.append(reference(part["file_id"], "image", where))
            else:
                raise InvalidRequest("an input_image part needs 'image_url' (a data: URL or URL) or 'file_id'",
                                     param=where)
        elif kind == "input_file":
            assert isinstance(part, dict)
            blocks.append(file_data(part.get("file_data"), part.get("file_id"), part.get("filename"), where,
                                    url=part.get("file_url")))
        elif kind == "input_audio":
            blocks.append(openai_part(part, where) or TextBlock(""))
        elif kind != "refusal":
            raise InvalidRequest(f"unknown content part type {kind!r} (input_text, input_image, input_file, "
                                 "input_audio)", param=f"{where}.type")
    return blocks


def text_of(content: Any, param: str) -> str:
    """Only the text of a content (reasoning, summaries): media parts are passed over."""
    if isinstance(content, list):
        content = [part for part in content if not (isinstance(part, dict) and part.get("type") in MEDIA_PARTS)]
    return "".join(block.text for block in _blocks_of(content, param) if isinstance(block, TextBlock))


def input_messages(items: list[dict[str, Any]], param: str = "input") -> list[Message]:
    """Responses input items as messages; an assistant turn's reasoning, text and calls join one message."""
    messages: list[Message] = []

    def assistant() -> Message:
        if not messages or messages[-1].role != "assistant":
            messages.append(Message("assistant", []))
        return messages[-1]

    for index, item in enumerate(items):
        where = f"{param}.{index}"
        if not isinstance(item, dict):
            raise InvalidRequest("each input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"unknown role {role!r} (use user, assistant, system or developer)",
                                     param=f"{where}.role")
            blocks = _blocks_of(item.get("content"), f"{where}.content") or [TextBlock("")]
            if role == "assistant":
                assistant().content.extend(blocks)
            else:
                messages.append(Message(role, list(blocks)))
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise InvalidRequest("a function_call item needs 'call_id' and 'name'", param=where)
            arguments = parse_arguments(item.get("arguments"), f"{where}.arguments")
            assistant().content.append(ToolCallBlock(call_id, name, arguments))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest("a function_call_output item needs 'call_id'", param=where)
            result = tool_result(call_id, _blocks_of(item.get("output", ""), f"{where}.output"), None)
            if messages and messages[-1].role == "tool":
                messages[-1].content.append(result)
            else:
                messages.append(Message("tool", [result]))
        elif kind == "compaction":  # a /v1/responses/compact summary standing for the turns it replaced
            summary = item.get("encrypted_content")
            if not isinstance(summary, str):
                raise InvalidRequest("a compaction item needs 'encrypted_content' (from /v1/responses/compact)",
                                     param=f"{where}.encrypted_content")
            messages.append(Message("user", [TextBlock(COMPACTED_HEADER + summary.removeprefix(COMPACTED_MARK))]))
        elif kind == "reasoning":
            text = text_of(item.get("content"), f"{where}.content") or str(item.get("encrypted_content") or "")
            if text:
                assistant().content.append(ReasoningBlock(text))
        elif kind not in IGNORED_ITEMS:
            raise InvalidRequest(f"unknown input item type {kind!r}", param=f"{where}.type")
    return messages


def tools_of(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """Function tools; ``namespace`` tools are flattened to ``namespace.name``; other types are ignored."""
    result: list[Tool] = []

    def add(tool: dict[str, Any], where: str, prefix: str = "") -> None:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a function tool needs 'name'", param=f"{where}.name")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        parsed = Tool(prefix + name, str(tool.get("description") or ""), parameters)
        check_tool_schema(parsed, f"{where}.parameters")
        result.append(parsed)

    for index, tool in enumerate(tools or []):
        where = f"tools.{index}"
        kind = tool.get("type")
        if kind == "function":
            add(tool, where)
        elif kind == "namespace":
            inner_tools = tool.get("tools") or []
            if not isinstance(inner_tools, list):
                raise InvalidRequest("a namespace tool's 'tools' must be a list", param=f"{where}.tools")
            for inner_index, inner in enumerate(inner_tools):
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    add(inner, f"{where}.tools.{inner_index}", prefix=f"{tool.get('name')}.")
    return result


def tool_choice_of(value: str | dict[str, Any] | None) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value in ("none", "required"):
        return ToolChoice(value)  # type: ignore[arg-type]
    if isinstance(value, dict) and value.get("type") == "function" and value.get("name"):
        return ToolChoice("function", str(value["name"]))
    if isinstance(value, dict) and value.get("type") in ("allowed_tools",):
        return ToolChoice("required" if value.get("mode") == "required" else "auto")
    raise InvalidRequest("tool_choice must be none, auto, required or {type: function, name}", param="tool_choice")


def text_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    spec = (text or {}).get("format")
    if spec is not None and not isinstance(spec, dict):
        raise InvalidRequest("text.format must be an object such as {\"type\": \"json_schema\", ...}",
                             param="text.format")
    if not spec or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return ResponseFormat("json_object")
    if spec.get("type") == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise InvalidRequest("text.format json_schema needs 'schema'", param="text.format.schema")
        return ResponseFormat("json_schema", spec["schema"])
    raise InvalidRequest(f"unknown text.format type {spec.get('type')!r}", param="text.format.type")


# -- output ---------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage_json(finished: Finished) -> dict[str, Any]:
    usage = finished.usage
    # cache_write_tokens: the prompt's tokens not read from the cache, which the turn's save stores
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": max(0, usage.prompt_tokens - usage.cached_tokens)},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


class OutputBuilder:
    """Turns events into output items and, for streaming, into the Responses event sequence."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self.sequence = 0
        self.out: list[tuple[str, dict[str, Any]]] = []
        self.logprobs = PendingLogprobs()  # the output text's next delta carries them

    def event(self, kind: str, **data: Any) -> None:
        self.out.append((kind, {"type": kind, "sequence_number": self.sequence, **data}))
        self.sequence += 1

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        out, self.out = self.out, []
        return out

    def _start(self, item: dict[str, Any]) -> None:
        self.close()
        self.items.append(item)
        self._open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def close(self) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.items) - 1
        if item["type"] == "message":
            part = item["content"][0]
            self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=part["text"], logprobs=part["logprobs"])
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=dict(part))
        elif item["type"] == "reasoning":
            self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=item["content"][0]["text"])
            item["encrypted_content"] = item["content"][0]["text"]  # comes back in the next request's input
        elif item["type"] == "function_call":
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])
        item["status"] = "completed"
        self.event("response.output_item.done", output_index=index, item=dict(item))

    def feed(self, event: TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | LogprobsDelta,
             ) -> None:
        current = self._open
        index = len(self.items) - 1
        if isinstance(event, LogprobsDelta):
            self.logprobs.add(event)
        elif isinstance(event, TextDelta):
            if current is None or current["type"] != "message":
                self._start({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []})
                current, index = self._open, len(self.items) - 1
                assert current is not None
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                current["content"].append(part)
                self.event("response.content_part.added", item_id=current["id"], output_index=index,
                           content_index=0, part=dict(part))
            current["content"][0]["text"] += event.text
            logprobs = self.logprobs.take()
            current["content"][0]["logprobs"].extend(logprobs)
            self.event("response.output_text.delta", item_id=current["id"], output_index=index, content_index=0,
                       delta=event.text, logprobs=logprobs)
        elif isinstance(event, ReasoningDelta):
            if current is None or current["type"] != "reasoning":
                self._start({"type": "reasoning", "id": new_id("rs"), "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}]})
                current, index = self._open, len(self.items) - 1
                assert current is not None
            current["content"][0]["text"] += event.text
            self.event("response.reasoning_text.delta", item_id=current["id"], output_index=index,
                       content_index=0, delta=event.text)
        elif isinstance(event, ToolCallStart):
            self._start({"type": "function_call", "id": new_id("fc"), "call_id": event.id, "name": event.name,
                         "arguments": "", "status": "in_progress"})
        elif isinstance(event, ToolCallDelta) and current is not None and current["type"] == "function_call":
            current["arguments"] += event.arguments
            self.event("response.function_call_arguments.delta", item_id=current["id"], output_index=index,
                       delta=event.arguments)
        elif isinstance(event, ToolCallEnd) and current is not None and current["type"] == "function_call":
            current["arguments"] = event.arguments
            self.close()


def response_json(body: ResponsesRequest, response_id: str, created: int, status: str,
                  output: list[dict[str, Any]], tools: list[Tool], finished: Finished | None,
                  sampling: dict[str, Any]) -> dict[str, Any]:
    """The response object, every field the Open Responses schema requires, with the sampling values used."""
    incomplete = {"reason": "max_output_tokens"} if finished is not None and finished.reason == "length" else None
    reasoning = body.reasoning or {}
    return {
        "id": response_id, "object": "response", "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None, "status": status, "error": None,
        "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": body.model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": body.store, "background": False, "service_tier": "default",
        "temperature": float(sampling.get("temperature", DEFAULT_SAMPLING["temperature"])),
        "top_p": float(sampling.get("top_p", DEFAULT_SAMPLING["top_p"])),
        "presence_penalty": float(sampling.get("presence_penalty", 0.0)),
        "frequency_penalty": float(sampling.get("frequency_penalty", 0.0)),
        "top_logprobs": body.top_logprobs or 0,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                   "strict": False} for t in tools],
        "truncation": body.truncation or "disabled", "metadata": body.metadata or {}, "user": body.user,
        "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        "usage": usage_json(finished) if finished is not None else None,
    }


# -- endpoints ------------------------------------------------------------------------------------

@dataclass
class ResponseRun:
    """One response being made: the request, its generation and the output it builds."""

    body: ResponsesRequest
    generation: Generation
    tools: list[Tool]
    conversation: list[dict[str, Any]]  # everything before the output: the history and this turn's items
    items: list[dict[str, Any]]  # this turn's own input items (stored after the previous response's)
    store: ResponseStore
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    id: str = field(default_factory=lambda: new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, finished: Finished | None) -> dict[str, Any]:
        return response_json(self.body, self.id, self.created, status, self.builder.items, self.tools, finished,
                             self.generation.sampling)

    async def finish(self, finished: Finished) -> dict[str, Any]:
        self.builder.close()
        response = self.response("incomplete" if finished.reason == "length" else "completed", finished)
        if self.body.store:
            await self.store.save(response, self.items, self.conversation, self.body.previous_response_id)
        return response

    async def events(self) -> AsyncGenerator[tuple[str, dict[str, Any]] | KeepAlive, None]:
        """The Responses event sequence, from response.created to response.completed (or incomplete)."""
        start = self.response("in_progress", None)
        self.builder.event("response.created", response=start)
        self.builder.event("response.in_progress", response=start)
        for out in self.builder.take():
            yield out
        async for event in self.generation.stream_events():
            if isinstance(event, KeepAlive):
                yield event
                continue
            if isinstance(event, Finished):
                response = await self.finish(event)
                self.builder.event("response.incomplete" if response["status"] == "incomplete"
                                   else "response.completed", response=response)
            else:
                self.builder.feed(event)
            for out in self.builder.take():
                yield out

    def failed(self, exc: LocalAIError) -> list[tuple[str, dict[str, Any]]]:
        failed = self.response("failed", None)
        failed["error"] = {"code": exc.code or exc.error_type, "message": exc.message}
        self.builder.event("response.failed", response=failed)
        return self.builder.take()


async def read_conversation(store: ResponseStore, given: str | list[dict[str, Any]] | None,
                            previous_response_id: str | None,
                            earlier: Mapping[str, list[dict[str, Any]]] | None = None,
                            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Message]]:
    """A request's input items after ``previous_response_id``'s conversation (looked up in ``earlier`` first: a
    WebSocket connection's own responses), its own items alone, and the whole as messages."""
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    history: list[dict[str, Any]] = []
    if previous_response_id:
        known = (earlier or {}).get(previous_response_id)
        history = list(known) if known is not None else await store.conversation(previous_response_id)
    conversation = [*history, *items]
    return conversation, items, input_messages(conversation)


def with_instructions(messages: list[Message], instructions: str | None) -> list[Message]:
    """``instructions`` first, as the system message, and every tool result answering a call before it."""
    if instructions:
        messages.insert(0, Message("system", [TextBlock(instructions)]))
    check_tool_results(messages, "input")
    return messages


async def start_response(body: ResponsesRequest, request: HTTPConnection,
                         earlier: Mapping[str, list[dict[str, Any]]] | None = None) -> ResponseRun:
    """Validate the request, build its conversation (after ``previous_response_id``'s, looked up in ``earlier``
    first: a WebSocket connection's own responses) and start the generation."""
    if body.background:
        raise InvalidRequest("background responses are not supported", param="background")
    store = ResponseStore(request)
    conversation, items, messages = await read_conversation(store, body.input, body.previous_response_id, earlier)
    if body.generate and not any(m.role in ("user", "tool") for m in messages):
        # a prewarm (generate: false) may come before the first message: its instructions and tools are warmed
        raise InvalidRequest("'input' needs at least one user message or tool output", param="input")
    messages = with_instructions(messages, body.instructions)
    tools = tools_of(body.tools)
    effort = (body.reasoning or {}).get("effort")
    generation_request = GenerationRequest(
        model=body.model, messages=messages, max_tokens=body.max_output_tokens,
        sampling=SamplingOptions(temperature=body.temperature, top_p=body.top_p,
                                 presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty),
        session_id=session_id(request.headers, body.prompt_cache_key), tools=tools,
        cache_partition=cache_partition(request, body.cache_salt),
        tool_choice=tool_choice_of(body.tool_choice), response_format=text_format(body.text),
        reasoning=False if effort in ("none", "minimal") else None, reasoning_effort=effort_of(effort),
        prefill_only=not body.generate, logprobs=body.logprobs_count(),
    )
    try:
        generation = await runtime_of(request).start(generation_request)
    except InvalidRequest as exc:
        if exc.param == "response_format":
            exc.param = "text.format"
        raise
    return ResponseRun(body, generation, tools, conversation, items, store)


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | StreamingResponse:
    run = await start_response(body, request)
    headers = generation_headers(run.generation)
    if not body.stream:
        async def whole() -> Finished | None:
            finished: Finished | None = None
            try:
                async for event in run.generation.events():
                    if isinstance(event, Finished):
                        finished = event
                    else:
                        run.builder.feed(event)
            finally:
                await run.generation.aclose()
            return finished

        finished = await unless_disconnected(request, whole(), run.generation)
        if finished is None:
            raise LocalAIError("the generation ended without finishing")
        return JSONResponse(await run.finish(finished), headers=headers)

    async def stream() -> AsyncGenerator[bytes, None]:
        async for out in run.events():
            yield KEEPALIVE_COMMENT if isinstance(out, KeepAlive) else sse(out[1], out[0])

    def error(exc: LocalAIError) -> bytes:
        return b"".join(sse(data, kind) for kind, data in run.failed(exc))

    return stream_response(run.generation, stream(), error, headers={**SSE_HEADERS, **headers})


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    try:
        row = await ResponseStore(request).get(response_id)
    except NotFound as exc:
        exc.param = "response_id"
        raise
    response: dict[str, Any] = json.loads(row["response"])
    return response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    try:
        await ResponseStore(request).delete(response_id)
    except NotFound as exc:
        exc.param = "response_id"
        raise
    return {"id": response_id, "object": "response.deleted", "deleted": True}

