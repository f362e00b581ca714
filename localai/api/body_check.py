"""Large request bodies checked in a process of their own, so parsing them never holds the event loop.

Parsing JSON is one C call that holds the interpreter lock for its whole length (about 100 ms for 10 MB of small
objects): in a thread it stalls ``/health`` and every stream as surely as on the event loop. So a body over
``LARGE`` goes to a checker process (``python -m localai.api.body_check``, reused from body to body) that parses
it and applies ``limits.py``; only a body that passes is parsed again in the daemon, and then its size is bounded
by those limits. A checker that overruns its deadline is killed and replaced; one that checked a very large body
ends after answering, so the memory of parsing it goes back to the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from typing import IO, Any

from localai import protocol
from localai.api import limits
from localai.errors import ServerBusy
from localai.models.renderer import Died, HelperProcess, Overran, start_helper

log = logging.getLogger("localai.server")
LARGE = 1 << 20  # bodies over this are checked in the checker process
CHECK_SECONDS = 10.0  # 32 MiB of small objects parse and walk in about 2 s
RECYCLE_BYTES = 8 << 20  # a checker that parsed a body this large ends after answering: its memory goes back
MEMORY_BYTES = 3 << 30
PROCESSES = 2


class BodyChecker:
    """A few checker processes (``PROCESSES``), each used by one body at a time; their waits run on threads, never
    the event loop."""

    def __init__(self, processes: int = PROCESSES, seconds: float = CHECK_SECONDS) -> None:
        self.seconds = seconds
        self._slots = asyncio.Semaphore(processes)
        self._idle: list[HelperProcess] = []
        self._lock = threading.Lock()
        self._closed = False

    async def check(self, body: bytes) -> None:
        """Raise ``limits.BodyProblem`` for a body ``limits.check_json`` refuses, ServerBusy when checking it took
        past the deadline (waiting for a checker included)."""
        deadline = time.monotonic() + self.seconds
        try:
            await asyncio.wait_for(self._slots.acquire(), self.seconds)
        except TimeoutError:
            raise ServerBusy(f"every request-body checker was busy for {self.seconds:g} s") from None
        try:
            verdict = await asyncio.to_thread(self._run, body, deadline)
        finally:
            self._slots.release()
        if verdict.get("problem"):
            raise limits.BodyProblem(str(verdict["problem"]), int(verdict.get("status", 400)))

    def _run(self, body: bytes, deadline: float) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise ServerBusy("the daemon is shutting down")
            process = self._idle.pop() if self._idle else None
        if process is None or not process.usable:
            if process is not None:
                process.kill()
            process = HelperProcess("localai.api.body_check", memory=MEMORY_BYTES)
        keep = False
        try:
            verdict = process.exchange(protocol.HEADER.pack(len(body)) + body, deadline)
            keep = process.usable
            return verdict
        except Overran:
            log.warning("checking a request body of %d bytes took over %g s; its checker was killed", len(body),
                        self.seconds)
            raise ServerBusy(f"checking the request body took over {self.seconds:g} s") from None
        except Died as exc:
            raise limits.BodyProblem(f"the request body could not be checked: its checker died ({exc})",
                                     413) from None
        finally:
            with self._lock:
                if keep and not self._closed:
                    self._idle.append(process)
                else:
                    process.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for process in idle:
            process.kill()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """Have glibc's malloc map every block of ``threshold`` bytes or more on its own (the daemon calls this at
    start): freed, such a block goes straight back to the system. By default the threshold rises to the largest
    block freed (up to 32 MiB), after which a refused 20 MB body's copies stay in a thread's heap for good."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)


def release_memory() -> None:
    """Give the memory of a large body's objects back to the system: collect cycles, then have glibc's malloc
    return its free pages (Python's own allocator gives back only whole empty arenas)."""
    import ctypes
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """Check bodies from ``stdin`` until it closes: one JSON frame answers each."""
    while (body := protocol.read_frame(stdin)) is not None:
        length = len(body)
        answer: dict[str, Any] = {"ok": True}
        try:
            limits.check_json(body)
        except limits.BodyProblem as exc:
            answer = {"problem": str(exc), "status": exc.status}
        except MemoryError:
            answer = {"problem": "the request body is too large to parse", "status": 413}
        answer["exit"] = length >= RECYCLE_BYTES or ("problem" in answer and answer["status"] == 413)
        del body
        with contextlib.suppress(BrokenPipeError):
            stdout.write(protocol.encode(answer))
            stdout.flush()
        if answer["exit"]:
            return


def main(argv: list[str] | None = None) -> None:
    serve(*start_helper("python -m localai.api.body_check", MEMORY_BYTES, argv))


if __name__ == "__main__":
    main()
