"""The daemon's handle on one worker process: spawn it, route its frames, notice when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, overload

from localai import paths, protocol
from localai.engines import llama_rpc
from localai.errors import InvalidRequest, RequestTooLarge, WorkerCrashed, WorkerLoadFailed
from localai.protocol import (
    CancelOp,
    DoneFrame,
    EmbeddingsFrame,
    EmbedOp,
    FrameTooLarge,
    GenerateOp,
    IdleFrame,
    ModelInfo,
    RanksFrame,
    RequestFrame,
    RerankOp,
    ShutdownOp,
    TokenizeOp,
    TokensFrame,
    WorkerFrame,
)

log = logging.getLogger("localai.runner")
_ids = itertools.count(1)


class Worker:
    """A running worker process serving one model."""

    def __init__(self, name: str, backend: str, options: dict[str, Any], *, debug: bool = False) -> None:
        self.name = name
        self.backend = backend
        self.options = options
        self.debug = debug
        self.info: ModelInfo | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.alive = False
        self.on_exit: Callable[[Worker], None] | None = None
        self.on_stats: Callable[[Worker, dict[str, int]], None] | None = None
        self.reported_cache_stats: dict[str, float] = {}  # the last cumulative stats counted into metrics
        self.failure: str | None = None  # what the engine reported before it exited, when it failed
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[WorkerFrame | None]] = {}  # None: the worker died
        # requests their reader left before their end: told their done frame (the usage of what was generated)
        self._abandoned: dict[str, Callable[[DoneFrame], None]] = {}

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    async def start(self, timeout: float) -> ModelInfo:
        """Spawn the worker and wait for its ``ready`` frame (or its load error)."""
        parent, child = socket.socketpair()
        try:
            paths.logs_dir().mkdir(parents=True, exist_ok=True)
            paths.rotate_log(paths.logs_dir() / "workers.log")
            log_file = open(paths.logs_dir() / "workers.log", "ab")  # noqa: SIM115 - handed to the child
            try:
                self.process = await asyncio.create_subprocess_exec(
                    *self.command(child.fileno()), pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file, stderr=log_file, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            finally:
                child.close()
                log_file.close()
            reader, self._writer = await asyncio.open_unix_connection(sock=parent, limit=protocol.MAX_FRAME)
            first = await asyncio.wait_for(_read_frame(reader), timeout)
            if first["ev"] != "ready":
                raise WorkerLoadFailed(f"could not load '{self.name}': {first.get('message', first)}")
        except BaseException as exc:  # every way out closes the socket and ends the process (a cancelled load too)
            await self._abandon_start()
            parent.close()
            if isinstance(exc, TimeoutError | asyncio.IncompleteReadError | ConnectionError | ValueError):
                reason = "timed out" if isinstance(exc, TimeoutError) else "exited"
                raise WorkerLoadFailed(
                    f"the worker for '{self.name}' {reason} while loading; see {paths.logs_dir() / 'workers.log'}"
                ) from exc
            raise
        self.info = first["info"]
        self.alive = True
        self._reader_task = asyncio.create_task(self._read_loop(reader), name=f"worker-{self.name}")
        log.info("worker %s loaded %s (pid %s)", self.backend, self.name, self.pid)
        return self.info

    def command(self, fd: int) -> list[str]:
        """The worker's command line; it inherits ``fd``, its end of the frame socket."""
        command = [sys.executable, "-m", "localai.workers.worker", "--fd", str(fd), "--backend", self.backend,
                   "--options", json.dumps(self.options)]
        return [*command, "--debug"] if self.debug else command

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await _read_frame(reader)
                if message["ev"] == "stats":
                    if "warning" in message:  # sent as it happens, beside the counters' reports (not one)
                        log.warning("worker for %s (pid %s): %s", self.name, self.pid, message["warning"])
                        continue
                    if self.on_stats is not None:
                        self.on_stats(self, message["cache"])
                    continue
                if message["ev"] == "fatal":
                    self.failure = message["message"] or "unknown failure"
                    log.error("worker for %s (pid %s) failed: %s", self.name, self.pid, self.failure)
                    continue
                if message["ev"] == "ready" or message["ev"] == "load_error":
                    continue  # only the first frame may be one
                queue = self._queues.get(str(message["id"]))
                if queue is not None:
                    queue.put_nowait(message)
                elif message["ev"] in ("done", "error"):
                    told = self._abandoned.pop(str(message["id"]), None)
                    if told is not None and message["ev"] == "done":
                        told(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ValueError as exc:  # an oversized or undecodable frame: the protocol is broken, so is the worker
            log.error("worker for %s (pid %s) sent a bad frame (%s); killing it", self.name, self.pid, exc)
        finally:
            self.alive = False
            if self._writer is not None:  # the worker's end is gone (or lies): close ours, nothing more is sent
                self._writer.close()
                self._writer = None
            servers = self.options.get("rpc_servers") or []
            if self._queues and servers and self.failure is None:  # died under requests: did an RPC server go?
                gone = await asyncio.to_thread(llama_rpc.reachable, servers)
                if gone:
                    self.failure = "; ".join(gone)
            for queue in self._queues.values():
                queue.put_nowait(None)
            self._abandoned.clear()
            if self.process is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.process.wait(), 5)
                if self.process.returncode is None:
                    await self.kill()  # the daemon gives up on it: it must not keep its RAM
                code = self.process.returncode
                if code not in (0, None):
                    log.error("worker for %s (pid %s) died with exit code %s", self.name, self.pid, code)
                    self._forget_cache_owner()
            if self.on_exit is not None:
                self.on_exit(self)

    def _forget_cache_owner(self) -> None:
        """Remove the dead worker's ``<cache>/<fingerprint>/owners/<pid>`` (its store removes it on a clean exit): a
        crash left it, and the folder looked in use by a live worker forever after (promptcache/blocks.py)."""
        root = self.options.get("cache_dir")
        if self.process is None or self.process.returncode is None or not root:
            return
        with contextlib.suppress(OSError):
            for owner in Path(str(root)).glob(f"*/owners/{self.process.pid}"):
                owner.unlink(missing_ok=True)

    async def _send(self, message: Mapping[str, Any]) -> None:
        self._write(message)
        await self._drain()

    def _write(self, message: Mapping[str, Any]) -> None:
        """Queue ``message`` for the worker; once this returns, the worker gets it unless it dies."""
        if not self.alive or self._writer is None:
            raise WorkerCrashed(f"the worker for '{self.name}' is not running")
        try:
            frame = protocol.encode(message)
        except FrameTooLarge as exc:
            raise RequestTooLarge(f"the request is too large for the model's worker: {exc}") from exc
        try:
            self._writer.write(frame)
        except (ConnectionError, RuntimeError) as exc:
            raise WorkerCrashed(f"the worker for '{self.name}' stopped: {exc}") from exc

    async def _drain(self) -> None:
        if self._writer is None:
            raise WorkerCrashed(f"the worker for '{self.name}' is not running")
        try:
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise WorkerCrashed(f"the worker for '{self.name}' stopped: {exc}") from exc

    async def generate(self, op: GenerateOp, *, idle: float = 0.0,
                       abandoned: Callable[[DoneFrame], None] | None = None) -> AsyncIterator[RequestFrame]:
        """Send a generate op and yield its frames until ``done`` or ``error``; cancels if abandoned, and then
        ``abandoned`` is told its done frame when the worker sends it (what it generated still counts: the worker
        ends every op it took with one, a queued one cancelled before it started included). With ``idle``, an
        ``{"ev": "idle"}`` frame comes each time the worker sent nothing for that many seconds."""
        queue: asyncio.Queue[WorkerFrame | None] = asyncio.Queue()
        self._queues[op["id"]] = queue
        finished = False
        written = False  # an op never written (too large, the worker gone) has nothing to cancel or wait for
        try:
            self._write(op)
            written = True
            await self._drain()
            while True:
                if idle > 0:
                    try:
                        message = await asyncio.wait_for(queue.get(), idle)  # a cancelled get loses no frame
                    except TimeoutError:
                        yield IdleFrame(ev="idle")
                        continue
                else:
                    message = await queue.get()
                if message is None:
                    finished = True
                    raise self.crashed("during the request")
                if message["ev"] == "prompt" or message["ev"] == "text":
                    yield message
                elif message["ev"] == "done" or message["ev"] == "error":
                    finished = True
                    yield message
                    return
        finally:
            left = self._queues.pop(op["id"], None)
            ended = next((m for m in _drained(left) if m is not None and m["ev"] in ("done", "error")), None)
            if not finished and ended is not None:  # it ended while its reader was going
                if ended["ev"] == "done" and abandoned is not None:
                    abandoned(ended)
            elif not finished and written and self.alive:
                if abandoned is not None:
                    self._abandoned[op["id"]] = abandoned
                cancel: CancelOp = {"op": "cancel", "id": op["id"]}
                with contextlib.suppress(Exception):
                    await self._send(cancel)

    def crashed(self, when: str) -> WorkerCrashed:
        """The error a request sees when the worker died under it."""
        cause = f" ({self.failure})" if self.failure else ""
        return WorkerCrashed(f"the worker serving '{self.name}' crashed {when}{cause}; it will be reloaded on the "
                             "next request")

    @overload
    async def _call(self, op: TokenizeOp, param: str) -> TokensFrame: ...

    @overload
    async def _call(self, op: EmbedOp, param: str) -> EmbeddingsFrame: ...

    @overload
    async def _call(self, op: RerankOp, param: str) -> RanksFrame: ...

    async def _call(self, op: TokenizeOp | EmbedOp | RerankOp,
                    param: str) -> TokensFrame | EmbeddingsFrame | RanksFrame:
        """Send a one-answer op and wait for its answer; an engine error is a 400 naming ``param``."""
        queue: asyncio.Queue[WorkerFrame | None] = asyncio.Queue()
        self._queues[op["id"]] = queue
        try:
            await self._send(op)
            message = await queue.get()
            if message is None:
                raise self.crashed(f"while answering a {op['op']} request")
            if message["ev"] == "error":
                error = RequestTooLarge if message["kind"] == "too_large" else InvalidRequest
                failure = error(message["message"] or f"{op['op']} failed", param=param)
                if message["kind"] == "foreign_token_ids":  # the dialect adds what a client should send
                    failure.code = "foreign_token_ids"
                raise failure
            answers = {"tokenize": "tokens", "embed": "embeddings", "rerank": "ranks"}
            if message["ev"] == answers[op["op"]]:
                return message  # type: ignore[return-value]
            raise self.crashed(f"(it answered a {op['op']} op with a {message['ev']} frame)")
        finally:
            self._queues.pop(op["id"], None)

    async def tokenize(self, text: str) -> list[int]:
        op: TokenizeOp = {"op": "tokenize", "id": f"tok-{next(_ids)}", "text": text}
        message = await self._call(op, "input")
        return list(message.get("tokens", []))

    async def count_tokens(self, text: str, media: dict[str, str] | None = None) -> int:
        op: TokenizeOp = {"op": "tokenize", "id": f"tok-{next(_ids)}", "text": text, "count_only": True}
        if media:
            op["media"] = media
        return (await self._call(op, "messages"))["count"]

    async def embed(self, texts: list[str], *, truncate: bool,
                    tokens: list[list[int]] | None = None) -> tuple[list[list[float]], int]:
        """Vectors for ``texts`` (or for ``tokens``, ids a client sent, checked to be the model's own) from the
        worker's embedding context, and the tokens evaluated."""
        op: EmbedOp = {"op": "embed", "id": f"emb-{next(_ids)}", "texts": texts, "truncate": truncate}
        if tokens is not None:
            op["tokens"] = tokens
        message = await self._call(op, "input")
        return [list(v) for v in message["vectors"]], message["prompt_tokens"]

    async def rerank(self, query: str, documents: list[str], *, truncate: bool) -> tuple[list[float], int]:
        """Each document's relevance score from the worker's rerank context, and the tokens evaluated."""
        op: RerankOp = {"op": "rerank", "id": f"rank-{next(_ids)}", "query": query, "documents": documents,
                        "truncate": truncate}
        message = await self._call(op, "documents")
        return list(message["scores"]), message["prompt_tokens"]

    async def stop(self, timeout: float = 60.0) -> None:
        """Ask the worker to exit (it first writes its queued cache entries); kill it if it does not."""
        if self.alive:
            with contextlib.suppress(Exception):
                await self._send(ShutdownOp(op="shutdown"))
        if self.process is not None and self.process.returncode is None:
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                await self.kill()
        if self._reader_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader_task, 5)

    async def _abandon_start(self) -> None:
        with contextlib.suppress(Exception):
            await self.kill()
        self._forget_cache_owner()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        self.alive = False


def _drained(queue: asyncio.Queue[WorkerFrame | None] | None) -> list[WorkerFrame | None]:
    """The frames still waiting in ``queue``."""
    frames: list[WorkerFrame | None] = []
    while queue is not None and not queue.empty():
        frames.append(queue.get_nowait())
    return frames


async def _read_frame(reader: asyncio.StreamReader) -> WorkerFrame:
    header = await reader.readexactly(protocol.HEADER.size)
    (length,) = protocol.HEADER.unpack(header)
    if length > protocol.MAX_FRAME:
        raise ValueError("frame too large")
    return protocol.decode_frame(await reader.readexactly(length))


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"
