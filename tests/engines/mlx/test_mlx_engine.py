"""The MLX engine through the real daemon: a real MLX model (SmolLM2's own weights) on mlx-lm's CPU backend.

MLX on this CPU decodes a few tokens a second, so replies here are short; each dialect and feature runs once.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Daemon, cached, corrupt_cache_files, start_daemon
from tests.conftest import chat as shared_chat
from tests.engines.mlx.conftest import MLX_MODEL, assert_blocks_round_trip, create_mlx_model

SYSTEM = "You are a careful coding assistant. " + "Follow the project's conventions and explain briefly. " * 12
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# The conversion check: greedy replies of both engines on the same weights (8 prompts).
PROMPTS = ["What is the capital of France?", "Name a primary colour.", "Write a haiku about rain.", "What is 2+2?",
           "Explain what a compiler does.", "Say hello in Spanish.", "What is Python?",
           "Give one tip for sleeping well."]


def chat(daemon: Daemon, messages: list[dict[str, Any]], model: str = MLX_MODEL, **extra: Any) -> dict[str, Any]:
    return shared_chat(daemon, messages, model=model, **{"max_tokens": 6, **extra})


def text(result: dict[str, Any]) -> str:
    return str(result["choices"][0]["message"]["content"])


def test_the_converted_model_answers_like_the_gguf_it_came_from(daemon: Daemon, mlx_daemon: Daemon) -> None:
    """Same weights, two engines, greedy: the first word agrees on nearly every prompt (measured: 7 of 8; all 8
    words on 5 of 8; llama.cpp multiplies Q4_1 weights by 8-bit quantized activations, MLX in float16)."""
    first_words = 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        gguf, mlx = text(chat(daemon, messages, model="smollm2", max_tokens=4)), text(chat(mlx_daemon, messages,
                                                                                        max_tokens=4))
        assert mlx.strip(), f"the MLX model gave nothing for {prompt!r}"
        first_words += gguf.split()[:1] == mlx.split()[:1]
    assert first_words >= 6, f"only {first_words} of {len(PROMPTS)} prompts start alike: the conversion is off"


def test_openai_chat_plain_and_streamed_give_the_same_greedy_text_and_logprobs(mlx_daemon: Daemon) -> None:
    with openai.OpenAI(base_url=f"{mlx_daemon.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
        plain = client.chat.completions.create(model=MLX_MODEL, messages=messages, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=3)
        assert plain.choices[0].message.content and "Paris" in plain.choices[0].message.content
        chunks = list(client.chat.completions.create(model=MLX_MODEL, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     logprobs=True, top_logprobs=3))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]
    # logprobs from the MLX model's logits: the greedy token the likeliest, streamed as plain
    entries = plain.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries and "".join(e.token for e in entries) == plain.choices[0].message.content
    for entry in entries:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob < 0.01
    streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed_entries] == [e.token for e in entries]
    assert [e.logprob for e in streamed_entries] == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_sampling_fields_and_seed_are_honoured(mlx_daemon: Daemon) -> None:
    body: dict[str, Any] = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                            "frequency_penalty": 0.5, "seed": 11, "max_tokens": 6}
    first = text(chat(mlx_daemon, ASK, **body))
    assert first == text(chat(mlx_daemon, ASK, **body))  # the same seed, the same tokens
    with mlx_daemon.http(timeout=300) as http:
        stopped = http.post("/api/generate", json={"model": MLX_MODEL, "prompt": "Count: 1, 2, 3,", "raw": True,
                                                   "stream": False, "options": {"temperature": 0, "stop": [","],
                                                                                "num_predict": 8,
                                                                                "repeat_penalty": 1.2}})
    assert stopped.status_code == 200, stopped.text
    assert "," not in stopped.json()["response"] and stopped.json()["done_reason"] == "stop"


def test_responses_anthropic_and_ollama_dialects(mlx_daemon: Daemon) -> None:
    with openai.OpenAI(base_url=f"{mlx_daemon.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as sdk:
        response = sdk.responses.create(model=MLX_MODEL, input="What is the capital of France?", max_output_tokens=8,
                                        temperature=0)
    assert "Paris" in response.output_text
    with anthropic.Anthropic(base_url=mlx_daemon.base_url, api_key="unused", max_retries=0, timeout=300) as claude:
        message = claude.messages.create(model=MLX_MODEL, max_tokens=8, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert message.content[0].type == "text" and "Paris" in message.content[0].text
    with mlx_daemon.http(timeout=300) as http, http.stream("POST", "/api/chat", json={
            "model": MLX_MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "options": {"temperature": 0, "num_predict": 8}}) as stream:
        lines = [json.loads(line) for line in stream.iter_lines() if line]
    assert "Paris" in "".join(line["message"]["content"] for line in lines if not line["done"])
    assert lines[-1]["done"] and lines[-1]["eval_count"] > 0


def test_forced_tool_calls_and_json_schema_are_grammar_constrained(mlx_daemon: Daemon) -> None:
    forced = chat(mlx_daemon, ASK, tools=[WEATHER], max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = forced["choices"][0]["message"]["tool_calls"][0]["function"]
    assert forced["choices"][0]["finish_reason"] == "tool_calls"
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}  # no invented keys
    with mlx_daemon.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json={
            "model": MLX_MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "stream": True,
            "max_tokens": 40, "temperature": 0}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    deltas = [d for e in events for d in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"]]
    assert deltas and deltas[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(d["function"].get("arguments") or "" for d in deltas))["city"]
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    shaped = chat(mlx_daemon, [{"role": "user", "content": "Invent a person."}], max_tokens=40,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})
    value = json.loads(text(shaped))  # the whole reply is the JSON value: the grammar ends the generation
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert shaped["choices"][0]["finish_reason"] == "stop"


def test_auto_tool_calls_are_parsed_and_tool_results_continue(mlx_daemon: Daemon) -> None:
    auto = chat(mlx_daemon, ASK, tools=[WEATHER], max_tokens=40)
    message = auto["choices"][0]["message"]
    if message.get("tool_calls"):  # smollm2 may or may not call: whatever it does must be well formed
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
        json.loads(message["tool_calls"][0]["function"]["arguments"])
    else:
        assert message["content"]
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    assert text(chat(mlx_daemon, follow, tools=[WEATHER], tool_choice="none", max_tokens=12)).strip()


def test_ps_show_and_tags_name_the_mlx_engine_and_embeddings_work(mlx_daemon: Daemon) -> None:
    with mlx_daemon.http(timeout=300) as http:
        embedded = http.post("/v1/embeddings", json={"model": MLX_MODEL, "input": ["hello", "a longer sentence"]})
        assert embedded.status_code == 200, embedded.text
        vectors = [item["embedding"] for item in embedded.json()["data"]]
        assert len(vectors) == 2 and len(vectors[0]) == 576 and vectors[0] != vectors[1]
        running = {m["name"]: m for m in http.get("/api/ps").json()["models"]}
        assert running[f"{MLX_MODEL}:latest"]["engine"] == "mlx"
        assert http.post("/api/show", json={"model": MLX_MODEL}).json()["engine"] == "mlx"
    listed = mlx_daemon.cli("ps")
    assert listed.returncode == 0 and "mlx" in listed.stdout.split("\n", 1)[1]
    assert "engine" in mlx_daemon.cli("show", MLX_MODEL).stdout


def test_interleaved_sessions_each_keep_their_kv(mlx_daemon: Daemon, mlx_arch_fixtures: dict[str, Path]) -> None:
    """Cache mechanics, not answers: on the tiny random-weight llama folder (tests/mlxarch.py)."""
    tiny = create_mlx_model(mlx_daemon, mlx_arch_fixtures["llama"], name="tiny-mlx-llama")
    sessions = {name: [{"role": "system", "content": f"Session {name}. {SYSTEM}"},
                       {"role": "user", "content": f"Hello from {name}"}] for name in ("red", "blue", "green")}
    previous: dict[str, int] = {}
    for turn in range(2):
        for name, messages in sessions.items():
            result = chat(mlx_daemon, messages, model=tiny, max_tokens=3, prompt_cache_key=f"mlx-{name}")
            if turn:  # more sessions than sequences (2): each resumes from its own cached prefix
                assert cached(result) >= previous[name], (name, result["usage"])
            previous[name] = result["usage"]["total_tokens"] - 1
            messages += [{"role": "assistant", "content": text(result)}, {"role": "user", "content": "Go on."}]


def test_restart_resumes_from_disk_and_a_corrupt_file_is_never_served(tmp_path: Path,
                                                                     mlx_arch_fixtures: dict[str, Path]) -> None:
    """Cache mechanics, not answers: on the tiny random-weight llama folder (tests/mlxarch.py)."""
    mlx_model_path = mlx_arch_fixtures["llama"]
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a linked list?"}]
    with start_daemon(tmp_path / "home") as daemon:
        create_mlx_model(daemon, mlx_model_path)
        first = chat(daemon, turn1)
    layouts = [json.loads(path.read_text()) for path in (tmp_path / "home" / "cache").glob("*/layout.json")]
    assert layouts and all(layout["layout"]["mlx"] == 1 for layout in layouts)  # stored as token blocks
    turn2 = [*turn1, {"role": "assistant", "content": text(first)}, {"role": "user", "content": "And a queue?"}]
    with start_daemon(tmp_path / "home") as daemon:  # a new daemon and worker: only the disk remembers
        resumed = chat(daemon, turn2)
        assert cached(resumed) >= first["usage"]["prompt_tokens"] - 1
        stats = daemon.cli("cache", "ls").stdout
        assert "history" in stats
        with daemon.http() as http:
            metrics = http.get("/metrics").text.splitlines()
        counter = f'localai_prompt_tokens_cached_total{{model="{MLX_MODEL}'
        reused = [line for line in metrics if line.startswith(counter)]
        assert reused and float(reused[0].split()[-1]) >= cached(resumed)
    with start_daemon(tmp_path / "nocache", cache_max_bytes="0") as baseline:
        create_mlx_model(baseline, mlx_model_path)
        fresh = chat(baseline, turn2)
    assert cached(fresh) == 0 and text(resumed) == text(fresh)
    assert corrupt_cache_files(tmp_path / "home")
    with start_daemon(tmp_path / "home") as daemon:
        again = chat(daemon, turn2)
        assert cached(again) == 0 and text(again) == text(fresh)
        assert "dropping damaged cache" in (tmp_path / "home" / "logs" / "workers.log").read_text()


def test_mlx_worker_killed_mid_stream_errors_clearly_and_the_next_request_reloads(tmp_path: Path,
                                                                                  mlx_model_path: Path) -> None:
    with start_daemon(tmp_path / "home") as daemon:
        create_mlx_model(daemon, mlx_model_path)
        body = {"model": MLX_MODEL, "messages": [{"role": "user", "content": "Count from one to one thousand."}],
                "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        with daemon.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: ") and '"content"' in line:
                    break
            pid = int(http.get("/api/ps").json()["models"][0]["pid"])
            os.kill(pid, signal.SIGKILL)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [p for p in rest if "error" in p][-1]["error"]["code"] == "worker_crashed"
        again = chat(daemon, [{"role": "user", "content": "Hi"}], max_tokens=2)
        assert again["usage"]["completion_tokens"] > 0
        with daemon.http() as http:
            assert int(http.get("/api/ps").json()["models"][0]["pid"]) != pid


def test_an_mlx_model_where_mlx_does_not_import_gets_a_400_naming_the_extra(
        tmp_path: Path, mlx_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shadow = tmp_path / "shadow" / "mlx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this mlx is broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with start_daemon(tmp_path / "home") as daemon:
        create_mlx_model(daemon, mlx_model_path)
        with daemon.http() as http:
            response = http.post("/v1/chat/completions", json={"model": MLX_MODEL, "messages": ASK})
            assert response.status_code == 400
            assert "localai[mlx]" in response.json()["error"]["message"]
            pinned = http.post("/api/create", json={"model": "gguf-on-llama", "modelfile": "FROM smollm2\n"})
            assert pinned.status_code == 200  # GGUF models are unaffected
            assert http.post("/v1/chat/completions", json={"model": "gguf-on-llama", "messages": ASK,
                                                          "max_tokens": 2}).status_code == 200


def test_a_gguf_pinned_to_mlx_and_an_unknown_engine_are_refused(mlx_daemon: Daemon) -> None:
    with mlx_daemon.http() as http:
        unknown = http.post("/api/create", json={"model": "bad-engine",
                                                 "modelfile": "FROM smollm2\nPARAMETER engine vllm\n"})
        assert unknown.status_code == 400 and "line 2" in unknown.json()["error"]
        assert http.post("/api/create", json={"model": "gguf-mlx", "modelfile": "FROM smollm2\nPARAMETER engine mlx\n"}
                         ).status_code == 200
        refused = http.post("/v1/chat/completions", json={"model": "gguf-mlx", "messages": ASK})
    assert refused.status_code == 400 and "cannot load gguf" in refused.json()["error"]["message"]


@pytest.mark.parametrize("state", [b"", b"\x00\x00\x00\x00", b"\xff\xff\xff\x7fgarbage", b"\x05\x00\x00\x00{\"la"])
def test_mlx_state_restore_refuses_malformed_bytes(state: bytes, mlx_model_path: Path) -> None:
    """A damaged state never reaches a sequence (the cache's checksum catches damage first; this is the floor)."""
    from localai.engines.engine import LoadOptions
    from localai.engines.mlx import MlxEngine

    engine = MlxEngine(LoadOptions(model_path=str(mlx_model_path), num_ctx=512, n_parallel=1, n_batch=64))
    assert engine.seq_restore(0, state) is False
    assert engine.caches[0][0].offset == 0


def test_mlx_states_are_cut_into_token_blocks_and_put_back_bit_for_bit(mlx_model_path: Path) -> None:
    """The prompt cache stores an MLX sequence as token blocks: cutting its state by token range and joining the
    pieces gives the same bytes, and the first pieces alone give the state of that shorter prefix, which restores
    and continues exactly as the sequence computed directly does."""
    from localai.engines.engine import LoadOptions
    from localai.engines.mlx import MlxEngine

    engine = MlxEngine(LoadOptions(model_path=str(mlx_model_path), num_ctx=512, n_parallel=2, n_batch=64))
    tokens = engine.tokenize(SYSTEM * 2)[:150]
    layout, pieces, rest, state = assert_blocks_round_trip(engine, tokens)
    with pytest.raises(ValueError):
        engine.state_split(state, len(tokens) + 1, [(0, 64)])
    with pytest.raises(ValueError):
        engine.state_join(layout, [pieces[0][:-2]], [64], rest)


def test_forced_calls_of_tools_with_defs_and_recursive_refs(mlx_daemon: Daemon) -> None:
    """llguidance takes each tool's $defs/$ref schema (Pydantic's shape for nested models): the forced call keeps to
    its own definitions; a recursive one compiles too (smollm2 may then write whitespace to its limit, which JSON
    allows: only the call's name is checked there)."""
    place = {"type": "object", "required": ["city"], "additionalProperties": False,
             "properties": {"city": {"type": "string", "maxLength": 20}}}
    route = {"type": "function", "function": {"name": "plan_route", "description": "Plan a route to a place",
                                              "parameters": {"$defs": {"Place": place}, "type": "object",
                                                             "required": ["to"], "additionalProperties": False,
                                                             "properties": {"to": {"$ref": "#/$defs/Place"}}}}}
    forced = chat(mlx_daemon, ASK, tools=[route], max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "plan_route"}})
    assert forced["choices"][0]["finish_reason"] == "tool_calls", forced["choices"][0]["message"]
    arguments = json.loads(forced["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert set(arguments) == {"to"} and set(arguments["to"]) == {"city"} and isinstance(arguments["to"]["city"], str)
    node = {"type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 8},
                           "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Node"}}}}
    tree = {"type": "function", "function": {"name": "make_tree", "description": "Make a tree of named nodes",
                                             "parameters": {"$ref": "#/$defs/Node", "$defs": {"Node": node}}}}
    recursive = chat(mlx_daemon, [{"role": "user", "content": "Make a tree."}], tools=[tree], max_tokens=30,
                     tool_choice="required")
    assert recursive["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "make_tree"
