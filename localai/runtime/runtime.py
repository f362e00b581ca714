"""From a ``GenerationRequest`` to a stream of ``Event``s: the model looked up, its media prepared, a target leased
(a local worker, or a remote model's replicas), the request admitted (``admission.py``), a ``Generation`` back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Any

from localai.errors import InvalidRequest, UpstreamFailed, UpstreamTimeout, UpstreamUnavailable
from localai.models import library, renderer
from localai.models.loading import chosen_engine, is_reranker
from localai.models.modelfile import LOAD_PARAMETERS
from localai.models.registry import ModelRecord, Registry
from localai.protocol import DEFAULT_SAMPLING
from localai.runtime import admission, media
from localai.runtime.fitting import FitMemory
from localai.runtime.generation import Generation, Target, close_quietly
from localai.runtime.local import LocalTarget, media_of, requested_sampling, template_of
from localai.runtime.remote import RemoteTarget, remote_target
from localai.runtime.sessions import Sessions, session_key, side_session
from localai.schema import GenerationRequest
from localai.settings import Settings
from localai.upstreams.pool import Remotes
from localai.upstreams.translation import estimated_tokens
from localai.workers.scheduler import LoadedModel, Scheduler

log = logging.getLogger("localai.runtime")


class Runtime:
    """Serves generation requests for every API dialect."""

    def __init__(self, settings: Settings, registry: Registry, scheduler: Scheduler) -> None:
        self.settings = settings
        self.registry = registry
        self.scheduler = scheduler
        self.fit_memory = FitMemory()
        self.remotes = Remotes(scheduler.metrics, settings.remote_health_interval)
        self.sessions = Sessions(registry)
        self.documents = media.DocumentReader()
        self._warmed: set[tuple[str, int | None]] = set()  # (model, worker pid) whose template the renderers compiled

    async def record(self, name: str) -> ModelRecord:
        """The model called ``name`` (``Registry.get``), read on a worker thread: a query that waits for a write
        another thread or process holds (up to the database's busy timeout) must not stall the event loop."""
        return await self.registry.off_loop(lambda registry: registry.get(name))

    async def start(self, request: GenerationRequest) -> Generation:
        """Admit a request: load the model if needed, render and send the prompt, await its acceptance.

        Errors that belong to the request (unknown model, prompt over the context) are raised here,
        before any response bytes are sent, so they get a proper HTTP status. A request whose client leaves before
        it is admitted stops waiting then (``admission.unless_client_left``): it frees its place in the queue.
        """
        return await admission.unless_client_left(self._admit(request))

    async def _admit(self, request: GenerationRequest) -> Generation:
        request = replace(request, session_id=side_session(request))
        record = await self.record(request.model)
        if await asyncio.to_thread(is_reranker, record):  # reads the GGUF header's facts (a stat, at first a parse)
            raise InvalidRequest(f"'{record.name}' is a reranker: it scores documents against a query (POST "
                                 "/v1/rerank) and does not generate text; chat with a chat model", param="model")
        if record.remote and request.logprobs is not None:
            raise InvalidRequest(f"{record.name} is a remote model: logprobs are not passed on to remote models yet",
                                 param="logprobs")
        prepared = await media.prepare(request.messages, self.documents, model=record.name,
                                       sees_images=self.sees_images(record), passes_images=record.remote)
        try:
            return await self._start(record, request, prepared)
        except (InvalidRequest, UpstreamFailed, UpstreamUnavailable) as exc:
            # an upstream that takes no images (a text model, llama-server without its mmproj): the request again,
            # each image a stand-in saying so, rather than an agent's session ended on the error
            if isinstance(exc, UpstreamTimeout) or not (record.remote and media.carries_images(prepared.messages)
                                                        and media.refused_images(str(exc))):
                raise
            log.warning("%s's upstream refused images (%s): sending stand-ins instead", record.name, exc)
            prepared = await media.prepare(request.messages, self.documents, model=record.name,
                                           image_reason=f"the upstream refused images: {str(exc)[:200]}")
            return await self._start(record, request, prepared)

    async def _start(self, record: ModelRecord, request: GenerationRequest, prepared: media.Prepared) -> Generation:
        request = replace(request, messages=prepared.messages, images=prepared.images)
        stack = contextlib.AsyncExitStack()
        leases: list[contextlib.AsyncExitStack] = []  # the model's lease, given back early if its worker dies unused

        async def open_target() -> Target[Any]:
            if leases:
                await leases.pop().aclose()
            lease = contextlib.AsyncExitStack()
            stack.push_async_callback(lease.aclose)
            leases.append(lease)
            return await self._target(lease, record, request)

        try:
            fitting = request.fit_context if request.fit_context is not None \
                else bool(record.parameters.get("fit_context", True))
            admitted = await admission.admit(request, await open_target(), open_target, model=record.name,
                                             session=session_key(request), fitting=fitting, memory=self.fit_memory)
            stack.push_async_callback(close_quietly, admitted.frames)
            target, op, first = admitted.target, admitted.op, admitted.first
            follow_up = None
            if isinstance(target, LocalTarget):
                if op.get("follow_up"):
                    follow_up = self.sessions.follow_up(target, admitted.request, admitted.messages,
                                                        str(op["prompt"]))
                cache = first.get("cache")  # what an agent's turn found in the cache, for LOCALAI_DEBUG's log
                log.debug("%s: session %s: %d of %d prompt tokens cached (%s)", record.name, request.session_id,
                          first["cached_tokens"], first["prompt_tokens"], cache["source"] if cache else "miss")
                if request.session_id and admitted.messages is not None:
                    self.sessions.compare_turn(target, admitted.request, admitted.messages, str(op["prompt"]),
                                               int(first["prompt_tokens"]), admitted.cuts)
            return Generation(
                fit=admitted.fit, parser=target.parser(request, op.get("prompt")),
                id=op["id"], model=record.name, prompt_tokens=first["prompt_tokens"],
                cached_tokens=first["cached_tokens"], _frames=admitted.frames, _stack=stack,
                _metrics=self.scheduler.metrics, replica=first.get("replica"), cache=first.get("cache"),
                follow_up=follow_up, sampling={**DEFAULT_SAMPLING, **requested_sampling(record, request)},
                omitted=prepared.omitted,
            )
        except BaseException:
            await stack.aclose()
            raise

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait (a while) for follow-up prefills in flight, so a stopping daemon still saves the last turns."""
        await self.sessions.settle(timeout)

    async def _target(self, stack: contextlib.AsyncExitStack, record: ModelRecord,
                      request: GenerationRequest) -> Target[Any]:
        """Where the request goes: a lease on a local worker, or a remote model's replicas."""
        if record.remote:
            return await self._remote_target(record)
        overrides = {k: v for k, v in request.load_options.items() if k in LOAD_PARAMETERS}
        loaded = await stack.enter_async_context(
            self.scheduler.lease(record, keep_alive=request.keep_alive, overrides=overrides))
        await self.sessions.note_cache_use(record.name, loaded.shared.fingerprint, request.session_id)
        if (record.name, loaded.worker.pid) not in self._warmed:  # beside this request, not before it
            self.sessions.spawn(self._warm_template(record, loaded))
        return LocalTarget(record, loaded, self.settings, metrics=self.scheduler.metrics)

    async def _warm_template(self, record: ModelRecord, loaded: LoadedModel) -> None:
        """Have every render process compile the model's template once per worker (awaited by an explicit load,
        beside the first request otherwise), so later requests never pay a process's first render."""
        key = (record.name, loaded.worker.pid)
        if key in self._warmed or loaded.worker.info is None:
            return
        self._warmed.add(key)
        template = template_of(record, loaded)
        await asyncio.to_thread(renderer.warm, template.source, template.bos_token, template.eos_token)

    async def _remote_target(self, record: ModelRecord) -> RemoteTarget:
        """A remote model's pool, once a replica has said what it serves (raises when none can)."""
        return await remote_target(self.remotes.pool(record), record)

    async def count_tokens(self, request: GenerationRequest) -> int:
        """How many tokens the request's prompt is, as the model tokenizes it."""
        record = await self.record(request.model)
        prepared = await media.prepare(request.messages, self.documents, model=record.name,
                                       sees_images=self.sees_images(record))
        request = replace(request, messages=prepared.messages)
        if record.remote:  # the upstream's tokenizer is not here: an estimate
            target = await self._remote_target(record)
            return estimated_tokens(await target.operation(request, request.messages))
        async with self.scheduler.lease(record, keep_alive=request.keep_alive) as loaded:
            prompt, _ = await LocalTarget(record, loaded, self.settings).render(request, request.messages,
                                                                               system=False)
            return await loaded.worker.count_tokens(prompt, media=media_of(prepared.images, prompt))

    def sees_images(self, record: ModelRecord) -> bool:
        """Whether images reach this model as images: it has a vision projector and runs on llama.cpp."""
        return bool(record.projector) and chosen_engine(record, self.settings.engine) == "llama.cpp"

    async def embed(self, model: str, texts: list[str], *, truncate: bool = True, keep_alive: float | None = None,
                    tokens: list[list[int]] | None = None) -> tuple[list[list[float]], int]:
        """L2-normalised embeddings of ``texts`` (or of ``tokens``, ids of the model's own tokenizer) and the tokens
        evaluated (a separate context in the worker)."""
        record = await self.record(model)
        if record.remote:
            if tokens is not None:
                raise InvalidRequest("token ids cannot go to a remote model (its tokenizer is not here); send the "
                                     "text", param="input")
            return await self.remotes.pool(record).embed(texts)
        async with self.scheduler.lease(record, keep_alive=keep_alive) as loaded:
            return await loaded.worker.embed(texts, truncate=truncate, tokens=tokens)

    async def rerank(self, model: str, query: str, documents: list[str], *, truncate: bool = True,
                     keep_alive: float | None = None) -> tuple[list[float], int]:
        """Each document's relevance to ``query`` from a reranker model (its classifier head, in a context of its own
        in the worker), in the order sent, and the tokens evaluated."""
        record = await self.record(model)
        if record.remote:
            raise InvalidRequest(f"'{model}' is a remote model: reranking is not passed on to remote models yet; "
                                 "rerank with a local reranker GGUF", param="model")
        if not await asyncio.to_thread(is_reranker, record):
            found = library.rerankers()
            suggestion = f"`localai pull {found[0]}`" if found else "a reranker GGUF"
            raise InvalidRequest(f"'{model}' is not a reranker (its weights have no rank pooling head); rerank with "
                                 f"a reranker model, such as the library's {suggestion}", param="model")
        async with self.scheduler.lease(record, keep_alive=keep_alive) as loaded:
            return await loaded.worker.rerank(query, documents, truncate=truncate)

    async def unload(self, name: str) -> bool:
        """Unload a model now (``localai stop``, a deleted or edited model): its worker, or a remote model's pool
        (health checks stop; the next request makes a new one). True when something was loaded."""
        had_pool = name in self.remotes.pools
        self.remotes.forget(name)
        return await self.scheduler.unload(name) or had_pool

    async def load(self, model: str, keep_alive: float | None) -> None:
        """Load a model now (Ollama's empty prompt); for a remote model, check that a replica answers."""
        record = await self.record(model)
        if record.remote:
            await self._remote_target(record)  # raises when no replica answered
            return
        async with self.scheduler.lease(record, keep_alive=keep_alive) as loaded:
            await self._warm_template(record, loaded)
