"""The OpenAI dialect through the real daemon, real llama.cpp and the real openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import Daemon

PROMPT = [{"role": "user", "content": "Name one colour."}]


@pytest.fixture
def sdk(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_chat_completion_with_usage(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert response.usage.prompt_tokens > 5
    assert 0 < response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_repeated_prompt_reports_cached_tokens(sdk: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You answer in one word. " * 20}, *PROMPT]
    first = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    second = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert first.choices[0].message.content == second.choices[0].message.content


def test_streaming_with_include_usage(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="smollm2", messages=PROMPT, max_tokens=10, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0


def test_streaming_ends_with_done(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": PROMPT, "max_tokens": 3, "stream": True}
    with daemon.http() as http:
        lines = [line for line in http.post("/v1/chat/completions", json=body).text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_content_parts_unknown_fields_and_sampling(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "yes."}]}],
        max_completion_tokens=5, temperature=0.7, top_p=0.9, seed=7, stop=["\n\n"], presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"top_k": 20, "min_p": 0.05, "store": False, "something_new": {"a": 1}},
    )
    assert response.usage is not None and response.usage.completion_tokens <= 5


def test_seed_makes_sampling_repeatable(sdk: openai.OpenAI) -> None:
    def sample() -> str | None:
        return sdk.chat.completions.create(
            model="smollm2", messages=PROMPT, max_tokens=12, temperature=1.0, seed=1234,  # type: ignore[arg-type]
        ).choices[0].message.content

    assert sample() == sample()


def test_text_completions(sdk: openai.OpenAI) -> None:
    response = sdk.completions.create(model="smollm2", prompt="The sky is", max_tokens=5, temperature=0)
    assert response.choices[0].text and response.usage and response.usage.completion_tokens > 0
    chunks = list(sdk.completions.create(model="smollm2", prompt="One, two,", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_models(sdk: openai.OpenAI) -> None:
    ids = {model.id for model in sdk.models.list()}
    assert {"smollm2:135m", "smollm2:latest"} <= ids
    assert sdk.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError) as error:
        sdk.models.retrieve("nope")
    assert "not in the library either" in str(error.value) and "localai pull nope" not in str(error.value)


def test_unknown_model_is_404_naming_the_fix(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        sdk.chat.completions.create(model="qwen9:100b", messages=PROMPT)  # type: ignore[arg-type]
    body = error.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "'qwen9:100b' is not installed" in body["message"] and "localai list --library" in body["message"]


def test_prompt_over_the_context_is_400_with_both_numbers(sdk: openai.OpenAI, daemon: Daemon) -> None:
    too_long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(
            model="smollm2", messages=too_long, max_tokens=4, extra_body={"fit_context": False},  # type: ignore[arg-type]
        )
    body = error.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert "4096" in body["message"] and "9" in body["message"].split("prompt is ")[1][:1]  # test daemons: 4096
    # by default an over-long prompt is fitted (shortened in its middle) and answered, saying so in a header;
    # a 1,024-token copy of smollm2 keeps the prefill short
    with daemon.http() as http:
        http.post("/api/create", json={"model": "smollm2-1k", "modelfile": "FROM smollm2\nPARAMETER num_ctx 1024\n"})
    long = [{"role": "user", "content": "word " * 3000}]
    fitted = sdk.chat.completions.with_raw_response.create(model="smollm2-1k", messages=long, max_tokens=2)  # type: ignore[arg-type]
    assert "shortened_chars=" in fitted.headers["x-localai-context-fitted"]
    assert fitted.parse().choices[0].finish_reason in ("stop", "length")


def test_unix_socket_serves_the_same_api(daemon: Daemon) -> None:
    assert oct(daemon.socket_path.stat().st_mode & 0o777) == "0o600"
    with openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=httpx.Client(
            transport=httpx.HTTPTransport(uds=str(daemon.socket_path)))) as client:
        response = client.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=3)  # type: ignore[arg-type]
    assert response.usage and response.usage.completion_tokens > 0


def test_health_and_version(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert http.get("/health").json()["status"] == "ok"
        assert http.get("/api/version").json()["version"]
        assert http.head("/").status_code == 200
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and "no such endpoint" in missing.json()["error"]["message"]
