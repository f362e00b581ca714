"""Watching a daemon or an in-process app from outside: waiting for something it does, the pid of a model's worker,
a /metrics counter. The clients are ``httpx.Client``s (a Starlette ``TestClient`` is one)."""

from __future__ import annotations

import time
from collections.abc import Callable
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
