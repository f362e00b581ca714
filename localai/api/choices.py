"""A request's ``n`` choices (OpenAI chat and completions): ``n`` generations of one prompt as parallel sequences.
The first starts alone; the others once its prompt is evaluated (its first event), so the serving loop starts each
from the first's live state (``engines/slot_cache.py``, ``fork_if_better``) instead of computing the prompt again.
Each other choice samples with the request's seed plus its index, and only the first is the session's turn (its
reply is what a next turn continues, and what the prompt cache keeps for it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace

from localai.errors import LocalAIError
from localai.runtime.generation import Generation
from localai.runtime.runtime import Runtime
from localai.schema import Event, GenerationRequest, KeepAlive, Usage

MAX_CHOICES = 8  # a request's n: at most this many (twice the default parallel sequences; more queue for a slot)


def sibling(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice ``index``'s request: the same prompt, its own seed, not the session's turn."""
    seed = request.sampling.seed
    return replace(request, sampling=replace(request.sampling, seed=None if seed is None else seed + index),
                   session_id=None, follow_up=False)


class Choices:
    """The ``n`` generations of one request, their events merged as (choice index, event)."""

    def __init__(self, runtime: Runtime, request: GenerationRequest, n: int, first: Generation) -> None:
        self.runtime = runtime
        self.request = request
        self.n = n
        self.generations = [first]
        self._tasks: list[asyncio.Task[None]] = []  # each choice's events, read into the merged queue
        self._closed = False

    @classmethod
    async def start(cls, runtime: Runtime, request: GenerationRequest, n: int) -> Choices:
        """Admit the first choice (its errors are the request's: a status before any byte is sent)."""
        return cls(runtime, request, n, await runtime.start(request))

    async def events(self, *, keepalive: bool = False) -> AsyncGenerator[tuple[int, Event | KeepAlive], None]:
        """Each choice's events as they come, tagged with its index (keep-alives only from the first, while its
        prompt is evaluated). The other choices start at the first's first event; an error in any ends them all."""
        if self.n == 1:  # read in this task: a client that leaves cancels it, and with it the generation
            try:
                async for event in self.first.stream_events() if keepalive else self.first.events():
                    yield 0, event
            finally:
                await self.aclose()
            return
        queue: asyncio.Queue[tuple[int, Event | KeepAlive | LocalAIError | None]] = asyncio.Queue()
        tasks = self._tasks

        async def pump(index: int, generation: Generation) -> None:
            try:
                events = generation.stream_events() if keepalive and index == 0 else generation.events()
                async for event in events:
                    await queue.put((index, event))
            except LocalAIError as exc:
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        tasks.append(asyncio.create_task(pump(0, self.generations[0])))
        running, others_started = 1, False
        try:
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, LocalAIError):
                    raise item
                if not others_started and not isinstance(item, KeepAlive):
                    others_started = True  # the first's prompt is evaluated: the others start from its state
                    for other in range(1, self.n):
                        generation = await self.runtime.start(sibling(self.request, other))
                        self.generations.append(generation)
                        tasks.append(asyncio.create_task(pump(other, generation)))
                        running += 1
                yield index, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop every choice: the tasks reading them first (a generation being read cannot be closed from outside
        its reader: the client that left would leave the worker or upstream generating), then the generations."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for generation in self.generations:
            await generation.aclose()

    @property
    def first(self) -> Generation:
        return self.generations[0]


def merged_usage(usages: dict[int, Usage]) -> Usage:
    """The choices' usage as OpenAI counts it: the prompt once (the first choice's, with its cached tokens), the
    completion tokens of every choice."""
    first = usages[0]
    return replace(first, completion_tokens=sum(usage.completion_tokens for usage in usages.values()),
                   drafted_tokens=sum(usage.drafted_tokens for usage in usages.values()),
                   accepted_tokens=sum(usage.accepted_tokens for usage in usages.values()))
