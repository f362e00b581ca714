"""Oversized requests (issue 38): a 200,000-item conversation on every dialect and a 16 MB tool schema, each sent
three times, must get their 4xx in under a second while /health's p99 stays under 100 ms and a running stream
on the model does not pause; the daemon's memory after them is compared with before."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from tests.api.stress.common import HealthProbe, Report, daemon, rss_and_fds

ITEMS = 200_000
TARGET_SECONDS = 1.0
TARGET_P99_MS = 100.0


def bodies() -> dict[str, tuple[str, bytes]]:
    items = [{"type": "message", "role": "user", "content": "x"}] * ITEMS
    messages = [{"role": "user", "content": "x"}] * ITEMS
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                               for i in range(130_000)}}  # ~16 MB
    cases = {
        "Responses 200k input items": ("/v1/responses", {"model": "smollm2", "input": items}),
        "chat 200k messages": ("/v1/chat/completions", {"model": "smollm2", "messages": messages}),
        "Messages 200k messages": ("/v1/messages", {"model": "smollm2", "max_tokens": 4, "messages": messages}),
        "Ollama 200k messages": ("/api/chat", {"model": "smollm2", "stream": False, "messages": messages}),
        "chat 16 MB tool schema": ("/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "big", "parameters": schema}}]}),
    }
    return {name: (path, json.dumps(body).encode()) for name, (path, body) in cases.items()}


class Stream:
    """A slow stream on the model (the scripted engine's ``[[slow]]``: 20 tokens a second); its longest gap."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": "smollm2", "stream": True, "max_tokens": 100_000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "count [[slow]]"}]}
        with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=600) as response:
            last = time.perf_counter()
            for _ in response.iter_raw():
                now = time.perf_counter()
                self.gaps.append(now - last)
                last = now
                if self._stop.is_set():
                    return

    def __enter__(self) -> Stream:
        self._thread.start()
        time.sleep(1.0)
        self.gaps.clear()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def worst(self) -> float:
        return 1000 * max(self.gaps, default=0.0)


def run(report: Report, workdir: Path) -> None:
    cases = bodies()
    with daemon(workdir / "home", engine="scripted") as instance:
        base = instance.base_url
        httpx.post(f"{base}/api/chat", timeout=60, json={"model": "smollm2", "stream": False,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        with HealthProbe(base, workdir) as quiet, Stream(base) as calm:
            time.sleep(2.0)
        report.figure(f"quiet: {quiet}; a slow stream's longest gap {calm.worst:.0f} ms")
        rss_before, fds_before = rss_and_fds(instance.process.pid)
        for name, (path, body) in cases.items():
            times, statuses = [], set()
            with HealthProbe(base, workdir) as probe, Stream(base) as stream:
                for _ in range(3):
                    started = time.perf_counter()
                    response = httpx.post(base + path, content=body, timeout=600,
                                          headers={"content-type": "application/json"})
                    times.append(time.perf_counter() - started)
                    statuses.add(response.status_code)
            report.figure(f"{name} ({len(body) / 1e6:.1f} MB) x3: {sorted(statuses)} in {max(times):.2f} s at "
                          f"worst; {probe}; the stream's longest gap {stream.worst:.0f} ms")
            if not all(400 <= status < 500 for status in statuses):
                report.finding(f"{name}: statuses {sorted(statuses)}")
            if max(times) >= TARGET_SECONDS:
                report.finding(f"{name}: {max(times):.2f} s to its 4xx")
            if probe.p99 >= TARGET_P99_MS:
                report.finding(f"{name}: {probe}")
            if stream.worst > calm.worst + TARGET_P99_MS:
                report.finding(f"{name}: the running stream paused {stream.worst:.0f} ms ({calm.worst:.0f} ms quiet)")
        time.sleep(3.0)
        rss_after, fds_after = rss_and_fds(instance.process.pid)
        report.figure(f"daemon memory {rss_before >> 20} MB before the oversized requests, {rss_after >> 20} MB "
                      f"after; open files {fds_before} -> {fds_after}")
        if rss_after > rss_before + (100 << 20):
            report.finding(f"the daemon kept {(rss_after - rss_before) >> 20} MB after refusing the requests")
        with instance.http(timeout=60) as http:
            if http.post("/api/chat", json={"model": "smollm2", "stream": False,
                                            "messages": [{"role": "user", "content": "still there?"}]}
                         ).status_code != 200:
                report.finding("the model stopped answering after the oversized requests")
