"""Every tool-call format round-trips: 1,000 seeded random replies per format (text, reasoning, several calls whose
arguments hold code full of markup, unicode and nested JSON), written the way each model family writes them and
fed to its parser in random pieces, come back as exactly the text, reasoning and calls that were written, with no
markup leaked into the text. Then the bad inputs: truncated calls, unknown functions, unclosed parameters."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import pytest

from localai.models.modelfile import PARSERS
from localai.runtime.formats import FORMATS, parser_for
from localai.runtime.formats.json_calls import DEEPSEEK_CLOSE, DEEPSEEK_OPEN, DEEPSEEK_OUTER, DEEPSEEK_SEP
from localai.schema import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

CASES = 1000
SCHEMAS: dict[str, dict[str, Any]] = {
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]},
    "edit": {"type": "object", "properties": {
        "file": {"type": "string"}, "line": {"type": "integer"}, "replace_all": {"type": "boolean"},
        "ratio": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": "array"}}},
    "run_shell": {"type": "object", "properties": {"command": {"type": ["string", "null"]}}},
}
CODE_BITS = ["<", ">", "&", "&amp;", '"', "'", "\\", "\\n", "</div>", "<tool_call>", "</tool_call>", "</function>",
             "<parameter=x>", "<arg_key>", "[ARGS]", "{", "}", "[", "]", "if a < b && c > d:", "print(\"héllo\")",
             "日本語", "😀", DEEPSEEK_CLOSE, "\t", "    ", "</parameter>", "<|channel|>", "x = {'a': [1, 2]}",
             "// comment", "<!-- -->", "null"]


AMBIGUOUS = re.compile(r"</parameter>\s*(<parameter=(path|content|file|line|replace_all|ratio|options|tags|command)>"
                       r"|</function>\s*(</tool_call>|<tool_call>|$)|</tool_call>)|</arg_value>\s*(<arg_key>|</tool_call>)")


def code(rng: random.Random, lines: int) -> str:
    """Code full of markup, short of the one thing no tag format can tell from its own end: a closing tag followed
    by the next tag of the same call (``</parameter>`` then ``<parameter=path>`` of a parameter not given yet)."""
    while AMBIGUOUS.search(text := _code(rng, lines)):
        pass
    return text


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for _ in range(lines):
        out.append("".join(rng.choice(CODE_BITS) if rng.random() < 0.4 else rng.choice("abcdefgh_ =()")
                           for _ in range(rng.randrange(0, 12))))
    text = "\n".join(out)
    if rng.random() < 0.2:
        text = "\n" + text  # values may begin or end with blank lines of their own
    if rng.random() < 0.2:
        text += "\n"
    return text


def nested(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["int", "str", "list", "dict", "bool", "null", "float"] if depth < 3 else ["int", "str"])
    if kind == "list":
        return [nested(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == "dict":
        return {f"k{i}": nested(rng, depth + 1) for i in range(rng.randrange(0, 4))}
    return {"int": rng.randrange(-10**6, 10**6), "str": "v<&>\"é", "bool": rng.random() < 0.5, "null": None,
            "float": rng.randrange(-1000, 1000) / 8}[kind]


def arguments(rng: random.Random, name: str) -> dict[str, Any]:
    if name == "write_file":
        return {"path": f"src/{rng.randrange(100)}/ü.py", "content": code(rng, rng.randrange(0, 40))}
    if name == "edit":
        args: dict[str, Any] = {"file": code(rng, 1) or "f"}
        for key, make in (("line", lambda: rng.randrange(-5, 10**6)), ("replace_all", lambda: rng.random() < .5),
                          ("ratio", lambda: rng.randrange(-100, 100) / 4), ("options", lambda: {
                              "a": nested(rng), "b": [nested(rng)]}), ("tags", lambda: [nested(rng)])):
            if rng.random() < 0.7:
                args[key] = make()
        return args
    return {"command": code(rng, rng.randrange(1, 3))} if rng.random() < 0.8 else {"command": None}


def text_piece(rng: random.Random) -> str:
    words = ["Let me", "write", "the file", "now.", "é", "😀", "-", "1.", "a", "b"]
    return " ".join(rng.choice(words) for _ in range(rng.randrange(1, 8)))


# -- how each family writes a reply -------------------------------------------------------------------------------

def xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def qwen3_coder(call: tuple[str, dict[str, Any]]) -> str:
    name, args = call
    params = "".join(f"<parameter={key}>\n{xml_value(value)}\n</parameter>\n" for key, value in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm(call: tuple[str, dict[str, Any]]) -> str:
    name, args = call
    params = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{xml_value(value)}</arg_value>\n"
                     for key, value in args.items())
    return f"<tool_call>{name}\n{params}</tool_call>"


def write(style: str, text: str, reasoning: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """A reply as a model of ``style`` writes it."""
    dumps: Callable[[Any], str] = lambda value: json.dumps(value, ensure_ascii=False)  # noqa: E731
    think = f"<think>{reasoning}</think>\n\n" if reasoning and style != "harmony" else ""
    if style == "harmony":
        out = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
        if text:
            out += f"<|channel|>commentary<|message|>{text}<|end|><|start|>assistant"
        for name, args in calls:
            out += f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{dumps(args)}<|call|>"
            out += "<|start|>assistant"
        return out.removesuffix("<|start|>assistant")
    body = {
        "hermes": lambda: "\n".join(f'<tool_call>\n{dumps({"name": n, "arguments": a})}\n</tool_call>'
                                    for n, a in calls),
        "llama3": lambda: "<|python_tag|>" + dumps({"name": calls[0][0], "parameters": calls[0][1]}),
        "mistral": lambda: "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a} for n, a in calls]),
        "mistral-args": lambda: "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a)}" for n, a in calls),
        "deepseek-v3.1": lambda: DEEPSEEK_OUTER[0] + "".join(
            f"{DEEPSEEK_OPEN}{n}{DEEPSEEK_SEP}{dumps(a)}{DEEPSEEK_CLOSE}" for n, a in calls) + DEEPSEEK_OUTER[1],
        "qwen3-coder": lambda: "\n".join(qwen3_coder(call) for call in calls),
        "glm-4.5": lambda: "\n".join(glm(call) for call in calls),
    }[style]
    return think + text + ("\n\n" if text and calls else "") + (body() if calls else "")


def parse(style: str, output: str, rng: random.Random, *, reasoning: bool = True) -> list[Event]:
    parser = parser_for("mistral" if style == "mistral-args" else style, tools=True, reasoning=reasoning,
                        functions=SCHEMAS)
    events: list[Event] = []
    at = 0
    while at < len(output):
        step = rng.choice([1, 2, 3, 7, 40, 400])
        events += parser.feed(output[at:at + step])
        at += step
    events += parser.finish()
    return events


def outcome(events: list[Event]) -> tuple[str, str, list[tuple[str, Any]]]:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = []
    deltas: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            deltas[event.index] = deltas.get(event.index, "") + event.arguments
        if isinstance(event, ToolCallEnd):
            assert deltas.get(event.index, "") == event.arguments  # the streamed pieces are the arguments
            calls.append((event.name, json.loads(event.arguments)))
    starts = [e.name for e in events if isinstance(e, ToolCallStart)]
    assert starts == [name for name, _ in calls]
    return text, reasoning, calls


STYLES = ["hermes", "llama3", "mistral", "mistral-args", "qwen3-coder", "harmony", "glm-4.5", "deepseek-v3.1"]


def test_the_parser_names_are_the_modelfiles() -> None:
    assert tuple(PARSERS) == tuple(FORMATS)


@pytest.mark.parametrize("style", STYLES)
def test_every_format_round_trips_a_thousand_random_replies(style: str) -> None:
    rng = random.Random(f"roundtrip-{style}")
    for case in range(CASES):
        count = 1 if style == "llama3" else rng.randrange(0, 4)
        calls = [(name, arguments(rng, name)) for name in rng.choices(list(SCHEMAS), k=count)]
        text = text_piece(rng) if rng.random() < 0.6 or not calls else ""
        if style == "llama3" and calls:
            text = ""  # Llama 3 writes a call alone
        reasoning = text_piece(rng) if rng.random() < 0.5 else ""
        output = write(style, text, reasoning, calls)
        got = outcome(parse(style, output, rng))
        assert got == (text, reasoning, calls), f"case {case}: {output!r}"


# -- bad input: never a crash, never a lost reply ------------------------------------------------------------------

@pytest.mark.parametrize(("style", "output", "text", "calls"), [
    # cut off by the token limit inside a value: the call ends with what was written (the finish reason says why)
    ("qwen3-coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
                    "print(1)", "", [("write_file", {"path": "a.py", "content": "print(1)"})]),
    ("qwen3-coder", "<tool_call>\n<function=write_file>\n<parameter=pa", "", [("write_file", {})]),
    ("glm-4.5", "<tool_call>run_shell\n<arg_key>command</arg_key>\n<arg_value>ls -", "",
     [("run_shell", {"command": "ls -"})]),
    # a function the request did not offer: text, never a call the client cannot run
    ("qwen3-coder", "<tool_call>\n<function=format_disk>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=format_disk>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>", []),
    ("glm-4.5", "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
     "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", []),
    ("harmony", "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>",
     "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>", []),
    ("deepseek-v3.1", f"{DEEPSEEK_OPEN}nope{DEEPSEEK_SEP}{{}}{DEEPSEEK_CLOSE}",
     f"{DEEPSEEK_OPEN}nope{DEEPSEEK_SEP}{{}}{DEEPSEEK_CLOSE}", []),
    # arguments that do not match the schema: typed as far as they go, kept as text where they are not JSON
    ("qwen3-coder", "<tool_call>\n<function=edit>\n<parameter=line>\nten\n</parameter>\n</function>\n</tool_call>",
     "", [("edit", {"line": "ten"})]),
    # markup that is not a call stays text
    ("qwen3-coder", "Use <function=...> tags like <parameter=x>.", "Use <function=...> tags like <parameter=x>.", []),
    ("mistral", "[TOOL_CALLS] is a marker", "[TOOL_CALLS] is a marker", []),
    ("harmony", "no channels here", "no channels here", []),
    ("harmony", "<|channel|>final<|message|>cut off", "cut off", []),
])
def test_bad_input_is_text_or_a_closed_call_never_a_crash(style: str, output: str, text: str,
                                                         calls: list[tuple[str, Any]]) -> None:
    for seed in range(5):
        got_text, _, got_calls = outcome(parse(style, output, random.Random(seed), reasoning=False))
        assert (got_text, got_calls) == (text, calls)


def test_a_qwen3_coder_file_of_thousands_of_lines_streams_as_it_is_written() -> None:
    """The case Ollama's parser fails (ollama #18563): a 3,000-line file holding its own closing tags."""
    rng = random.Random(7)
    content = code(rng, 3000) + "\ns = '</parameter>'\n"
    output = qwen3_coder(("write_file", {"path": "big.py", "content": content}))
    parser = parser_for("qwen3-coder", tools=True, reasoning=False, functions=SCHEMAS)
    streamed = 0
    for at in range(0, len(output), 50):
        events = parser.feed(output[at:at + 50])
        streamed += sum(len(e.arguments) for e in events if isinstance(e, ToolCallDelta))
        if at > len(output) // 2:
            assert streamed > len(content) // 3  # the arguments grew while the file was being written
    parser.finish()
    assert json.loads(parser.calls[0].arguments)["content"] == content


@pytest.mark.parametrize("style", ["glm-4.5", "qwen3-coder", "deepseek-v3.1"])
def test_a_reply_after_a_prompt_that_opened_the_reasoning_starts_inside_it(style: str) -> None:
    """GLM-4.7's and Qwen3's thinking templates end the prompt with <think>: the model writes its reasoning and
    </think> only; with ``opened`` the parser starts inside the reasoning (without it, it would be text)."""
    parser = parser_for(style, tools=True, reasoning=True, functions=dict(SCHEMAS), opened=True)
    events = [*parser.feed("I should write it.</think>\n\nDone."), *parser.finish()]
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "I should write it."
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Done."


@pytest.mark.parametrize("style", ["qwen3-coder", "glm-4.5"])
def test_a_parameter_given_by_ref_is_typed_from_its_definition(style: str) -> None:
    """A tagged call's values are typed from the tool's schema, a local $ref followed: Pydantic's nested model
    ({"$ref": "#/$defs/Place"}) comes back as an object, not as the text of one."""
    schema = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}, "n": {"$ref": "#/$defs/N"}},
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}},
                        "N": {"type": "integer"}}}
    output = {"qwen3-coder": '<tool_call>\n<function=find>\n<parameter=where>\n{"city": "Paris"}\n</parameter>\n'
                             '<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>',
              "glm-4.5": '<tool_call>find\n<arg_key>where</arg_key>\n<arg_value>{"city": "Paris"}</arg_value>\n'
                         '<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>'}[style]
    parser = parser_for(style, tools=True, reasoning=False, functions={"find": schema})
    _, _, calls = outcome([*parser.feed(output), *parser.finish()])
    assert calls == [("find", {"where": {"city": "Paris"}, "n": 3})]
