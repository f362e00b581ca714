"""64 concurrent clients for a while, with a small LOCALAI_MAX_QUEUE and with the default. Every request must be
answered 200 or 503 with Retry-After, none reset or hung; the daemon's memory and open files are compared before
and after."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.api.stress.common import Report, daemon, rss_and_fds

CLIENTS = 64
HANG = 120.0


def _client(base_url: str, index: int, until: float, tally: Counter[str], problems: list[str],
            lock: threading.Lock) -> None:
    with httpx.Client(base_url=base_url, timeout=HANG) as http:
        turn = 0
        while time.monotonic() < until:
            turn += 1
            content = f"Client {index} turn {turn}: name a colour."
            kind = (index + turn) % 3
            try:
                if kind == 0:
                    response = http.post("/api/chat", json={"model": "smollm2", "stream": False, "messages": [
                        {"role": "user", "content": content}], "options": {"num_predict": 8}})
                    status, body = response.status_code, response.text
                    retry = response.headers.get("retry-after")
                elif kind == 1:
                    with http.stream("POST", "/v1/chat/completions", json={
                            "model": "smollm2", "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": content}]}) as response:
                        status, retry = response.status_code, response.headers.get("retry-after")
                        body = "".join(response.iter_text())
                        if status == 200 and "[DONE]" not in body:
                            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
                else:
                    response = http.post("/v1/messages", json={"model": "smollm2", "max_tokens": 8, "messages": [
                        {"role": "user", "content": content}]}, headers={"x-session-id": f"client-{index}"})
                    status, body = response.status_code, response.text
                    retry = response.headers.get("retry-after")
            except httpx.TimeoutException:
                outcome = "hang"
            except httpx.HTTPError as exc:
                outcome = f"reset ({type(exc).__name__})"
            else:
                if status == 200:
                    outcome = "200"
                elif status == 503 and retry and retry.isdigit():
                    outcome = "503+Retry-After"
                    time.sleep(min(int(retry), 2) * 0.5)
                else:
                    outcome = f"{status}{'' if status != 503 else ' without Retry-After'}"
                    with lock:
                        problems.append(f"{status}: {json.dumps(body[:160])}")
            with lock:
                tally[outcome] += 1


def run(report: Report, workdir: Path, seconds: float) -> None:
    for label, settings in (("LOCALAI_MAX_QUEUE=4", {"max_queue": "4"}), ("default queue", {})):
        with daemon(workdir / label.replace("=", "-").replace(" ", "-"), **settings) as instance:
            with instance.http() as http:  # load the model and let the pools fill before measuring
                for _ in range(3):
                    http.post("/api/chat", json={"model": "smollm2", "stream": False, "messages": [
                        {"role": "user", "content": "hi"}], "options": {"num_predict": 4}})
            before = rss_and_fds(instance.process.pid)
            tally: Counter[str] = Counter()
            problems: list[str] = []
            lock = threading.Lock()
            until = time.monotonic() + seconds
            threads = [threading.Thread(target=_client, args=(instance.base_url, i, until, tally, problems, lock),
                                        daemon=True) for i in range(CLIENTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(seconds + HANG + 30)
            alive = sum(thread.is_alive() for thread in threads)
            time.sleep(5)  # let finished requests' cache writes and keep-alive timers settle
            after = rss_and_fds(instance.process.pid)
            healthy = instance.process.poll() is None
        bad = {k: v for k, v in tally.items() if k not in ("200", "503+Retry-After")}
        report.figure(f"{label}: {CLIENTS} clients x {seconds:.0f} s: {sum(tally.values())} requests, "
                      f"{dict(sorted(tally.items()))}; clients stuck {alive}; daemon RSS {before[0] / 2**20:.0f} -> "
                      f"{after[0] / 2**20:.0f} MiB, open fds {before[1]} -> {after[1]}")
        if bad or alive or not healthy:
            report.finding(f"{label}: {bad}, stuck clients {alive}, daemon alive {healthy}; first problems "
                           f"{problems[:3]}")
        if after[1] > before[1] + 8:
            report.finding(f"{label}: open file descriptors grew {before[1]} -> {after[1]}")
        if after[0] > before[0] * 1.5 + (64 << 20):
            report.finding(f"{label}: daemon RSS grew {before[0] >> 20} -> {after[0] >> 20} MiB")
