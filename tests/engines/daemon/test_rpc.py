"""A model spread over machines with llama.cpp's RPC backend, through a real daemon: two ``localai rpc-server``
processes on 127.0.0.1 (each serving its CPU) stand for the other machines. Greedy replies equal a local load's,
with every layer remote and with a split; the prompt cache works over them (a turn, a fork, a daemon restart);
a server down at load, one of another protocol version and one killed mid-stream are errors naming it, and the
daemon lives on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from localai.engines import llama_rpc
from tests.conftest import Daemon, free_port, start_daemon
from tests.engines.test_llama_rpc import fake_server, hello_answer

pytestmark = pytest.mark.skipif(not llama_rpc.supported(), reason="llama-cpp-python was built without RPC "
                                "(make install builds it with -DGGML_RPC=ON)")

MESSAGES = [{"role": "user", "content": "Name three colours, one per line."}]


@dataclass
class RpcServer:
    """``python -m localai.engines.llama_rpc`` (what ``localai rpc-server`` runs) on a port of its own."""

    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RpcServer:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "localai.engines.llama_rpc", "--port", str(self.port), "--threads", "1"],
                stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            try:
                llama_rpc.probe(self.endpoint, timeout=2)
                return self
            except llama_rpc.RpcServerError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"rpc server did not start:\n{self.log.read_text()}") from None
                time.sleep(0.2)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@dataclass
class Setup:
    home: Path
    servers: list[RpcServer]
    daemon: Daemon

    def restart(self) -> None:
        self.daemon.stop()
        self.daemon = start_daemon(self.home, keep_alive="-1", max_loaded_models="1")


@pytest.fixture(scope="module")
def rpc(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path,
        arch_fixtures: Path) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("rpc")
    servers = [RpcServer(free_port(), root / f"rpc-{index}.log").start() for index in range(2)]
    # one model loaded at a time: an rpc-server serves one client at a time, so the next load waits for the last
    # worker to be gone
    daemon = start_daemon(root / "home", keep_alive="-1", max_loaded_models="1")
    remote = "".join(f"PARAMETER rpc {server.endpoint}\n" for server in servers)
    models = {"smol-local": (smollm2_path, ""), "smol-rpc": (smollm2_path, remote),
              "smol-split": (smollm2_path, remote + "PARAMETER num_gpu 14\n"),
              "gemma-local": (gemma3_path, ""), "gemma-rpc": (gemma3_path, remote),
              "hybrid-local": (arch_fixtures / "qwen35.gguf", ""),
              "hybrid-rpc": (arch_fixtures / "qwen35.gguf", remote)}
    with daemon.http() as http:
        for name, (path, extra) in models.items():
            created = http.post("/api/create", json={"model": name, "modelfile": f"FROM {path}\n{extra}"})
            assert created.status_code == 200, created.text
    setup = Setup(root / "home", servers, daemon)
    yield setup
    setup.daemon.stop()
    for server in servers:
        server.kill()


def ask(daemon: Daemon, model: str, messages: list[dict[str, str]] = MESSAGES, session: str | None = None,
        max_tokens: int = 16) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if session:
        body["prompt_cache_key"] = session
    with daemon.http(timeout=300) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def text(result: dict[str, Any]) -> str:
    return str(result["choices"][0]["message"]["content"])


def placement(daemon: Daemon, model: str) -> dict[str, Any]:
    with daemon.http() as http:
        for entry in http.get("/api/ps").json()["models"]:
            if entry["name"] in (model, f"{model}:latest"):
                found: dict[str, Any] = entry["placement"]
                return found
        raise AssertionError(f"{model} is not loaded: {http.get('/api/ps').json()}")


def test_every_layer_remote_or_split_answers_as_a_local_load(rpc: Setup) -> None:
    local = text(ask(rpc.daemon, "smol-local"))
    remote = text(ask(rpc.daemon, "smol-rpc"))
    placed = placement(rpc.daemon, "smol-rpc")
    spans = placed["layer_devices"]
    assert placed["processor"] == "100% RPC"
    assert [device["description"] for device in placed["devices"]] == [server.endpoint for server in rpc.servers]
    split = text(ask(rpc.daemon, "smol-split"))
    split_spans = placement(rpc.daemon, "smol-split")["layer_devices"]
    assert local and remote == local and split == local
    # every repeating layer on the two servers (spread by their memory), none on this process's CPU
    assert {span["device"] for span in spans} == {"RPC0", "RPC1"}
    # num_gpu 14 of smollm2's 30 layers and its output layer: layers 17-29 and the output remote, the rest here
    devices = [span["device"] for span in split_spans]
    assert devices[0] == "CPU" and all(device.startswith("RPC") for device in devices[1:])
    assert split_spans[0]["layers"] == "0-16"  # llama.cpp: the output layer and the last 13 repeating ones


@pytest.mark.parametrize("family", ["gemma", "hybrid"])
def test_a_window_model_and_a_hybrid_answer_over_rpc_as_locally(rpc: Setup, family: str) -> None:
    local = text(ask(rpc.daemon, f"{family}-local"))
    remote = text(ask(rpc.daemon, f"{family}-rpc"))
    assert all(span["device"].startswith("RPC") for span in placement(rpc.daemon, f"{family}-rpc")["layer_devices"])
    assert remote == local


def opening(session: str) -> list[dict[str, str]]:
    rules = " ".join(f"Rule {index}: answer in few words." for index in range(24))  # a few 64-token blocks
    return [{"role": "system", "content": f"Conversation {session}. {rules}"}, *MESSAGES]


def session_turns(rpc: Setup, model: str, session: str) -> list[int]:
    """Three turns of one session, the daemon restarted before the third: the prompt tokens each one found
    cached."""
    messages = opening(session)
    cached = []
    for turn in range(3):
        if turn == 2:
            rpc.restart()
        result = ask(rpc.daemon, model, messages, session=session)
        cached.append(result["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [{"role": "assistant", "content": text(result)},
                     {"role": "user", "content": f"And {turn + 2} more, please."}]
    return cached


def test_the_prompt_cache_over_rpc_resumes_after_a_restart_as_locally(rpc: Setup) -> None:
    local = session_turns(rpc, "smol-local", "session-a")
    remote = session_turns(rpc, "smol-rpc", "session-b")
    print("cached tokens per turn, local and over RPC:", local, remote)
    assert local[0] == remote[0] == 0
    assert remote[1] > 0 and remote[1] == local[1]  # the live sequence's state, read back from the servers
    assert remote[2] >= 0.95 * local[2] > 0  # after a restart: from the disk, written from the servers' buffers
    # a fork (a sub-agent): another session sharing the first turn finds it
    forks = [ask(rpc.daemon, model, [*opening(session), {"role": "assistant", "content": "Red"},
                                     {"role": "user", "content": "Another?"}],
                 session=f"fork-{session}")["usage"]["prompt_tokens_details"]["cached_tokens"]
             for model, session in (("smol-local", "session-a"), ("smol-rpc", "session-b"))]
    print("forks", forks)
    assert forks[1] == forks[0] > 0


def dialect_errors(daemon: Daemon, model: str) -> list[str]:
    """The error text of one request in each dialect (the load fails)."""
    found = []
    with daemon.http(timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 4})
        assert chat.status_code == 500
        found.append(chat.json()["error"]["message"])
        anthropic = http.post("/v1/messages", json={"model": model, "messages": MESSAGES, "max_tokens": 4})
        assert anthropic.status_code == 500 and anthropic.json()["type"] == "error"
        found.append(anthropic.json()["error"]["message"])
        responses = http.post("/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4})
        assert responses.status_code == 500
        found.append(responses.json()["error"]["message"])
        ollama = http.post("/api/chat", json={"model": model, "messages": MESSAGES, "stream": False})
        assert ollama.status_code == 500
        found.append(ollama.json()["error"])
        assert http.get("/health").status_code == 200
    return found


def test_a_server_down_at_load_is_an_error_naming_it_in_every_dialect(rpc: Setup) -> None:
    down = f"127.0.0.1:{free_port()}"
    with rpc.daemon.http() as http:
        created = http.post("/api/create", json={"model": "smol-down", "modelfile":
                                                 f"FROM smol-local\nPARAMETER rpc {rpc.servers[0].endpoint}\n"
                                                 f"PARAMETER rpc {down}\n"})
        assert created.status_code == 200, created.text
    for message in dialect_errors(rpc.daemon, "smol-down"):
        assert f"rpc server {down} cannot be reached" in message, message
    assert text(ask(rpc.daemon, "smol-local"))  # the daemon serves on


def test_a_server_of_another_protocol_version_is_refused_naming_both(rpc: Setup) -> None:
    major, minor, patch = llama_rpc.PROTOCOL
    with fake_server(hello_answer(major + 1, 0, 0)) as endpoint, rpc.daemon.http() as http:
        created = http.post("/api/create", json={"model": "smol-foreign",
                                                 "modelfile": f"FROM smol-local\nPARAMETER rpc {endpoint}\n"})
        assert created.status_code == 200, created.text
        response = http.post("/v1/chat/completions", json={"model": "smol-foreign", "messages": MESSAGES,
                                                           "max_tokens": 4})
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert f"rpc server {endpoint} speaks RPC protocol {major + 1}.0.0" in message
    assert f"speaks {major}.{minor}.{patch}" in message


def test_a_server_killed_mid_stream_ends_it_naming_the_server_and_the_next_load_says_what_is_missing(
        rpc: Setup) -> None:
    cold = text(ask(rpc.daemon, "smol-rpc", max_tokens=8))
    victim = rpc.servers[1]
    body = {"model": "smol-rpc", "messages": [{"role": "user", "content": "Count slowly to one thousand."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with rpc.daemon.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen == 3:
                    break
        victim.kill()
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    errors = [event["error"] for event in rest if "error" in event]
    assert errors, rest[-3:]
    assert f"rpc server {victim.endpoint} cannot be reached" in errors[-1]["message"], errors[-1]
    with rpc.daemon.http(timeout=120) as http:
        assert http.get("/health").status_code == 200
        again = http.post("/v1/chat/completions", json={"model": "smol-rpc", "messages": MESSAGES, "max_tokens": 8,
                                                        "temperature": 0})
    assert again.status_code == 500 and victim.endpoint in again.json()["error"]["message"]
    victim.start()  # back: the next request loads on both again and answers as a cold daemon did
    assert text(ask(rpc.daemon, "smol-rpc", max_tokens=8)) == cold


# a long reply without ignore_eos (an OpenAI-body extension the other dialects do not take)
LONG_ASK = "Count from 1 to 300, separated by commas."
COUNT = [{"role": "user", "content": LONG_ASK}]
STREAMS = {  # dialect: (path, body, a line that carries reply text)
    "anthropic": ("/v1/messages", {"model": "smol-rpc", "messages": COUNT, "max_tokens": 2000, "stream": True,
                                   "temperature": 0}, "text_delta"),
    "responses": ("/v1/responses", {"model": "smol-rpc", "input": LONG_ASK,
                                    "max_output_tokens": 2000, "stream": True, "temperature": 0},
                  "output_text.delta"),
    "ollama": ("/api/chat", {"model": "smol-rpc", "messages": COUNT, "stream": True,
                             "options": {"num_predict": 2000, "temperature": 0}}, '"content"'),
}


@pytest.mark.parametrize("dialect", sorted(STREAMS))
def test_a_server_killed_mid_stream_is_named_in_every_dialects_stream(rpc: Setup, dialect: str) -> None:
    path, body, marker = STREAMS[dialect]
    victim = rpc.servers[0]
    assert text(ask(rpc.daemon, "smol-rpc", max_tokens=4))  # loaded on both servers
    with rpc.daemon.http(timeout=300) as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += marker in line
            if seen == 3:
                break
        victim.kill()
        rest = "\n".join(lines)
    assert f"rpc server {victim.endpoint} cannot be reached" in rest, rest[-600:]
    assert '"done":true' not in rest.replace(" ", "") and "message_stop" not in rest  # not ended as a success
    victim.start()
    assert text(ask(rpc.daemon, "smol-rpc", max_tokens=4))  # the next request loads on both again
