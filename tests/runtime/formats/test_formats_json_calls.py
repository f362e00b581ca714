"""The output parser: every tool-call family, streamed in small pieces, and text that only looks like a call."""

from __future__ import annotations

import json

import pytest

from localai.runtime.formats.json_calls import JsonScan, OutputParser
from localai.schema import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart


def parse(text: str, *, chunk: int = 3, tools: bool = True, reasoning: bool = False) -> list[Event]:
    parser = OutputParser(tools=tools, reasoning=reasoning)
    events: list[Event] = []
    for start in range(0, len(text), chunk):
        events += parser.feed(text[start:start + chunk])
    return events + parser.finish()


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def calls_of(events: list[Event]) -> list[tuple[str, dict[str, object]]]:
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize(("output", "expected_text"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ""),
    ('Let me check.\n<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>', "Let me check."),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),  # Llama 3
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),  # Mistral
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
    ('{"arguments": {"city": "Paris"}, "name": "get_weather"}', ""),  # name last: whole call at the end
    ('{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}', ""),
])
def test_each_family_parses_to_one_call(output: str, expected_text: str, chunk: int) -> None:
    events = parse(output, chunk=chunk)
    assert calls_of(events) == [("get_weather", {"city": "Paris"})]
    assert text_of(events) == expected_text


def test_arguments_stream_while_written_and_concatenate_to_the_final_arguments() -> None:
    events = parse('<tool_call>\n{"name": "write", "arguments": {"path": "a}b.txt", "body": "x\\"y"}}\n</tool_call>',
                   chunk=2)
    deltas = [e.arguments for e in events if isinstance(e, ToolCallDelta)]
    assert len(deltas) > 3  # streamed, not sent whole at the end
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert "".join(deltas) == end.arguments
    assert json.loads(end.arguments) == {"path": "a}b.txt", "body": 'x"y'}
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert (start.id, start.index) == (end.id, 0)


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_a_closing_marker_inside_the_arguments_is_part_of_them(chunk: int) -> None:
    # A forced call (tool_choice required) once came back cut at a "</tool_call>" smollm2 wrote inside a string,
    # arguments '{"city": "][0]}</tool_call>': not JSON. Only a marker outside the JSON's strings ends the call.
    events = parse('<tool_call>\n{"name": "write", "arguments": {"text": "a</tool_call>\\"</tool_call>b"}}'
                   '\n</tool_call>\nDone.', chunk=chunk)
    assert calls_of(events) == [("write", {"text": 'a</tool_call>"</tool_call>b'})]
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert "".join(e.arguments for e in events if isinstance(e, ToolCallDelta)) == end.arguments
    assert text_of(events) == "Done."


def test_broken_json_still_ends_at_its_closing_marker() -> None:
    # An unterminated string is read as far as the first marker once the output ends: the text after it stays text.
    events = parse('<tool_call>\n{"name": "f", "arguments": {"a": "b}}\n</tool_call>\nAfter.')
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.name == "f" and end.arguments.startswith('{"a": "b')
    assert text_of(events) == "After."


def test_several_calls_get_their_own_index_and_id() -> None:
    events = parse('<tool_call>{"name":"a","arguments":{"x":1}}</tool_call>\n'
                   '<tool_call>{"name":"b","arguments":{}}</tool_call>')
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.index, e.name) for e in ends] == [(0, "a"), (1, "b")]
    assert ends[0].id != ends[1].id
    assert text_of(events) == ""


@pytest.mark.parametrize("output", [
    '{"answer": 42}', "[1, 2, 3]", "Use braces {like this} freely.", "a <tool is not a marker", "[TOOL",
    '{"name": "not a call, just a name"}',
])
def test_text_that_only_looks_like_a_call_stays_text(output: str) -> None:
    events = parse(output)
    assert calls_of(events) == []
    assert text_of(events) == output


def test_without_tools_nothing_is_parsed() -> None:
    output = '<tool_call>{"name":"a","arguments":{}}</tool_call>'
    assert text_of(parse(output, tools=False)) == output


def test_a_call_cut_off_by_the_token_limit_still_ends() -> None:
    events = parse('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.name == "f" and end.arguments.startswith('{"a": [1')


def test_leading_think_block_becomes_reasoning() -> None:
    events = parse("<think>\nCompare the options.\n</think>\n\nThe answer.", reasoning=True, tools=False, chunk=2)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning.strip() == "Compare the options."
    assert text_of(events) == "The answer."


def test_reasoning_then_a_call() -> None:
    events = parse('<think>weather needs a tool</think><tool_call>{"name":"w","arguments":{}}</tool_call>',
                   reasoning=True)
    assert isinstance(events[0], ReasoningDelta)
    assert calls_of(events) == [("w", {})]


@pytest.mark.parametrize("text", [
    '{"a": "}\\"]", "b": [1, {"c": 2}]} tail', '[[], {"x": "[{"}] more', '"a \\" b" c', "  {}", "plain", '{"a": 1',
    '{"unterminated": "x', "", "  ", '["\\\\"]x',
])
def test_a_scan_fed_a_growing_text_agrees_with_a_fresh_scan_at_every_length(text: str) -> None:
    start = len(text) - len(text.lstrip())
    scan = JsonScan(start)
    for length in range(len(text) + 1):
        assert scan.end_in(text[:length]) == JsonScan(start).end_in(text[:length]), length


def test_a_scan_respects_strings_and_nesting() -> None:
    assert JsonScan().end_in('{"a": "}", "b": [1, {"c": 2}]} tail') == len('{"a": "}", "b": [1, {"c": 2}]}')
    assert JsonScan().end_in('{"a": 1') is None
    assert JsonScan().end_in("plain") is None


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("output", [
    '<tool_call>\n{"name": "<function name>", "arguments": {}}\n</tool_call>',  # smollm2 copying the preamble
    '{"name": "rm_rf", "parameters": {"path": "/"}}',
    '[TOOL_CALLS] [{"name": "invented", "arguments": {}}]',
    '{"arguments": {}, "name": "invented"}',
])
def test_a_call_of_a_function_not_offered_is_text(output: str, chunk: int) -> None:
    parser = OutputParser(tools=True, reasoning=False, names=["get_weather"])
    events: list[Event] = []
    for start in range(0, len(output), chunk):
        events += parser.feed(output[start:start + chunk])
    events += parser.finish()
    assert not [e for e in events if isinstance(e, ToolCallStart | ToolCallDelta | ToolCallEnd)]
    assert "invented" in text_of(events) or "rm_rf" in text_of(events) or "<function name>" in text_of(events)
    assert not parser.calls


def test_offered_calls_still_parse_among_unknown_ones() -> None:
    parser = OutputParser(tools=True, reasoning=False, names=["get_weather"])
    output = ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    events = parser.feed(output) + parser.finish()
    assert calls_of(events) == [("get_weather", {"city": "Oslo"})]
    assert "nope" in text_of(events)
