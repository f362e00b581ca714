"""Remote models against NVIDIA Dynamo itself: ai-dynamo 1.6.1's own frontend (``python -m dynamo.frontend``: its
OpenAI, Responses and Anthropic endpoints, its KV-aware router, file-based discovery) with its CPU mocker engine
(``python -m dynamo.mocker``, which schedules and caches like a real engine and answers random tokens of the real
tokenizer), installed into .dynamo/ by ``make install-dynamo``.

Two deployments: A, a frontend with two mockers and session affinity; B, a frontend with one. Every dialect
through A; the session header and ``nvext.agent_hints`` as Dynamo reads them; Dynamo's errors in each dialect's
shape; failover from B's frontend to A's."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.api.daemon.streams import check_anthropic_stream, check_chat_stream, check_responses_stream, named_events
from tests.conftest import Daemon, free_port, start_daemon
from tests.upstreams.test_remote import post

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = ROOT / ".dynamo" / "bin" / "python"
SUPPORTED = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
MODEL = "smollm2"  # the name the mockers register
HI = [{"role": "user", "content": "Say hi."}]

pytestmark = pytest.mark.skipif(not SUPPORTED, reason=(
    f"the Dynamo tier needs ai-dynamo 1.6.1, whose runtime has wheels for Linux x86-64 and arm64 only, not "
    f"{sys.platform} {platform.machine()}: skipped"))


@dataclass
class Deployment:
    """A Dynamo frontend and its mockers on loopback, discovering each other through a folder of their own."""

    root: Path
    mockers: int
    model_path: Path
    frontend_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    frontend: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALAI_", "DYN_"))}
        env.update({"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.root / "kv"),
                    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1",
                    "DYN_LOG": "warn", "XDG_CACHE_HOME": str(self.root / "cache")})
        return env

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.log", "ab") as log:
            return subprocess.Popen([str(DYNAMO_PYTHON), "-m", *args], env=self.env(), stdout=log, stderr=log)

    def start(self) -> Deployment:
        (self.root / "kv").mkdir(parents=True, exist_ok=True)
        self.frontend = self._spawn("frontend", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                                    str(self.port), "--discovery-backend", "file", "--router-mode", "kv",
                                    "--enable-anthropic-api", *self.frontend_args)
        for index in range(self.mockers):
            self.workers.append(self._spawn(f"mocker-{index}", "dynamo.mocker", "--model-path", str(self.model_path),
                                            "--model-name", MODEL, "--discovery-backend", "file",
                                            "--speedup-ratio", "0"))
        self.wait_for_workers(self.mockers)
        return self

    def wait_for_workers(self, count: int, timeout: float = 90) -> None:
        """Until the frontend lists the model and its router knows ``count`` workers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in [self.frontend, *self.workers]:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"a Dynamo process exited with {process.returncode}: {self.logs()}")
            try:
                listed = httpx.get(f"{self.url}/models", timeout=2).json().get("data", [])
                if any(entry.get("id") == MODEL for entry in listed):
                    # the router lists its workers in its metrics once it has routed a request
                    httpx.post(f"{self.url}/chat/completions", timeout=10, json={
                        "model": MODEL, "messages": HI, "max_tokens": 1})
                    if len(self.workers_seen()) >= count:
                        return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"Dynamo did not come up with {count} workers: {self.logs()}")

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text

    def workers_seen(self) -> set[str]:
        return set(re.findall(r'dynamo_frontend_worker_active_decode_blocks\{[^}]*worker_id="(\d+)"', self.metrics()))

    def last_input_tokens(self) -> dict[str, int]:
        """Each worker's last request's input length, as the frontend's router recorded it."""
        found = re.findall(r'dynamo_frontend_worker_last_input_sequence_tokens\{[^}]*worker_id="(\d+)"[^}]*\} (\d+)',
                           self.metrics())
        return {worker: int(tokens) for worker, tokens in found}

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
                         for path in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for process in [*self.workers, self.frontend]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*self.workers, self.frontend]:
            if process is not None:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@dataclass
class Setup:
    a: Deployment
    b: Deployment
    daemon: Daemon


@pytest.fixture(scope="module")
def dynamo(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Setup]:
    if not DYNAMO_PYTHON.exists():  # a failure, not a skip: make test installs it on every platform it runs on
        pytest.fail(f"the Dynamo tier needs ai-dynamo in {DYNAMO_PYTHON.parent.parent}: run `make install-dynamo` "
                    "(make test does)")
    from tests.mlxmodel import convert

    root = tmp_path_factory.mktemp("dynamo")
    folder = convert(smollm2_path, root / "smollm2", weights_too=False)  # the mocker reads config and tokenizer
    a = Deployment(root / "a", 2, folder, ("--router-session-affinity-ttl-secs", "300"))
    b = Deployment(root / "b", 1, folder)
    deployments: list[Deployment] = []
    daemon = None
    try:
        for deployment in (a, b):
            deployments.append(deployment)
            deployment.start()
        daemon = start_daemon(root / "home", remote_health_interval="1")
        modelfiles = {
            "dyn": f"FROM {a.url}\nPARAMETER num_ctx 2048\nPARAMETER priority 5\n",
            "dyn-pair": f"FROM {b.url}\nPARAMETER replica {a.url}\nPARAMETER num_ctx 2048\n",
            "dyn-b": f"FROM {b.url}\nPARAMETER num_ctx 2048\n",
            "dyn-unknown": f"FROM {a.url}\nPARAMETER upstream_model no-such-model\nPARAMETER num_ctx 2048\n",
        }
        with daemon.http() as http:
            for name, text in modelfiles.items():
                created = http.post("/api/create", json={"model": name, "modelfile": text})
                assert created.status_code == 200, created.text
        yield Setup(a, b, daemon)
    finally:
        if daemon is not None:
            daemon.stop()
        for deployment in deployments:
            deployment.stop()


def test_dynamo_is_detected_and_listed(dynamo: Setup) -> None:
    shown = post(dynamo.daemon, "/api/show", {"model": "dyn"}).json()["remote"]
    assert shown["kind"] == "dynamo" and shown["upstream_model"] == MODEL  # its owned_by is "nvidia"
    assert shown["context_length"] == 2048  # Dynamo reports context_window 0: the Modelfile's num_ctx


def test_every_dialect_through_dynamo(dynamo: Setup) -> None:
    daemon = dynamo.daemon
    chat = post(daemon, "/v1/chat/completions", {"model": "dyn", "messages": HI, "max_tokens": 6})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["finish_reason"] == "length"  # the mocker always fills max_tokens
    with daemon.http(timeout=120) as http:
        streamed = check_chat_stream(named_events(http, "/v1/chat/completions", {
            "model": "dyn", "messages": HI, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}), usage=True)
        assert streamed["text"]
        message = check_anthropic_stream(named_events(http, "/v1/messages", {
            "model": "dyn", "max_tokens": 6, "stream": True, "messages": HI}))
        assert message["blocks"][0]["text"] and message["usage"]["output_tokens"] == 6
        final = check_responses_stream(named_events(http, "/v1/responses", {
            "model": "dyn", "input": "Say hi.", "max_output_tokens": 6, "stream": True}))
        assert final["output"][0]["content"][0]["text"]
        with http.stream("POST", "/api/chat", json={"model": "dyn", "messages": HI,
                                                    "options": {"num_predict": 6}}) as response:
            lines = [json.loads(line) for line in response.iter_lines() if line]
        assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 6
    anthropic = post(daemon, "/v1/messages", {"model": "dyn", "max_tokens": 6, "messages": HI})
    assert anthropic.status_code == 200 and anthropic.json()["content"][0]["text"]
    assert anthropic.json()["stop_reason"] == "max_tokens"
    responses = post(daemon, "/v1/responses", {"model": "dyn", "input": "Say hi.", "max_output_tokens": 6})
    assert responses.status_code == 200 and responses.json()["output"][0]["content"][0]["text"]
    generate = post(daemon, "/api/generate", {"model": "dyn", "prompt": "The sky is", "raw": True, "stream": False,
                                              "options": {"num_predict": 4}})
    assert generate.status_code == 200 and generate.json()["response"]  # raw: Dynamo's /v1/completions
    # tools: the mocker never calls one, but the request with them is served as any other
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with_tools = post(daemon, "/v1/chat/completions", {"model": "dyn", "messages": HI, "max_tokens": 6,
                                                       "tools": tools})
    assert with_tools.status_code == 200 and with_tools.json()["choices"][0]["finish_reason"] == "length"


def test_a_sessions_requests_stay_on_one_dynamo_worker(dynamo: Setup) -> None:
    """localai sends the session as x-dynamo-session-id and X-Session-Id (Dynamo reads either; without both the
    sessions here land on both workers); Dynamo's router, with session affinity on, keeps each session's requests
    on one of its two workers: which one is read from the router's per-worker record of the last request's length
    (each request here a length of its own)."""
    workers: dict[str, set[str]] = {}
    for turn in range(3):
        for session in ("alpha", "beta", "gamma", "delta"):
            words = " ".join(["more"] * (turn * 7 + len(workers.get(session, ())) + 1))
            content = f"Session {session}, turn {turn}: {words}"
            response = post(dynamo.daemon, "/v1/chat/completions",
                            {"model": "dyn", "messages": [{"role": "user", "content": content}], "max_tokens": 2},
                            **{"X-Session-Id": session})
            assert response.status_code == 200, response.text
            tokens = response.json()["usage"]["prompt_tokens"]
            served = [worker for worker, last in dynamo.a.last_input_tokens().items() if last == tokens]
            assert served, (tokens, dynamo.a.last_input_tokens())
            if len(served) == 1:
                workers.setdefault(session, set()).add(served[0])
    assert all(len(seen) == 1 for seen in workers.values()), workers
    assert len(workers) >= 3  # the lengths told most requests apart


def test_agent_hints_are_what_dynamo_parses(dynamo: Setup) -> None:
    """Dynamo's frontend refuses an nvext.agent_hints field it does not know or of the wrong type (its parser is
    strict), so localai's hints (priority from PARAMETER priority, osl from max_tokens) being served shows they
    are read, not ignored."""
    direct = httpx.post(f"{dynamo.a.url}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": HI, "max_tokens": 2, "nvext": {"agent_hints": {"priority": "high"}}})
    assert direct.status_code == 400 and "expected i32" in direct.text
    mistaken = httpx.post(f"{dynamo.a.url}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": HI, "max_tokens": 2, "nvext": {"agent_hints": {"prio": 5}}})
    assert mistaken.status_code == 400 and "unknown field" in mistaken.text
    through = post(dynamo.daemon, "/v1/chat/completions", {"model": "dyn", "messages": HI, "max_tokens": 3})
    assert through.status_code == 200, through.text


def test_dynamos_errors_come_back_in_each_dialects_shape(dynamo: Setup) -> None:
    # the mocker requires max_tokens (a real engine defaults it): Dynamo's 400, sent as the stream's first event
    no_limit = post(dynamo.daemon, "/v1/chat/completions", {"model": "dyn", "messages": HI})
    assert no_limit.status_code == 400, no_limit.text
    assert no_limit.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in no_limit.json()["error"]["message"] and dynamo.a.url in no_limit.json()["error"]["message"]
    anthropic = post(dynamo.daemon, "/v1/messages", {"model": "dyn", "messages": HI, "max_tokens": 0})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    ollama = post(dynamo.daemon, "/api/chat", {"model": "dyn", "messages": HI, "stream": False})
    assert ollama.status_code == 400 and "max_tokens" in ollama.json()["error"]
    responses = post(dynamo.daemon, "/v1/responses", {"model": "dyn", "input": "hi"})
    assert responses.status_code == 400 and "max_tokens" in responses.json()["error"]["message"]
    # a model Dynamo does not serve: its 404 says which
    unknown = post(dynamo.daemon, "/v1/chat/completions", {"model": "dyn-unknown", "messages": HI, "max_tokens": 2})
    assert unknown.status_code == 502 and "upstream_model" in unknown.json()["error"]["message"]
    assert "Model not found" in unknown.json()["error"]["message"]
    assert dynamo.daemon.get("/health").status_code == 200


def test_failover_between_two_dynamo_frontends_and_a_dead_worker(dynamo: Setup) -> None:
    """B's mocker dies (Dynamo answers 503: no worker), then B's frontend: the sessions whose replica was B move to
    A without an error; a model on B alone says what Dynamo said."""
    sessions = [f"s{index}" for index in range(6)]

    def replicas() -> dict[str, str]:
        found = {}
        for session in sessions:
            response = post(dynamo.daemon, "/v1/chat/completions", {"model": "dyn-pair", "messages": HI,
                                                                   "max_tokens": 2}, **{"X-Session-Id": session})
            assert response.status_code == 200, response.text
            found[session] = response.headers["x-localai-replica"]
        return found

    before = replicas()
    assert set(before.values()) == {dynamo.a.url, dynamo.b.url}  # six sessions spread over the two frontends
    for worker in dynamo.b.workers:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    gone = post(dynamo.daemon, "/v1/chat/completions", {"model": "dyn-b", "messages": HI, "max_tokens": 2})
    assert gone.status_code in (502, 503), gone.text
    assert dynamo.b.url in gone.json()["error"]["message"]
    assert set(replicas().values()) == {dynamo.a.url}  # no worker behind B: every session served by A
    assert dynamo.b.frontend is not None
    dynamo.b.frontend.send_signal(signal.SIGKILL)
    dynamo.b.frontend.wait()
    assert set(replicas().values()) == {dynamo.a.url}
    down = post(dynamo.daemon, "/v1/messages", {"model": "dyn-b", "messages": HI, "max_tokens": 2})
    assert down.status_code == 503 and down.json()["error"]["type"] == "overloaded_error"
    assert dynamo.daemon.get("/health").status_code == 200
