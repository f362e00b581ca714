"""The one internal representation of a request and of its stream of events.

Every API dialect translates into ``GenerationRequest`` and out of ``Event``s; the engine never
knows which dialect asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]


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


@dataclass
class ToolResultBlock:
    tool_call_id: str
    content: str
    type: Literal["tool_result"] = "tool_result"


Block = TextBlock | ReasoningBlock | ToolCallBlock | ToolResultBlock


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


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TextDelta:
    text: str
    type: Literal["text"] = "text"


@dataclass
class Finished:
    reason: FinishReason
    usage: Usage
    type: Literal["finished"] = "finished"


Event = TextDelta | Finished
