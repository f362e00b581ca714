"""Watching a daemon or an in-process app from outside: waiting for something it does, the pid of a model's worker,
a /metrics counter, the CPU time a process has used (the sign that it is working on what it was sent), the
divergences it reported. The clients are ``httpx.Client``s (a Starlette ``TestClient`` is one)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def poll(condition: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    """``condition()``'s first truthy value, asked every ``step`` seconds; None if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(step)


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    """Poll until ``condition()`` is truthy and return its value (a deadline against hanging, not a timing
    assertion: what is waited for is something the system must do, however long it takes)."""
    value = poll(condition, timeout)
    if value is None:
        raise AssertionError(f"gave up waiting for {what} ({timeout} s)")
    return value


def worker_pid(http: httpx.Client, model: str = "smollm2:135m") -> int | None:
    """The pid of the worker ``/api/ps`` lists for ``model`` (a name, or a name's start such as ``smollm2``)."""
    return next((int(m["pid"]) for m in http.get("/api/ps").json()["models"] if m["name"].startswith(model)), None)


def counted(http: httpx.Client, name: str, model: str, outcome: str | None = None) -> float:
    """The sum of a /metrics counter over the labels of ``model`` (and ``outcome``, when given)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in http.get("/metrics").text.splitlines()
               if line.startswith(name + "{") and f'model="{model}' in line
               and (outcome is None or f'outcome="{outcome}"' in line))


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used (user and system): work it did, whatever the machine's speed. /proc
    where there is one (ticks), else ``ps`` (whole seconds)."""
    if Path("/proc/self/stat").exists():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # it has ended
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    text = subprocess.run(["ps", "-o", "time=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    seconds = 0.0
    for part in text.replace("-", ":").split(":"):
        seconds = seconds * 60 + float(part or 0)
    return seconds


def helper_processes(parent: int, module: str) -> list[int]:
    """The pids of ``python -m MODULE`` processes started by ``parent`` (a daemon's render processes)."""
    listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,command="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in listing.splitlines()]
    return [int(row[0]) for row in rows if len(row) == 3 and int(row[1]) == parent and f"-m {module}" in row[2]]


def reported_divergences(http: httpx.Client, prefix: str, model: str = "smollm2") -> list[dict[str, Any]]:
    """The early divergences of sessions starting with ``prefix``, once every report sent before is written: a
    control session that does diverge is sent last (to ``model``), and its record awaited (reports are written in
    the background)."""
    control = f"control-{time.monotonic_ns()}"
    for text in ("first [[say:one]]", "something else entirely [[say:two]]"):
        assert http.post("/v1/chat/completions", headers={"x-session-id": control}, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "system", "content": text * 20},
                                                         {"role": "user", "content": text}]}).status_code == 200

    def found() -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = http.get("/api/cache").json()["divergences"]
        return listed
    wait_for(lambda: any(d["session"] == control for d in found()), "the control session's divergence", timeout=30)
    return [d for d in found() if d["session"].startswith(prefix) and d["early"]]
