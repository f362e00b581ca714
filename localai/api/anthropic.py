"""Anthropic Messages API: ``POST /v1/messages`` (Claude Code's only protocol) and ``/v1/messages/count_tokens``.

``cache_control`` (on the request, system blocks, tools or content blocks) pins the conversation's cached prefix
for its TTL (5m, or 1h) against eviction, refreshed by every request that sends it; localai caches every prefix
anyway, so a breakpoint changes how long it is kept, not what is cached. ``output_config.format`` (structured
outputs) constrains the reply to its JSON schema; ``output_config.effort`` is the reasoning level. Images,
documents and audio a model cannot read become text stand-ins (``runtime/media.py``). Accepted and ignored:
``context_management``, ``metadata``, ``service_tier``, ``container``,
``mcp_servers``, ``anthropic-beta`` / ``anthropic-version`` headers, thinking ``budget_tokens``,
``disable_parallel_tool_use``, and Anthropic-defined tools (``bash_…``, ``web_search_…``: a
``type`` other than ``custom``) which have nothing local to run them.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from localai.api.common import (
    SSE_HEADERS,
    Collected,
    ParsedBodyRoute,
    check_tool_results,
    check_tool_schema,
    collect,
    generation_headers,
    runtime_of,
    sse,
    stream_response,
)
from localai.api.errors import anthropic_error_type
from localai.api.media import from_base64, reference
from localai.api.sessions import cache_partition, cache_salt_field, session_id
from localai.errors import InvalidRequest, LocalAIError
from localai.runtime.media import document_text
from localai.schema import (
    Block,
    Finished,
    GenerationRequest,
    KeepAlive,
    MediaBlock,
    MediaKind,
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
    ToolCallStart,
    ToolChoice,
    ToolResultBlock,
    effort_of,
    effort_of_budget,
)

router = APIRouter(route_class=ParsedBodyRoute)

IGNORED_BLOCKS = frozenset({"redacted_thinking", "server_tool_use", "web_search_tool_result", "container_upload",
                            "search_result", "mcp_tool_use", "mcp_tool_result"})


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (``toolu_``); ``internal_id`` reads it back, so the conversation a
    client resends renders as the one the reply was made in."""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def internal_id(block_id: str) -> str:
    return "call_" + block_id.removeprefix("toolu_") if block_id.startswith("toolu_") else block_id


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False
    source: dict[str, Any] | None = None  # an image's or a document's bytes (or where they are)
    title: str | None = None  # a document's


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentBlock]


class SystemBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    text: str = ""


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(default=None, ge=0)


# Claude Code (2.1.36 and later) starts the system prompt with a billing line whose hash changes on every request
# ("x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=<hash>;"): left in, no two prompts share
# more than its first few tokens and the prompt cache misses everything after them. It says nothing to the model.
# `localai launch` turns it off (CLAUDE_CODE_ATTRIBUTION_HEADER=0); this drops it for Claude Code started otherwise.
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}


def cache_ttl(control: Any, param: str) -> float:
    """Seconds a ``cache_control`` breakpoint keeps its prefix (0 without one); a malformed one is a 400."""
    if control is None:
        return 0.0
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise InvalidRequest('cache_control must be {"type": "ephemeral"}, with an optional "ttl" of "5m" or "1h"',
                             param=param)
    ttl = control.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise InvalidRequest(f'cache_control ttl must be "5m" or "1h", not {ttl!r}', param=f"{param}.ttl")
    return CACHE_TTLS[ttl]


BILLING_LINE = re.compile(r"\A\s*x-anthropic-billing-header:[^\n]*(?:\n|\Z)", re.IGNORECASE)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    system: str | list[SystemBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = None  # format (structured outputs) and effort
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's spelling of output_config.format
    logprobs: Any = Field(default=None, description="Anthropic's Messages API has no logprobs: asking is a 400.")
    top_logprobs: Any = Field(default=None, description="Anthropic's Messages API has no logprobs: asking is a 400.")

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("Anthropic's Messages API has no logprobs; ask for them through /v1/chat/completions, "
                             "/v1/responses or /api/chat")
        return value

    def response_format(self) -> ResponseFormat | None:
        """Structured output: ``output_config.format`` (or the beta's ``output_format``) ``{"type": "json_schema",
        "schema": ...}`` constrains the reply to JSON valid against the schema, as chat completions'
        ``response_format`` does."""
        spec, param = (self.output_config or {}).get("format"), "output_config.format"
        if spec is None:
            spec, param = self.output_format, "output_format"
        if spec is None:
            return None
        if not isinstance(spec, dict) or spec.get("type") != "json_schema":
            raise InvalidRequest('the output format must be {"type": "json_schema", "schema": {...}}', param=param)
        if not isinstance(spec.get("schema"), dict):
            raise InvalidRequest("a json_schema output format needs 'schema', a JSON schema object",
                                 param=f"{param}.schema")
        return ResponseFormat("json_schema", spec["schema"])
    cache_salt: str | None = cache_salt_field()

    def generation(self, request: Request) -> GenerationRequest:
        messages = self.internal_messages()
        tools = self.internal_tools()
        choice = ToolChoice("auto")
        if self.tool_choice is not None:
            mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[self.tool_choice.type]
            if mode == "function" and not self.tool_choice.name:
                raise InvalidRequest("tool_choice of type 'tool' needs 'name'", param="tool_choice.name")
            choice = ToolChoice(mode, self.tool_choice.name)  # type: ignore[arg-type]
        reasoning = None
        effort = None
        if self.thinking is not None:
            reasoning = self.thinking.type != "disabled"
            budget = getattr(self.thinking, "budget_tokens", None)
            effort = effort_of_budget(budget if isinstance(budget, int) else None) if reasoning else "low"
        asked = effort_of((self.output_config or {}).get("effort"))
        return GenerationRequest(
            model=self.model, messages=messages, max_tokens=self.max_tokens, stop=self.stop_sequences,
            sampling=SamplingOptions(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
            session_id=session_id(request.headers), tools=tools, tool_choice=choice, reasoning=reasoning,
            reasoning_effort=asked or effort, response_format=self.response_format(),
            cache_partition=cache_partition(request, self.cache_salt),
            cache_ttl=self.breakpoint_ttl() or None,
        )

    def breakpoint_ttl(self) -> float:
        """The longest TTL among the request's ``cache_control`` breakpoints (0 when it sets none)."""
        found = [cache_ttl((self.model_extra or {}).get("cache_control"), "cache_control")]
        if isinstance(self.system, list):
            found += [cache_ttl((b.model_extra or {}).get("cache_control"), f"system.{i}.cache_control")
                      for i, b in enumerate(self.system)]
        found += [cache_ttl((t.model_extra or {}).get("cache_control"), f"tools.{i}.cache_control")
                  for i, t in enumerate(self.tools or [])]
        for index, message in enumerate(self.messages):
            if not isinstance(message.content, str):
                found += [cache_ttl((b.model_extra or {}).get("cache_control"),
                                    f"messages.{index}.content.{j}.cache_control")
                          for j, b in enumerate(message.content)]
        return max(found)

    def internal_messages(self) -> list[Message]:
        messages: list[Message] = []
        texts = [self.system] if isinstance(self.system, str) else [b.text for b in self.system or [] if b.text]
        texts = [kept for kept in (BILLING_LINE.sub("", text, count=1) for text in texts) if kept.strip()]
        if texts:
            messages.append(Message("system", [TextBlock("\n\n".join(texts))]))
        for index, message in enumerate(self.messages):
            param = f"messages.{index}"
            if message.role not in ("user", "assistant", "system"):
                raise InvalidRequest(f"unknown role '{message.role}' (use user or assistant)", param=f"{param}.role")
            if isinstance(message.content, str):
                messages.append(Message(message.role, [TextBlock(message.content)]))  # type: ignore[arg-type]
                continue
            blocks: list[Block] = []
            results: list[Block] = []
            for block_index, block in enumerate(message.content):
                blocks_param = f"{param}.content.{block_index}"
                if block.type == "text":
                    blocks.append(TextBlock(block.text or ""))
                elif block.type == "thinking":
                    blocks.append(ReasoningBlock(block.thinking or ""))
                elif block.type == "tool_use":
                    if not block.id or not block.name:
                        raise InvalidRequest("a tool_use block needs 'id' and 'name'", param=blocks_param)
                    blocks.append(ToolCallBlock(internal_id(block.id), block.name, block.input or {}))
                elif block.type == "tool_result":
                    if not block.tool_use_id:
                        raise InvalidRequest("a tool_result block needs 'tool_use_id'", param=blocks_param)
                    results.append(_tool_result(block, blocks_param))
                elif block.type in ("image", "document"):
                    blocks.extend(media_blocks(block.type, block.source, block.title, blocks_param))
                elif block.type not in IGNORED_BLOCKS:
                    raise InvalidRequest(f"unknown content block type '{block.type}'", param=f"{blocks_param}.type")
            if results:  # tool results come first in a user turn; any text follows as its own message
                messages.append(Message("tool", results))
                if blocks:
                    messages.append(Message(message.role, blocks))  # type: ignore[arg-type]
            else:
                messages.append(Message(message.role, blocks))  # type: ignore[arg-type]
        check_tool_results(messages)
        return messages

    def internal_tools(self) -> list[Tool]:
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                continue  # an Anthropic-hosted tool (web search, computer use...): nothing local runs it
            parsed = Tool(tool.name, tool.description or "", tool.input_schema or {"type": "object", "properties": {}})
            check_tool_schema(parsed, f"tools.{index}.input_schema")
            tools.append(parsed)
        return tools


def media_blocks(kind: str, source: Any, title: str | None, param: str) -> list[TextBlock | MediaBlock]:
    """An ``image`` or ``document`` block's content: base64 bytes, a URL or file id (kept, not fetched), a text
    document's text, or a document made of content blocks."""
    where = f"{param}.source"
    if not isinstance(source, dict):
        raise InvalidRequest(f"an {kind} block needs 'source' (base64, url, file, or for documents text or content)",
                             param=where)
    name = title if isinstance(title, str) and title else None
    medium: MediaKind = "image" if kind == "image" else "document"
    source_type = source.get("type")
    if source_type == "base64":
        return [from_base64(source.get("data"), medium, f"{where}.data", source.get("media_type"), name)]
    if source_type in ("url", "file"):
        return [reference(source.get("url") if source_type == "url" else source.get("file_id"), medium, param, name)]
    if kind == "document" and source_type == "text":
        data = source.get("data")
        if not isinstance(data, str):
            raise InvalidRequest("a text document's 'data' must be a string", param=f"{where}.data")
        return [TextBlock(document_text(name, data))]
    if kind == "document" and source_type == "content":
        inner = source.get("content")
        if isinstance(inner, str):
            return [TextBlock(document_text(name, inner))]
        blocks = _content_parts(inner, f"{where}.content")
        return [TextBlock(document_text(name, "")), *blocks] if name else blocks
    raise InvalidRequest(f"unknown {kind} source type {source_type!r} (base64, url, file"
                         f"{', text, content' if kind == 'document' else ''})", param=f"{where}.type")


def _content_parts(content: Any, param: str) -> list[TextBlock | MediaBlock]:
    """Blocks inside a tool result or a content document: text, images, documents (search results as text); other
    types are skipped, as they were before media were read."""
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=param)
    found: list[TextBlock | MediaBlock] = []
    for index, part in enumerate(content):
        where = f"{param}.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            found.append(TextBlock(str(part.get("text", ""))))
        elif kind in ("image", "document"):
            found.extend(media_blocks(kind, part.get("source"), part.get("title"), where))
        elif kind == "search_result":
            texts = [str(b.get("text", "")) for b in part.get("content") or [] if isinstance(b, dict)]
            found.append(TextBlock("\n".join([str(part.get("title", "")), *texts]).strip()))
        # anything else (Claude Code's tool_reference, blocks of later API versions) says nothing to the model
    return found


def _tool_result(block: ContentBlock, param: str) -> ToolResultBlock:
    """A ``tool_result``: its text parts joined by newlines, each image or document where it stood."""
    call_id = internal_id(block.tool_use_id or "")
    if block.content is None or isinstance(block.content, str):
        return ToolResultBlock(call_id, block.content or "", is_error=block.is_error)
    text = ""
    media: list[tuple[int, MediaBlock]] = []
    for part in _content_parts(block.content, f"{param}.content"):
        if isinstance(part, TextBlock):
            text += ("\n" if text else "") + part.text
        else:
            media.append((len(text), part))
    return ToolResultBlock(call_id, text, is_error=block.is_error, media=media)


def stop_reason(finished: Finished, stops: list[str] | None) -> tuple[str, str | None]:
    if finished.reason == "tool_calls":
        return "tool_use", None
    if finished.reason == "length":
        return "max_tokens", None
    if finished.stop_sequence and stops and finished.stop_sequence in stops:
        return "stop_sequence", finished.stop_sequence
    return "end_turn", None


def usage_json(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic counts cache reads apart from (not inside) input_tokens."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def message_json(result: Collected, body: MessagesRequest, message_id: str) -> dict[str, Any]:
    """A whole (non-streamed) reply as a Messages API message."""
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not result.calls:
        content.append({"type": "text", "text": result.text})
    content.extend({"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": c.parsed_arguments()}
                   for c in result.calls)
    reason, sequence = stop_reason(result.finished, body.stop_sequences)
    usage = result.finished.usage
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": body.model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage_json(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens),
    }


@router.post("/v1/messages", response_model=None)
async def messages(body: MessagesRequest, request: Request) -> JSONResponse | StreamingResponse:
    try:
        generation = await runtime_of(request).start(body.generation(request))
    except InvalidRequest as exc:
        if exc.param == "response_format":  # a schema the grammar cannot be built from: name the field sent
            exc.param = "output_config.format" if body.output_config else "output_format"
        raise
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    headers = generation_headers(generation)
    if not body.stream:
        return JSONResponse(headers=headers, content=message_json(await collect(generation, request), body,
                                                                  message_id))

    async def stream() -> AsyncGenerator[bytes, None]:
        index = -1
        open_kind: str | None = None

        def start_block(block: dict[str, Any]) -> bytes:
            nonlocal index, open_kind
            index += 1
            open_kind = block["type"]
            return sse({"type": "content_block_start", "index": index, "content_block": block},
                       "content_block_start")

        def stop_block() -> bytes:
            nonlocal open_kind
            open_kind = None
            return sse({"type": "content_block_stop", "index": index}, "content_block_stop")

        yield sse({"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": body.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage_json(generation.prompt_tokens, generation.cached_tokens, 0)}}, "message_start")
        yield sse({"type": "ping"}, "ping")
        async for event in generation.stream_events():
            if isinstance(event, KeepAlive):
                yield sse({"type": "ping"}, "ping")
            elif isinstance(event, TextDelta | ReasoningDelta):
                kind = "text" if isinstance(event, TextDelta) else "thinking"
                if open_kind != kind:
                    if open_kind is not None:
                        yield stop_block()
                    yield start_block({"type": "text", "text": ""} if kind == "text"
                                      else {"type": "thinking", "thinking": "", "signature": ""})
                delta = ({"type": "text_delta", "text": event.text} if kind == "text"
                         else {"type": "thinking_delta", "thinking": event.text})
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            elif isinstance(event, ToolCallStart):
                if open_kind is not None:
                    yield stop_block()
                yield start_block({"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}})
            elif isinstance(event, ToolCallDelta):
                yield sse({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": event.arguments}},
                          "content_block_delta")
            elif isinstance(event, Finished):
                if open_kind is not None:
                    yield stop_block()
                reason, sequence = stop_reason(event, body.stop_sequences)
                usage = event.usage
                yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": usage_json(usage.prompt_tokens, usage.cached_tokens,
                                               usage.completion_tokens)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")

    def error(exc: LocalAIError) -> bytes:
        return sse({"type": "error", "error": {"type": anthropic_error_type(exc.status_code), "message": exc.message}},
                   "error")

    return stream_response(generation, stream(), error, headers={**SSE_HEADERS, **headers})


class CountTokensRequest(MessagesRequest):
    max_tokens: StrictInt | None = None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The real token count of the prompt as the model's template and tokenizer make it."""
    return {"input_tokens": await runtime_of(request).count_tokens(body.generation(request))}

