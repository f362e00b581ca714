"""Streams send keep-alives while a long prompt is evaluated, in each dialect's own form, and the dialects' own
clients read through them (LOCALAI_STREAM_KEEPALIVE set low so a CPU prefill of ~420 tokens, seven chunks, spans
several)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai

from tests.api.daemon.streams import check_anthropic_stream, check_chat_stream, check_responses_stream, named_events
from tests.conftest import start_daemon

LONG = "The build failed again, so read the log, find the first error and explain it. " * 25  # ~420 tokens


def raw_lines(http: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read().decode()
        return list(response.iter_lines())


def test_every_dialect_keeps_a_long_prefill_alive_and_clients_read_through(tmp_path: Path, smollm2_path: Path) -> None:
    with start_daemon(tmp_path / "home", stream_keepalive="0.05") as daemon, daemon.http() as http:
        def ask(n: int) -> str:
            return f"{n}. {LONG}"  # a new prompt each time: nothing cached, the whole prefill to wait through

        chat = {"model": "smollm2", "max_tokens": 3, "temperature": 0, "stream": True}
        lines = raw_lines(http, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": ask(1)}]})
        first_text = next(i for i, line in enumerate(lines) if '"content":' in line and '"content":""' not in line
                          and '"content": ""' not in line)
        assert ": keep-alive" in lines[:first_text], lines[:5]
        events = named_events(http, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": ask(2)}]})
        assert check_chat_stream(events, usage=False)["finish_reason"] in ("stop", "length")
        with openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="x", max_retries=0) as sdk:
            pieces = [c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
                model="smollm2", max_tokens=3, temperature=0, stream=True,
                messages=[{"role": "user", "content": ask(3)}]) if c.choices]
        assert "".join(pieces)

        completion = raw_lines(http, "/v1/completions", {"model": "smollm2", "prompt": ask(4), "max_tokens": 2,
                                                         "stream": True})
        assert ": keep-alive" in completion and completion[-2] == "data: [DONE]"

        responses = raw_lines(http, "/v1/responses", {"model": "smollm2", "input": ask(5), "max_output_tokens": 3,
                                                      "stream": True})
        assert ": keep-alive" in responses
        check_responses_stream(named_events(http, "/v1/responses", {"model": "smollm2", "input": ask(6),
                                                                     "max_output_tokens": 3, "stream": True}))

        messages = {"model": "smollm2", "max_tokens": 3, "stream": True,
                    "messages": [{"role": "user", "content": ask(7)}]}
        named = named_events(http, "/v1/messages", messages)
        assert sum(1 for name, _ in named if name == "ping") >= 3  # the first, then keep-alives
        check_anthropic_stream(named)
        with anthropic.Anthropic(base_url=daemon.base_url, api_key="x", max_retries=0) as client, \
                client.messages.stream(model="smollm2", max_tokens=3,
                                       messages=[{"role": "user", "content": ask(8)}]) as stream:
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")

        ndjson = raw_lines(http, "/api/chat", {"model": "smollm2", "stream": True, "options": {"num_predict": 3},
                                               "messages": [{"role": "user", "content": ask(9)}]})
        parsed = [json.loads(line) for line in ndjson if line]  # every line is still a JSON object
        empty = [p for p in parsed if not p["done"] and p["message"]["content"] == ""]
        assert len(empty) >= 2 and parsed[-1]["done"] is True
        generated = raw_lines(http, "/api/generate", {"model": "smollm2", "prompt": ask(10), "stream": True,
                                                      "options": {"num_predict": 2}})
        assert sum(1 for p in map(json.loads, generated) if not p["done"] and p["response"] == "") >= 2
        with ollama.Client(host=daemon.base_url) as native:
            reply = "".join(part["message"]["content"] for part in native.chat(
                model="smollm2", stream=True, options={"num_predict": 3},
                messages=[{"role": "user", "content": ask(11)}]))
        assert reply

        # A client that leaves during the keep-alives costs nothing: the request is cancelled, the daemon serves on.
        with http.stream("POST", "/v1/chat/completions",
                         json={**chat, "messages": [{"role": "user", "content": ask(12)}]}) as response:
            for line in response.iter_lines():
                if line == ": keep-alive":
                    break
        after = http.post("/v1/chat/completions", json={**chat, "stream": False,
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
