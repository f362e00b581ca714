"""Streams send keep-alives while the worker has nothing to send, in each dialect's own form, and the dialects' own
clients read through them. The worker is held (SIGSTOP) as each stream's headers arrive (the request is admitted: a
prompt of ~420 tokens is being evaluated) until the stream has carried a few keep-alives (LOCALAI_STREAM_KEEPALIVE
50 ms), then let go (SIGCONT): keep-alives come for as long as the worker is silent, whatever the machine's speed,
where the long prefill alone had to outlast three of them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import ollama
import openai

from tests.api.daemon.streams import check_anthropic_stream, check_chat_stream, check_responses_stream, named_events
from tests.conftest import Daemon, start_daemon
from tests.observe import counted, wait_for, worker_pid

LONG = "The build failed again, so read the log, find the first error and explain it. " * 25  # ~420 tokens
KeepAliveLine = Callable[[str], bool]


def sse_comment(line: str) -> bool:
    return line == ": keep-alive"


def anthropic_ping(line: str) -> bool:
    return line == "event: ping"


def ndjson_empty(line: str) -> bool:  # Ollama's keep-alive: a chunk with no text that is not the last
    chunk = json.loads(line) if line.startswith("{") else {}
    return chunk.get("done") is False and not (chunk.get("message", {}).get("content") or chunk.get("response"))


def resuming_transport(lib: Any) -> type:
    """The transport below for ``lib``: httpx, or httpx2 (the anthropic SDK's fork of it)."""

    class ResumingStream(lib.SyncByteStream):  # type: ignore[misc,name-defined]
        """A response's bytes as they come; the worker is let go once ``count`` of its lines were keep-alives."""

        def __init__(self, inner: Any, pid: int, keepalive: KeepAliveLine, count: int) -> None:
            self.inner, self.pid, self.keepalive, self.count = inner, pid, keepalive, count
            self.seen = 0
            self.partial = b""

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.inner:
                if self.seen < self.count:
                    *lines, self.partial = (self.partial + chunk).split(b"\n")
                    self.seen += sum(self.keepalive(line.decode().strip()) for line in lines)
                    if self.seen >= self.count:
                        os.kill(self.pid, signal.SIGCONT)
                yield chunk

        def close(self) -> None:
            self.inner.close()

    class Resuming(lib.HTTPTransport):  # type: ignore[misc,name-defined]
        """A transport whose streamed responses hold the worker from their headers until ``count`` keep-alives
        (every client here, the SDKs' included, is given one)."""

        def __init__(self, pid: int, keepalive: KeepAliveLine, count: int) -> None:
            super().__init__()
            self.pid, self.keepalive, self.count = pid, keepalive, count
            self.streams: list[ResumingStream] = []

        def handle_request(self, request: Any) -> Any:
            response = super().handle_request(request)
            os.kill(self.pid, signal.SIGSTOP)  # admitted, its prompt being evaluated: the worker goes silent
            stream = ResumingStream(response.stream, self.pid, self.keepalive, self.count)
            self.streams.append(stream)
            return lib.Response(response.status_code, headers=response.headers, stream=stream,
                                extensions=response.extensions)

        @property
        def keepalives(self) -> int:
            return sum(stream.seen for stream in self.streams)

    return Resuming


Resuming = resuming_transport(httpx)


@contextlib.contextmanager
def held(pid: int, keepalive: KeepAliveLine, count: int = 3, lib: Any = httpx) -> Iterator[Any]:
    """A transport whose streams hold the worker from their headers until ``count`` keep-alives (it goes on in
    any case when the block ends)."""
    try:
        yield resuming_transport(lib)(pid, keepalive, count)
    finally:
        os.kill(pid, signal.SIGCONT)


def raw_lines(http: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read().decode()
        return list(response.iter_lines())


def test_every_dialect_keeps_a_silent_worker_alive_and_clients_read_through(tmp_path: Path,
                                                                            smollm2_path: Path) -> None:
    with start_daemon(tmp_path / "home", stream_keepalive="0.05") as daemon, daemon.http() as plain:
        assert plain.post("/api/generate", json={"model": "smollm2"}).status_code == 200  # loaded
        pid = worker_pid(plain, "smollm2")
        assert pid is not None

        def client(transport: Any) -> httpx.Client:
            return httpx.Client(base_url=daemon.base_url, transport=transport, timeout=120)

        def ask(n: int) -> str:
            return f"{n}. {LONG}"  # a new prompt each time: nothing cached, the whole prefill to hold

        chat = {"model": "smollm2", "max_tokens": 3, "temperature": 0, "stream": True}
        with held(pid, sse_comment) as transport, client(transport) as http:
            lines = raw_lines(http, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": ask(1)}]})
        first_text = next(i for i, line in enumerate(lines) if '"content":' in line and '"content":""' not in line
                          and '"content": ""' not in line)
        assert sum(map(sse_comment, lines[:first_text])) >= 3, lines[:8]  # all before the first text
        with held(pid, sse_comment) as transport, client(transport) as http:
            events = named_events(http, "/v1/chat/completions",
                                  {**chat, "messages": [{"role": "user", "content": ask(2)}]})
        assert check_chat_stream(events, usage=False)["finish_reason"] in ("stop", "length")
        with held(pid, sse_comment) as transport, \
                openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="x", max_retries=0,
                              http_client=client(transport)) as sdk:
            pieces = [c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
                model="smollm2", max_tokens=3, temperature=0, stream=True,
                messages=[{"role": "user", "content": ask(3)}]) if c.choices]
            assert transport.keepalives >= 3
        assert "".join(pieces)

        with held(pid, sse_comment) as transport, client(transport) as http:
            completion = raw_lines(http, "/v1/completions", {"model": "smollm2", "prompt": ask(4), "max_tokens": 2,
                                                             "stream": True})
        assert sum(map(sse_comment, completion)) >= 3 and completion[-2] == "data: [DONE]"

        responses_body = {"model": "smollm2", "max_output_tokens": 3, "stream": True}
        with held(pid, sse_comment) as transport, client(transport) as http:
            responses = raw_lines(http, "/v1/responses", {**responses_body, "input": ask(5)})
        assert sum(map(sse_comment, responses)) >= 3
        with held(pid, sse_comment) as transport, client(transport) as http:
            check_responses_stream(named_events(http, "/v1/responses", {**responses_body, "input": ask(6)}))

        messages = {"model": "smollm2", "max_tokens": 3, "stream": True,
                    "messages": [{"role": "user", "content": ask(7)}]}
        with held(pid, anthropic_ping, count=4) as transport, client(transport) as http:
            named = named_events(http, "/v1/messages", messages)
        assert sum(1 for name, _ in named if name == "ping") >= 4  # the first, then keep-alives
        check_anthropic_stream(named)
        with held(pid, anthropic_ping, count=4, lib=httpx2) as transport, \
                anthropic.Anthropic(base_url=daemon.base_url, api_key="x", max_retries=0,
                                    http_client=httpx2.Client(transport=transport, timeout=120)) as sdk, \
                sdk.messages.stream(model="smollm2", max_tokens=3,
                                    messages=[{"role": "user", "content": ask(8)}]) as stream:
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
            assert transport.keepalives >= 4

        with held(pid, ndjson_empty) as transport, client(transport) as http:
            ndjson = raw_lines(http, "/api/chat", {"model": "smollm2", "stream": True, "options": {"num_predict": 3},
                                                   "messages": [{"role": "user", "content": ask(9)}]})
        parsed = [json.loads(line) for line in ndjson if line]  # every line is still a JSON object
        assert sum(map(ndjson_empty, ndjson)) >= 3 and parsed[-1]["done"] is True
        with held(pid, ndjson_empty) as transport, client(transport) as http:
            generated = raw_lines(http, "/api/generate", {"model": "smollm2", "prompt": ask(10), "stream": True,
                                                          "options": {"num_predict": 2}})
        assert sum(map(ndjson_empty, generated)) >= 3 and json.loads(generated[-1])["done"] is True
        with held(pid, ndjson_empty) as transport, ollama.Client(host=daemon.base_url, transport=transport) as native:
            reply = "".join(part["message"]["content"] for part in native.chat(
                model="smollm2", stream=True, options={"num_predict": 3},
                messages=[{"role": "user", "content": ask(11)}]))
            assert transport.keepalives >= 3
        assert reply

        leaves_during_keepalives(daemon, pid)


def leaves_during_keepalives(daemon: Daemon, pid: int) -> None:
    """A client that leaves during the keep-alives costs nothing: its request is cancelled (counted so in /metrics,
    under a model of its own sharing smollm2's worker), and the daemon serves on."""
    model = "smollm2-keepalive-leaver"
    with daemon.http() as http:
        assert http.post("/api/create", json={"model": model, "modelfile": "FROM smollm2\n"}).status_code == 200
        with held(pid, sse_comment, count=10**9) as transport, \
                httpx.Client(base_url=daemon.base_url, transport=transport, timeout=120) as leaving, \
                leaving.stream("POST", "/v1/chat/completions", json={
                    "model": model, "max_tokens": 500, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "Count to a thousand. " + LONG}]}) as response:
            for line in response.iter_lines():
                if line == ": keep-alive":
                    break  # the client goes while the worker has not started: let go after the stream is closed
        wait_for(lambda: counted(http, "localai_requests_total", model), "the left request's end")
        assert counted(http, "localai_requests_total", model, "cancelled") == 1, http.get("/metrics").text[-3000:]
        after = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 3, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] is not None
        assert http.get("/health").status_code == 200


def test_a_keepalive_setting_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {"LOCALAI_HOME": str(tmp_path), "LOCALAI_STREAM_KEEPALIVE": "soon", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "localai", "serve"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "STREAM_KEEPALIVE" in (done.stderr + done.stdout).upper()
