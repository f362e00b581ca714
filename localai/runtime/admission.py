"""Admitting a request: send it to its target until the target takes it, fitting the conversation into the context
(``fitting.py`` decides the cuts) and retrying once on a fresh worker when the first died before taking it; and
giving up on it as soon as its client leaves (``unless_client_left``), however long it waited for its turn."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

from localai.errors import ClientDisconnected, ContextLengthExceeded, InvalidRequest, LocalAIError, WorkerCrashed
from localai.protocol import ErrorFrame, PromptFrame, RequestFrame
from localai.runtime.fitting import Fit, FitMemory, conversation_key, next_cut, slim_tools
from localai.runtime.fitting import apply as fitting_apply
from localai.runtime.generation import Generation, Target, close_quietly
from localai.schema import GenerationRequest, Message

log = logging.getLogger("localai.runtime")
MAX_FIT_ATTEMPTS = 12
# Set when the client of the request being served has gone: the server sets one for each request it serves
# (api/common.ParsedBodyRoute), so that a request waiting its turn (the scheduler's queue, a busy worker) stops
# waiting then, not once admitted; with none (a caller that is no HTTP request), a request waits as long as it must.
client_left: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("client_left", default=None)


async def unless_client_left(admitting: Coroutine[Any, Any, Generation]) -> Generation:
    """``admitting``'s generation, unless the request's client (``client_left``) goes first: then the admission is
    cancelled (its place in the queue, its lease and its op in the worker go with it) and ClientDisconnected raised."""
    left = client_left.get()
    if left is None:
        return await admitting
    task = asyncio.ensure_future(admitting)
    watch = asyncio.ensure_future(left.wait())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request cancelled (the server stopping): its admission too
        await _abandon(task)
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    await _abandon(task)
    raise ClientDisconnected("the client disconnected while its request waited to start; it was not run")


async def _abandon(task: asyncio.Future[Generation]) -> None:
    task.cancel()
    try:
        generation = await task
    except BaseException:  # cancelled, or failed meanwhile: nobody is there to be told
        return
    await generation.aclose()  # admitted just as the client left


@dataclass
class Admitted:
    """A request its target took: the op sent, the frames that follow its first one, and how it was fitted."""

    target: Target[Any]
    request: GenerationRequest  # as sent: its tools slimmed when fitting had to
    messages: list[Message] | None  # as sent: fitted
    op: Mapping[str, Any]
    first: PromptFrame  # tokens, tokens reused, where from
    frames: AsyncIterator[RequestFrame]
    fit: Fit | None
    cuts: tuple[int, int, int]  # messages dropped, characters cut, tools' slimming level


@dataclass
class _Attempt:
    """Where fitting stands: what the next attempt cuts, and what the last one was told."""

    dropped: int = 0
    cut_chars: int = 0
    tool_level: int = 0
    fit: Fit | None = None
    last_error: str = ""
    previous_length: int | None = None


async def admit(request: GenerationRequest, target: Target[Any], reopen: Callable[[], Awaitable[Target[Any]]], *,
                model: str, session: str | None, fitting: bool, memory: FitMemory) -> Admitted:
    """Send ``request`` to ``target`` until it takes it (``reopen``: a fresh worker's, when the first died before).

    A prompt over the context is cut (``fitting``) and sent again, each attempt smaller; errors that belong to the
    request (over the context with nothing left to cut, a constraint that cannot be built) are raised."""
    original = request.messages
    key = conversation_key(model, request.cache_partition, session, original) if original else ""
    at = _Attempt()
    if fitting and original:
        at.dropped, at.tool_level = memory.get(key, original)
    retried = False
    while True:
        messages = original
        if original is not None and (at.dropped or at.cut_chars):
            messages = fitting_apply(original, at.dropped, at.cut_chars)
        fitted = replace(request, tools=slim_tools(request.tools, at.tool_level)) if at.tool_level else request
        op = await target.operation(fitted, messages)
        _check_shrinks(at, target.size(op))
        frames = target.generate(op)
        try:
            first = await frames.__anext__()
            while first["ev"] == "idle":  # waiting for a slot: nothing to tell the client yet
                first = await frames.__anext__()
        except WorkerCrashed:
            # The worker died before it took the request (killed, or crashed on another one): nothing has reached
            # the client yet, so it goes once to a fresh worker. A second death is the answer.
            await close_quietly(frames)
            if retried or not target.retries_on_crash:
                raise
            retried = True
            log.warning("the worker for %s died before taking a request; sending it to a new worker", model)
            target = await reopen()
            at.previous_length = None
            continue
        except BaseException:  # cancelled while it waited for the worker's slot: the worker drops the op
            await close_quietly(frames)
            raise
        if first["ev"] == "prompt":
            break
        await close_quietly(frames)
        if first["ev"] != "error":
            raise LocalAIError(f"the worker for {model} answered a request with a {first['ev']} frame")
        _next_attempt(at, request, original, op, first, fitting)
    cuts = (at.dropped, at.cut_chars, at.tool_level)
    fit = at.fit
    if original is not None and any(cuts):
        fit = fit or Fit()
        fit.dropped, fit.shortened_chars, fit.tool_level = cuts
        memory.put(key, original, at.dropped, at.tool_level)
        log.warning("fitted a conversation for %s into its context: %s", model, fit.header())
    return Admitted(target, fitted, messages, op, first, frames, fit, cuts)


def _check_shrinks(at: _Attempt, length: int) -> None:
    """Every attempt must shrink the prompt; one that does not would loop, holding a slot."""
    if at.previous_length is not None and (length >= at.previous_length
                                           or (at.fit is not None and at.fit.attempts >= MAX_FIT_ATTEMPTS)):
        raise ContextLengthExceeded(
            f"{at.last_error} (localai could not shorten it further: what is left is the system prompt, "
            "the last user message and what follows it)", param="messages")
    at.previous_length = length


def _next_attempt(at: _Attempt, request: GenerationRequest, original: list[Message] | None,
                  op: Mapping[str, Any], error: ErrorFrame, fitting: bool) -> None:
    """What the next attempt cuts after the target refused ``op`` with ``error``; raises when it is the answer."""
    if error["kind"] == "constraint":
        constraint = op.get("constraint") or {}
        raise InvalidRequest(error["message"] or "the output constraint cannot be built",
                             param="tools" if constraint.get("type") == "tool_call" else "response_format")
    if error["kind"] != "context_length":
        raise InvalidRequest(error["message"] or "the request was rejected")
    step = None
    if fitting and original is not None:
        n_ctx = error.get("n_ctx", 0)
        budget = n_ctx - int(op.get("reserve", 0))
        step = next_cut(original, at.dropped, at.cut_chars, error.get("prompt_tokens", 0), budget, n_ctx)
        slimmer = bool(request.tools) and at.tool_level < 3
        if slimmer and (step is None or (step[1] > at.cut_chars and at.tool_level == 0)):
            at.tool_level += 1  # slim the tools before cutting text, and when no text is left to cut
            step = (at.dropped, at.cut_chars)
    if step is None:
        hint = "" if fitting else " (fitting is off for this request or model)"
        raise ContextLengthExceeded(error["message"] + hint, param="messages")
    at.dropped, at.cut_chars = step
    at.last_error = error["message"]
    at.fit = at.fit or Fit()
    at.fit.attempts += 1
