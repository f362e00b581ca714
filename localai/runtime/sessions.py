"""What the daemon remembers of agent sessions between their requests: the model each one asked for (so /api/cache
can name it), whether a prompt extends its session's last one (divergences), and the follow-up prefill of a reply
as the next turn will render it (the worker saves it, so the next request computes only what is new)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from localai.errors import LocalAIError
from localai.models.registry import Registry
from localai.promptcache.divergences import Divergence
from localai.protocol import GenerateOp
from localai.runtime import divergence
from localai.runtime.generation import FollowUp
from localai.runtime.local import LocalTarget
from localai.schema import GenerationRequest, Message, TextBlock, ToolCallEnd, child_session, parent_session
from localai.workers.handle import new_request_id

log = logging.getLogger("localai.runtime")
SESSIONS_REMEMBERED = 4096  # sessions whose model /api/cache can name
# How long the end of a reply waits for its follow-up prefill to be on its way to the worker (a render, milliseconds):
# sent before the client has the end, it reaches the worker before the conversation's next request can.
FOLLOW_UP_WAIT = 0.5


def session_key(request: GenerationRequest) -> str | None:
    """A request's session as the daemon's per-session memories know it (fitting, divergences): within its cache
    partition, so a session id another principal also uses never shares them."""
    if request.session_id is None or not request.cache_partition:
        return request.session_id
    return f"{request.cache_partition}/{request.session_id}"


# Side requests agents send under their main session's id, known by how their system prompt starts: each goes to a
# child session of its own, so it neither takes the main conversation's slot nor reads as the conversation changing
SIDE_REQUESTS = (
    ("title", "You are a title generator"),  # OpenCode's session title (its system prompt, title.txt)
)


def side_session(request: GenerationRequest) -> str | None:
    """The session a request belongs to: its own, or, for a side request recognised by ``SIDE_REQUESTS``, a child
    session of it (``schema.child_session``)."""
    session = request.session_id
    if session is None or not request.messages or parent_session(session) is not None:
        return session
    first = request.messages[0]
    if first.role not in ("system", "developer"):
        return session
    text = "".join(block.text for block in first.content if isinstance(block, TextBlock)).lstrip()[:200]
    for name, start in SIDE_REQUESTS:
        if text.startswith(start):
            return child_session(session, name)
    return session


class Sessions:
    """Per-session memories, and the background work they start (follow-up prefills, divergence reports)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.divergences = divergence.Tracker()
        # Which model each recent session asked for, and which models each cache folder served: the cache's entries
        # carry a fingerprint and a session, and /api/cache names their model from these.
        self.models: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._cache_models_noted: set[tuple[str, str]] = set()
        self._background: set[asyncio.Task[None]] = set()  # follow-up prefills and template warm-ups in flight
        self._reports: set[asyncio.Task[None]] = set()  # divergence reports being written

    def spawn(self, work: Coroutine[Any, Any, None], *, report: bool = False) -> asyncio.Task[None]:
        """Run ``work`` in the background; ``settle`` waits for it unless it is a ``report``."""
        tasks = self._reports if report else self._background
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait (a while) for follow-up prefills in flight, so a stopping daemon still saves the last turns."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    async def note_cache_use(self, model: str, fingerprint: str | None, session: str | None) -> None:
        if session:
            self.models[session] = model
            self.models.move_to_end(session)
            while len(self.models) > SESSIONS_REMEMBERED:
                self.models.popitem(last=False)
        if fingerprint is None or (fingerprint, model) in self._cache_models_noted:
            return
        self._cache_models_noted.add((fingerprint, model))
        try:
            await self.registry.off_loop(lambda registry: registry.remember_cache_model(fingerprint, model))
        except Exception:  # a name for the cache screen is not worth failing a request over
            log.warning("could not record that %s uses cache folder %s", model, fingerprint, exc_info=True)

    def compare_turn(self, target: LocalTarget, request: GenerationRequest, messages: list[Message], prompt: str,
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

        self.spawn(report(), report=True)

    def follow_up(self, target: LocalTarget, request: GenerationRequest, messages: list[Message] | None,
                  prompt: str) -> FollowUp:
        """After the reply: have the worker prefill it as the next turn will render it, then save the sequence,
        so the next request computes only the new user or tool message (the worker holds that request until the
        prefill is done). Runs after the response; a failure costs the next turn a few tokens, nothing else."""
        async def prefill(text: str, calls: list[ToolCallEnd], reasoning: str, sent: asyncio.Future[None]) -> None:
            try:
                rendered = await target.next_turn_prefix(request, messages, text, calls, reasoning)
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
            model, session = target.record.name, request.session_id or "(none)"
            try:
                async for frame in frames:
                    if frame["ev"] == "error":
                        log.warning("the follow-up prefill of session %s on %s was refused: %s", session, model,
                                    frame["message"])
            except LocalAIError as exc:  # the worker died, or the op could not be sent: the next turn recomputes
                log.warning("the follow-up prefill of session %s on %s failed: %s", session, model, exc)
            except Exception:  # a bug: costs the next turn its reuse, never the daemon
                log.exception("the follow-up prefill of session %s on %s failed", session, model)
            # a cancelled task (the daemon stopping) ends quietly: CancelledError is no Exception

        async def start(text: str, calls: list[ToolCallEnd], reasoning: str) -> None:
            sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task = self.spawn(prefill(text, calls, reasoning, sent))
            task.add_done_callback(lambda _: _settle(sent))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sent), FOLLOW_UP_WAIT)

        return start


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
