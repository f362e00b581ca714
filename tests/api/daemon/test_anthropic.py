"""Anthropic Messages through the real daemon and the real anthropic SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.api.daemon.streams import check_anthropic_stream, named_events
from tests.conftest import Daemon, start_daemon

WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"]}}
SYSTEM: Any = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]


@pytest.fixture
def sdk(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.base_url, api_key="unused", max_retries=0) as client:
        yield client


def test_create_with_system_blocks(sdk: anthropic.Anthropic) -> None:
    message = sdk.messages.create(model="smollm2", max_tokens=24, system=SYSTEM, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": "Name a colour."}])
    assert message.role == "assistant" and message.type == "message"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_text(sdk: anthropic.Anthropic) -> None:
    with sdk.messages.stream(model="smollm2", max_tokens=20, messages=[{"role": "user", "content": "Say hi."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_named_tool_choice_gives_a_valid_tool_use(sdk: anthropic.Anthropic) -> None:
    message = sdk.messages.create(model="smollm2", max_tokens=64, tools=[WEATHER],  # type: ignore[list-item]
                                  tool_choice={"type": "tool", "name": "get_weather"},
                                  messages=[{"role": "user", "content": "Weather in Rome?"}])
    assert message.stop_reason == "tool_use"
    use = message.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])  # type: ignore[arg-type]


def test_streamed_tool_use_sends_input_json_deltas(daemon: Daemon) -> None:
    body = {"model": "smollm2", "max_tokens": 64, "stream": True, "tools": [WEATHER], "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Weather in Rome?"}]}
    with daemon.http() as http:
        events = named_events(http, "/v1/messages?beta=true", body)
    result = check_anthropic_stream(events)
    assert result["stop_reason"] == "tool_use"
    assert any(name == "content_block_delta" and data["delta"]["type"] == "input_json_delta" for name, data in events)
    use = result["blocks"][-1]
    assert use["type"] == "tool_use" and use["name"] == "get_weather"
    jsonschema.validate(use["input"], WEATHER["input_schema"])


def test_tool_result_turn_and_cache_reads(sdk: anthropic.Anthropic) -> None:
    messages: Any = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "Sunny, 25C"}]}]},
    ]
    first = sdk.messages.create(model="smollm2", max_tokens=16, tools=[WEATHER], messages=messages,  # type: ignore[list-item]
                                system=SYSTEM, extra_body={"temperature": 0}, tool_choice={"type": "none"})
    again = sdk.messages.create(model="smollm2", max_tokens=16, tools=[WEATHER], messages=messages,  # type: ignore[list-item]
                                system=SYSTEM, extra_body={"temperature": 0}, tool_choice={"type": "none"})
    assert first.content[0].type == "text"
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert again.usage.cache_read_input_tokens == total - 1  # all but the replayed last token
    assert again.usage.input_tokens == 1


def test_count_tokens_is_the_real_prompt_size(sdk: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "Weather in Rome?"}]
    counted = sdk.messages.count_tokens(model="smollm2", messages=messages, tools=[WEATHER], system=SYSTEM)  # type: ignore[list-item]
    sent = sdk.messages.create(model="smollm2", max_tokens=1, messages=messages, tools=[WEATHER], system=SYSTEM,  # type: ignore[list-item]
                               tool_choice={"type": "none"})
    assert counted.input_tokens == sent.usage.input_tokens + (sent.usage.cache_read_input_tokens or 0)
    longer: Any = [*messages, {"role": "assistant", "content": "It is sunny."},
                   {"role": "user", "content": "And tomorrow?"}]
    assert sdk.messages.count_tokens(model="smollm2", messages=longer).input_tokens > counted.input_tokens - 200


def test_api_key_as_x_api_key_and_as_bearer(tmp_path: Any, smollm2_path: Any) -> None:
    with start_daemon(tmp_path / "keyed", api_key="s3cret") as keyed:
        ask: Any = [{"role": "user", "content": "Hi"}]
        with anthropic.Anthropic(base_url=keyed.base_url, api_key="s3cret", max_retries=0) as by_header:
            assert by_header.messages.create(model="smollm2", max_tokens=2, messages=ask).content
        with anthropic.Anthropic(base_url=keyed.base_url, auth_token="s3cret", max_retries=0) as by_bearer:
            assert by_bearer.messages.create(model="smollm2", max_tokens=2, messages=ask).content
        with anthropic.Anthropic(base_url=keyed.base_url, api_key="nope", max_retries=0) as wrong, \
                pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.create(model="smollm2", max_tokens=2, messages=ask)
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_head_root_answers(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert http.head("/").status_code == 200
