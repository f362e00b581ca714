"""The smaller findings of issue 38: 40 concurrent /api/info requests (one device probe, /health unaffected), the
WebSocket's 5,000-deep nesting and lone surrogate (error events, no traceback), an unknown reasoning effort in each
dialect, 1,000 connections that never finish their headers (closed; open files back to where they were), and
/health without the key."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

from tests.api.stress.common import HealthProbe, Report, daemon, rss_and_fds

KEY = "stress-edges-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW_CLIENTS = 1000


def _info(report: Report, base: str, workdir: Path) -> None:
    with HealthProbe(base, workdir) as probe, concurrent.futures.ThreadPoolExecutor(40) as pool:
        started = time.perf_counter()
        answers = list(pool.map(lambda _: httpx.get(f"{base}/api/info", headers=AUTH, timeout=300).json(),
                                range(40)))
        took = time.perf_counter() - started
    probes = {answer["llama_cpp"].get("probed_at") for answer in answers}
    report.figure(f"40 concurrent /api/info: answered in {took:.1f} s from {len(probes)} device probe(s); {probe}")
    if len(probes) != 1 or probe.p99 >= 100:
        report.finding(f"/api/info: {len(probes)} probes, {probe}")


def _socket(report: Report, instance_port: int, home: Path) -> None:
    cases = {"5,000-deep nesting": '{"type": "response.create", "model": "smollm2", "input": '
                                   + "[" * 5000 + "]" * 5000 + "}",
             "a lone surrogate": '{"type": "response.create", "model": "smollm2", "input": "\\ud800"}'}
    before = (home / "daemon.log").read_text().count("Traceback")
    got = {}
    with connect(f"ws://127.0.0.1:{instance_port}/v1/responses", additional_headers=AUTH,
                 max_size=None) as ws:
        for name, message in cases.items():
            ws.send(message)
            event = json.loads(ws.recv(timeout=60))
            got[name] = event.get("status")
    tracebacks = (home / "daemon.log").read_text().count("Traceback") - before
    report.figure(f"WebSocket: {got} (error events; the connection stayed); tracebacks logged: {tracebacks}")
    if any(status != 400 for status in got.values()) or tracebacks:
        report.finding(f"WebSocket: {got}, {tracebacks} tracebacks")


def _efforts(report: Report, base: str) -> None:
    hi = [{"role": "user", "content": "hi"}]
    cases = {"chat reasoning_effort": ("/v1/chat/completions", {"messages": hi, "reasoning_effort": "ultra"}),
             "Responses reasoning.effort": ("/v1/responses", {"input": "hi", "reasoning": {"effort": "ultra"}}),
             "Messages thinking.type": ("/v1/messages", {"max_tokens": 4, "messages": hi,
                                                         "thinking": {"type": "ultra"}}),
             "Ollama think": ("/api/chat", {"stream": False, "messages": hi, "think": "ultra"})}
    got = {name: httpx.post(base + path, json={"model": "smollm2", **body}, headers=AUTH, timeout=60).status_code
           for name, (path, body) in cases.items()}
    report.figure(f"reasoning effort 'ultra': {got}")
    if any(status != 400 for status in got.values()):
        report.finding(f"an unknown reasoning effort was taken: {got}")


def _slow_headers(report: Report, base: str, port: int, pid: int) -> None:
    _, fds_before = rss_and_fds(pid)
    clients = []
    for _ in range(SLOW_CLIENTS):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        clients.append(sock)
    time.sleep(1.0)
    _, fds_held = rss_and_fds(pid)
    answered = httpx.get(f"{base}/health", timeout=30).status_code
    time.sleep(11.0)  # past the 10 s deadline
    _, fds_after = rss_and_fds(pid)
    open_ = 0
    for sock in clients:
        sock.setblocking(False)
        try:
            open_ += sock.recv(1) != b""
        except BlockingIOError:
            open_ += 1
        except OSError:
            pass
        sock.close()
    report.figure(f"{SLOW_CLIENTS} connections sending half their headers: daemon fds {fds_before} -> {fds_held} "
                  f"(1 s in) -> {fds_after} (11 s later); still open after the deadline: {open_}; a normal "
                  f"request meanwhile: {answered}")
    if open_ or fds_held - fds_before > 300 or answered != 200:
        report.finding(f"slow headers: {open_} still open, fds {fds_before} -> {fds_held}, /health {answered}")


def run(report: Report, workdir: Path) -> None:
    home = workdir / "home"
    with daemon(home, engine="scripted", api_key=KEY) as instance:
        base = instance.base_url
        bare = httpx.get(f"{base}/health", timeout=30).json()
        keyed = httpx.get(f"{base}/health", headers=AUTH, timeout=30).json()
        report.figure(f"/health without the key: {bare}; with it: {sorted(keyed)}")
        if bare != {"status": "ok"}:
            report.finding(f"/health without the key says {bare}")
        _info(report, base, workdir)
        _socket(report, instance.port, home)
        _efforts(report, base)
        _slow_headers(report, base, instance.port, instance.process.pid)
