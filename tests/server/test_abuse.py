"""Bad and hostile requests against one real daemon: each gets a clear 4xx (or stops its work), and the model keeps
serving everyone else. Each case was found by an abuse run against a live daemon (issue "A fresh machine passes
`make test`; one bad request can never wedge a model")."""

from __future__ import annotations

import concurrent.futures
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, start_daemon

SMALL = "smollm2-1k"  # num_ctx 1024: over-long conversations are cheap to build


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("abuse") / "home"
    home.mkdir(mode=0o755)  # an existing home, made with a permissive umask
    instance = start_daemon(home, keep_alive="-1", responses_max="3")
    with instance.http() as http:
        created = http.post("/api/create", json={"model": SMALL, "modelfile": "FROM smollm2\nPARAMETER num_ctx 1024\n"})
        assert created.status_code == 200, created.text
    yield instance
    instance.stop()


def raw(http: httpx.Client, path: str, text: str, method: str = "POST") -> httpx.Response:
    """Send JSON text as is (``json=`` could not carry a lone surrogate or 1e400)."""
    return http.request(method, path, content=text.encode("utf-8", "surrogatepass"),
                        headers={"content-type": "application/json"})


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/api/chat", json={"model": "smollm2", "stream": False,
                                        "messages": [{"role": "user", "content": "Say hi."}], **body})


def worker_pid(http: httpx.Client, model: str = "smollm2:135m") -> int | None:
    return next((m["pid"] for m in http.get("/api/ps").json()["models"] if m["name"] == model), None)


def healthy(daemon: Daemon, timeout: float = 10.0) -> bool:
    with daemon.http(timeout=timeout) as http:
        return http.get("/health").status_code == 200


# -- 2. options are validated; the engine thread cannot be wedged --------------------------------------

@pytest.mark.parametrize(("options", "needle"), [
    ({"stop": [1]}, "options.stop"),
    ({"stop": 5}, "options.stop"),
    ({"num_predict": "x"}, "num_predict must be an integer"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"num_ctx": -1}, "num_ctx must be between"),
    ({"repeat_last_n": 200_000_000}, "repeat_last_n must be between"),
    ({"fit_context": "maybe"}, "fit_context must be true or false"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"num_batch": 10**9}, "num_batch must be between"),
])
def test_bad_options_are_400s_and_never_touch_the_model(daemon: Daemon, options: dict[str, Any], needle: str) -> None:
    with daemon.http() as http:
        assert chat(http, options={"num_predict": 1}).status_code == 200
        pid = worker_pid(http)
        response = chat(http, options=options)
        assert response.status_code == 400 and needle in response.json()["error"], response.text
        after = chat(http, options={"num_predict": 2})
        assert after.status_code == 200 and worker_pid(http) == pid  # served by the same worker, not reloaded


@pytest.mark.parametrize("body", [
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"options":{"num_predict":1e400}}',
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"options":{"seed":1e400}}',
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"options":{"top_k":NaN}}',
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"keep_alive":"100000000h"}',
])
def test_numbers_out_of_range_are_400s(daemon: Daemon, body: str) -> None:
    with daemon.http() as http:
        response = raw(http, "/api/chat", body)
        assert response.status_code == 400, response.text
        assert http.get("/api/ps").status_code == 200


def test_fit_context_false_as_a_string_means_false(daemon: Daemon) -> None:
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}. " + "word " * 120}
            for i in range(15)]
    with daemon.http() as http:
        off = http.post("/api/chat", json={"model": SMALL, "stream": False, "messages": long,
                                           "options": {"fit_context": "false", "num_predict": 4}})
        assert off.status_code == 400 and "context" in off.json()["error"], off.text
        on = http.post("/api/chat", json={"model": SMALL, "stream": False, "messages": long,
                                          "options": {"fit_context": "true", "num_predict": 4}})
        assert on.status_code == 200, on.text


# -- 3. fitting always ends --------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_many_small_text_blocks_are_fitted_not_looped_on(daemon: Daemon) -> None:
    blocks = [{"type": "text", "text": f"Block {i}: " + "x" * 140} for i in range(400)]  # ~15k tokens
    with daemon.http() as http:
        response = http.post("/v1/messages", json={"model": SMALL, "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": blocks}]})
        assert response.status_code == 200, response.text
        assert "X-LocalAI-Context-Fitted" in response.headers


@pytest.mark.timeout(180)
def test_what_cannot_be_shortened_is_a_400_not_a_loop(daemon: Daemon) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Run the tools."}]
    for i in range(120):  # after the last user message (kept whole), each result too short to shorten
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"t{i}", "name": "probe", "input": {"n": i}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"result {i} " + "y" * 120}]})
    with daemon.http() as http:
        response = http.post("/v1/messages", json={
            "model": SMALL, "max_tokens": 4, "messages": messages,
            "tools": [{"name": "probe", "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}],
        })
        assert response.status_code == 400, response.text
        assert "could not shorten it further" in response.json()["error"]["message"]
        assert chat(http, options={"num_predict": 1}).status_code == 200


# -- 4 and 10. sizes -----------------------------------------------------------------------------------

def test_request_bodies_over_the_limit_are_413(daemon: Daemon) -> None:
    with daemon.http(timeout=300) as http:
        huge = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": [
            {"role": "user", "content": "a" * (65 << 20)}]})
        assert huge.status_code == 413 and "LOCALAI_MAX_REQUEST_BYTES" in huge.json()["error"]["message"]
        chinese = http.post("/v1/messages/count_tokens", json={"model": "smollm2", "messages": [
            {"role": "user", "content": "中文" * 7_000_000}]})
        assert chinese.status_code == 413 and chinese.json()["type"] == "error"
        counted = http.post("/v1/messages/count_tokens", json={"model": "smollm2", "messages": [
            {"role": "user", "content": "中文 " * 300_000}]})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 300_000
        assert chat(http, options={"num_predict": 1}).status_code == 200


def test_embedding_inputs_are_capped(daemon: Daemon) -> None:
    with daemon.http() as http:
        many = http.post("/v1/embeddings", json={"model": "smollm2", "input": ["x"] * 2049})
        assert many.status_code == 400 and "2048" in many.json()["error"]["message"]
        also = http.post("/api/embed", json={"model": "smollm2", "input": ["x"] * 2049})
        assert also.status_code == 400 and "2048" in also.json()["error"]


def test_deeply_nested_json_is_a_400(daemon: Daemon) -> None:
    schema = '{"type":"object","properties":{"a":' * 950 + '{"type":"string"}' + "}}" * 950
    with daemon.http() as http:
        body = ('{"model":"smollm2","messages":[{"role":"user","content":"x"}],"response_format":'
                '{"type":"json_schema","json_schema":{"name":"deep","schema":' + schema + "}}}")
        response = raw(http, "/v1/chat/completions", body)
        assert response.status_code == 400 and "nested" in response.json()["error"]["message"]
        assert worker_pid(http) is not None


# -- 5. load options ---------------------------------------------------------------------------------------

def test_create_refuses_out_of_range_parameters(daemon: Daemon) -> None:
    with daemon.http() as http:
        response = raw(http, "/api/create", '{"model":"inf-ctx","from":"smollm2","parameters":{"num_ctx":1e400}}')
        assert response.status_code == 400
        response = http.post("/api/create", json={"model": "neg-ctx", "from": "smollm2",
                                                  "parameters": {"num_ctx": -1}})
        assert response.status_code == 400 and "num_ctx must be between" in response.json()["error"]


# -- 6. slow work off the event loop; stored responses are bounded -------------------------------------

def test_health_answers_while_create_hashes_its_weights(daemon: Daemon, smollm2_path: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.gguf"  # smollm2's header, then a sparse 1.5 GB tail: seconds of hashing, no disk used
    big.write_bytes(smollm2_path.read_bytes())
    os.truncate(big, 3 << 29)
    with concurrent.futures.ThreadPoolExecutor() as pool, daemon.http(timeout=300) as http:
        creating = pool.submit(http.post, "/api/create", json={"model": "big", "modelfile": f"FROM {big}\n"})
        time.sleep(0.5)
        assert healthy(daemon, timeout=60)
        assert not creating.done()  # /health was answered while the create was still hashing
        assert creating.result(timeout=300).status_code == 200


def test_health_answers_while_the_cache_listing_reads_a_file(daemon: Daemon) -> None:
    folder = daemon.home / "cache" / ("e" * 32)
    folder.mkdir(parents=True, exist_ok=True)
    fifo = folder / "stuck.kv"
    os.mkfifo(fifo)  # reading it blocks until the test writes: an entry on a very slow disk
    try:
        with concurrent.futures.ThreadPoolExecutor() as pool, daemon.http() as http:
            listing = pool.submit(http.get, "/api/cache")
            time.sleep(0.5)
            assert healthy(daemon, timeout=5)
            assert not listing.done()
            while not listing.done():  # each open for writing, then close, lets one blocked read see the end
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    time.sleep(0.05)
            assert listing.result(timeout=60).status_code == 200
    finally:
        fifo.unlink()


def test_stored_responses_are_bounded(daemon: Daemon) -> None:  # the daemon keeps 3 (LOCALAI_RESPONSES_MAX)
    with daemon.http() as http:
        ids = []
        for index in range(4):
            created = http.post("/v1/responses", json={"model": "smollm2", "input": f"Hi {index}",
                                                       "max_output_tokens": 1})
            assert created.status_code == 200, created.text
            ids.append(created.json()["id"])
            time.sleep(1.1)  # created_at has one-second resolution
        assert http.get(f"/v1/responses/{ids[0]}").status_code == 404
        assert http.get(f"/v1/responses/{ids[-1]}").status_code == 200


# -- 9. Unicode, templates, disconnects ----------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/chat/completions", '{"model":"smollm2","messages":[{"role":"user","content":"\\ud800"}]}'),
    ("POST", "/v1/chat/completions", '{"model":"smollm2","prompt_cache_key":"\\udfff","messages":'
                                     '[{"role":"user","content":"x"}]}'),
    ("POST", "/v1/chat/completions", '{"model":"smollm2","messages":[{"role":"user","content":"x"},{"role":'
                                     '"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":'
                                     '"f","arguments":"{\\"a\\":\\"\\\\ud800\\"}"}}]},{"role":"tool",'
                                     '"tool_call_id":"c","content":"\\ud800"}]}'),
    ("POST", "/api/show", '{"model":"\\ud800"}'),
    ("DELETE", "/api/delete", '{"model":"\\ud800"}'),
    ("POST", "/api/pull", '{"model":"\\ud800","stream":false}'),
])
def test_lone_surrogates_are_400s(daemon: Daemon, method: str, path: str, body: str) -> None:
    with daemon.http() as http:
        response = raw(http, path, body, method)
        assert response.status_code == 400 and "surrogate" in response.text, response.text
        assert http.get("/health").status_code == 200


def test_a_template_that_includes_files_is_refused_naming_the_line(daemon: Daemon) -> None:
    modelfile = "FROM smollm2\nPARAMETER temperature 0\nTEMPLATE \"\"\"{% include '/etc/passwd' %}\"\"\"\n"
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": "snoop", "modelfile": modelfile})
        assert response.status_code == 400, response.text
        assert "line 3" in response.json()["error"] and "include" in response.json()["error"]
        assert http.post("/api/show", json={"model": "snoop"}).status_code == 404


@pytest.mark.timeout(240)
def test_a_runaway_template_is_stopped_and_never_blocks_the_daemon(daemon: Daemon) -> None:
    loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    modelfile = f'FROM smollm2\nTEMPLATE """{loops}x{{% endfor %}}{{% endfor %}}{{% endfor %}}"""\n'
    with concurrent.futures.ThreadPoolExecutor() as pool, daemon.http(timeout=200) as http:
        assert http.post("/api/create", json={"model": "runaway", "modelfile": modelfile}).status_code == 200
        asking = pool.submit(chat, http, model="runaway")
        time.sleep(1)
        assert healthy(daemon, timeout=5)  # rendering runs off the event loop
        response = asking.result(timeout=200)
        assert response.status_code == 400 and "stopped" in response.json()["error"], response.text


@pytest.mark.timeout(240)
def test_a_non_streamed_request_stops_when_its_client_goes_away(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 7000, "ignore_eos": True}
    with daemon.http() as http:
        assert chat(http, options={"num_predict": 1}).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=3))
        deadline = time.monotonic() + 30  # 7000 tokens would take minutes; a stopped request frees its slot at once
        while time.monotonic() < deadline:
            if all(m["active_requests"] == 0 for m in http.get("/api/ps").json()["models"]):
                break
            time.sleep(0.2)
        assert all(m["active_requests"] == 0 for m in http.get("/api/ps").json()["models"])


# -- 10. the rest ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": 5}]}, "tools"),
    ("/v1/responses", {"input": "x", "text": {"format": "abc"}}, "text"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": [1]},
                                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]}, "input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
])
def test_wrong_shapes_are_400s_naming_the_field(daemon: Daemon, path: str, body: dict[str, Any], param: str) -> None:
    with daemon.http() as http:
        response = http.post(path, json={"model": "smollm2", **body})
        assert response.status_code == 400, response.text
        assert param in json.dumps(response.json()["error"])


def test_pins_with_absurd_ttls_are_refused_and_the_cli_keeps_working(daemon: Daemon) -> None:
    with daemon.http() as http:
        response = raw(http, "/api/cache/pin", '{"session":"s","ttl":1e400}')
        assert response.status_code == 400
        response = http.post("/api/cache/pin", json={"session": "s", "ttl": "100000000h"})
        assert response.status_code == 400 and "ten years" in response.json()["error"]
    (daemon.home / "cache").mkdir(exist_ok=True)
    (daemon.home / "cache" / "pins.json").write_text('[{"session": "s", "entry": null, "expires_at": Infinity}]')
    listing = daemon.cli("cache", "ls")
    assert listing.returncode == 0, listing.stderr


@pytest.mark.parametrize("destination", ["../../x", "/etc/x", "a" * 100_000, "sp ace", "x/../../y"])
def test_copy_refuses_bad_names(daemon: Daemon, destination: str) -> None:
    with daemon.http() as http:
        response = http.post("/api/copy", json={"source": "smollm2", "destination": destination})
        assert response.status_code == 400, response.text
        assert "smollm2:135m" in [m["name"] for m in http.get("/api/tags").json()["models"]]


def test_in_flight_cache_writes_are_not_listed(daemon: Daemon) -> None:
    with daemon.http() as http:
        http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 2, "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 20}, {"role": "user", "content": "Hi"}]})
        time.sleep(1)
        entries = http.get("/api/cache").json()["entries"]
        assert entries
        first = daemon.home / "cache" / entries[0]["fingerprint"] / f"{entries[0]['id']}.kv"
        (first.parent / f".tmp-{first.name}").write_bytes(first.read_bytes())  # a write caught mid-rename
        again = http.get("/api/cache").json()["entries"]
        assert sorted(e["id"] for e in again) == sorted(e["id"] for e in entries)


def test_files_under_an_existing_home_are_private(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert chat(http, options={"num_predict": 1}).status_code == 200
    assert stat.S_IMODE(daemon.home.stat().st_mode) == 0o700
    created = [path for path in daemon.home.rglob("*") if path.is_file() and not path.is_symlink()]
    assert created
    written_by_tests = {"daemon.log", "pins.json"}
    for path in created:
        if path.name in written_by_tests or path.name.startswith(".tmp-"):
            continue
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_the_daemon_is_still_healthy_and_answers(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert http.get("/health").status_code == 200
        assert chat(http, options={"num_predict": 2}).status_code == 200
    listing = subprocess.run([sys.executable, "-m", "localai", "ps"], env=daemon.env, capture_output=True,
                             text=True, timeout=60)
    assert listing.returncode == 0 and "smollm2" in listing.stdout


def test_a_prompt_is_fitted_to_leave_the_reply_its_room(daemon: Daemon) -> None:
    """An agent is told a quarter of the context as its output limit; a prompt that fits the context but leaves
    less than that is fitted, so the reply is never cut by a full context (OpenCode loops on such replies)."""
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}. " + "word " * 60}
            for i in range(13)]  # ~850 tokens: under the 1024-token context, over 1024 - 256
    with daemon.http() as http:
        response = http.post("/v1/chat/completions", json={"model": SMALL, "messages": long, "max_tokens": 256,
                                                           "temperature": 0})
        assert response.status_code == 200, response.text
        assert "x-localai-context-fitted" in response.headers
        assert response.json()["usage"]["prompt_tokens"] + 256 <= 1024
