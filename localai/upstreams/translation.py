"""A remote model's request and reply in the OpenAI wire format: the internal ``GenerationRequest`` becomes one chat
completions (or completions) request upstream, and the upstream's stream comes back as the same frames and events a
local worker produces, so fitting, metrics and every dialect's output work unchanged."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from localai.errors import UpstreamFailed
from localai.models.registry import ModelRecord
from localai.protocol import DoneFrame, EventFrame, Usage
from localai.schema import (
    Event,
    FinishReason,
    GenerationRequest,
    MediaBlock,
    Message,
    ReasoningBlock,
    ReasoningDelta,
    TextBlock,
    TextDelta,
    ToolCallBlock,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResultBlock,
    new_call_id,
)

SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                   "typical_p")
_CONTEXT_MESSAGE = re.compile(
    r"maximum context length is (\d+) tokens.*?requested (\d+) tokens(?: \((\d+) in the messages)?", re.S)


def error_message(body: bytes) -> str:
    """The message of an upstream's error body (OpenAI's, Anthropic's or Ollama's shape, or plain text)."""
    try:
        value = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500] or "no message"
    if isinstance(value, dict):
        error = value.get("error", value)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)[:500]
        if isinstance(error, str):
            return error[:500]
        if "detail" in value:
            return str(value["detail"])[:500]
    return str(value)[:500]


def context_error(body: bytes, status: int) -> tuple[int | None, int | None] | None:
    """(context, prompt tokens) when an upstream's 400 says the prompt is over the context (each may be unknown);
    None for other errors. Knows vLLM's and llama-cpp-python's message and llama-server's fields."""
    if status not in (400, 413, 422):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    error = value.get("error") if isinstance(value, dict) else None
    if isinstance(error, dict) and "n_ctx" in error:  # llama-server's exceed_context_size_error
        return int(error["n_ctx"]), int(error.get("n_prompt_tokens") or 0) or None
    message = error_message(body)
    match = _CONTEXT_MESSAGE.search(message)
    if match:
        prompt = int(match.group(3)) if match.group(3) else int(match.group(2))
        return int(match.group(1)), prompt
    code = error.get("code") if isinstance(error, dict) else None
    lowered = message.lower()
    if code == "context_length_exceeded" or ("context" in lowered and ("exceed" in lowered or "too long" in lowered)):
        return None, None
    return None


IMAGE_TOKENS = 768  # what an image counts in a remote prompt's estimate (Gemma 3 takes 256, Qwen-VL 256-1,280)


def image_url(block: MediaBlock) -> str:
    """An image as chat completions carries it: its bytes as a data URL, or the URL the client gave."""
    if block.data:
        return f"data:{block.media_type};base64,{base64.b64encode(block.data).decode()}"
    return block.reference or ""


def _content(message: Message, text: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or, with images, text and image parts in their order."""
    if not any(isinstance(block, MediaBlock) for block in message.content):
        return text
    parts: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += block.text
            else:
                parts.append({"type": "text", "text": block.text})
        elif isinstance(block, MediaBlock):
            parts.append({"type": "image_url", "image_url": {"url": image_url(block)}})
    return parts


def prompt_size(prompt: Any, tools: Any) -> int:
    """A remote prompt's size in characters for fitting: its JSON, each image counted as ``IMAGE_TOKENS``."""
    images = 0

    def strip(value: Any) -> Any:
        nonlocal images
        if isinstance(value, dict):
            if value.get("type") == "image_url":
                images += 1
                return None
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, list):
            return [strip(item) for item in value]
        return value

    return len(json.dumps([strip(prompt), tools], ensure_ascii=False)) + 4 * IMAGE_TOKENS * images


def openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The internal messages as chat completions messages (tool results one message per call, as OpenAI wants;
    images as ``image_url`` parts where they stood)."""
    result: list[dict[str, Any]] = []
    for message in messages:
        text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
        calls = [block for block in message.content if isinstance(block, ToolCallBlock)]
        results = [block for block in message.content if isinstance(block, ToolResultBlock)]
        for block in results:
            result.append({"role": "tool", "tool_call_id": block.tool_call_id, "content": block.content,
                           **({"name": block.name} if block.name else {})})
        if results and not text and message.role in ("tool", "user") \
                and not any(isinstance(block, MediaBlock) for block in message.content):
            continue
        role = "system" if message.role == "developer" else message.role
        if role == "tool":
            role = "user"  # a tool message without results: its text is the user's
        entry: dict[str, Any] = {"role": role, "content": _content(message, text)}  # "" beside calls, not null
        if message.role == "assistant":
            reasoning = "".join(b.text for b in message.content if isinstance(b, ReasoningBlock))
            if reasoning:
                entry["reasoning_content"] = reasoning
        if calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                   for call in calls]
        if message.name and role in ("user", "system"):
            entry["name"] = message.name
        result.append(entry)
    return result


def request_body(record: ModelRecord, request: GenerationRequest, messages: Sequence[Message] | None,
                 model_id: str, kind: str, priority: int | None) -> tuple[str, dict[str, Any]]:
    """The path (``/chat/completions`` or ``/completions``) and body of the upstream request."""
    params = record.parameters
    body: dict[str, Any] = {"model": model_id, "stream": True, "stream_options": {"include_usage": True}}
    if messages is None:
        path = "/completions"
        body["prompt"] = request.prompt or ""
    else:
        path = "/chat/completions"
        shaped = list(messages)
        if record.system and not any(m.role in ("system", "developer") for m in shaped):
            shaped.insert(0, Message("system", [TextBlock(record.system)]))
        extra = [Message(m["role"], [TextBlock(m["content"])]) for m in record.messages]  # type: ignore[arg-type]
        leading = 1 if shaped and shaped[0].role in ("system", "developer") else 0
        shaped[leading:leading] = extra  # the Modelfile's MESSAGEs: after the system prompt, before the talk
        body["messages"] = openai_messages(shaped)
    sampling: dict[str, Any] = {k: v for k, v in params.items() if k in SAMPLING_FIELDS}
    sampling.update({k: v for k, v in request.sampling.as_dict().items() if k in SAMPLING_FIELDS})
    body.update(sampling)
    penalty = request.sampling.repeat_penalty if request.sampling.repeat_penalty is not None \
        else params.get("repeat_penalty")
    if penalty is not None:
        body["repetition_penalty" if kind in ("vllm", "sglang", "dynamo") else "repeat_penalty"] = penalty
    max_tokens = request.max_tokens
    if max_tokens is None and isinstance(params.get("num_predict"), int) and int(params["num_predict"]) >= 0:  # type: ignore[arg-type]
        max_tokens = int(params["num_predict"])  # type: ignore[arg-type]
    if max_tokens is not None and max_tokens >= 0:
        body["max_tokens"] = max_tokens
    model_stops = params.get("stop") if isinstance(params.get("stop"), list) else []
    stops = list(dict.fromkeys([*(request.stop or []), *model_stops]))  # type: ignore[misc]
    if stops:
        body["stop"] = stops
    if request.ignore_eos:
        body["ignore_eos"] = True
    if messages is not None and request.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in request.tools]
        choice = request.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.mode == "function"
                               else choice.mode)
    if request.response_format is not None:
        if request.response_format.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "response", "schema": request.response_format.schema or {}}}
        else:
            body["response_format"] = {"type": "json_object"}
    if request.reasoning is False and messages is not None:
        body["chat_template_kwargs"] = {"enable_thinking": False}  # vLLM, SGLang and llama-server read it
    if request.session_id:
        body["prompt_cache_key"] = request.session_id
    if request.cache_partition and kind in ("vllm", "dynamo", "localai"):
        body["cache_salt"] = request.cache_partition  # the upstream's prefix cache is partitioned as this one is
    if kind == "dynamo":
        hints: dict[str, Any] = {}
        if priority is not None:
            hints["priority"] = priority
        if max_tokens:
            hints["osl"] = max_tokens
        if hints:
            body["nvext"] = {"agent_hints": hints}
    return path, body


class RemoteOp(TypedDict):
    """A request as a remote model's pool sends it: the chat-completions (or completions) body, its headers, the
    key its replicas are chosen by, the room its reply needs and its size (for fitting)."""

    id: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    key: str
    reserve: int
    size: int


def estimated_tokens(op: RemoteOp) -> int:
    """A prompt's tokens without the upstream's tokenizer: about 4 characters of its JSON a token."""
    return max(1, int(op["size"]) // 4)


async def relay(lines: AsyncIterator[str], op: RemoteOp, where: str) -> AsyncIterator[EventFrame | DoneFrame]:
    """The upstream's server-sent events as frames, each relayed as it arrives (``where``: the replica, for
    errors)."""
    calls: dict[int, _Call] = {}
    usage: dict[str, Any] = {}
    reason = "stop"
    pieces = 0
    text_mode = op["path"] == "/completions"

    def event(value: Event) -> EventFrame:
        return EventFrame(ev="event", id=op["id"], event=value)

    complete = False
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            complete = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            raise UpstreamFailed(f"{where} sent an event that is not JSON: "
                                 f"{data[:200]!r}") from None
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            raise UpstreamFailed(f"{where} reported an error during the reply: "
                                 f"{error_message(json.dumps(chunk).encode())}")
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if text_mode:
                if choice.get("text"):
                    pieces += 1
                    yield event(TextDelta(str(choice["text"])))
            else:
                delta = choice.get("delta") or {}
                thought = delta.get("reasoning_content") or delta.get("reasoning")
                if thought:
                    yield event(ReasoningDelta(str(thought)))
                if delta.get("content"):
                    pieces += 1
                    yield event(TextDelta(str(delta["content"])))
                for item in delta.get("tool_calls") or []:
                    for value in _call_events(calls, item):
                        pieces += 1
                        yield event(value)
            if choice.get("finish_reason"):
                reason = str(choice["finish_reason"])
                complete = True
    if not complete:  # the connection closed cleanly, but before the reply said it was finished
        raise UpstreamFailed(f"{where} ended its stream before the reply was "
                             "complete")
    for call in sorted(calls.values(), key=lambda c: c.position):
        if not call.started:
            call.started = True
            yield event(ToolCallStart(call.position, call.id, call.name))
        yield event(ToolCallEnd(call.position, call.id, call.name, "".join(call.arguments)))
    finish: FinishReason = "tool_calls" if calls else _FINISH.get(reason, "stop")
    details = usage.get("prompt_tokens_details") or {}
    # Servers that report no usage while streaming (llama-cpp-python's): about 4 characters a token, so agents
    # that compact their context by the reported input size still see it grow.
    yield DoneFrame(ev="done", id=op["id"], finish_reason=finish, stop_sequence=None, usage=Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or estimated_tokens(op)),
        completion_tokens=int(usage.get("completion_tokens") or pieces),
        cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
        prompt_ms=0.0, decode_ms=0.0,  # the upstream's own timings are not reported
    ))


_FINISH: dict[str, FinishReason] = {"length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls"}


@dataclass
class _Call:
    position: int
    id: str
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    started: bool = False


def _call_events(calls: dict[int, _Call], item: dict[str, Any]) -> list[Event]:
    """Events for one tool-call delta. Some servers repeat the id and name on every delta (llama-cpp-python);
    a call starts once its name is known."""
    if not isinstance(item, dict):
        return []
    index = int(item.get("index", 0) or 0)
    function = item.get("function") or {}
    events: list[Event] = []
    call = calls.get(index)
    if call is None:
        call = calls[index] = _Call(position=len(calls), id=str(item.get("id") or new_call_id()))
    if not call.name and function.get("name"):
        call.name = str(function["name"])
    if call.name and not call.started:
        call.started = True
        events.append(ToolCallStart(call.position, call.id, call.name))
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    if arguments:
        call.arguments.append(str(arguments))
        if call.started:
            pending = "".join(call.arguments) if len(events) else str(arguments)
            events.append(ToolCallDelta(call.position, pending))
    return events
