"""An admitted request as the dialects see it: the worker's (or upstream's) frames turned into ``Event``s; and the
``Target`` protocol, what serves a request (a local worker's lease, a remote model's replicas)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from localai.errors import LocalAIError
from localai.metrics import Metrics
from localai.protocol import CacheSource, RequestFrame
from localai.runtime import media
from localai.runtime.fitting import Fit
from localai.runtime.formats import Parser
from localai.schema import (
    Event,
    Finished,
    GenerationRequest,
    KeepAlive,
    LogprobsDelta,
    Message,
    ReplyParts,
    TextDelta,
    ToolCallEnd,
    Usage,
)

FollowUp = Callable[[str, list[ToolCallEnd], str], Awaitable[None]]


OpT = TypeVar("OpT", bound=Mapping[str, Any])


class Target(Protocol[OpT]):
    """Where a request is served: what admission (``runtime/admission.py``) needs of it. ``OpT``: the op it takes
    (a local worker's ``GenerateOp``, an upstream's ``RemoteOp``)."""

    # whether a request whose worker died before taking it goes once to a fresh one (a local worker's lease)
    retries_on_crash: bool

    async def operation(self, request: GenerationRequest, messages: list[Message] | None) -> OpT:
        """The request as the target takes it (its heavy parts run off the event loop)."""

    def size(self, op: OpT) -> int:
        """How big the prompt is: fitting must make it smaller each attempt."""

    def generate(self, op: OpT) -> AsyncIterator[RequestFrame]:
        """Frames: ``prompt`` (accepted) or ``error`` first, then ``text``/``event`` frames and ``done``."""

    def parser(self, request: GenerationRequest, prompt: str | None = None) -> Parser | None:
        """What turns generated text into tool calls and reasoning, when the target yields raw text."""


@dataclass
class Generation:
    """A request admitted by a worker: its prompt is tokenized and fits; events follow."""

    id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    _frames: AsyncIterator[RequestFrame]
    _stack: contextlib.AsyncExitStack
    fit: Fit | None = None
    parser: Parser | None = None  # tool calls and reasoning, when the request can have them
    _closed: bool = field(default=False)
    _metrics: Metrics | None = None
    replica: str | None = None  # the remote replica serving it (remote models)
    cache: CacheSource | None = None  # where the reused prefix came from
    follow_up: FollowUp | None = None  # told the reply once it is complete (the worker then prefills it)
    omitted: list[media.Omission] = field(default_factory=list)  # media the model did not get (stand-ins instead)
    sampling: dict[str, Any] = field(default_factory=dict)  # the values it samples with (request, Modelfile, default)

    async def events(self) -> AsyncGenerator[Event, None]:
        """Text, reasoning and tool-call events, then ``Finished`` (reason ``tool_calls`` when calls were made)."""
        async for event in self._events(keepalive=False):
            if not isinstance(event, KeepAlive):
                yield event

    def stream_events(self) -> AsyncGenerator[Event | KeepAlive, None]:
        """``events()``, with a ``KeepAlive`` each time the worker had nothing to send for ``keepalive`` seconds (a long
        prompt being evaluated): a stream's clients and proxies with idle timeouts keep the request."""
        return self._events(keepalive=True)

    async def _events(self, *, keepalive: bool) -> AsyncGenerator[Event | KeepAlive, None]:
        parser = self.parser
        reply = ReplyParts()
        seen = reply.add
        try:
            async for frame in self._frames:
                if frame["ev"] == "idle":  # the worker is still evaluating the prompt
                    if keepalive:
                        yield KeepAlive()
                elif frame["ev"] == "event":  # already an event: a remote model's upstream parsed its own output
                    yield frame["event"]
                elif frame["ev"] == "text":
                    if frame.get("logprobs"):
                        yield seen(LogprobsDelta(frame["logprobs"]))
                    if parser is None:
                        yield seen(TextDelta(frame["text"]))
                    else:
                        for event in parser.feed(frame["text"]):
                            yield seen(event)
                elif frame["ev"] == "done":
                    reason = frame["finish_reason"]
                    if parser is not None:
                        for event in parser.finish():
                            yield seen(event)
                        if parser.calls and reason == "stop":
                            reason = "tool_calls"
                    if self.follow_up is not None and reason != "cancelled":
                        await self.follow_up(reply.text, reply.calls, reply.reasoning)
                    usage = Usage(**frame["usage"])
                    if self._metrics is not None:
                        self._metrics.request_done(self.model, usage.prompt_tokens, usage.cached_tokens,
                                                   usage.completion_tokens, reason, usage.drafted_tokens,
                                                   usage.accepted_tokens)
                    yield Finished(reason, usage, frame["stop_sequence"])
                    return
                elif frame["ev"] == "error":
                    raise LocalAIError(frame["message"] or "generation failed")
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await close_quietly(self._frames)
        await self._stack.aclose()


async def close_quietly(frames: AsyncIterator[Any]) -> None:
    with contextlib.suppress(Exception):
        await frames.aclose()  # type: ignore[attr-defined]
