"""kill -9 of the worker and of the daemon, during streams and just after replies (while the kept reply is prefilled
and the cache written). Figures: what every client got, damaged cache files, registry state, orphan workers, and
whether greedy replies after each kill equal those of a cold run."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import httpx

from tests.api.stress.common import PROMPT, Report, daemon, damaged_cache_files, greedy, worker_pids
from tests.conftest import Daemon
from tests.observe import poll

LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


class Stream(threading.Thread):
    """A streamed request in the background: ``outcome`` is answer, error (a clear error event, or the connection
    dropped by a killed daemon) or, if it never ends, the caller counts a hang."""

    def __init__(self, base_url: str, dialect: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.dialect = base_url, dialect
        self.first = threading.Event()
        self.outcome = ""
        self.detail = ""

    def run(self) -> None:
        if self.dialect == "ollama":
            path, body = "/api/chat", {"model": "smollm2", "messages": LONG, "options": {"num_predict": 400}}
        else:
            path, body = "/v1/chat/completions", {"model": "smollm2", "messages": LONG, "max_tokens": 400,
                                                  "stream": True}
        try:
            with httpx.stream("POST", self.base_url + path, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    self.first.set()
                    text = line.removeprefix("data: ").strip()
                    if not text or text == "[DONE]" or text.startswith(":"):
                        continue
                    event = json.loads(text)
                    if "error" in event:
                        self.outcome, self.detail = "error", str(event["error"])[:120]
                        return
                    if event.get("done") or (event.get("choices") and event["choices"][0].get("finish_reason")):
                        self.outcome = "answer"
                self.outcome = self.outcome or "cut"  # the stream ended with neither an answer nor an error
        except httpx.TransportError as exc:
            self.outcome, self.detail = "dropped", type(exc).__name__
        finally:
            self.first.set()


def run(report: Report, workdir: Path, kills: int) -> None:
    with daemon(workdir / "cold") as cold, cold.http() as http:
        reference = greedy(http, "ref")  # no cache anywhere yet: the cold reply every later one must equal
    report.figure(f"cold greedy reply: {reference[:60]!r}")
    _worker_kills(report, workdir / "home", kills, reference)
    _daemon_kills(report, workdir / "home", kills, reference)


def _model_pid(http: httpx.Client) -> int | None:
    return next((m["pid"] for m in http.get("/api/ps").json()["models"] if m["name"].startswith("smollm2")), None)


def _worker_kills(report: Report, home: Path, kills: int, reference: str) -> None:
    outcomes: Counter[str] = Counter()
    mismatched = 0
    with daemon(home) as instance, instance.http() as http:
        for trial in range(kills):
            greedy(http, "warm", tokens=1)  # a loaded worker
            pid = _model_pid(http)
            assert pid is not None
            if trial % 2 == 0:
                stream = Stream(instance.base_url, "ollama" if trial % 4 == 0 else "openai")
                stream.start()
                stream.first.wait(60)
                os.kill(pid, signal.SIGKILL)
                stream.join(60)
                outcomes["hang" if stream.is_alive() else stream.outcome] += 1
                if stream.outcome not in ("error", "answer"):
                    report.finding(f"worker kill {trial} during a stream: the client got {stream.outcome or 'nothing'}")
            else:  # just after a reply: the kept reply is being prefilled and the cache written
                messages = [{"role": "user", "content": f"{PROMPT} (take {trial})"}]
                greedy(http, f"s{trial}", messages, tokens=8)
                os.kill(pid, signal.SIGKILL)
                outcomes["answer"] += 1
            again = greedy(http, "ref")
            mismatched += again != reference
            if again != reference:
                report.finding(f"worker kill {trial}: greedy reply after the kill differs from the cold run: {again!r}")
        damaged = damaged_cache_files(home)
        served = _corrupt_count(http)
    report.figure(f"worker kill -9 x{kills}: clients {dict(outcomes)}; greedy replies after a kill equal to the cold "
                  f"run {kills - mismatched}/{kills}; cache files checked {damaged[0]}, damaged {damaged[1]}; "
                  f"damaged blocks met by the daemon {served}")
    if damaged[1]:
        report.finding(f"{damaged[1]} damaged cache files after worker kills")


def _corrupt_count(http: httpx.Client) -> int:
    metrics = http.get("/metrics").text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
               if line.startswith("localai_prompt_cache_corrupt_total"))


def _daemon_kills(report: Report, home: Path, kills: int, reference: str) -> None:
    outcomes: Counter[str] = Counter()
    mismatched = orphans = registry_broken = damaged_total = 0
    instance: Daemon = daemon(home)
    try:
        for trial in range(kills):
            with instance.http() as http:
                greedy(http, "warm", tokens=1)
                if trial % 2 == 0:
                    stream = Stream(instance.base_url, "openai" if trial % 4 == 0 else "ollama")
                    stream.start()
                    stream.first.wait(60)
                    instance.process.send_signal(signal.SIGKILL)
                    stream.join(60)
                    outcomes["hang" if stream.is_alive() else stream.outcome] += 1
                    if stream.outcome not in ("dropped", "error", "answer"):
                        report.finding(f"daemon kill {trial}: the client got {stream.outcome or 'nothing'}")
                else:
                    messages = [{"role": "user", "content": f"{PROMPT} (daemon take {trial})"}]
                    greedy(http, f"d{trial}", messages, tokens=8)
                    instance.process.send_signal(signal.SIGKILL)
                    outcomes["answer"] += 1
            instance.process.wait()
            if not poll(lambda: not worker_pids(), 15):
                orphans += len(worker_pids())
                report.finding(f"daemon kill {trial}: workers left running: {worker_pids()}")
            _, damaged = damaged_cache_files(home)
            damaged_total += damaged
            instance = daemon(home)
            with instance.http() as http:
                names = [m["name"] for m in http.get("/api/tags").json()["models"]]
                if "smollm2:135m" not in names:
                    registry_broken += 1
                    report.finding(f"daemon kill {trial}: the registry lost the model: {names}")
                again = greedy(http, "ref")
                if again != reference:
                    mismatched += 1
                    report.finding(f"daemon kill {trial}: greedy reply after restart differs: {again!r}")
        with instance.http() as http:
            served = _corrupt_count(http)
    finally:
        instance.stop()
    report.figure(f"daemon kill -9 x{kills}: clients {dict(outcomes)}; restarts healthy {kills}/{kills}; registry "
                  f"intact {kills - registry_broken}/{kills}; greedy replies after restart equal to the cold run "
                  f"{kills - mismatched}/{kills}; orphan workers {orphans}; damaged cache files {damaged_total}; "
                  f"damaged blocks met by the restarted daemon {served}")
    if damaged_total:
        report.finding(f"{damaged_total} damaged cache files after daemon kills")
