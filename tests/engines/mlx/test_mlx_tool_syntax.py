"""Forced tool calls on the MLX engine in each family's own syntax: llguidance grammars that name the family's special
tokens by id (Harmony's <|channel|>, DeepSeek's call markers, Mistral's [TOOL_CALLS]/[ARGS], GLM's and Qwen3-Coder's
tags), on a random-weight folder whose tokenizer has those special tokens. Whatever the weights, the output is one
well-formed call that the family's own parser reads back."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from localai.engines.engine import BatchItem, LoadOptions
from localai.engines.grammars import JSON_ARGUMENT_CALLS, NATIVE_FORCED, TAGGED_CALLS
from localai.engines.lark_calls import marker
from localai.runtime.formats import parser_for
from localai.schema import TextDelta, ToolCallEnd
from tests.conftest import Daemon, start_daemon

BAR, SPACE = "\uff5c", "\u2581"
SPECIALS = {  # the special tokens of each family that its call markers use
    "harmony": ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"],
    "deepseek-v3.1": [f"<{BAR}tool{SPACE}calls{SPACE}begin{BAR}>", f"<{BAR}tool{SPACE}call{SPACE}begin{BAR}>",
                      f"<{BAR}tool{SPACE}sep{BAR}>", f"<{BAR}tool{SPACE}call{SPACE}end{BAR}>",
                      f"<{BAR}tool{SPACE}calls{SPACE}end{BAR}>"],
    "mistral-args": ["[TOOL_CALLS]", "[ARGS]"],
    "qwen3-coder": ["<tool_call>", "</tool_call>"],
    "glm-4.5": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
}
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}},
    {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 16}},
                                         "required": ["path"]}},
]


def with_specials(source: Path, out: Path, names: list[str]) -> Path:
    """A copy of an MLX folder whose tokenizer's unused special tokens (SmolLM2's <reponame>, <filename>...) are
    renamed to ``names``: the same ids, now the family's markers."""
    shutil.copytree(source, out)
    data = json.loads((out / "tokenizer.json").read_text())
    spare = [token for token in data["added_tokens"] if token["id"] >= 3][:len(names)]
    assert len(spare) == len(names)
    vocab = data["model"]["vocab"]
    for token, name in zip(spare, names, strict=True):
        del vocab[token["content"]]
        vocab[name] = token["id"]
        token["content"] = name
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    return out


def test_a_marker_names_special_tokens_by_id_and_the_rest_as_text() -> None:
    specials = {"<|channel|>": 5, "<|message|>": 7}
    assert marker("<|channel|>commentary to=functions.f <|message|>", specials) == \
        '<[5]> "commentary to=functions.f " <[7]>'
    assert marker("<tool_call>\n", specials) == '"<tool_call>\\n"'
    assert marker("", specials) == ""


@pytest.mark.parametrize("style", sorted(NATIVE_FORCED))
def test_a_forced_call_on_mlx_is_written_in_the_family_syntax(style: str, mlx_arch_fixtures: dict[str, Path],
                                                             tmp_path: Path) -> None:
    from localai.engines.mlx import MlxEngine

    folder = with_specials(mlx_arch_fixtures["llama"], tmp_path / style, SPECIALS[style])
    engine = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=2048, n_parallel=1, n_batch=256))
    ids = engine._special_ids()
    assert all(name in ids for name in SPECIALS[style])
    for number, tool in enumerate(TOOLS):
        constraint: Any = {"type": "tool_call", "format": style, "tools": [TOOLS[1 - number], tool]}
        prompt = engine.tokenize(f"Call {tool['name']} now, please.")
        sampler = engine.new_sampler({"temperature": 0.8, "seed": number}, constraint)
        output = generate(engine, sampler, prompt, limit=300)
        assert sampler.matcher.is_stopped(), (style, b"".join(engine.token_bytes(t) for t in output).decode()[:400])
        markers = [token for token in output if token in ids.values()]
        assert markers, f"{style}: no special token was written"  # the markers are the family's own tokens
        text = b"".join(engine.token_bytes(token) for token in output).decode()
        parser = parser_for("mistral" if style == "mistral-args" else style, tools=True, reasoning=False,
                            functions={t["name"]: t["parameters"] for t in TOOLS})
        events = [*parser.feed(text), *parser.finish()]
        calls = [event for event in events if isinstance(event, ToolCallEnd)]
        assert len(calls) == 1, (style, text, events)
        assert not "".join(e.text for e in events if isinstance(e, TextDelta)).strip(), (style, text)
        assert calls[0].name in {t["name"] for t in TOOLS}
        arguments = json.loads(calls[0].arguments)
        schema = next(t for t in TOOLS if t["name"] == calls[0].name)["parameters"]
        assert set(schema["required"]) <= set(arguments) <= set(schema["properties"]), (style, text)


PLACE = {"name": "find", "parameters": {
    "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}, "note": {"type": "string", "maxLength": 8}},
    "required": ["where"], "$defs": {"Place": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}}}}


@pytest.mark.parametrize("style", sorted(NATIVE_FORCED))
def test_a_forced_call_whose_parameters_use_defs_and_refs(style: str, mlx_arch_fixtures: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """Pydantic writes nested models as $defs and $ref: each family's grammar follows them (a tagged call's
    parameter is a grammar of its own, with the definitions it points to)."""
    from localai.engines.mlx import MlxEngine

    folder = with_specials(mlx_arch_fixtures["llama"], tmp_path / style, SPECIALS[style])
    engine = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=2048, n_parallel=1, n_batch=256))
    prompt = engine.tokenize("Find Paris.")
    engine.decode([BatchItem(0, token, index, index == len(prompt) - 1) for index, token in enumerate(prompt)])
    sampler = engine.new_sampler({"temperature": 0.8, "seed": 3}, {"type": "tool_call", "format": style,
                                                                  "tools": [PLACE]})
    output: list[int] = []
    row = len(prompt) - 1
    while len(output) < 300 and not engine.is_end(token := engine.sample(sampler, row)):
        row = 0
        output.append(token)
        engine.decode([BatchItem(0, token, len(prompt) + len(output) - 1, True)])
    text = b"".join(engine.token_bytes(token) for token in output).decode()
    parser = parser_for("mistral" if style == "mistral-args" else style, tools=True, reasoning=False,
                        functions={"find": PLACE["parameters"]})
    calls = [event for event in [*parser.feed(text), *parser.finish()] if isinstance(event, ToolCallEnd)]
    assert len(calls) == 1 and calls[0].name == "find", (style, text)
    jsonschema.validate(json.loads(calls[0].arguments), PLACE["parameters"])


def test_every_native_format_has_special_tokens_to_test() -> None:
    assert set(SPECIALS) == set(JSON_ARGUMENT_CALLS) | set(TAGGED_CALLS)


WEATHER = {"type": "function", "function": {"name": TOOLS[0]["name"], "parameters": TOOLS[0]["parameters"]}}
DAEMON_STYLES = ["harmony", "deepseek-v3.1", "mistral-args", "qwen3-coder", "glm-4.5"]
# Mistral's [ARGS] form is picked from the template (runtime/local.forced_format): a note in the chat template
# like the one Mistral's templates carry
ARGS_NOTE = "{#- a tool call is written [TOOL_CALLS]name[ARGS]arguments -#}"


@pytest.fixture(scope="module")
def tool_daemon(mlx_arch_fixtures: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with one MLX model per family: the family's special tokens in its tokenizer, PARSER naming it."""
    home = tmp_path_factory.mktemp("mlx-tools")
    with start_daemon(home / "home") as daemon:
        for style in DAEMON_STYLES:
            folder = with_specials(mlx_arch_fixtures["llama"], home / style, SPECIALS[style])
            parser = style
            if style == "mistral-args":
                parser = "mistral"
                config = json.loads((folder / "tokenizer_config.json").read_text())
                config["chat_template"] = ARGS_NOTE + config["chat_template"]
                (folder / "tokenizer_config.json").write_text(json.dumps(config))
            with daemon.http() as http:
                created = http.post("/api/create", json={"model": f"mlx-{style}",
                                                         "modelfile": f"FROM {folder}\nPARSER {parser}\n"})
            assert created.status_code == 200, created.text
        yield daemon


def _check(style: str, name: str, arguments: Any) -> None:
    assert name == "get_weather", style
    parsed = arguments if isinstance(arguments, dict) else json.loads(arguments)
    jsonschema.validate(parsed, TOOLS[0]["parameters"])


@pytest.mark.parametrize("style", DAEMON_STYLES)
def test_forced_calls_in_the_family_syntax_in_every_dialect_plain_and_streamed(tool_daemon: Daemon,
                                                                               style: str) -> None:
    model = f"mlx-{style}"
    ask = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
    base = tool_daemon.base_url
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        plain = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],  # type: ignore[arg-type,list-item]
                                               tool_choice="required", max_tokens=120, temperature=0)
        call = plain.choices[0].message.tool_calls[0].function  # type: ignore[index,union-attr]
        _check(style, call.name, call.arguments)
        assert plain.choices[0].finish_reason == "tool_calls" and not plain.choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.tool_calls[0].function.arguments or ""  # type: ignore[index,union-attr]
                           for chunk in client.chat.completions.create(
                               model=model, messages=ask, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type,list-item]
                               max_tokens=120, temperature=0, stream=True)
                           if chunk.choices and chunk.choices[0].delta.tool_calls)
        assert json.loads(streamed) == json.loads(call.arguments)
        response = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=120,
                                           tools=[{"type": "function", "name": "get_weather", "strict": False,
                                                   "parameters": TOOLS[0]["parameters"]}],
                                           tool_choice="required", temperature=0)
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1
        _check(style, calls[0].name, calls[0].arguments)  # type: ignore[union-attr]
    with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300) as claude:
        tool: Any = {"name": "get_weather", "input_schema": TOOLS[0]["parameters"]}
        message = claude.messages.create(model=model, max_tokens=120, messages=ask,  # type: ignore[arg-type]
                                         tools=[tool], tool_choice={"type": "any"},
                                         extra_body={"temperature": 0})
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1
        _check(style, uses[0].name, uses[0].input)  # type: ignore[union-attr]
        with claude.messages.stream(model=model, max_tokens=120, messages=ask,  # type: ignore[arg-type]
                                    tools=[tool], tool_choice={"type": "any"},
                                         extra_body={"temperature": 0}) as stream:
            final = stream.get_final_message()
        streamed_uses = [block for block in final.content if block.type == "tool_use"]
        assert [u.input for u in streamed_uses] == [u.input for u in uses]  # type: ignore[union-attr]


def generate(engine: Any, sampler: Any, prompt: list[int], *, limit: int, trigger: int | None = None,
             at: int = 0) -> list[int]:
    """Sample ``sampler`` after ``prompt`` (sequence 0, from empty) until the end or ``limit`` tokens; with
    ``trigger``, its logits pushed towards that token at token ``at`` (the model opening a call in an ``auto``
    reply: random weights never would)."""
    engine.seq_clear(0)
    engine.decode([BatchItem(0, token, index, index == len(prompt) - 1) for index, token in enumerate(prompt)])
    output: list[int] = []
    row = len(prompt) - 1
    while len(output) < limit:
        if trigger is not None and len(output) == at:
            engine._rows[row] = engine._rows[row] + (engine._rows[row].max() + 100.0) * (
                mx_arange(engine._rows[row].shape[-1]) == trigger)
        token = engine.sample(sampler, row)
        row = 0
        if engine.is_end(token):
            break
        output.append(token)
        engine.decode([BatchItem(0, token, len(prompt) + len(output) - 1, True)])
    return output


def sample_with_trigger_at(engine: Any, sampler: Any, prompt: list[int], trigger: int, at: int,
                           limit: int = 200) -> str:
    """The text ``generate`` samples with the trigger pushed at token ``at``."""
    output = generate(engine, sampler, prompt, limit=limit, trigger=trigger, at=at)
    return b"".join(engine.token_bytes(token) for token in output).decode(errors="replace")


def mx_arange(n: int) -> Any:
    import mlx.core as mx

    return mx.arange(n)


def test_an_auto_call_is_free_text_until_the_model_opens_one_then_constrained(mlx_arch_fixtures: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """``auto`` tool calls on MLX: as on llama.cpp, the text is free until the model writes <tool_call> (a token of
    its own), and from there the call must be well formed: one or more calls of the given tools, then the end.
    Without the grammar the same random weights write no call at all after the tag (checked: the control)."""
    from localai.engines.mlx import MlxEngine

    folder = with_specials(mlx_arch_fixtures["llama"], tmp_path / "hermes", ["<tool_call>", "</tool_call>"])
    engine = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=2048, n_parallel=1, n_batch=256))
    trigger = engine._special_ids()["<tool_call>"]
    constraint: Any = {"type": "tool_call", "format": "hermes", "lazy": True, "tools": TOOLS}
    prompt = engine.tokenize("What is the weather in Oslo?")
    functions = {t["name"]: t["parameters"] for t in TOOLS}
    for seed in range(3):
        sampler = engine.new_sampler({"temperature": 0.8, "seed": seed}, constraint)
        assert sampler.matcher is None and sampler.lazy is not None  # free until the trigger
        text = sample_with_trigger_at(engine, sampler, prompt, trigger, at=4)
        before, _, after = text.partition("<tool_call>")
        assert before and after, text  # free text first, then the call
        parser = parser_for("hermes", tools=True, reasoning=False, functions=functions)
        calls = [e for e in [*parser.feed(text), *parser.finish()] if isinstance(e, ToolCallEnd)]
        assert calls and not sampler.matcher.is_error(), (seed, text)  # every token after the tag was the grammar's
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), functions[call.name])
    control = sample_with_trigger_at(engine, engine.new_sampler({"temperature": 0.8, "seed": 0}, None), prompt,
                                     trigger, at=4, limit=60)
    parser = parser_for("hermes", tools=True, reasoning=False, functions=functions)
    assert not [e for e in [*parser.feed(control), *parser.finish()] if isinstance(e, ToolCallEnd)], control


def test_an_auto_call_stays_parsed_only_where_the_trigger_is_several_tokens(mlx_arch_fixtures: dict[str, Path]) -> None:
    """SmolLM2's tokenizer writes <tool_call> in pieces: no lazy grammar (the llama.cpp engine's rule too)."""
    from localai.engines.mlx import MlxEngine

    engine = MlxEngine(LoadOptions(model_path=str(mlx_arch_fixtures["llama"]), num_ctx=512, n_parallel=1))
    sampler = engine.new_sampler({"temperature": 0}, {"type": "tool_call", "format": "hermes", "lazy": True,
                                                      "tools": TOOLS})  # type: ignore[typeddict-item]
    assert sampler.matcher is None and sampler.lazy is None
