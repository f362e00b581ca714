"""The walk of one chat request through localai's modules, measured on the real daemon: ``python -m tests.walk``.

It starts ``localai serve`` on smollm2 (as tests/conftest.py does), sends a warm-up chat request (it loads the
model and compiles its template), then the measured ones: a POST /v1/chat/completions with a system message, a
user message and one tool, streamed, then the same not streamed. Every localai process (the daemon, its workers,
its render processes) runs with a generated ``sitecustomize.py`` first on PYTHONPATH that installs
``sys.setprofile``/``threading.setprofile`` and appends each call into localai code to ``<dir>/<pid>.jsonl``, one
line at a time (a worker ends with ``os._exit``: nothing is left in a buffer). localai itself is not changed.

Definitions (what the numbers count):
- A *stop*: a call from one localai module into another, counted once per call site (caller file:line -> callee
  function) and listed in the order of its first occurrence inside the request's window, so a per-token loop
  counts once. The window runs from sending the request (once the daemon is quiet) until no traced process has
  made a fresh call for 1.5 s: the request's tail (the worker's cache writes, the runtime's prefill of the
  follow-up turn) is part of its walk, and idle pollers (the Modelfile watcher) only resume, so they end nothing.
  The *caller* is the nearest localai frame below the callee, looked for down the stack through library frames,
  but not across an event loop's callback or a thread's start (asyncio/events.py, threading.py,
  concurrent/futures/thread.py): a call with no localai caller above those is an *entry* (``<starlette> =>
  api/...``, named after the package of the frame below it), shown but not counted.
- A fresh call vs a resumption (Python 3.11): calling a generator or coroutine function fires no 'call' event (its
  first instruction, RETURN_GENERATOR, returns before RESUME); every start or resumption of its frame fires one.
  At that event ``frame.f_lasti`` is the offset of the code's first RESUME instruction for a fresh start (0 for a
  plain function; later when MAKE_CELL/COPY_FREE_VARS or RETURN_GENERATOR come first) and past it for a resumption
  (the RESUME after a YIELD_VALUE). A resumption counts only when a localai frame resumed it (``async for``,
  ``next()``, an awaiting coroutine), under the same call-site key, so a chain resumed by the event loop adds
  nothing and an ``async for`` adds its one line; a resumption with no localai caller is dropped.
- Calls into the foundations (tests/test_layout.py's FOUNDATIONS: schema, errors, settings, paths, protocol,
  metrics, text) are listed apart, not as stops; a foundation calling up into a room is a stop.
- A *climb*: a stop whose callee's room is above its caller's in tests/test_layout.py's LEVELS (api > runtime >
  workers, upstreams > engines, promptcache, models > foundations). A *call against the imports*: a stop whose
  callee's module imports the caller's (directly or through others): a callback, or a base class calling its
  subclass. *Entries per module*: how many distinct stops enter each module.
A thread hop (``asyncio.to_thread``) or a queue (the worker's inbox) is not a call: what runs on the other side
starts as an entry. Not measured: whether the messages crossing a process boundary are typed (read protocol.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import localai
from tests.conftest import Daemon, start_daemon
from tests.test_layout import FOUNDATIONS, LEVELS, imports

PACKAGE = Path(localai.__file__).resolve().parent
SYSTEM = "You are a terse assistant. Call a tool when one fits."
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# Imported by every localai process of the daemon (PYTHONPATH); does nothing unless LOCALAI_WALK_OUT is set.
SITECUSTOMIZE = r'''
import os
if os.environ.get("LOCALAI_WALK_OUT"):
    import dis, json, sys, threading, time

    _PKG = os.environ["LOCALAI_WALK_PKG"]
    _BOUNDARY = ("asyncio/events.py", "/threading.py", "concurrent/futures/thread.py")
    _info = {}  # code -> (module, qualname, offset of the first RESUME) | "lib" | "boundary"
    _out = open(os.path.join(os.environ["LOCALAI_WALK_OUT"], f"{os.getpid()}.jsonl"), "a", buffering=1)
    _out.write(json.dumps({"argv": sys.orig_argv}) + "\n")

    def _classify(code):
        name = code.co_filename
        if name.startswith(_PKG):
            resume = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
            info = (name[len(_PKG):].removesuffix(".py"), code.co_qualname, resume)
        else:
            info = "boundary" if name.endswith(_BOUNDARY) else "lib"
        _info[code] = info
        return info

    def _profile(frame, event, arg):
        if event != "call":
            return
        info = _info.get(frame.f_code) or _classify(frame.f_code)
        if type(info) is not tuple:
            return
        fresh = frame.f_lasti <= info[2]
        back, via = frame.f_back, None
        while back is not None:
            binfo = _info.get(back.f_code) or _classify(back.f_code)
            if type(binfo) is tuple:
                break
            if via is None:
                via = back.f_globals.get("__name__", "?").split(".")[0]
            if binfo == "boundary":
                back = None
                break
            back = back.f_back
        if back is None:
            if not fresh:
                return  # resumed by the event loop or a library: not a call
            caller = [None, via or "?", 0]
        else:
            caller = [binfo[0], binfo[1], back.f_lineno]
        _out.write(json.dumps([time.time(), *caller, info[0], info[1], fresh]) + "\n")

    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''


def dotted(module: str) -> str:
    """``runtime/formats/__init__`` -> ``localai.runtime.formats``."""
    return ("localai." + module.replace("/", ".")).removesuffix(".__init__")


def room(module: str) -> str:
    """The room of a module named relative to localai (``runtime/runtime``, ``schema``), as test_layout names it."""
    name = dotted(module)
    if name == "localai.__main__":
        return "cli"
    return "foundations" if name in FOUNDATIONS else name.split(".")[1]


@cache
def imported_by(module: str) -> frozenset[str]:
    """Every localai module ``module`` (dotted) imports, directly or through others."""
    found: set[str] = set()
    todo = [module]
    while todo:
        for target, _ in imports(todo.pop()):
            if target not in found:
                found.add(target)
                todo.append(target)
    return frozenset(found)


@dataclass
class Walk:
    """The walk of one request in one kind of process."""

    process: str
    stops: list[str] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)
    foundations: list[str] = field(default_factory=list)
    climbs: list[str] = field(default_factory=list)
    against_imports: list[str] = field(default_factory=list)
    entered: dict[str, int] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)  # in the order the walk first reaches them


def process_name(argv: list[str]) -> str:
    """``daemon``, ``worker``, ``render``... from a process's command line."""
    if "-m" in argv:
        module = argv[argv.index("-m") + 1]
        return {"localai": "daemon", "localai.workers.worker": "worker",
                "localai.models.renderer": "render"}.get(module, module)
    return " ".join(argv)


def walks(folder: Path, start: float, end: float) -> list[Walk]:
    """Each kind of process's walk between ``start`` and ``end`` (processes of one kind, such as the render
    processes a pool hands requests to in turn, make one walk), from the files the traced processes wrote."""
    events: dict[str, list[list[Any]]] = {}
    for path in sorted(folder.glob("*.jsonl"), key=lambda p: int(p.stem)):
        lines = path.read_text().splitlines()
        kind = events.setdefault(process_name(json.loads(lines[0])["argv"]), [])
        for line in lines[1:]:
            with contextlib.suppress(ValueError):  # a line cut short by a killed process
                kind.append(json.loads(line))
    return [walk for process, found in events.items() if (walk := one_walk(process, found, start, end))]


def one_walk(process: str, events: list[list[Any]], start: float, end: float) -> Walk | None:
    walk, seen, entered = Walk(process), set(), Counter[str]()
    for at, caller, caller_function, caller_line, callee, callee_function, _ in sorted(events, key=lambda e: e[0]):
        key = (caller, caller_function, caller_line, callee, callee_function)
        if not start <= at <= end or caller == callee or key in seen:
            continue
        seen.add(key)
        target = f"{callee}:{callee_function}"
        if caller is None:
            walk.entries.append(f"<{caller_function}> => {target}")
        elif room(callee) == "foundations":
            if room(caller) != "foundations":  # the foundations among themselves are not part of the walk
                walk.foundations.append(f"{caller}:{caller_function}:{caller_line} -> {target}")
        else:
            walk.stops.append(f"{caller}:{caller_function}:{caller_line} -> {target}")
            entered[callee] += 1
            walk.modules += [m for m in (caller, callee) if m not in walk.modules]
            if LEVELS[room(callee)] > LEVELS[room(caller)]:
                walk.climbs.append(walk.stops[-1])
            if dotted(caller) in imported_by(dotted(callee)):
                walk.against_imports.append(walk.stops[-1])
    walk.entered = dict(sorted(entered.items(), key=lambda item: (-item[1], item[0])))
    return walk if walk.stops or walk.entries or walk.foundations else None


def settle(traces: Path, quiet: float = 1.5, limit: float = 60.0) -> float:
    """Wait until no traced process has made a fresh call for ``quiet`` seconds (the request's tail: the worker's
    cache writes, the runtime's prefill of the follow-up turn; idle pollers such as the Modelfile watcher only
    resume); returns the time it went quiet."""
    read: dict[Path, int] = {}
    last, deadline = time.time(), time.time() + limit
    while time.time() - last < quiet:
        if time.time() > deadline:
            raise RuntimeError(f"the daemon did not go quiet within {limit:.0f} s")
        time.sleep(0.2)
        for path in traces.glob("*.jsonl"):
            with path.open("rb") as file:
                file.seek(read.get(path, 0))
                data = file.read()
            complete = data[:data.rfind(b"\n") + 1]
            read[path] = read.get(path, 0) + len(complete)
            for line in complete.splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    event = json.loads(line)
                    if event[-1]:
                        last = max(last, event[0])
    return time.time()


def post(daemon: Daemon, traces: Path, user: str, *, stream: bool) -> tuple[float, float]:
    """One chat request with the system message and the tool, sent once the daemon is quiet; returns the window
    of its walk: from sending it to the end of its tail (the request's own background work, when it is quiet)."""
    settle(traces)
    body = {"model": "smollm2", "max_tokens": 8, "temperature": 0, "stream": stream, "tools": [TOOL],
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    with daemon.http(timeout=300) as http:
        start = time.time()
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.read()
    if response.status_code != 200:
        raise RuntimeError(f"the request failed ({response.status_code}): {response.text}")
    return start, settle(traces)


def measure() -> dict[str, list[Walk]]:
    """Start a traced daemon, warm it up, measure the streamed and the non-streamed request."""
    with tempfile.TemporaryDirectory(prefix="localai-walk-") as temp:
        root = Path(temp)
        (root / "site").mkdir()
        (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        traces = root / "out"
        traces.mkdir()
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(root / "site"), str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
        with start_daemon(root / "home", keep_alive="-1", walk_out=str(traces),
                          walk_pkg=str(PACKAGE) + os.sep) as daemon:
            post(daemon, traces, "Say hello.", stream=True)
            streamed = post(daemon, traces, "What is the weather in Paris?", stream=True)
            plain = post(daemon, traces, "What is the weather in Rome?", stream=False)
        return {"streamed": walks(traces, *streamed), "not streamed": walks(traces, *plain)}


def report(request: str, found: list[Walk]) -> list[str]:
    """The walks as text: each process's stops in order, then the summary."""
    lines = [f"== {request}"]
    for walk in found:
        lines += [f"-- {walk.process}: the walk", *(f"   {entry}" for entry in walk.entries),
                  *(f"   {stop}" for stop in walk.stops), f"-- {walk.process}: the modules in order",
                  f"   {' > '.join(walk.modules)}", f"-- {walk.process}: into the foundations",
                  *(f"   {stop}" for stop in walk.foundations)]
    entered: Counter[str] = Counter()
    for walk in found:
        entered.update(walk.entered)
    modules = {module for walk in found for module in walk.modules}
    climbs = [f"   {walk.process}: {stop}" for walk in found for stop in walk.climbs]
    against = [f"   {walk.process}: {stop}" for walk in found for stop in walk.against_imports]
    return [*lines, f"-- summary ({request}): {sum(len(w.stops) for w in found)} stops in {len(modules)} modules "
            f"({', '.join(f'{w.process} {len(w.stops)}' for w in found)})",
            f"   climbs back up (callee in a higher room): {len(climbs)}", *climbs,
            f"   calls against the imports (the callee's module imports the caller's): {len(against)}", *against,
            "   entries per module: " + ", ".join(f"{m} {n}" for m, n in sorted(entered.items(),
                                                                               key=lambda i: (-i[1], i[0]))),
            "   process boundaries typed: not measured here (read protocol.py)"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.walk", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the walks to this file as JSON")
    args = parser.parse_args(argv)
    measured = measure()
    for request, found in measured.items():
        print("\n".join(report(request, found)))
    if args.json:
        args.json.write_text(json.dumps({r: [asdict(w) for w in found] for r, found in measured.items()}, indent=1))


if __name__ == "__main__":
    main()
