"""What the stress checks share: a report of figures and findings, daemons, greedy replies, process facts."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from localai.promptcache.blocks import TEMP_PREFIX, CorruptEntry, read_block, read_snapshot
from tests.conftest import Daemon, start_daemon

PROMPT = "List three prime numbers and say why each is prime."
# a system prompt of ~700 tokens: every conversation is long enough to be saved to the cache and restored from it
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: check step {i} of the build before you answer, and say which file it touched." for i in range(40))


@dataclass
class Report:
    name: str
    figures: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    def figure(self, text: str) -> None:
        print(f"  {text}", flush=True)
        self.figures.append(text)

    def finding(self, text: str) -> None:
        print(f"  FINDING: {text}", flush=True)
        self.findings.append(text)


def daemon(home: Path, **settings: str) -> Daemon:
    settings.setdefault("keep_alive", "-1")
    return start_daemon(home, **settings)


def healthy(base_url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def greedy(http: httpx.Client, session: str, messages: list[dict[str, Any]] | None = None, tokens: int = 24) -> str:
    """A deterministic reply (temperature 0) in a session, so the prompt cache is used and written."""
    body = {"model": "smollm2", "temperature": 0, "seed": 7, "max_tokens": tokens,
            "messages": [{"role": "system", "content": SYSTEM}, *(messages or [{"role": "user", "content": PROMPT}])]}
    response = http.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def worker_pids() -> list[int]:
    """Every model worker process on this machine (``python -m localai.workers.worker``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"localai.workers.worker" in command:
                found.append(int(entry.name))
    return found


def rss_and_fds(pid: int) -> tuple[int, int]:
    """Resident memory (bytes) and open file descriptors of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def half_written(home: Path) -> list[Path]:
    """Temp files left under ``home``: the cache's (``write_atomic``: ``.tmp-<pid>-<hex>-<name>``) and the other
    atomic writers' (``.<name>.tmp``: conversations, agents' configs). None may stay once their writers are done."""
    return sorted({*home.rglob(TEMP_PREFIX + "*"), *home.rglob("*.tmp")})


def damaged_cache_files(home: Path) -> tuple[int, int]:
    """(files checked, files whose checksum or framing is wrong) among the cache's blocks and snapshots."""
    checked = damaged = 0
    for path in (home / "cache").rglob("*"):
        if path.suffix not in (".blk", ".snp"):
            continue
        checked += 1
        try:
            if path.suffix == ".blk":
                read_block(path, with_payload=True)
            else:
                read_snapshot(path)
        except FileNotFoundError:
            checked -= 1  # evicted while we looked
        except (OSError, CorruptEntry):
            damaged += 1
    return checked, damaged


PROBE_SCRIPT = """
import json, sys, time, httpx
url, stop, out = sys.argv[1], sys.argv[2], sys.argv[3]
from pathlib import Path
latencies = []
with httpx.Client(timeout=60) as http:
    while not Path(stop).exists():
        started = time.perf_counter()
        try:
            http.get(url)
        except httpx.HTTPError:
            pass
        latencies.append(time.perf_counter() - started)
        time.sleep(0.01)
Path(out).write_text(json.dumps(latencies))
"""


class HealthProbe:
    """``/health`` asked every 10 ms from a process of its own (so the check's own work never delays it), for as
    long as the ``with`` block runs; then ``p99`` and ``worst`` in milliseconds."""

    def __init__(self, base_url: str, workdir: Path) -> None:
        import subprocess
        import sys
        import uuid

        self.stop = workdir / f"probe-{uuid.uuid4().hex}.stop"
        self.out = self.stop.with_suffix(".json")
        workdir.mkdir(parents=True, exist_ok=True)
        self._command = [sys.executable, "-c", PROBE_SCRIPT, f"{base_url}/health", str(self.stop), str(self.out)]
        self._process: Any = None
        self._subprocess = subprocess
        self.latencies: list[float] = []

    def __enter__(self) -> HealthProbe:
        self._process = self._subprocess.Popen(self._command)
        time.sleep(0.5)  # it is asking before the check starts
        return self

    def __exit__(self, *_: object) -> None:
        import json

        self.stop.touch()
        self._process.wait(timeout=120)
        self.latencies = sorted(json.loads(self.out.read_text()))

    @property
    def p99(self) -> float:
        return 1000 * self.latencies[max(0, int(len(self.latencies) * 0.99) - 1)] if self.latencies else 0.0

    @property
    def worst(self) -> float:
        return 1000 * self.latencies[-1] if self.latencies else 0.0

    def __str__(self) -> str:
        return f"/health p99 {self.p99:.0f} ms, worst {self.worst:.0f} ms ({len(self.latencies)} asked)"
