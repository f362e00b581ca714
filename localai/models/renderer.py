"""Chat templates rendered in processes of their own, stopped at a deadline whatever they do.

A template comes from a GGUF file or a Modelfile, so it is not trusted: Jinja's sandbox keeps it from files and
objects, but nothing inside one Python process can stop a bare ``{% for %}`` over a long range. So the daemon never
runs one: a small pool of render processes does (``python -m localai.models.renderer``), each reused for request
after request (a render costs a pipe round trip, not a process start), and one that runs past its deadline is
killed and replaced. Each process is capped in memory and cannot outlive the daemon.

Two lanes keep a bad template from starving the others. Templates that have rendered in time before are
*trusted* and go to the main lane (``main`` processes, one template at most ``main - 1`` of them, so another model
always finds one free). A template seen for the first time, or one that ran past its deadline in the last
``QUARANTINE_SECONDS``, goes to the probation lane: one process, at a lower CPU priority, serving one render at a
time, the waiting templates in turn. A render still waiting when its deadline passes is refused, and a quarantined
template has one render at a time and none waiting (the others are refused at once): its backlog is answered
within the deadline, without touching the main lane.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from localai import protocol
from localai.errors import InvalidRequest, ModelfileError, ServerBusy
from localai.models import chat_template
from localai.models.chat_template import RENDER_SECONDS, RenderCall

log = logging.getLogger("localai.renderer")
MEMORY_BYTES = 2 << 30  # address space of a render process: a 64 M-character prompt and its copies fit
QUARANTINE_SECONDS = 600.0  # how long a template that overran renders in the probation lane
KILL_GRACE = 0.25  # past the deadline, the time a render has to report its own overrun before it is killed
PROBATION_NICE = 19  # a template looping on probation (or demoted) takes CPU time only when the engines leave some
DEMOTE_AFTER = 0.25  # a render on the main lane still running after this is lowered to PROBATION_NICE
Lane = Literal["main", "probation"]


class RenderFailed(InvalidRequest):
    """A template that failed, overran its deadline or its memory, or whose render process died: the template's
    fault, a 400 (the runtime names the model)."""


class RenderTooLarge(RenderFailed):
    """A conversation too large to send to a render process (a frame over the worker protocol's limit): 413."""

    status_code = 413


@dataclass
class Outcome:
    """One call's result: the prompt text, or why there is none."""

    text: str | None = None
    error: str | None = None
    overran: bool = False  # the template stopped itself at its deadline: it counts as overrunning


@dataclass
class _Job:
    calls: list[RenderCall]
    key: str
    deadline: float
    future: concurrent.futures.Future[list[Outcome]] = field(default_factory=concurrent.futures.Future)


def template_key(source: str | None) -> str:
    """What the lanes know a template by."""
    return hashlib.blake2b((source or "").encode(), digest_size=8).hexdigest()


class Overran(Exception):
    """A helper process did not answer by its deadline (it is killed)."""


class Died(Exception):
    """A helper process ended before it answered."""


class HelperProcess:
    """A helper process of the daemon (``python -m MODULE``): requests written to its stdin, one JSON frame read
    back from its stdout by a deadline, killed when it overruns. Used by one thread at a time. The module's main
    caps its memory (``--memory``), lowers its priority (``--nice``) and ends with its parent (``--parent``)."""

    def __init__(self, module: str, nice: int = 0, memory: int = MEMORY_BYTES) -> None:
        command = [sys.executable, "-m", module, "--memory", str(memory), "--nice", str(nice),
                   "--parent", str(os.getpid())]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in: IO[bytes] = self.process.stdin
        self._out: IO[bytes] = self.process.stdout
        self._selector = selectors.DefaultSelector()  # epoll/kqueue: the daemon's fds may be numbered past 1024
        self._selector.register(self._out, selectors.EVENT_READ)
        self.exiting = False
        self.demoted = False  # its priority was lowered during a slow render (it cannot be raised again)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def usable(self) -> bool:
        """Still running, not on its way out and not demoted (one killed from outside is noticed before a job is
        sent; a demoted one is replaced by one at full priority)."""
        return not self.exiting and not self.demoted and self.process.poll() is None

    def exchange(self, request: bytes, deadline: float, demote_at: float | None = None) -> dict[str, Any]:
        """Send ``request`` (framed as the module reads it) and return its answer's frame; raises Overran past
        ``deadline`` (plus a grace), Died when the process died. Still waiting at ``demote_at``, the process's CPU
        priority is lowered: a render that takes that long is likely one that never ends, and meanwhile the
        engines come first."""
        try:
            self._in.write(request)
            self._in.flush()
        except (BrokenPipeError, OSError) as exc:
            raise Died(str(exc)) from exc
        header = self._read(protocol.HEADER.size, deadline, demote_at)
        (length,) = protocol.HEADER.unpack(header)
        if length > protocol.MAX_FRAME:
            raise Died("an oversized frame")
        reply = protocol.decode(self._read(length, deadline))
        self.exiting = bool(reply.get("exit"))  # it answered, and ends now (out of memory, or told to)
        return reply

    def run(self, calls: list[RenderCall], deadline: float, demote_at: float | None = None) -> list[Outcome]:
        """The outcomes of ``calls``; raises RenderFailed when they are too large to send. The process stops a
        template itself just before ``deadline`` where it can (a call, an attribute, output), killing it the rest."""
        try:
            frame = protocol.encode({"calls": calls, "seconds": max(0.05, deadline - time.monotonic() - 0.1)})
        except protocol.FrameTooLarge as exc:
            raise RenderTooLarge(f"the conversation is too large to render: {exc}", param="messages") from exc
        reply = self.exchange(frame, deadline, demote_at)
        return [Outcome(item.get("text"), item.get("error"), bool(item.get("overran"))) for item in reply["results"]]

    def _read(self, size: int, deadline: float, demote_at: float | None = None) -> bytes:
        data = bytearray()
        while len(data) < size:
            now = time.monotonic()
            remaining = deadline + KILL_GRACE - now
            if demote_at is not None and not self.demoted:
                if now >= demote_at:
                    self._demote()
                else:
                    remaining = min(remaining, demote_at - now)
                    if not self._selector.select(remaining):
                        continue  # the demotion is due: lower its priority, then wait on
            try:
                if remaining <= 0 or not self._selector.select(remaining):
                    raise Overran()
                chunk = os.read(self._out.fileno(), min(size - len(data), 1 << 20))
            except (OSError, ValueError) as exc:  # killed and its pipe closed meanwhile (the pool is closing)
                raise Died(f"its pipe was closed ({exc})") from exc
            if not chunk:
                raise Died(f"exit code {self.process.poll()}")
            data.extend(chunk)
        return bytes(data)

    def _demote(self) -> None:
        self.demoted = True
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, self.process.pid, PROBATION_NICE)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.wait(timeout=5)
        self._selector.close()
        for pipe in (self._in, self._out):
            with contextlib.suppress(OSError):
                pipe.close()


class Renderer:
    """The pool: ``main`` trusted processes and one on probation, each driven by a thread of its own (never the
    event loop's executor, which other work needs)."""

    def __init__(self, main: int | None = None, seconds: float = RENDER_SECONDS) -> None:
        self.main = main or max(2, min(4, (os.cpu_count() or 2) // 2))
        self.seconds = seconds
        self.per_template = max(1, self.main - 1)
        self._queue: list[_Job] = []
        self._trusted: set[str] = set()
        self._quarantined: dict[str, float] = {}  # key -> until (monotonic)
        self._running: dict[tuple[Lane, str], int] = {}
        self._turns: dict[str, float] = {}  # probation: when each template last had the process
        self._processes: set[HelperProcess] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._threads = [threading.Thread(target=self._drive, args=(lane,), name=f"render-{lane}-{index}",
                                          daemon=True)
                         for index, lane in enumerate(["probation", *(["main"] * self.main)])]
        for thread in self._threads:
            thread.start()

    # -- asking --------------------------------------------------------------------------------------

    def submit(self, calls: Sequence[RenderCall], seconds: float | None = None) -> concurrent.futures.Future[
            list[Outcome]]:
        """Queue ``calls`` (one template's, rendered in one process one after the other); the future holds their
        outcomes, or raises RenderFailed (the template overran, or its process died) or ServerBusy."""
        if not calls:
            raise ValueError("no calls")
        job = _Job(list(calls), template_key(calls[0]["source"]), time.monotonic() + (seconds or self.seconds))
        with self._wake:
            if self._closed:
                raise ServerBusy("the daemon is shutting down")
            if self._in_quarantine(job.key, time.monotonic()) and (
                    any(key == job.key for _, key in self._running) or any(o.key == job.key for o in self._queue)):
                # a template that overran has one render at a time and none waiting: the rest are refused now
                _fail(job, RenderFailed(f"the chat template ran past its {self.seconds:g} s deadline recently and "
                                        "another of its renders is running; try again later", param="messages"))
                return job.future
            self._queue.append(job)
            self._wake.notify_all()
        return job.future

    def render(self, calls: Sequence[RenderCall], seconds: float | None = None) -> list[Outcome]:
        """``submit``, waited for here (a thread that may block: never the event loop)."""
        future = self.submit(calls, seconds)
        return future.result(timeout=(seconds or self.seconds) + 30)

    def trusted(self, source: str | None) -> bool:
        """Whether the template has rendered in time (and not overran since)."""
        key = template_key(source)
        with self._lock:
            return key in self._trusted and not self._in_quarantine(key, time.monotonic())

    def close(self) -> None:
        """Kill the processes and refuse what waits (the daemon is stopping)."""
        with self._wake:
            self._closed = True
            waiting, self._queue = self._queue, []
            processes = list(self._processes)
            self._wake.notify_all()
        for job in waiting:
            _fail(job, ServerBusy("the daemon is shutting down"))
        for process in processes:
            process.kill()

    # -- the lanes -----------------------------------------------------------------------------------

    def _in_quarantine(self, key: str, now: float) -> bool:
        until = self._quarantined.get(key)
        if until is not None and until <= now:
            del self._quarantined[key]
            return False
        return until is not None

    def _lane_of(self, key: str, now: float) -> Lane:
        return "main" if key in self._trusted and not self._in_quarantine(key, now) else "probation"

    def _take(self, lane: Lane) -> tuple[_Job, float] | None:
        """The next job this lane may run and the time it may run until, waiting for one; None once closed. A
        quarantined template's job runs until its own deadline (its backlog is answered within it); any other
        gets the whole deadline from its start, so waiting behind others never makes it look like it overran."""
        with self._wake:
            while not self._closed:
                now = time.monotonic()
                for expired in [job for job in self._queue if job.deadline <= now]:
                    self._queue.remove(expired)
                    _fail(expired, self._expired(expired, now))
                job = self._pick(lane, now)
                if job is not None:
                    self._queue.remove(job)
                    if not job.future.set_running_or_notify_cancel():
                        continue  # its request went away while it waited
                    self._running[(lane, job.key)] = self._running.get((lane, job.key), 0) + 1
                    self._turns[job.key] = now
                    until = job.deadline if self._in_quarantine(job.key, now) else now + self.seconds
                    return job, until
                soonest = min((job.deadline for job in self._queue), default=now + 60.0)
                self._wake.wait(max(0.01, soonest - now))
            return None

    def _pick(self, lane: Lane, now: float) -> _Job | None:
        mine = [job for job in self._queue if self._lane_of(job.key, now) == lane]
        if lane == "main":
            return next((job for job in mine if self._running.get(("main", job.key), 0) < self.per_template), None)
        # probation: one render at a time, the template that waited longest for its turn first
        return min(mine, key=lambda job: (self._turns.get(job.key, 0.0), job.deadline), default=None)

    def _expired(self, job: _Job, now: float) -> Exception:
        """Why a job that waited past its deadline is refused: its own template's other renders held it (the
        template's fault, a 400), or every process was busy with others (503)."""
        if self._in_quarantine(job.key, now) or any(key == job.key for _, key in self._running):
            return RenderFailed(f"the chat template's other renders held this one past its {self.seconds:g} s "
                                "deadline (a template that runs past it renders one at a time)", param="messages")
        return ServerBusy(f"every template render process was busy for {self.seconds:g} s")

    def _done(self, lane: Lane, job: _Job, overran: bool) -> None:
        with self._wake:
            self._running[(lane, job.key)] -= 1
            if not self._running[(lane, job.key)]:
                del self._running[(lane, job.key)]
            if overran:
                self._trusted.discard(job.key)
                self._quarantined[job.key] = time.monotonic() + QUARANTINE_SECONDS
            elif job.key not in self._quarantined:
                self._trusted.add(job.key)
            self._wake.notify_all()

    def _spawn(self, lane: Lane) -> HelperProcess | None:
        process = HelperProcess("localai.models.renderer", nice=PROBATION_NICE if lane == "probation" else 0)
        with self._lock:
            if self._closed:
                process.kill()
                return None
            self._processes.add(process)
        return process

    def _retire(self, process: HelperProcess) -> None:
        with self._lock:
            self._processes.discard(process)
        process.kill()

    def _drive(self, lane: Lane) -> None:
        """One process's thread: take a job, run it, kill and replace the process when it overran or died."""
        try:  # started before the first job: a render never waits for a process start
            process = self._spawn(lane)
        except OSError:
            log.exception("could not start a render process")
            process = None
        while True:
            taken = self._take(lane)
            if taken is None:
                if process is not None:
                    self._retire(process)
                return
            job, until = taken
            overran = broken = False  # broken: the process was killed or is no longer to be trusted
            outcomes: list[Outcome] | None = None
            error: Exception | None = None
            try:
                if process is not None and not process.usable:
                    self._retire(process)
                    process = None
                if process is None:
                    process = self._spawn(lane)
                    if process is None:
                        raise ServerBusy("the daemon is shutting down")
                outcomes = process.run(job.calls, until,
                                       time.monotonic() + DEMOTE_AFTER if lane == "main" else None)
                overran = any(outcome.overran for outcome in outcomes)
            except Overran:
                overran = broken = True
                log.warning("a chat template ran past its %g s deadline; its render process (pid %s) was killed",
                            self.seconds, process.pid if process else None)
                error = RenderFailed(f"the chat template ran past its {self.seconds:g} s deadline and was stopped",
                                     param="messages")
            except Died as exc:
                broken = True
                if self._closed:  # killed by close(): the daemon is stopping, the template did nothing wrong
                    error = ServerBusy("the daemon is shutting down")
                else:  # a template that kills its process (memory) is one that overran
                    overran = True
                    error = RenderFailed(f"the chat template's render process died ({exc}): the template used "
                                         f"more than {MEMORY_BYTES >> 20} MiB or crashed it", param="messages")
            except (RenderFailed, ServerBusy) as exc:
                error = exc
            except Exception as exc:  # the future must always be resolved: its request waits on it
                broken = True
                log.exception("a render process failed")
                error = exc
            if process is not None and (broken or not process.usable):
                self._retire(process)
                process = None
            self._done(lane, job, overran)  # before the answer: whoever waits sees the template's new standing
            if outcomes is not None:
                job.future.set_result(outcomes)
            else:
                _fail(job, error or RuntimeError("no outcome"))


def _fail(job: _Job, error: BaseException) -> None:
    """Resolve a job's future with ``error`` (queued or running; nothing when its request cancelled it)."""
    future = job.future
    if future.done() or (not future.running() and not future.set_running_or_notify_cancel()):
        return
    future.set_exception(error)


# What a template must render in time to be accepted: a short conversation, without and with a tool.
PROBE_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                  {"role": "user", "content": "And 3 + 3?"}]
PROBE_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


def check_renders(source: str | None, where: str) -> None:
    """Refuse a template that cannot render a short conversation within the deadline (or that exhausts its render
    process): ModelfileError naming ``where``. A template that rejects the conversation is not refused here (some
    take no system message, or insist on their own roles): only one that overruns."""
    if source is None or pool().trusted(source):
        return
    calls = [RenderCall(source=source, messages=PROBE_MESSAGES, bos_token="", eos_token="", add_generation_prompt=True,
                        extra=extra) for extra in ({}, {"tools": PROBE_TOOLS})]
    try:
        pool().render(calls)
    except RenderFailed as exc:
        raise ModelfileError(f"{where}: {exc.message} while rendering a four-message conversation; a chat template "
                             "must render in milliseconds (a loop that never ends?)") from None


def warm(source: str | None, bos_token: str = "", eos_token: str = "") -> None:
    """Render a short conversation with a template in every main process (after once on probation, which makes it
    trusted), so the first requests after a model loads, or after a restart, find it compiled in whichever process
    takes them: a large template's first render in a process costs tens of milliseconds (gpt-oss's: ~45 ms on
    this 2-core VM), which a restarted daemon's first turns paid. Errors are the requests' to report, not this."""
    if source is None:
        return
    renderer = pool()
    calls = [RenderCall(source=source, messages=PROBE_MESSAGES, bos_token=bos_token, eos_token=eos_token,
                        add_generation_prompt=True, extra={})]
    with contextlib.suppress(Exception):
        renderer.render(calls)
        if renderer.trusted(source):
            for future in [renderer.submit(calls) for _ in range(2 * renderer.main)]:  # most land on each
                future.result(timeout=renderer.seconds + 30)


_pool: Renderer | None = None
_pool_lock = threading.Lock()


def pool() -> Renderer:
    """This process's renderer, started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = Renderer()
        return _pool


def shutdown() -> None:
    """Stop this process's renderer (the daemon's shutdown; also at exit)."""
    global _pool
    with _pool_lock:
        current, _pool = _pool, None
    if current is not None:
        current.close()


atexit.register(shutdown)


# -- the render process ----------------------------------------------------------------------------------


def start_helper(prog: str, memory: int, argv: list[str] | None = None) -> tuple[IO[bytes], IO[bytes]]:
    """A helper process's start (``HelperProcess`` passes these): its limits from the command line, applied; its
    frames' streams (stdin, stdout), with ``sys.stdout`` moved to stderr so a stray print never corrupts a frame."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--memory", type=int, default=memory)
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--parent", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    limit_process(args.memory, args.nice, args.parent)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr
    return stdin, stdout


def limit_process(memory: int, nice: int, parent: int) -> None:
    """Cap the address space, lower the priority, and end with the parent (never an orphan that loops)."""
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _one(call: RenderCall) -> dict[str, Any]:
    from localai.models.chat_template import TemplateTimeout, render_call

    try:
        return {"text": render_call(call)}
    except InvalidRequest as exc:
        return {"error": exc.message, "overran": isinstance(exc.__cause__, TemplateTimeout)}
    except MemoryError:
        raise
    except Exception as exc:  # whatever a template does wrong is the template's error, never this process's end
        return {"error": f"the model's chat template failed: {type(exc).__name__}: {str(exc)[:500]}"}


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """Render jobs from ``stdin`` until it closes; a job that runs out of memory ends the process after its
    answer (the daemon starts another)."""
    while (body := protocol.read_frame(stdin)) is not None:
        job = protocol.decode(body)
        calls: list[RenderCall] = job["calls"]
        chat_template.RENDER_SECONDS = float(job.get("seconds", chat_template.RENDER_SECONDS))  # this process's
        results: list[dict[str, Any]] = []
        exhausted = False
        for call in calls:
            try:
                results.append(_one(call))
            except MemoryError:
                exhausted = True
                results.append({"error": f"the model's chat template used more than {MEMORY_BYTES >> 20} MiB"})
        try:
            frame = protocol.encode({"results": results, "exit": exhausted})
        except protocol.FrameTooLarge as exc:
            frame = protocol.encode({"results": [{"error": f"the rendered prompt is too large: {exc}"}] * len(calls),
                                     "exit": exhausted})
        stdout.write(frame)
        stdout.flush()
        if exhausted:
            return


def main(argv: list[str] | None = None) -> None:
    serve(*start_helper("python -m localai.models.renderer", MEMORY_BYTES, argv))


if __name__ == "__main__":
    main()
