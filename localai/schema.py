"""The one internal representation of a request and of its stream of events.

Every API dialect translates into ``GenerationRequest`` and out of ``Event``s; the engine never
knows which dialect asked.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import pydantic_core

Role = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]

MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's bound)


SUBSESSION = " > "  # between a session and a session of its own it started: "PARENT > agent:ID", "PARENT > title"


def child_session(parent: str, child: str) -> str:
    """The session of a sub-agent (``agent:ID``) or of a side request (``title``, Codex's ``memory``...) of
    ``parent``: its own cache slot, divergences and entries, listed under the parent's, and its own prefix."""
    return f"{parent}{SUBSESSION}{child}"


def parent_session(session: str | None) -> str | None:
    """The session that started ``session``, or None when it is not a child session."""
    if session is None or SUBSESSION not in session:
        return None
    return session.rsplit(SUBSESSION, 1)[0]


class TopLogprob(TypedDict):
    """One of the likeliest tokens at a position: its text (UTF-8, a partial character replaced), bytes and
    log-probability."""

    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token's log-probability and the likeliest tokens at its position (``top_logprobs`` of them)."""

    top_logprobs: list[TopLogprob]


@dataclass
class TextBlock:
    text: str
    type: Literal["text"] = "text"


@dataclass
class ReasoningBlock:
    text: str
    type: Literal["reasoning"] = "reasoning"


@dataclass
class ToolCallBlock:
    id: str
    name: str
    arguments: dict[str, Any]
    type: Literal["tool_call"] = "tool_call"


MediaKind = Literal["image", "audio", "document"]


@dataclass
class MediaBlock:
    """An image, audio clip or document a client sent: its bytes, or where it lives when the client only named it
    (a URL or an uploaded file's id, which localai does not fetch). Before the prompt is rendered each becomes text
    (``runtime/media.py``): a document its extracted text; for a model that cannot see or hear it, a short stand-in
    saying what was left out; for a model with a vision projector, the image's place in the prompt."""

    kind: MediaKind
    media_type: str  # "image/png", "audio/wav", "application/pdf"; "application/octet-stream" when unknown
    data: bytes = b""
    reference: str | None = None  # a URL or file id given instead of the bytes
    name: str | None = None  # a document's title or file name
    where: str = ""  # the request field it came from ("messages.2.content.0"), for messages that name it
    type: Literal["media"] = "media"

    def digest(self) -> str:
        """The sha256 of its bytes (or of its reference): the same content always describes the same."""
        return hashlib.sha256(self.data if self.data or self.reference is None else self.reference.encode()
                              ).hexdigest()


@dataclass
class ToolResultBlock:
    tool_call_id: str
    content: str
    name: str | None = None  # the function that produced it, when the dialect says (Ollama's tool_name)
    is_error: bool = False
    # Media inside the result (Claude Code's Read of a PNG), each with the offset in ``content`` where it stood;
    # emptied, with its text put in place, before the prompt is rendered.
    media: list[tuple[int, MediaBlock]] = field(default_factory=list)
    type: Literal["tool_result"] = "tool_result"


Block = TextBlock | ReasoningBlock | ToolCallBlock | ToolResultBlock | MediaBlock


@dataclass
class Message:
    role: Role
    content: list[Block] = field(default_factory=list)
    name: str | None = None

    def text(self) -> str:
        return "".join(block.text for block in self.content if isinstance(block, TextBlock))


@dataclass
class SamplingOptions:
    """Sampling as the request asked for it; None means "the model's default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if value is not None}


@dataclass
class Tool:
    """A function the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class ToolChoice:
    """``auto`` (the model decides), ``none``, ``required`` (some call), or ``function`` (``name`` only)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclass
class ResponseFormat:
    """Structured output: any JSON object, or JSON valid against ``schema``."""

    type: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None


@dataclass
class GenerationRequest:
    """A chat (``messages``) or raw completion (``prompt``) request, whatever the dialect."""

    model: str
    messages: list[Message] | None = None
    prompt: str | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    max_tokens: int | None = None
    stop: list[str] | None = None
    session_id: str | None = None
    keep_alive: float | None = None
    load_options: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False
    raw: bool = False
    fit_context: bool | None = None  # None: the model's setting (default on)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    response_format: ResponseFormat | None = None
    reasoning: bool | None = None  # None: the model's default; False asks a thinking model not to think
    # How hard a model with reasoning levels thinks (gpt-oss's Harmony "Reasoning: low|medium|high"); None: its
    # default. Given to every template as `reasoning_effort`.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    cache_ttl: float | None = None  # keep this request's cached prefix at least this long (cache_control)
    prefill_only: bool = False  # evaluate and cache the prompt, generate nothing (a client warming its session)
    speculative: bool | None = None  # None: the model's PARAMETER speculative (default auto: where output is exact)
    # Images a model with a vision projector sees, by sha256 (the rendered prompt marks where each stands)
    images: dict[str, bytes] = field(default_factory=dict)
    cache_partition: str = ""  # whose cached prefixes it may reuse (api/sessions.cache_partition); "" the default
    logprobs: int | None = None  # each generated token's logprob and this many alternatives (0-20); None: none
    follow_up: bool = True  # the reply is the session's turn: prefilled as the next turn renders it (not: n's others)

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    drafted_tokens: int = 0  # speculative decoding: tokens guessed from the context, and those kept
    accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TextDelta:
    text: str
    type: Literal["text"] = "text"


@dataclass
class ReasoningDelta:
    text: str
    type: Literal["reasoning"] = "reasoning"


def new_call_id() -> str:
    """A tool call's id, for calls the model wrote without one (every engine's and upstream's alike)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStart:
    """A tool call begins: its position among this response's calls, its id and the function's name."""

    index: int
    id: str
    name: str
    type: Literal["tool_call_start"] = "tool_call_start"


@dataclass
class ToolCallDelta:
    """More of a tool call's arguments (JSON text); the deltas of one call concatenate to its arguments."""

    index: int
    arguments: str
    type: Literal["tool_call_delta"] = "tool_call_delta"


@dataclass
class ToolCallEnd:
    """A tool call is complete; ``arguments`` is the whole JSON text."""

    index: int
    id: str
    name: str
    arguments: str
    type: Literal["tool_call_end"] = "tool_call_end"

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as an object; a call cut short (``max_tokens``) keeps what was written of them, read as
        far as it goes (a string cut mid-way keeps its start), as a streamed reply's deltas would have."""
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            try:
                value = pydantic_core.from_json(self.arguments, allow_partial="trailing-strings")
            except ValueError:
                return {}
        return value if isinstance(value, dict) else {}


@dataclass
class Finished:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # which stop string ended the text, when one did
    type: Literal["finished"] = "finished"


@dataclass
class LogprobsDelta:
    """The logprobs of the generated tokens whose text the events that follow carry (the request asked for them):
    every generated token's, whether its text went to the answer, the reasoning or a tool call."""

    entries: list[TokenLogprob]
    type: Literal["logprobs"] = "logprobs"


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | LogprobsDelta | Finished


@dataclass
class KeepAlive:
    """Nothing to send for a while (a long prompt is being evaluated): a stream sends its keep-alive."""

    type: Literal["keep_alive"] = "keep_alive"


@dataclass
class ReplyParts:
    """A reply's text, reasoning and complete tool calls, gathered from its events."""

    texts: list[str] = field(default_factory=list)
    reasonings: list[str] = field(default_factory=list)
    calls: list[ToolCallEnd] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, event: Event) -> Event:
        if isinstance(event, LogprobsDelta):
            self.logprobs.extend(event.entries)
        elif isinstance(event, TextDelta):
            self.texts.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self.reasonings.append(event.text)
        elif isinstance(event, ToolCallEnd):
            self.calls.append(event)
        return event

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasonings)


# The reasoning efforts OpenAI's dialects take (chat's reasoning_effort, Responses' reasoning.effort); others are 400s.
OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
OpenAIEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# Ollama's think: true/false, or a level (gpt-oss).
OllamaThink = bool | Literal["low", "medium", "high", "true", "false", "none"]


def effort_of(value: object) -> Literal["low", "medium", "high"] | None:
    """A dialect's reasoning effort as a level: low, medium and high as they are; none and minimal are low (a model
    with levels cannot stop reasoning: the least it does is low); anything else is the model's default."""
    if value in ("none", "minimal", "low"):
        return "low"
    if value == "medium":
        return "medium"
    if value in ("high", "xhigh"):
        return "high"
    return None


def effort_of_budget(budget_tokens: int | None) -> Literal["low", "medium", "high"] | None:
    """An Anthropic thinking budget as a level: under 4,096 tokens low, under 16,384 medium, more high."""
    if budget_tokens is None:
        return None
    return "low" if budget_tokens < 4096 else "medium" if budget_tokens < 16384 else "high"
