"""A worker process: loads one model on one backend and serves it over the frame protocol.

Started by the daemon as ``python -m localai.workers.worker --fd N --options JSON``. The engine runs on
its own thread; the main thread reads frames so that a cancel reaches the engine within a step.
If the engine thread fails, the process exits: a worker that stays alive without serving would
hang every request to its model, while a dead one is noticed by the daemon and reloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
from typing import Any

from localai.engines.engine import Engine, LoadOptions
from localai.engines.serving import Serving
from localai.protocol import FatalFrame, FrameSocket, LoadErrorFrame, ReadyFrame, WorkOp

log = logging.getLogger("localai.worker")
EXIT_ENGINE_FAILED = 70
SHUTDOWN_TIMEOUT = 60.0
# A SIGTERM or SIGINT sent to the whole process group (Ctrl-C in a terminal, `kill -- -PGID`, a service manager
# that signals every process) reaches the worker beside the daemon, which is stopping too: its shutdown first sends
# the replies still to be prefilled, then the shutdown op. The worker waits that long for it, then stops itself
# the same way (requests being prefilled finish, queued cache writes reach the disk).
SIGNAL_GRACE = 12.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localai-worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket file descriptor")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--options", required=True, help="JSON load options")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    channel = FrameSocket(socket.socket(fileno=args.fd))
    try:
        engine = load_engine(args.backend, json.loads(args.options), debug=args.debug)
    except Exception as exc:
        log.exception("load failed")
        channel.send(LoadErrorFrame(ev="load_error", message=f"{type(exc).__name__}: {exc}"))
        return 1
    inbox: queue.Queue[WorkOp | None] = queue.Queue()

    def run_engine() -> None:
        try:
            engine.serve(inbox, channel.emit)
        except BaseException as exc:
            log.exception("the engine failed; exiting so the daemon reloads the model")
            with contextlib.suppress(Exception):
                channel.send(FatalFrame(ev="fatal", message=f"{type(exc).__name__}: {exc}"[:2000]))
            os._exit(EXIT_ENGINE_FAILED)

    engine_thread = threading.Thread(target=run_engine, name="engine", daemon=True)
    engine_thread.start()
    stop_on_signals(inbox, engine_thread)
    channel.send(ReadyFrame(ev="ready", info=engine.info()))
    while True:
        try:
            message = channel.receive()
        except (OSError, ValueError):
            message = None
        if message is None or message["op"] == "shutdown":
            inbox.put(None)
            break
        inbox.put(message)
    engine_thread.join(timeout=SHUTDOWN_TIMEOUT)  # the engine flushes queued cache writes before it returns
    return 0


def stop_on_signals(inbox: queue.Queue[WorkOp | None], engine_thread: threading.Thread,
                    grace: float = SIGNAL_GRACE) -> None:
    """On SIGTERM or SIGINT, give the daemon ``grace`` seconds to stop this worker as it stops itself, then stop
    gracefully: the engine finishes what it is prefilling and flushes its cache writes, then the process exits."""
    signalled = threading.Event()

    def stop_later() -> None:
        if engine_thread.is_alive():
            engine_thread.join(timeout=grace)  # the daemon's shutdown op ends it first, when it comes
        if engine_thread.is_alive():
            log.info("stopping on a signal: finishing requests being prefilled and cache writes")
            inbox.put(None)
            engine_thread.join(timeout=SHUTDOWN_TIMEOUT)
        os._exit(0)

    def handler(signum: int, _frame: Any) -> None:
        if not signalled.is_set():
            signalled.set()
            threading.Thread(target=stop_later, name="signal-stop", daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def load_engine(backend: str, options: dict[str, Any], *, debug: bool) -> Serving:
    """Import and load the named backend behind the serving loop. Only worker processes ever import an engine."""
    load = LoadOptions(**options)
    engine: Engine
    if backend == "llama.cpp":
        from localai.engines.llama_cpp import LlamaCppEngine

        engine = LlamaCppEngine(load, debug=debug)
    elif backend == "mlx":
        from localai.engines.mlx import MlxEngine

        engine = MlxEngine(load, debug=debug)
    elif backend == "scripted":
        from localai.engines.scripted import ScriptedEngine

        engine = ScriptedEngine(load)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return Serving(engine, load)


if __name__ == "__main__":
    sys.exit(main())
