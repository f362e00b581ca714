"""From a ``GenerationRequest`` to a stream of ``Event``s: model lookup, scheduling, prompt, worker."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from localai.errors import ContextLengthExceeded, InvalidRequest, LocalAIError, WorkerCrashed
from localai.metrics import Metrics
from localai.models import renderer
from localai.models.chat_template import RenderCall
from localai.models.loading import chosen_engine
from localai.models.modelfile import LOAD_PARAMETERS
from localai.models.registry import ModelRecord, Registry
from localai.promptcache.divergences import Divergence
from localai.protocol import DEFAULT_SAMPLING, Constraint, GenerateOp, Sampling, image_mark
from localai.runtime import divergence, media
from localai.runtime import prompt as prompting
from localai.runtime.fitting import Fit, FitMemory, conversation_key, next_cut, slim_tools
from localai.runtime.fitting import apply as fitting_apply
from localai.runtime.formats import Parser, parser_for
from localai.schema import (
    Event,
    Finished,
    GenerationRequest,
    KeepAlive,
    Message,
    ReasoningBlock,
    ReplyParts,
    TextBlock,
    TextDelta,
    ToolCallBlock,
    ToolCallEnd,
    ToolChoice,
    ToolResultBlock,
    Usage,
)
from localai.settings import Settings
from localai.upstreams.pool import RemotePool, Remotes
from localai.upstreams.ring import routing_key
from localai.upstreams.translation import estimated_tokens, request_body
from localai.workers.handle import new_request_id
from localai.workers.scheduler import LoadedModel, Scheduler

log = logging.getLogger("localai.runtime")
SAMPLING_KEYS = frozenset(Sampling.__annotations__)
MAX_FIT_ATTEMPTS = 12
SESSIONS_REMEMBERED = 4096  # sessions whose model /api/cache can name
NEXT_TURN = "\u2063localai-next-turn\u2063"  # the next message, when rendering a reply as the next turn will
FollowUp = Callable[[str, list[ToolCallEnd], str], Awaitable[None]]
# How long the end of a reply waits for its follow-up prefill to be on its way to the worker (a render, milliseconds):
# sent before the client has the end, it reaches the worker before the conversation's next request can.
FOLLOW_UP_WAIT = 0.5


@dataclass
class Generation:
    """A request admitted by a worker: its prompt is tokenized and fits; events follow."""

    id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    _frames: AsyncIterator[dict[str, Any]]
    _stack: contextlib.AsyncExitStack
    fit: Fit | None = None
    parser: Parser | None = None  # tool calls and reasoning, when the request can have them
    _closed: bool = field(default=False)
    _metrics: Metrics | None = None
    replica: str | None = None  # the remote replica serving it (remote models)
    cache: dict[str, Any] | None = None  # where the reused prefix came from (source, restored, restore_ms)
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
                kind = frame.get("ev")
                if kind == "idle":  # the worker is still evaluating the prompt
                    if keepalive:
                        yield KeepAlive()
                elif kind == "event":  # already an event: a remote model's upstream parsed its own output
                    yield frame["event"]
                elif kind == "text":
                    if parser is None:
                        yield seen(TextDelta(frame["text"]))
                    else:
                        for event in parser.feed(frame["text"]):
                            yield seen(event)
                elif kind == "done":
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
                    yield Finished(reason, usage, frame.get("stop_sequence"))
                    return
                elif kind == "error":
                    raise LocalAIError(frame.get("message", "generation failed"))
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await self._frames.aclose()  # type: ignore[attr-defined]
        await self._stack.aclose()


class Runtime:
    """Serves generation requests for every API dialect."""

    def __init__(self, settings: Settings, registry: Registry, scheduler: Scheduler) -> None:
        self.settings = settings
        self.registry = registry
        self.scheduler = scheduler
        self.fit_memory = FitMemory()
        self.remotes = Remotes(scheduler.metrics, settings.remote_health_interval)
        self._background: set[asyncio.Task[None]] = set()  # follow-up prefills and template warm-ups in flight
        self._reports: set[asyncio.Task[None]] = set()  # divergence reports being written
        self.divergences = divergence.Tracker()
        # Which model each recent session asked for, and which models each cache folder served: the cache's entries
        # carry a fingerprint and a session, and /api/cache names their model from these.
        self.session_models: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._cache_models_noted: set[tuple[str, str]] = set()
        self.documents = media.DocumentReader()
        self._warmed: set[tuple[str, int | None]] = set()  # (model, worker pid) whose template the renderers compiled

    async def start(self, request: GenerationRequest) -> Generation:
        """Admit a request: load the model if needed, render and send the prompt, await its acceptance.

        Errors that belong to the request (unknown model, prompt over the context) are raised here,
        before any response bytes are sent, so they get a proper HTTP status.
        """
        record = self.registry.get(request.model)
        prepared = await media.prepare(request.messages, self.documents, model=record.name,
                                       sees_images=self.sees_images(record))
        request = replace(request, messages=prepared.messages, images=prepared.images)
        stack = contextlib.AsyncExitStack()
        try:
            lease = contextlib.AsyncExitStack()  # the model's lease, given back early if its worker dies unused
            stack.push_async_callback(lease.aclose)
            target = await self._target(lease, record, request)
            retried = False
            fitting = self._fitting_enabled(record, request)
            fit: Fit | None = None
            original = request.messages
            key = conversation_key(record.name, session_key(request), original) if original else ""
            dropped, tool_level = self.fit_memory.get(key) if (fitting and original) else (0, 0)
            last_error = ""
            cut_chars = 0
            previous_length: int | None = None
            while True:
                messages = original
                if original is not None and (dropped or cut_chars):
                    messages = fitting_apply(original, dropped, cut_chars)
                fitted = replace(request, tools=slim_tools(request.tools, tool_level)) if tool_level else request
                op = await target.operation(fitted, messages)
                length = target.size(op)
                if previous_length is not None and (length >= previous_length
                                                    or (fit is not None and fit.attempts >= MAX_FIT_ATTEMPTS)):
                    # Every attempt must shrink the prompt; one that does not would loop, holding a slot.
                    raise ContextLengthExceeded(
                        f"{last_error} (localai could not shorten it further: what is left is the system prompt, "
                        "the last user message and what follows it)", param="messages")
                previous_length = length
                frames = target.generate(op)
                try:
                    first = await frames.__anext__()
                    while first.get("ev") == "idle":  # waiting for a slot: nothing to tell the client yet
                        first = await frames.__anext__()
                except WorkerCrashed:
                    # The worker died before it took the request (killed, or crashed on another one): nothing has
                    # reached the client yet, so it goes once to a fresh worker. A second death is the answer.
                    await _close_quietly(frames)
                    if retried or not isinstance(target, LocalTarget):
                        raise
                    retried = True
                    log.warning("the worker for %s died before taking a request; sending it to a new worker",
                                record.name)
                    await lease.aclose()
                    lease = contextlib.AsyncExitStack()
                    stack.push_async_callback(lease.aclose)
                    target = await self._target(lease, record, request)
                    previous_length = None
                    continue
                if first.get("ev") != "error":
                    stack.push_async_callback(_close_quietly, frames)
                    break
                await _close_quietly(frames)
                if first.get("kind") == "constraint":
                    constraint = op.get("constraint") or {}
                    raise InvalidRequest(first.get("message", "the output constraint cannot be built"),
                                         param="tools" if constraint.get("type") == "tool_call" else "response_format")
                if first.get("kind") != "context_length":
                    raise InvalidRequest(first.get("message", "the request was rejected"))
                step = None
                if fitting and original is not None:
                    n_ctx = int(first["n_ctx"])
                    budget = n_ctx - int(op.get("reserve", 0))
                    step = next_cut(original, dropped, cut_chars, int(first["prompt_tokens"]), budget, n_ctx)
                    slimmer = bool(request.tools) and tool_level < 3
                    if slimmer and (step is None or (step[1] > cut_chars and tool_level == 0)):
                        tool_level += 1  # slim the tools before cutting text, and when no text is left to cut
                        step = (dropped, cut_chars)
                if step is None:
                    hint = "" if fitting else " (fitting is off for this request or model)"
                    raise ContextLengthExceeded(first["message"] + hint, param="messages")
                dropped, cut_chars = step
                last_error = first["message"]
                fit = fit or Fit()
                fit.attempts += 1
            if original is not None and (dropped or cut_chars or tool_level):
                fit = fit or Fit()
                fit.dropped, fit.shortened_chars, fit.tool_level = dropped, cut_chars, tool_level
                self.fit_memory.put(key, dropped, tool_level)
                log.warning("fitted a conversation for %s into its context: %s", record.name, fit.header())
            follow_up = None
            if isinstance(target, LocalTarget) and op.get("follow_up"):
                follow_up = self._follow_up(target, fitted, messages, str(op["prompt"]))
            if isinstance(target, LocalTarget) and request.session_id and messages is not None:
                self._compare_turn(target, fitted, messages, str(op["prompt"]), int(first["prompt_tokens"]),
                                   (dropped, cut_chars, tool_level))
            return Generation(
                fit=fit, parser=target.parser(request, op.get("prompt")),
                id=op["id"], model=record.name, prompt_tokens=first["prompt_tokens"],
                cached_tokens=first["cached_tokens"], _frames=frames, _stack=stack,
                _metrics=self.scheduler.metrics, replica=first.get("replica"), cache=first.get("cache"),
                follow_up=follow_up, sampling={**DEFAULT_SAMPLING, **requested_sampling(record, request)},
                omitted=prepared.omitted,
            )
        except BaseException:
            await stack.aclose()
            raise

    def _compare_turn(self, target: LocalTarget, request: GenerationRequest, messages: list[Message], prompt: str,
                      prompt_tokens: int, fitted: tuple[int, int, int]) -> None:
        """Does this prompt extend its session's last one? When not, log and record where and why it parts (the
        token offset is counted by the worker, after the request is on its way)."""
        session, key = request.session_id, session_key(request)
        assert session is not None and key is not None
        turn = divergence.turn_of(messages, request.tools, prompt, fitted=fitted)
        turn.tokens = prompt_tokens
        found = self.divergences.compare(target.record.name, key, turn)
        if found is None:
            return
        offset, previous = found
        cause, detail = divergence.explain(previous, turn, offset)
        worker = target.loaded.worker

        async def report() -> None:
            tokens = 0
            with contextlib.suppress(Exception):  # the worker may be gone: the character offset still tells
                tokens = await worker.count_tokens(prompt[:offset]) if offset else 0
            await asyncio.to_thread(self.divergences.record, Divergence(
                model=target.record.name, session=session, at=time.time(), offset_tokens=tokens,
                previous_tokens=previous.tokens, offset_chars=offset, cause=cause, detail=detail,
                early=offset < len(previous.prompt), partition=request.cache_partition))

        task = asyncio.get_running_loop().create_task(report())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait (a while) for follow-up prefills in flight, so a stopping daemon still saves the last turns."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    def _follow_up(self, target: LocalTarget, request: GenerationRequest, messages: list[Message] | None,
                   prompt: str) -> FollowUp:
        """After the reply: have the worker prefill it as the next turn will render it, then save the sequence,
        so the next request computes only the new user or tool message (the worker holds that request until the
        prefill is done). Runs after the response; a failure costs the next turn a few tokens, nothing else."""
        async def prefill(text: str, calls: list[ToolCallEnd], reasoning: str, sent: asyncio.Future[None]) -> None:
            try:
                rendered = await self._next_turn_prefix(target, request, messages, text, calls, reasoning)
            except Exception:  # a template that cannot render the reply: still save what the worker holds
                log.debug("could not render the reply as the next turn", exc_info=True)
                rendered = None
            key = session_key(request)
            if rendered and key:
                self.divergences.expect(target.record.name, key, prompt, rendered, reasoning)
            op = GenerateOp(op="generate", id=new_request_id(), prompt=rendered or prompt, max_tokens=0, stop=[],
                            sampling={}, session=request.session_id, warm=True, pin_ttl=request.cache_ttl,
                            cache_partition=request.cache_partition)
            frames = target.loaded.worker.generate(op)
            if not sent.done():
                sent.set_result(None)  # the op is written when the loop below starts, before the waiter resumes
            with contextlib.suppress(Exception):  # the worker may be gone (unloaded, crashed): nothing to keep
                async for _ in frames:
                    pass

        async def start(text: str, calls: list[ToolCallEnd], reasoning: str) -> None:
            sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task = asyncio.get_running_loop().create_task(prefill(text, calls, reasoning, sent))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(lambda _: _settle(sent))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sent), FOLLOW_UP_WAIT)

        return start

    async def _next_turn_prefix(self, target: LocalTarget, request: GenerationRequest,
                                messages: list[Message] | None, text: str, calls: list[ToolCallEnd],
                                reasoning: str) -> str | None:
        """The conversation with this reply, rendered up to where the next message's content will start."""
        if messages is None:
            return None
        content: list[Any] = [ReasoningBlock(reasoning)] if reasoning else []
        content += [TextBlock(text)] if text or not calls else []
        content += [ToolCallBlock(call.id, call.name, call.parsed_arguments()) for call in calls]
        if calls:
            following = Message(role="tool", content=[ToolResultBlock(calls[0].id, NEXT_TURN, name=calls[0].name)])
        else:
            following = Message(role="user", content=[TextBlock(NEXT_TURN)])
        rendered, _ = await self.render(target.record, target.loaded, request,
                                        [*messages, Message(role="assistant", content=content), following],
                                        system=False)
        cut = rendered.find(NEXT_TURN)
        return rendered[:cut] if cut > 0 else None

    async def _target(self, stack: contextlib.AsyncExitStack, record: ModelRecord,
                      request: GenerationRequest) -> Target:
        """Where the request goes: a lease on a local worker, or a remote model's replicas."""
        if record.remote:
            return await self._remote_target(record)
        loaded = await stack.enter_async_context(
            self.scheduler.lease(record, keep_alive=request.keep_alive, overrides=_load_overrides(request))
        )
        await self._note_cache_use(record.name, loaded.shared.fingerprint, request.session_id)
        if (record.name, loaded.worker.pid) not in self._warmed:  # beside this request, not before it
            task = asyncio.get_running_loop().create_task(self._warm_template(record, loaded))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return LocalTarget(self, record, loaded)

    async def _warm_template(self, record: ModelRecord, loaded: LoadedModel) -> None:
        """Have every render process compile the model's template once per worker (awaited by an explicit load,
        beside the first request otherwise), so later requests never pay a process's first render."""
        key = (record.name, loaded.worker.pid)
        if key in self._warmed or loaded.worker.info is None:
            return
        self._warmed.add(key)
        template = self.template(record, loaded)
        await asyncio.to_thread(renderer.warm, template.source, template.bos_token, template.eos_token)

    async def _note_cache_use(self, model: str, fingerprint: str | None, session: str | None) -> None:
        if session:
            self.session_models[session] = model
            self.session_models.move_to_end(session)
            while len(self.session_models) > SESSIONS_REMEMBERED:
                self.session_models.popitem(last=False)
        if fingerprint is None or (fingerprint, model) in self._cache_models_noted:
            return
        self._cache_models_noted.add((fingerprint, model))
        try:
            await self.registry.off_loop(lambda registry: registry.remember_cache_model(fingerprint, model))
        except Exception:  # a name for the cache screen is not worth failing a request over
            log.warning("could not record that %s uses cache folder %s", model, fingerprint, exc_info=True)

    async def _remote_target(self, record: ModelRecord) -> RemoteTarget:
        """A remote model's pool, once a replica has said what it serves (raises when none can)."""
        pool = self.remotes.pool(record)
        await pool.refresh()
        return RemoteTarget(record, pool, pool.model_id(), pool.kind(), pool.context_length())

    @staticmethod
    def _fitting_enabled(record: ModelRecord, request: GenerationRequest) -> bool:
        if request.fit_context is not None:
            return request.fit_context
        return bool(record.parameters.get("fit_context", True))

    async def count_tokens(self, request: GenerationRequest) -> int:
        """How many tokens the request's prompt is, as the model tokenizes it."""
        record = self.registry.get(request.model)
        prepared = await media.prepare(request.messages, self.documents, model=record.name,
                                       sees_images=self.sees_images(record))
        request = replace(request, messages=prepared.messages)
        if record.remote:  # the upstream's tokenizer is not here: an estimate
            target = await self._remote_target(record)
            return estimated_tokens(await target.operation(request, request.messages))
        async with self.scheduler.lease(record, keep_alive=request.keep_alive) as loaded:
            prompt, _ = await self.render(record, loaded, request, request.messages, system=False)
            return await loaded.worker.count_tokens(prompt, media=media_of(prepared.images, prompt))

    def sees_images(self, record: ModelRecord) -> bool:
        """Whether images reach this model as images: it has a vision projector and runs on llama.cpp."""
        return bool(record.projector) and chosen_engine(record, self.settings.engine) == "llama.cpp"

    async def embed(self, model: str, texts: list[str], *, truncate: bool = True, keep_alive: float | None = None,
                    tokens: list[list[int]] | None = None) -> tuple[list[list[float]], int]:
        """L2-normalised embeddings of ``texts`` (or of ``tokens``, ids of the model's own tokenizer) and the tokens
        evaluated (a separate context in the worker)."""
        record = self.registry.get(model)
        if record.remote:
            if tokens is not None:
                raise InvalidRequest("token ids cannot go to a remote model (its tokenizer is not here); send the "
                                     "text", param="input")
            return await self.remotes.pool(record).embed(texts)
        async with self.scheduler.lease(record, keep_alive=keep_alive) as loaded:
            return await loaded.worker.embed(texts, truncate=truncate, tokens=tokens)

    async def unload(self, name: str) -> bool:
        """Unload a model now (``localai stop``, a deleted or edited model): its worker, or a remote model's pool
        (health checks stop; the next request makes a new one). True when something was loaded."""
        had_pool = name in self.remotes.pools
        self.remotes.forget(name)
        return await self.scheduler.unload(name) or had_pool

    async def load(self, model: str, keep_alive: float | None) -> None:
        """Load a model now (Ollama's empty prompt); for a remote model, check that a replica answers."""
        record = self.registry.get(model)
        if record.remote:
            await self._remote_target(record)  # raises when no replica answered
            return
        async with self.scheduler.lease(record, keep_alive=keep_alive) as loaded:
            await self._warm_template(record, loaded)

    @staticmethod
    def template(record: ModelRecord, loaded: LoadedModel) -> prompting.Template:
        info = loaded.worker.info
        assert info is not None
        return prompting.Template(record.template or info["chat_template"], info["bos_token"], info["eos_token"])

    async def render(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest,
                     messages: list[Message] | None, *, system: bool = True) -> tuple[str, str | None]:
        """The prompt text (``messages`` and tools through the chat template, or the raw completion prompt) and,
        with ``system``, the rendered system-and-tools segment when it is a prefix of the prompt (cached as shared).
        The template runs in a render process (``models/renderer.py``), never here: it is not trusted. A template
        that fails or overruns is a 400 naming the model."""
        if messages is None:
            return request.prompt or "", None
        calls = await asyncio.to_thread(self._render_calls, record, loaded, request, messages, system)
        try:
            outcomes = await asyncio.wrap_future(renderer.pool().submit(calls))
        except renderer.RenderFailed as exc:
            exc.message, exc.param = f"model '{record.name}': {exc.message}", "messages"
            raise
        main = outcomes[0]
        if main.text is None:
            raise InvalidRequest(f"model '{record.name}': {main.error}", param="messages")
        for index, outcome in enumerate(outcomes[1:]):  # the segment with a first user message's header, or without
            text = outcome.text or ""
            if index == 0:
                text = text[:max(0, text.find(NEXT_TURN))]
            if text and main.text.startswith(text):
                return main.text, text
        return main.text, None

    def _render_calls(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest,
                      messages: list[Message], system: bool) -> list[RenderCall]:
        """The prompt's render and, with ``system``, the system-and-tools segment's (called off the event loop:
        shaping a long conversation and its tools' schemas takes a while)."""
        template = self.template(record, loaded)
        style = self.tool_format(record, loaded)
        shaped = prompting.template_messages(messages, template, request.tools, default_system=record.system,
                                             extra_messages=[{"role": m["role"], "content": m["content"]}
                                                             for m in record.messages], style=style)
        calls = [prompting.render_call(template, shaped, request.tools, reasoning=request.reasoning,
                                       effort=request.reasoning_effort)]
        leading = []
        for message in messages:
            if message.role not in ("system", "developer"):
                break
            leading.append(message)
        if system and (leading or request.tools or record.system):  # a Modelfile's SYSTEM: personas share it
            # The segment runs up to where a first user message's content starts: its header is shared too (a model
            # whose state returns only to checkpoints keeps one there), and some templates refuse a conversation
            # without a user message (Qwen3's "No user query found"); else (an assistant message first) the system
            # part alone
            for following in ([Message(role="user", content=[TextBlock(NEXT_TURN)])], []):
                segment = prompting.template_messages([*leading, *following], template, request.tools,
                                                      default_system=record.system, style=style)
                calls.append(prompting.render_call(template, segment, request.tools, add_generation_prompt=False,
                                                   reasoning=request.reasoning, effort=request.reasoning_effort))
        return calls

    def _parser(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest,
                prompt: str | None = None) -> Parser | None:
        template = self.template(record, loaded)
        chosen = self.tool_format(record, loaded)
        forced = self._forced_style(record, loaded, request)
        style: str = forced or chosen  # a forced call: what the grammar makes the model write
        thinks = (template.thinks or chosen in THINKING_FORMATS) and request.reasoning is not False \
            and not request.raw
        tools = request.parses_tool_calls() and request.messages is not None
        if style == "harmony" and not request.raw:
            thinks = True  # its analysis channel is reasoning, asked for or not
        if not tools and not thinks:
            return None
        # A forced call is all the grammar lets the model write, even after a prompt that opened the reasoning
        opened = thinks and forced is None and prompt is not None and prompt.rstrip().endswith("<think>")
        return parser_for(style, tools=tools, reasoning=thinks, opened=opened,
                          functions={tool.name: tool.parameters for tool in request.tools})

    def _forced_style(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest) -> str | None:
        """The form a forced call (tool_choice required or named) is constrained to; None when none is forced.
        The grammar (``_constraint``) and the parser (``_parser``) both follow it."""
        if not request.tools or request.tool_choice.mode not in ("required", "function"):
            return None
        info = loaded.worker.info
        backend = str(info.get("backend", "")) if info else ""
        return forced_format(self.tool_format(record, loaded), self.template(record, loaded), backend)

    def tool_format(self, record: ModelRecord, loaded: LoadedModel) -> prompting.ToolFormat:
        """How the model writes tool calls: its Modelfile's PARSER, else what its chat template shows."""
        return prompting.format_choice(record.parameters, self.template(record, loaded))[0]

    def _constraint(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest) -> Constraint | None:
        """The grammar the output must follow: a forced or lazy tool call, or the response format."""
        choice: ToolChoice = request.tool_choice
        tool_format = self.tool_format(record, loaded)
        forced = self._forced_style(record, loaded, request)
        if forced is not None:
            tools = request.tools
            if choice.mode == "function":
                tools = [tool for tool in request.tools if tool.name == choice.name]
                if not tools:
                    raise InvalidRequest(f"tool_choice names '{choice.name}', which is not among the tools",
                                         param="tool_choice")
            return Constraint(type="tool_call", format=forced,  # type: ignore[typeddict-item]
                              tools=[{"name": t.name, "parameters": t.parameters} for t in tools])
        if request.response_format is not None:
            if request.response_format.type == "json_schema":
                return Constraint(type="json_schema", schema=request.response_format.schema or {})
            return Constraint(type="json_object")
        if request.tools and choice.mode == "auto" and tool_format == "hermes":
            # Free text, but once the model opens <tool_call> the call must be well formed.
            return Constraint(type="tool_call", format="hermes", lazy=True,
                              tools=[{"name": t.name, "parameters": t.parameters} for t in request.tools])
        return None

    async def _operation(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest,
                         messages: list[Message] | None) -> GenerateOp:
        params = record.parameters
        sampling = requested_sampling(record, request)
        model_stops = list(params.get("stop", [])) if isinstance(params.get("stop"), list) else []  # type: ignore[arg-type]
        stop = list(dict.fromkeys([*(request.stop or []), *model_stops]))
        max_tokens = request.max_tokens
        if max_tokens is None and isinstance(params.get("num_predict"), int) and int(params["num_predict"]) >= 0:  # type: ignore[arg-type]
            max_tokens = int(params["num_predict"])  # type: ignore[arg-type]
        prompt, system_prefix = await self.render(record, loaded, request, messages)
        info = loaded.worker.info
        images = media_of(request.images, prompt)
        if request.prefill_only:
            max_tokens = 0  # a warm op: the prompt is evaluated and saved, nothing is generated
        return GenerateOp(
            op="generate", id=new_request_id(), prompt=prompt,
            reserve=output_reserve(max_tokens, info["n_ctx"] if info else 0),
            system_prefix=system_prefix,
            max_tokens=max_tokens, stop=stop, sampling=sampling,  # type: ignore[typeddict-item]
            session=request.session_id, ignore_eos=request.ignore_eos, pin_ttl=request.cache_ttl,
            cache_partition=request.cache_partition,
            constraint=self._constraint(record, loaded, request),
            follow_up=messages is not None and self.settings.cache_max_bytes > 0 and not request.prefill_only,
            warm=request.prefill_only,
            speculative=request.speculative if request.speculative is not None
            else {"on": True, "off": False}.get(str(params.get("speculative", "auto"))),
            **({"media": images} if images else {}),  # type: ignore[typeddict-item]
        )


class Target(Protocol):
    """Where a request is served: what the fitting loop in ``Runtime.start`` needs of it."""

    async def operation(self, request: GenerationRequest, messages: list[Message] | None) -> dict[str, Any]:
        """The request as the target takes it (its heavy parts run off the event loop)."""

    def size(self, op: dict[str, Any]) -> int:
        """How big the prompt is: fitting must make it smaller each attempt."""

    def generate(self, op: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Frames: ``prompt`` (accepted) or ``error`` first, then ``text``/``event`` frames and ``done``."""

    def parser(self, request: GenerationRequest, prompt: str | None = None) -> Parser | None:
        """What turns generated text into tool calls and reasoning, when the target yields raw text."""


# Families whose models open with <think> (GLM-4.5+, DeepSeek-V3.1 in thinking mode) even when a Modelfile's PARSER
# names them over a template that does not show it (Harmony's analysis channel is parsed whenever it is the format).
THINKING_FORMATS = frozenset({"glm-4.5", "deepseek-v3.1"})


def session_key(request: GenerationRequest) -> str | None:
    """A request's session as the daemon's per-session memories know it (fitting, divergences): within its cache
    partition, so a session id another principal also uses never shares them."""
    if request.session_id is None or not request.cache_partition:
        return request.session_id
    return f"{request.cache_partition}/{request.session_id}"


def requested_sampling(record: ModelRecord, request: GenerationRequest) -> dict[str, Any]:
    """The sampling a request asks for: its own values over its Modelfile's (the engine's defaults fill the rest)."""
    return {**{k: v for k, v in record.parameters.items() if k in SAMPLING_KEYS}, **request.sampling.as_dict()}


def forced_format(style: prompting.ToolFormat, template: prompting.Template, backend: str = "llama.cpp") -> str:
    """The form a forced call is constrained to: the family's own syntax (its special tokens are written as
    text, which llama.cpp's grammars match against the tokens' spelled-out pieces), Mistral's [ARGS] form where
    the template uses it. llguidance (the MLX engine) matches special tokens only by their ids, so there the
    formats of special tokens are forced as one bare JSON call, which the JSON parser reads back."""
    if style == "mistral":
        return "mistral-args" if "[ARGS]" in (template.source or "") else "mistral"
    if style in ("hermes", "llama3"):
        return style
    return "json" if backend == "mlx" else style


@dataclass
class LocalTarget:
    """A lease on a local worker: the prompt is rendered here and the worker generates."""

    runtime: Runtime
    record: ModelRecord
    loaded: LoadedModel

    async def operation(self, request: GenerationRequest, messages: list[Message] | None) -> dict[str, Any]:
        return dict(await self.runtime._operation(self.record, self.loaded, request, messages))

    def size(self, op: dict[str, Any]) -> int:
        return len(op["prompt"])

    def generate(self, op: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.loaded.worker.generate(op, idle=self.runtime.settings.stream_keepalive)  # type: ignore[arg-type]

    def parser(self, request: GenerationRequest, prompt: str | None = None) -> Parser | None:
        return self.runtime._parser(self.record, self.loaded, request, prompt)


@dataclass
class RemoteTarget:
    """A remote model's replicas: the request goes upstream as chat completions; events come back parsed."""

    record: ModelRecord
    pool: RemotePool
    model_id: str
    kind: str
    n_ctx: int

    async def operation(self, request: GenerationRequest, messages: list[Message] | None) -> dict[str, Any]:
        return await asyncio.to_thread(self._operation, request, messages)

    def _operation(self, request: GenerationRequest, messages: list[Message] | None) -> dict[str, Any]:
        path, body = request_body(self.record, request, messages, self.model_id, self.kind, self.pool.spec.priority)
        headers: dict[str, str] = {}
        if request.session_id:
            headers["X-Session-Id"] = request.session_id
            if self.kind == "dynamo":
                headers["x-dynamo-session-id"] = request.session_id
        max_tokens = body.get("max_tokens")
        # The upstream counts the whole max_tokens against its context: leave exactly that room when fitting.
        reserve = min(max_tokens, self.n_ctx) if max_tokens else output_reserve(None, self.n_ctx)
        prompt = body.get("messages", body.get("prompt"))
        return {"id": new_request_id("remote"), "path": path, "body": body, "headers": headers,
                "key": routing_key(self.record, request), "reserve": reserve,
                "size": len(json.dumps([prompt, body.get("tools")], ensure_ascii=False))}

    def size(self, op: dict[str, Any]) -> int:
        return int(op["size"])

    def generate(self, op: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.pool.generate(op)

    def parser(self, request: GenerationRequest, prompt: str | None = None) -> Parser | None:
        return None  # the upstream parsed its own tool calls and reasoning


def media_of(images: dict[str, bytes], prompt: str) -> dict[str, str]:
    """The images a rendered prompt marks (fitting may have dropped some), base64 by digest, for the worker."""
    return {digest: base64.b64encode(data).decode() for digest, data in images.items()
            if image_mark(digest) in prompt}


def output_reserve(max_tokens: int | None, n_ctx: int) -> int:
    """Room a prompt must leave for its reply: what the request may generate (512 when it sets no limit), at most
    a quarter of the context. ``localai launch`` gives agents that quarter as their output limit, so a reply is
    never cut by a full context before the limit the agent was told (agents treat that as an error, or loop)."""
    wanted = max_tokens if max_tokens is not None and max_tokens >= 0 else 512
    return min(wanted, n_ctx // 4)


def _load_overrides(request: GenerationRequest) -> dict[str, Any]:
    return {k: v for k, v in request.load_options.items() if k in LOAD_PARAMETERS}


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _close_quietly(frames: AsyncIterator[dict[str, Any]]) -> None:
    with contextlib.suppress(Exception):
        await frames.aclose()  # type: ignore[attr-defined]
