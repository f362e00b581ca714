"""From a ``GenerationRequest`` to a stream of ``Event``s: model lookup, scheduling, prompt, worker."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from localai import chat_template
from localai.errors import ContextLengthExceeded, InvalidRequest, LocalAIError
from localai.fitting import Fit, FitMemory, conversation_key, next_cut
from localai.fitting import apply as fitting_apply
from localai.metrics import Metrics
from localai.modelfile import FLOAT_PARAMETERS, INT_PARAMETERS, LOAD_PARAMETERS
from localai.protocol import GenerateOp, Sampling
from localai.registry import ModelRecord, Registry
from localai.runner import new_request_id
from localai.scheduler import LoadedModel, Scheduler
from localai.schema import Event, Finished, GenerationRequest, Message, TextDelta, Usage
from localai.settings import Settings

log = logging.getLogger("localai.runtime")
SAMPLING_KEYS = frozenset(Sampling.__annotations__)


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
    _closed: bool = field(default=False)
    _metrics: Metrics | None = None

    async def events(self) -> AsyncIterator[Event]:
        try:
            async for frame in self._frames:
                kind = frame.get("ev")
                if kind == "text":
                    yield TextDelta(frame["text"])
                elif kind == "done":
                    usage = Usage(**frame["usage"])
                    if self._metrics is not None:
                        self._metrics.request_done(self.model, usage.prompt_tokens, usage.cached_tokens,
                                                   usage.completion_tokens, frame["finish_reason"])
                    yield Finished(frame["finish_reason"], usage)
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

    async def start(self, request: GenerationRequest) -> Generation:
        """Admit a request: load the model if needed, render and send the prompt, await its acceptance.

        Errors that belong to the request (unknown model, prompt over the context) are raised here,
        before any response bytes are sent, so they get a proper HTTP status.
        """
        record = self.registry.get(request.model)
        stack = contextlib.AsyncExitStack()
        try:
            loaded = await stack.enter_async_context(
                self.scheduler.lease(record, keep_alive=request.keep_alive, overrides=_load_overrides(request))
            )
            fitting = self._fitting_enabled(record, request)
            fit: Fit | None = None
            original = request.messages
            key = conversation_key(record.name, request.session_id, original) if original else ""
            dropped, cut_chars = (self.fit_memory.get(key), 0) if (fitting and original) else (0, 0)
            while True:
                messages = original
                if original is not None and (dropped or cut_chars):
                    messages = fitting_apply(original, dropped, cut_chars)
                op = self._operation(record, loaded, request, messages)
                frames = loaded.worker.generate(op)
                first = await frames.__anext__()
                if first.get("ev") != "error":
                    stack.push_async_callback(_close_quietly, frames)
                    break
                await _close_quietly(frames)
                if first.get("kind") != "context_length":
                    raise InvalidRequest(first.get("message", "the request was rejected"))
                step = None
                if fitting and original is not None:
                    n_ctx = int(first["n_ctx"])
                    budget = n_ctx - min(request.max_tokens or 512, n_ctx // 4)
                    step = next_cut(original, dropped, cut_chars, int(first["prompt_tokens"]), budget, n_ctx)
                if step is None:
                    hint = "" if fitting else " (fitting is off for this request or model)"
                    raise ContextLengthExceeded(first["message"] + hint, param="messages")
                dropped, cut_chars = step
                fit = fit or Fit()
                fit.attempts += 1
            if original is not None and (dropped or cut_chars):
                fit = fit or Fit()
                fit.dropped, fit.shortened_chars = dropped, cut_chars
                self.fit_memory.put(key, dropped)
                log.warning("fitted a conversation for %s into its context: %s", record.name, fit.header())
            return Generation(
                fit=fit,
                id=op["id"], model=record.name, prompt_tokens=first["prompt_tokens"],
                cached_tokens=first["cached_tokens"], _frames=frames, _stack=stack,
                _metrics=self.scheduler.metrics,
            )
        except BaseException:
            await stack.aclose()
            raise

    @staticmethod
    def _fitting_enabled(record: ModelRecord, request: GenerationRequest) -> bool:
        if request.fit_context is not None:
            return request.fit_context
        return bool(record.parameters.get("fit_context", True))

    async def count_tokens(self, request: GenerationRequest) -> int:
        """How many tokens the request's prompt is, as the model tokenizes it."""
        record = self.registry.get(request.model)
        async with self.scheduler.lease(record, keep_alive=request.keep_alive) as loaded:
            prompt = self.render_prompt(record, loaded, request.messages, request.prompt)
            return len(await loaded.worker.tokenize(prompt))

    def render_prompt(self, record: ModelRecord, loaded: LoadedModel, messages: list[Message] | None,
                      raw_prompt: str | None = None) -> str:
        """The prompt text: ``messages`` through the chat template, or the raw completion prompt."""
        if messages is None:
            return raw_prompt or ""
        info = loaded.worker.info
        assert info is not None
        template = record.template or info["chat_template"]
        return chat_template.render(
            template, _template_messages(record, messages), bos_token=info["bos_token"], eos_token=info["eos_token"]
        )

    def _system_prefix(self, record: ModelRecord, loaded: LoadedModel, messages: list[Message] | None,
                       prompt: str) -> str | None:
        """The rendered system-and-tools segment, when it is a prefix of the prompt (cached as shared)."""
        if not messages:
            return None
        leading = []
        for message in messages:
            if message.role not in ("system", "developer"):
                break
            leading.append(message)
        if not leading:
            return None
        info = loaded.worker.info
        assert info is not None
        try:
            text = chat_template.render(record.template or info["chat_template"],
                                        _template_messages(record, leading), bos_token=info["bos_token"],
                                        eos_token=info["eos_token"], add_generation_prompt=False)
        except LocalAIError:
            return None
        return text if text and prompt.startswith(text) else None

    def _operation(self, record: ModelRecord, loaded: LoadedModel, request: GenerationRequest,
                   messages: list[Message] | None) -> GenerateOp:
        params = record.parameters
        sampling: dict[str, Any] = {k: v for k, v in params.items() if k in SAMPLING_KEYS}
        sampling.update(request.sampling.as_dict())
        model_stops = list(params.get("stop", [])) if isinstance(params.get("stop"), list) else []  # type: ignore[arg-type]
        stop = list(dict.fromkeys([*(request.stop or []), *model_stops]))
        max_tokens = request.max_tokens
        if max_tokens is None and isinstance(params.get("num_predict"), int) and int(params["num_predict"]) >= 0:  # type: ignore[arg-type]
            max_tokens = int(params["num_predict"])  # type: ignore[arg-type]
        prompt = self.render_prompt(record, loaded, messages, request.prompt)
        return GenerateOp(
            op="generate", id=new_request_id(), prompt=prompt,
            system_prefix=self._system_prefix(record, loaded, messages, prompt),
            max_tokens=max_tokens, stop=stop, sampling=sampling,  # type: ignore[typeddict-item]
            session=request.session_id, ignore_eos=request.ignore_eos,
        )


def _template_messages(record: ModelRecord, messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, with the Modelfile's SYSTEM and MESSAGEs applied."""
    rendered: list[dict[str, Any]] = []
    has_system = any(m.role in ("system", "developer") for m in messages)
    if record.system and not has_system:
        rendered.append({"role": "system", "content": record.system})
    rendered.extend({"role": m["role"], "content": m["content"]} for m in record.messages)
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text()}
        if message.name:
            entry["name"] = message.name
        rendered.append(entry)
    return rendered


def _load_overrides(request: GenerationRequest) -> dict[str, Any]:
    return {k: v for k, v in request.load_options.items() if k in LOAD_PARAMETERS}


def sampling_from_options(options: dict[str, Any]) -> dict[str, Any]:
    """Ollama-style ``options`` split into typed sampling values (unknown keys are ignored)."""
    result: dict[str, Any] = {}
    for key, value in options.items():
        if key in INT_PARAMETERS and key in SAMPLING_KEYS:
            result[key] = int(value)
        elif key in FLOAT_PARAMETERS and key in SAMPLING_KEYS:
            result[key] = float(value)
    return result


async def _close_quietly(frames: AsyncIterator[dict[str, Any]]) -> None:
    with contextlib.suppress(Exception):
        await frames.aclose()  # type: ignore[attr-defined]
