"""Remote models against real upstreams on loopback: llama-cpp-python's own OpenAI server (two replicas) and a
second localai daemon. Every dialect, routing, failover, timeouts, disconnects and keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localai.bench.servers import LlamaCppPythonServer
from tests.api.daemon.streams import check_anthropic_stream, check_chat_stream, check_responses_stream, named_events
from tests.api.daemon.test_agent_replays import CLAUDE_CODE, CLAUDE_HEADERS
from tests.conftest import Daemon, free_port, start_daemon
from tests.observe import wait_for

HI = [{"role": "user", "content": "Say hi."}]
WEATHER_TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def create(daemon: Daemon, name: str, modelfile: str) -> None:
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": name, "modelfile": modelfile})
    assert response.status_code == 200, response.text


def remote_modelfile(servers: list[LlamaCppPythonServer], *extra: str) -> str:
    lines = [f"FROM {servers[0].base_url}", *(f"PARAMETER replica {s.base_url}" for s in servers[1:]),
             "PARAMETER temperature 0", *extra]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def remote_daemon(tmp_path_factory: pytest.TempPathFactory, llama_servers: list[LlamaCppPythonServer]
                  ) -> Iterator[Daemon]:
    """A daemon whose model ``big`` lives on the two llama-cpp-python replicas (it loads no model itself)."""
    instance = start_daemon(tmp_path_factory.mktemp("remote-daemon"), remote_health_interval="1",
                            test_wrong_key="not-the-key", test_right_key="the-key")
    create(instance, "big", remote_modelfile(llama_servers, "PARAMETER num_ctx 2048"))
    yield instance
    instance.stop()


def post(daemon: Daemon, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    with daemon.http(timeout=300) as http:
        return http.post(path, json=body, headers=headers)


def replica_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-localai-replica"]


def test_logprobs_asked_of_a_remote_model_are_a_400_not_silently_missing(remote_daemon: Daemon) -> None:
    response = post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": HI, "max_tokens": 2,
                                                            "logprobs": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs", response.text
    assert "remote model" in response.json()["error"]["message"]


def test_every_dialect_through_a_remote_model(remote_daemon: Daemon) -> None:
    chat = post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": HI, "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"].strip()
    assert chat.json()["usage"]["completion_tokens"] > 0
    with remote_daemon.http(timeout=300) as http:
        result = check_chat_stream(named_events(http, "/v1/chat/completions", {
            "model": "big", "messages": HI, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}), usage=True)
        assert result["text"].strip()
        message = check_anthropic_stream(named_events(http, "/v1/messages", {
            "model": "big", "max_tokens": 8, "stream": True, "messages": HI}))
        assert message["blocks"][0]["text"].strip() and message["usage"]["output_tokens"] > 0
        final = check_responses_stream(named_events(http, "/v1/responses", {
            "model": "big", "input": "Say hi.", "max_output_tokens": 8, "stream": True}))
        assert final["output"][0]["content"][0]["text"].strip()
        with http.stream("POST", "/api/chat", json={"model": "big", "messages": HI,
                                                    "options": {"num_predict": 8}}) as response:
            lines = [json.loads(line) for line in response.iter_lines() if line]
        assert lines[-1]["done"] is True and "".join(line["message"]["content"] for line in lines).strip()
    anthropic = post(remote_daemon, "/v1/messages", {"model": "big", "max_tokens": 8, "messages": HI})
    assert anthropic.status_code == 200 and anthropic.json()["content"][0]["text"].strip()
    responses = post(remote_daemon, "/v1/responses", {"model": "big", "input": "Say hi.", "max_output_tokens": 8})
    assert responses.status_code == 200 and responses.json()["output"][0]["content"][0]["text"].strip()
    ollama = post(remote_daemon, "/api/chat", {"model": "big", "messages": HI, "stream": False,
                                               "options": {"num_predict": 8}})
    assert ollama.status_code == 200 and ollama.json()["message"]["content"].strip()
    generate = post(remote_daemon, "/api/generate", {"model": "big", "prompt": "The sky is", "raw": True,
                                                     "stream": False, "options": {"num_predict": 4}})
    assert generate.status_code == 200 and generate.json()["response"]  # raw: /v1/completions upstream
    completion = post(remote_daemon, "/v1/completions", {"model": "big", "prompt": "1, 2, 3,", "max_tokens": 4})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
    loaded = post(remote_daemon, "/api/generate", {"model": "big"})  # Ollama's "load": a replica answers
    assert loaded.status_code == 200 and loaded.json()["done_reason"] == "load"


def test_forced_tool_calls_come_back_in_each_dialect(remote_daemon: Daemon) -> None:
    openai = post(remote_daemon, "/v1/chat/completions", {
        "model": "big", "max_tokens": 40, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_TOOL}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert openai.status_code == 200, openai.text
    choice = openai.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)
    with remote_daemon.http(timeout=300) as http:
        message = check_anthropic_stream(named_events(http, "/v1/messages", {
            "model": "big", "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER_TOOL}],
            "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert message["stop_reason"] == "tool_use"
    assert [block["name"] for block in message["blocks"] if block["type"] == "tool_use"] == ["get_weather"]
    # the conversation goes on with the call's result, translated back into chat completions upstream
    follow = post(remote_daemon, "/v1/chat/completions", {"model": "big", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Paris?"}, choice["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]})
    assert follow.status_code == 200, follow.text


def test_claude_codes_first_request_replayed(remote_daemon: Daemon) -> None:
    with remote_daemon.http(timeout=300) as http:
        message = check_anthropic_stream(named_events(http, "/v1/messages", {**CLAUDE_CODE, "model": "big",
                                                                            "max_tokens": 16}, CLAUDE_HEADERS))
    assert message["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert message["usage"]["output_tokens"] > 0


def test_list_show_ps_and_models_report_a_remote_model(remote_daemon: Daemon) -> None:
    tags = {m["name"]: m for m in remote_daemon.get("/api/tags").json()["models"]}
    assert tags["big:latest"]["engine"] == "remote" and tags["big:latest"]["context_length"] == 2048
    assert tags["big:latest"]["remote"]["upstream_model"] == "smol"
    models = {m["id"]: m for m in remote_daemon.get("/v1/models").json()["data"]}
    assert models["big:latest"]["engine"] == "remote" and models["big:latest"]["context_length"] == 2048
    listed = remote_daemon.cli("list")
    assert listed.returncode == 0 and "remote" in listed.stdout.split("big:latest", 1)[1].splitlines()[0]
    shown = remote_daemon.cli("show", "big")
    assert shown.returncode == 0, shown.stderr
    assert "upstream model  smol" in shown.stdout and "llama-cpp-python" in shown.stdout
    assert shown.stdout.count("(up)") == 2
    post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": HI, "max_tokens": 1})
    ps = remote_daemon.cli("ps")
    assert ps.returncode == 0 and "2/2 replicas up" in ps.stdout, ps.stdout


def test_a_remote_model_on_its_own_daemon_lists_without_looping(remote_daemon: Daemon) -> None:
    """``loop`` is served by this same daemon's ``big`` (two hops): listing it asks the daemon's /v1/models, which
    must not probe ``loop`` again (before the probe header, every listing waited out a 7 s probe)."""
    create(remote_daemon, "loop", f"FROM {remote_daemon.base_url}/v1\nPARAMETER upstream_model big\n")
    with remote_daemon.http(timeout=5) as http:  # a listing that waits on itself would time out here
        tags = {m["name"]: m for m in http.get("/api/tags").json()["models"]}
        assert tags["loop:latest"]["context_length"] == 2048 and tags["loop:latest"]["remote"]["kind"] == "localai"
    answer = post(remote_daemon, "/v1/chat/completions", {"model": "loop", "messages": HI, "max_tokens": 4})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]


def test_sessions_stick_to_one_replica_and_spread(remote_daemon: Daemon) -> None:
    placement: dict[str, set[str]] = {}
    for _ in range(2):
        for session in range(10):
            body = {"model": "big", "messages": HI, "max_tokens": 1}
            response = post(remote_daemon, "/v1/chat/completions", body, **{"X-Session-Id": f"s{session}"})
            placement.setdefault(f"s{session}", set()).add(replica_of(response))
        # OpenAI's prompt_cache_key (Codex, Pi) names the session too
        response = post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": HI, "max_tokens": 1,
                                                                 "prompt_cache_key": "s3"})
        placement["s3"].add(replica_of(response))
    assert all(len(replicas) == 1 for replicas in placement.values()), placement
    assert len(set().union(*placement.values())) == 2  # sessions spread over both replicas
    # without a session id, a conversation sticks by its first messages
    conversation = [{"role": "system", "content": "You are terse."}, *HI]
    first = replica_of(post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": conversation,
                                                                    "max_tokens": 1}))
    longer = [*conversation, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]
    again = replica_of(post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": longer,
                                                                    "max_tokens": 1}))
    assert first == again


def metric(daemon: Daemon, name: str, **labels: str) -> float:
    text = daemon.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_dead_replica_fails_over_and_comes_back(remote_daemon: Daemon, smollm2_path: Path) -> None:
    servers = [LlamaCppPythonServer(str(smollm2_path), 2048, threads=1, alias="smol") for _ in range(2)]
    for server in servers:
        server.start()
    try:
        create(remote_daemon, "ha", remote_modelfile(servers))
        session = {"X-Session-Id": "failover-session"}
        conversation: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
        first = post(remote_daemon, "/v1/chat/completions", {"model": "ha", "messages": conversation,
                                                             "max_tokens": 6}, **session)
        home = replica_of(first)
        dead = next(s for s in servers if s.base_url == home)
        other = next(s for s in servers if s is not dead)
        conversation += [first.json()["choices"][0]["message"], {"role": "user", "content": "Another one."}]
        dead.kill()
        second = post(remote_daemon, "/v1/chat/completions", {"model": "ha", "messages": conversation,
                                                              "max_tokens": 6}, **session)
        assert replica_of(second) == other.base_url  # the client saw no error at all
        assert metric(remote_daemon, "localai_upstream_failovers_total", model="ha:latest", replica=home) >= 1
        assert metric(remote_daemon, "localai_upstream_healthy", model="ha:latest", replica=home) == 0
        ps = {m["name"]: m for m in remote_daemon.get("/api/ps").json()["models"]}
        down = next(r for r in ps["ha:latest"]["replicas"] if r["url"] == home)
        assert down["healthy"] is False and "connection refused" in down["reason"]
        # the session stays on its new replica while the old one is out
        third = post(remote_daemon, "/v1/chat/completions", {"model": "ha", "messages": conversation,
                                                             "max_tokens": 2}, **session)
        assert replica_of(third) == other.base_url
        # the first replica comes back on its port: the health checks put it back in rotation
        dead.start()
        wait_for(lambda: metric(remote_daemon, "localai_upstream_healthy", model="ha:latest", replica=home) == 1,
                 "the replica to be healthy again", timeout=30)
        fourth = post(remote_daemon, "/v1/chat/completions", {"model": "ha", "messages": conversation,
                                                              "max_tokens": 2}, **session)
        assert replica_of(fourth) == home  # consistent hashing: the session returns to its own replica
        assert remote_daemon.get("/health").status_code == 200
    finally:
        for server in servers:
            server.__exit__()


def test_all_replicas_down_is_a_clear_error_in_each_dialect(remote_daemon: Daemon) -> None:
    nowhere = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    create(remote_daemon, "gone", f"FROM {nowhere[0]}\nPARAMETER replica {nowhere[1]}\nPARAMETER upstream_model x\n")
    openai = post(remote_daemon, "/v1/chat/completions", {"model": "gone", "messages": HI, "stream": True})
    assert openai.status_code == 503 and openai.headers["retry-after"]
    error = openai.json()["error"]
    assert error["code"] == "upstream_unavailable" and all(url in error["message"] for url in nowhere)
    assert "connection refused" in error["message"]
    anthropic = post(remote_daemon, "/v1/messages", {"model": "gone", "max_tokens": 8, "messages": HI})
    assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"
    ollama = post(remote_daemon, "/api/chat", {"model": "gone", "messages": HI})
    assert ollama.status_code == 503 and nowhere[0] in ollama.json()["error"]
    responses = post(remote_daemon, "/v1/responses", {"model": "gone", "input": "hi"})
    assert responses.status_code == 503
    # no upstream_model and nobody to ask which model: say what to set
    create(remote_daemon, "gone2", f"FROM {nowhere[0]}\n")
    unknown = post(remote_daemon, "/v1/chat/completions", {"model": "gone2", "messages": HI})
    assert unknown.status_code == 503 and "upstream_model" in unknown.json()["error"]["message"]
    assert remote_daemon.get("/health").status_code == 200
    # deleted, a remote model stops being health-checked and leaves `ps`
    assert "gone:latest" in [m["name"] for m in remote_daemon.get("/api/ps").json()["models"]]
    assert remote_daemon.request("DELETE", "/api/delete", json={"model": "gone"}).status_code == 200
    assert "gone:latest" not in [m["name"] for m in remote_daemon.get("/api/ps").json()["models"]]


def test_a_slow_upstream_times_out_naming_the_replica(remote_daemon: Daemon,
                                                      llama_servers: list[LlamaCppPythonServer]) -> None:
    create(remote_daemon, "slow", f"FROM {llama_servers[0].base_url}\nPARAMETER timeout 0.3\n")
    long = " ".join(f"word{n}" for n in range(450))  # ~1,500 tokens: a prefill of seconds on one thread
    response = post(remote_daemon, "/v1/chat/completions", {"model": "slow", "messages": [
        {"role": "user", "content": long}], "max_tokens": 1})
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout" and llama_servers[0].base_url in error["message"]
    assert "no answer within 0.3 s" in error["message"]


def test_a_client_that_goes_away_closes_the_upstream_request(remote_daemon: Daemon, tmp_path: Path,
                                                             smollm2_path: Path) -> None:
    """The upstream is a second localai daemon: its /api/ps shows the request end when our client leaves."""
    with start_daemon(tmp_path / "upstream", keep_alive="-1") as upstream:
        create(remote_daemon, "far", f"FROM {upstream.base_url}/v1\nPARAMETER upstream_model smollm2:135m\n")
        models = {m["id"]: m for m in remote_daemon.get("/v1/models").json()["data"]}
        assert models["far:latest"]["context_length"] == 4096  # what the upstream localai reports it serves
        with remote_daemon.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json={
                "model": "far", "messages": HI, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)

            def active() -> int:
                ps = upstream.get("/api/ps").json()["models"]
                return sum(m["active_requests"] for m in ps)

            assert active() == 1
        wait_for(lambda: active() == 0, "the slot to be free", timeout=20)  # 3000 tokens take minutes: cancelled
        # the upstream killed in the middle of a reply: the client gets an error naming it, in its own dialect
        with remote_daemon.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json={
                "model": "far", "messages": HI, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while "content" not in next(lines):
                pass
            upstream.process.kill()
            rest = list(lines)
        errors = [json.loads(line[5:]) for line in rest if line.startswith("data:") and '"error"' in line]
        assert errors and upstream.base_url in errors[0]["error"]["message"], rest[-3:]
        assert remote_daemon.get("/health").status_code == 200


def test_upstream_keys_are_sent_and_a_refused_key_is_reported(remote_daemon: Daemon, smollm2_path: Path) -> None:
    with LlamaCppPythonServer(str(smollm2_path), 2048, threads=1, alias="smol", api_key="the-key") as locked:
        create(remote_daemon, "locked-right", f"FROM {locked.base_url}\nPARAMETER api_key_env LOCALAI_TEST_RIGHT_KEY\n")
        assert post(remote_daemon, "/v1/chat/completions", {"model": "locked-right", "messages": HI,
                                                             "max_tokens": 2}).status_code == 200
        create(remote_daemon, "locked-wrong", f"FROM {locked.base_url}\nPARAMETER upstream_model smol\n"
                                              "PARAMETER api_key_env LOCALAI_TEST_WRONG_KEY\n")
        wrong = post(remote_daemon, "/v1/chat/completions", {"model": "locked-wrong", "messages": HI})
        assert wrong.status_code == 502, wrong.text
        message = wrong.json()["error"]["message"]
        assert "401" in message and locked.base_url in message and "LOCALAI_TEST_WRONG_KEY" in message
        assert "not-the-key" not in message  # the key itself is never shown
        create(remote_daemon, "locked-unset", f"FROM {locked.base_url}\nPARAMETER upstream_model smol\n"
                                              "PARAMETER api_key_env LOCALAI_TEST_UNSET_KEY\n")
        unset = post(remote_daemon, "/v1/messages", {"model": "locked-unset", "max_tokens": 2, "messages": HI})
        assert unset.status_code == 502 and "LOCALAI_TEST_UNSET_KEY" in unset.json()["error"]["message"]
        shown = remote_daemon.request("POST", "/api/show", json={"model": "locked-wrong"}).json()
        assert "not-the-key" not in json.dumps(shown)


def test_an_over_long_conversation_is_fitted_to_the_upstream_context(remote_daemon: Daemon) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(30):
        messages += [{"role": "user", "content": f"Question {turn}: " + "tell me more about rivers. " * 12},
                     {"role": "assistant", "content": f"Answer {turn}: " + "rivers flow to the sea. " * 12}]
    messages.append({"role": "user", "content": "Summarise."})
    response = post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": messages, "max_tokens": 8})
    assert response.status_code == 200, response.text
    assert "dropped_messages=" in response.headers["x-localai-context-fitted"]
    refused = post(remote_daemon, "/v1/chat/completions", {"model": "big", "messages": messages, "max_tokens": 8,
                                                           "fit_context": False})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


def image_chat(model: str, image: bytes) -> dict[str, Any]:
    import base64

    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What colour is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def test_an_image_reaches_a_remote_model_as_an_image(remote_daemon: Daemon, smollm2_path: Path,
                                                     tmp_path: Path) -> None:
    """A remote model is sent the image in chat completions' own ``image_url`` part (not a stand-in): through a
    remote model on a localai upstream that sees images (``seer``: smollm2 with a projector), the answer and the
    prompt's tokens are the upstream's own for the same request."""
    from tests import media_files as files
    from tests.mmproj import write_mmproj

    projector = write_mmproj(tmp_path / "mmproj.gguf")
    create(remote_daemon, "seer", f"FROM {smollm2_path}\nPROJECTOR {projector}\n")
    create(remote_daemon, "far-seer", f"FROM {remote_daemon.base_url}/v1\nPARAMETER upstream_model seer\n")
    image = files.png(16, 16, (220, 20, 20))
    near = post(remote_daemon, "/v1/chat/completions", image_chat("seer", image))
    far = post(remote_daemon, "/v1/chat/completions", image_chat("far-seer", image))
    assert near.status_code == far.status_code == 200, far.text
    assert "x-localai-omitted" not in far.headers
    assert far.json()["choices"][0]["message"]["content"] == near.json()["choices"][0]["message"]["content"]
    assert far.json()["usage"]["prompt_tokens"] == near.json()["usage"]["prompt_tokens"]


def test_an_upstream_that_refuses_images_gets_stand_ins(remote_daemon: Daemon) -> None:
    """llama-cpp-python's server on a text model refuses an image part: the request goes again with the image's
    stand-in, and the response says what was left out and why."""
    from tests import media_files as files

    response = post(remote_daemon, "/v1/chat/completions", image_chat("big", files.png(16, 16, (20, 20, 220))))
    assert response.status_code == 200, response.text
    assert "upstream refused images" in response.headers["x-localai-omitted"]
    plain = post(remote_daemon, "/v1/chat/completions", {**image_chat("big", b""), "messages": [
        {"role": "user", "content": "What colour is this?"}]})
    # answered, with the stand-in's text in the prompt
    assert response.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + 10
