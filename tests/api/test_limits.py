"""Bad and hostile requests, in-process on the scripted engine: each gets a clear 4xx, and the model keeps
serving. Each case was found by an abuse run against a live daemon; the ones that need a real model or a real
server (a wedged llama.cpp engine, the event loop under load, a client that disconnects) are in
tests/api/daemon/test_abuse.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from localai.api import response_store
from tests.observe import worker_pid

SMALL = "scripted-1k"  # num_ctx 1024 (scripted tokens are bytes): over-long conversations are cheap to build


@pytest.fixture(scope="module", autouse=True)
def small_model(api: TestClient) -> Iterator[None]:
    created = api.post("/api/create", json={"model": SMALL, "modelfile": "FROM smollm2\nPARAMETER num_ctx 1024\n"})
    assert created.status_code == 200, created.text
    yield


def raw(api: TestClient, path: str, text: str, method: str = "POST") -> httpx.Response:
    """Send JSON text as is (``json=`` could not carry a lone surrogate or 1e400)."""
    return api.request(method, path, content=text.encode("utf-8", "surrogatepass"),
                       headers={"content-type": "application/json"})


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    """``Say hi.`` to smollm2 on /api/chat (``http``: the in-process app's TestClient, or a daemon's client)."""
    return http.post("/api/chat", json={"model": "smollm2", "stream": False,
                                        "messages": [{"role": "user", "content": "Say hi."}], **body})


def bad_options_never_touch_the_model(http: httpx.Client, options: dict[str, Any], needle: str) -> None:
    """A request with bad ``options`` is a 400 naming the field, and the next request is served by the same worker
    (not reloaded). Run here on the scripted engine and in tests/api/daemon/test_abuse.py on llama.cpp."""
    assert chat(http, options={"num_predict": 1}).status_code == 200
    pid = worker_pid(http)
    response = chat(http, options=options)
    assert response.status_code == 400 and needle in response.json()["error"], response.text
    after = chat(http, options={"num_predict": 2})
    assert after.status_code == 200 and worker_pid(http) == pid  # served by the same worker, not reloaded


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
def test_bad_options_are_400s_and_never_touch_the_model(api: TestClient, options: dict[str, Any], needle: str) -> None:
    bad_options_never_touch_the_model(api, options, needle)


@pytest.mark.parametrize("body", [
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"options":{"num_predict":1e400}}',
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"options":{"seed":1e400}}',
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"options":{"top_k":NaN}}',
    '{"model":"smollm2","stream":false,"messages":[{"role":"user","content":"x"}],"keep_alive":"100000000h"}',
])
def test_numbers_out_of_range_are_400s(api: TestClient, body: str) -> None:
    response = raw(api, "/api/chat", body)
    assert response.status_code == 400, response.text
    assert api.get("/api/ps").status_code == 200


def test_fit_context_false_as_a_string_means_false(api: TestClient) -> None:
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}. " + "word " * 30}
            for i in range(15)]
    off = api.post("/api/chat", json={"model": SMALL, "stream": False, "messages": long,
                                      "options": {"fit_context": "false", "num_predict": 4}})
    assert off.status_code == 400 and "context" in off.json()["error"], off.text
    on = api.post("/api/chat", json={"model": SMALL, "stream": False, "messages": long,
                                     "options": {"fit_context": "true", "num_predict": 4}})
    assert on.status_code == 200, on.text


@pytest.mark.timeout(120)
def test_many_small_text_blocks_are_fitted_not_looped_on(api: TestClient) -> None:
    blocks = [{"type": "text", "text": f"Block {i}: " + "x" * 140} for i in range(400)]
    response = api.post("/v1/messages", json={"model": SMALL, "max_tokens": 4,
                                              "messages": [{"role": "user", "content": blocks}]})
    assert response.status_code == 200, response.text
    assert "X-LocalAI-Context-Fitted" in response.headers


@pytest.mark.timeout(120)
def test_what_cannot_be_shortened_is_a_400_not_a_loop(api: TestClient) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Run the tools."}]
    for i in range(40):  # after the last user message (kept whole), each result too short to shorten
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"t{i}", "name": "probe", "input": {"n": i}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"result {i} " + "y" * 120}]})
    response = api.post("/v1/messages", json={
        "model": SMALL, "max_tokens": 4, "messages": messages,
        "tools": [{"name": "probe", "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}],
    })
    assert response.status_code == 400, response.text
    assert "could not shorten it further" in response.json()["error"]["message"]


def test_a_prompt_is_fitted_to_leave_the_reply_its_room(api: TestClient) -> None:
    """An agent is told a quarter of the context as its output limit; a prompt that fits the context but leaves
    less than that is fitted, so the reply is never cut by a full context (OpenCode loops on such replies)."""
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}. " + "w " * 30}
            for i in range(13)]  # ~900 byte-tokens: under the 1024-token context, over 1024 - 256
    response = api.post("/v1/chat/completions", json={"model": SMALL, "messages": long, "max_tokens": 256})
    assert response.status_code == 200, response.text
    assert "x-localai-context-fitted" in response.headers
    assert response.json()["usage"]["prompt_tokens"] + 256 <= 1024


def test_request_bodies_over_the_limit_are_413(api: TestClient) -> None:
    huge = api.post("/v1/chat/completions", json={"model": "smollm2", "messages": [
        {"role": "user", "content": "a" * (65 << 20)}]})
    assert huge.status_code == 413 and "LOCALAI_MAX_REQUEST_BYTES" in huge.json()["error"]["message"]
    chinese = api.post("/v1/messages/count_tokens", json={"model": "smollm2", "messages": [
        {"role": "user", "content": "中文" * 7_000_000}]})
    assert chinese.status_code == 413 and chinese.json()["type"] == "error"
    counted = api.post("/v1/messages/count_tokens", json={"model": "smollm2", "messages": [
        {"role": "user", "content": "中文 " * 300_000}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 300_000
    assert chat(api, options={"num_predict": 1}).status_code == 200


def test_embedding_inputs_are_capped(api: TestClient) -> None:
    many = api.post("/v1/embeddings", json={"model": "smollm2", "input": ["x"] * 2049})
    assert many.status_code == 400 and "2048" in many.json()["error"]["message"]
    also = api.post("/api/embed", json={"model": "smollm2", "input": ["x"] * 2049})
    assert also.status_code == 400 and "2048" in also.json()["error"]


def test_deeply_nested_json_is_a_400(api: TestClient) -> None:
    schema = '{"type":"object","properties":{"a":' * 950 + '{"type":"string"}' + "}}" * 950
    body = ('{"model":"smollm2","messages":[{"role":"user","content":"x"}],"response_format":'
            '{"type":"json_schema","json_schema":{"name":"deep","schema":' + schema + "}}}")
    response = raw(api, "/v1/chat/completions", body)
    assert response.status_code == 400 and "nested" in response.json()["error"]["message"]


def test_create_refuses_out_of_range_parameters(api: TestClient) -> None:
    response = raw(api, "/api/create", '{"model":"inf-ctx","from":"smollm2","parameters":{"num_ctx":1e400}}')
    assert response.status_code == 400
    response = api.post("/api/create", json={"model": "neg-ctx", "from": "smollm2", "parameters": {"num_ctx": -1}})
    assert response.status_code == 400 and "num_ctx must be between" in response.json()["error"]
    response = api.post("/api/create", json={"model": "e", "from": "smollm2", "parameters": {"engine": "vllm"}})
    assert response.status_code == 400 and "engine must be one of llama.cpp, mlx, scripted" in response.json()["error"]


class StoreClock:
    """The response store's clock (``time.time`` in localai/api/response_store.py), moved by the test: it starts
    now, so the module's earlier responses are older than the test's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = time.time()
        monkeypatch.setattr(response_store, "time", types.SimpleNamespace(time=lambda: self.now))


@pytest.fixture
def store(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int, float], list[str]]]:
    """``store(count, step)``: ``count`` stored responses, the store's clock moved ``step`` seconds after each;
    their ids. They are deleted after the test (their times are not the rest of the module's)."""
    clock = StoreClock(monkeypatch)
    ids: list[str] = []

    def make(count: int, step: float) -> list[str]:
        for n in range(count):
            created = api.post("/v1/responses", json={"model": "smollm2", "input": f"Hi {n}",
                                                      "max_output_tokens": 1})
            assert created.status_code == 200, created.text
            ids.append(created.json()["id"])
            clock.now += step
        return ids

    yield make
    for response_id in ids:
        api.delete(f"/v1/responses/{response_id}")


def test_stored_responses_are_bounded(api: TestClient, store: Callable[[int, float], list[str]]) -> None:
    """The app keeps 3 (LOCALAI_RESPONSES_MAX): a fourth stored a second later drops the oldest."""
    ids = store(4, 1.0)
    assert [api.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200, 200]


def test_the_newest_stored_responses_are_kept_within_one_instant(api: TestClient,
                                                                 store: Callable[[int, float], list[str]]) -> None:
    """Responses stored at the same instant (the clock stands still): the newest stay (they had been dropped at
    random when the order was created_at's second, so a previous_response_id just returned could be gone)."""
    ids = store(6, 0.0)
    assert [api.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 404, 404, 200, 200, 200]


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
def test_lone_surrogates_are_400s(api: TestClient, method: str, path: str, body: str) -> None:
    response = raw(api, path, body, method)
    assert response.status_code == 400 and "surrogate" in response.text, response.text


def test_a_template_that_includes_files_is_refused_naming_the_line(api: TestClient) -> None:
    modelfile = "FROM smollm2\nPARAMETER temperature 0\nTEMPLATE \"\"\"{% include '/etc/passwd' %}\"\"\"\n"
    response = api.post("/api/create", json={"model": "snoop", "modelfile": modelfile})
    assert response.status_code == 400, response.text
    assert "line 3" in response.json()["error"] and "include" in response.json()["error"]
    assert api.post("/api/show", json={"model": "snoop"}).status_code == 404


def test_a_template_being_parsed_never_holds_the_event_loop(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A create's Modelfile (a large TEMPLATE: Jinja parses it in pure Python) is parsed off the event loop:
    /health answers while the parse is held in the middle."""
    from localai.api import ollama_models

    entered, release, parsed = threading.Event(), threading.Event(), threading.Event()
    real = ollama_models.parse

    def held_parse(text: str, **kwargs: Any) -> Any:
        entered.set()
        release.wait(timeout=30)  # a safety net only: the test releases it
        parsed.set()
        return real(text, **kwargs)

    monkeypatch.setattr(ollama_models, "parse", held_parse)
    modelfile = "FROM smollm2\nTEMPLATE \"\"\"{{ messages[0].content }}\"\"\"\n"
    with ThreadPoolExecutor(1) as pool:
        creating = pool.submit(api.post, "/api/create", json={"model": "held-template", "modelfile": modelfile})
        assert entered.wait(timeout=30)
        health = api.get("/health")
        answered_during_parse = not parsed.is_set()
        release.set()
        assert creating.result().status_code == 200
    assert health.status_code == 200 and answered_during_parse


def test_a_gguf_whose_data_is_cut_off_is_refused_at_create(api: TestClient, smollm2_path: Path,
                                                          tmp_path: Path) -> None:
    """Accepted before, it failed every chat with a 500; now the create is a 400 saying so."""
    whole = smollm2_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:len(whole) // 2])
    response = api.post("/api/create", json={"model": "cut-weights", "modelfile": f"FROM {cut}\n"})
    assert response.status_code == 400 and "is truncated" in response.json()["error"], response.text
    assert api.post("/api/show", json={"model": "cut-weights"}).status_code == 404


def test_an_oversized_template_is_refused_naming_it(api: TestClient) -> None:
    template = "{{ messages[0].content }}" + " " * (300 * 1024)
    response = api.post("/api/create", json={"model": "huge-template",
                                             "modelfile": f'FROM smollm2\nTEMPLATE """{template}"""\n'})
    assert response.status_code == 400 and "TEMPLATE is" in response.json()["error"], response.text[:300]
    response = api.post("/api/create", json={"model": "huge-template", "from": "smollm2", "template": template})
    assert response.status_code == 400 and "over the limit" in response.json()["error"], response.text[:300]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": 5}]}, "tools"),
    ("/v1/responses", {"input": "x", "text": {"format": "abc"}}, "text"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": [1]},
                                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]}, "input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
])
def test_wrong_shapes_are_400s_naming_the_field(api: TestClient, path: str, body: dict[str, Any], param: str) -> None:
    response = api.post(path, json={"model": "smollm2", **body})
    assert response.status_code == 400, response.text
    assert param in str(response.json()["error"])


def test_pins_with_absurd_ttls_are_refused_and_the_cli_keeps_working(api: TestClient, api_home: Any) -> None:
    response = raw(api, "/api/cache/pin", '{"session":"s","ttl":1e400}')
    assert response.status_code == 400
    response = api.post("/api/cache/pin", json={"session": "s", "ttl": "100000000h"})
    assert response.status_code == 400 and "ten years" in response.json()["error"]
    (api_home / "cache").mkdir(exist_ok=True)
    (api_home / "cache" / "pins.json").write_text('[{"session": "s", "entry": null, "expires_at": Infinity}]')
    listing = subprocess.run([sys.executable, "-m", "localai", "cache", "ls"], capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0, listing.stderr


@pytest.mark.parametrize("destination", ["../../x", "/etc/x", "a" * 100_000, "sp ace", "x/../../y"],
                         ids=["dotdot", "absolute", "long", "space", "inner-dotdot"])
def test_copy_refuses_bad_names(api: TestClient, destination: str) -> None:
    response = api.post("/api/copy", json={"source": "smollm2", "destination": destination})
    assert response.status_code == 400, response.text
    assert "smollm2:135m" in [m["name"] for m in api.get("/api/tags").json()["models"]]


def test_in_flight_cache_writes_are_not_listed(api: TestClient, api_home: Any) -> None:
    api.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 2, "messages": [
        {"role": "system", "content": "You are a careful assistant. " * 20}, {"role": "user", "content": "Hi"}]})
    deadline = time.monotonic() + 30
    entries: list[dict[str, Any]] = []
    while time.monotonic() < deadline:  # settled: the reply's entry is saved just after the response
        listed = api.get("/api/cache").json()["entries"]
        if listed and listed == entries:
            break
        entries = listed
        time.sleep(0.5)
    assert entries
    folder = api_home / "cache" / entries[0]["fingerprint"]
    head = folder / "heads" / f"{entries[0]['id']}.json"
    (head.parent / f".tmp-1-{head.name}").write_bytes(head.read_bytes())  # writes caught mid-rename
    block = next((folder / "blocks").glob("*.blk"))
    temp_block = block.parent / f".tmp-1-{block.name}"
    temp_block.write_bytes(block.read_bytes())
    again = api.get("/api/cache").json()["entries"]
    assert sorted(e["id"] for e in again) == sorted(e["id"] for e in entries)
    assert temp_block.exists()  # another process's write in progress is neither listed nor deleted


def test_an_engine_failure_ends_the_worker_and_the_next_request_reloads(api: TestClient) -> None:
    assert chat(api, options={"num_predict": 1}).status_code == 200
    pid = worker_pid(api)
    crashed = api.post("/v1/chat/completions", json={"model": "smollm2", "messages": [
        {"role": "user", "content": "[[crash]]"}]})
    assert crashed.status_code == 500 and crashed.json()["error"]["code"] == "worker_crashed"
    assert "scripted crash" in crashed.json()["error"]["message"]  # the engine's own words reach the client
    again = chat(api, options={"num_predict": 2})
    assert again.status_code == 200 and worker_pid(api) not in (None, pid)
