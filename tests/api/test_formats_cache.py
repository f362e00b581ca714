"""The prompt cache across an agent's turns, in each model family's own format and chat template.

An agent resends its whole conversation every turn; the cache serves the part it has seen only if what the next
turn renders for the model's last reply (its tool call, its reasoning) is the text the model wrote. Here each
family's real chat template (tests/templates/) plays a tool-calling agent session: the scripted model writes,
each turn, exactly what its template renders for that reply (what a model trained on the template writes), the
client sends the reply back the way its dialect's clients do, and each later turn's cached tokens are compared
with the ceiling: all of the prompt before the new tool result's text (the scripted engine's tokens are bytes),
which no cache can have seen. The ceiling is at least the previous prompt and the reply; localai also has the
template's text after the reply (its end-of-turn and the tool result's header), rendered ahead of the turn.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from localai.models import chat_template
from tests.metagguf import metadata_gguf

TEMPLATES = Path(__file__).parent.parent / "templates"
SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {n}: keep edits small, run the tests, explain what changed." for n in range(60))
TOOLS = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a whole file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"]}}},
]
RESULT = "3 passed, 1 failed [[next]]"
CODE = "".join(f"def f{n}(x):\n    return '<b>' + x + \"&amp;\" if x < {n} else {{'k': [{n}]}}\n" for n in range(40))


@dataclass(frozen=True)
class Family:
    parser: str
    template: str
    arch: str
    reasons: bool  # the model writes reasoning before its calls
    ends: tuple[str, ...]  # what the template writes after a reply that the model gives as its end token


FAMILIES = {
    "qwen3-coder": Family("qwen3-coder", "qwen3-coder.jinja", "qwen3moe", False, ("<|im_end|>\n",)),
    "harmony": Family("harmony", "gpt-oss.jinja", "gpt-oss", True, ("<|call|>", "<|return|>", "<|end|>")),
    # gpt-oss also writes the header as the Harmony guide shows it, which its template renders the other way
    # round: the reply then comes back different, and the prefill after the turn makes up for it
    "harmony-guide-header": Family("harmony", "gpt-oss.jinja", "gpt-oss", True,
                                   ("<|call|>", "<|return|>", "<|end|>")),
    "glm-4.5": Family("glm-4.5", "glm-4.7-flash.jinja", "deepseek2", True, ()),
    "deepseek-v3.1": Family("deepseek-v3.1", "deepseek-v3.1.jinja", "deepseek2", False,
                            ("<\uff5cend\u2581of\u2581sentence\uff5c>",)),
    "mistral": Family("mistral", "devstral-small.jinja", "llama", False, ("</s>",)),
}


def source(family: Family) -> str:
    return (TEMPLATES / family.template).read_text()


def replies(family: Family) -> list[dict[str, Any]]:
    """The assistant's turns in a session: three tool calls (a file write of code full of markup, commands),
    then an answer."""
    thought = "I should look at the failing test first." if family.reasons else ""
    calls = [("run", {"command": "pytest -x tests/test_a.py", "timeout": 60}),
             ("write_file", {"path": "src/a.py", "content": CODE}),
             ("run", {"command": "pytest -x"})]
    turns = [{"role": "assistant", "content": "", "reasoning_content": thought, "thinking": thought,
              "tool_calls": [{"id": f"call{n}", "type": "function",
                              "function": {"name": name, "arguments": arguments}}]}
             for n, (name, arguments) in enumerate(calls)]
    return [*turns, {"role": "assistant", "content": "The test passes now.", "reasoning_content": thought,
                     "thinking": thought}]


def written(family: Family, history: list[dict[str, Any]], reply: dict[str, Any], guide_header: bool = False) -> str:
    """What a model trained on ``family``'s template writes for ``reply`` after ``history``: the template's own
    rendering of it, without the end token (which the engine gives as its end of generation)."""
    text = source(family)
    tools = [t for t in TOOLS]
    before = chat_template.render(text, history, add_generation_prompt=True, tools=tools)
    after = chat_template.render(text, [*history, reply], add_generation_prompt=False, tools=tools)
    if not after.startswith(before) and family.parser == "harmony" and not reply.get("tool_calls"):
        # a final answer makes gpt-oss's template drop the turn's analysis from the history; the model writes it
        return (f"<|channel|>analysis<|message|>{reply['thinking']}<|end|><|start|>assistant"
                f"<|channel|>final<|message|>{reply['content']}")
    assert after.startswith(before), f"{family.parser}: the template renders the history differently with a reply"
    said = after[len(before):]
    if guide_header and reply.get("tool_calls"):
        header = r"(^|<\|start\|>assistant) to=(functions\.\w+)<\|channel\|>commentary json<\|message\|>"
        said, changed = re.subn(header, r"\1<|channel|>commentary to=\2 <|constrain|>json<|message|>", said)
        assert changed == 1, said
    for end in family.ends:
        if said.endswith(end):
            return said[: -len(end)]
    return said


@dataclass
class Turn:
    prompt: int
    cached: int
    completion: int


def openai_turn(api: TestClient, name: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], Turn]:
    body = {"model": name, "messages": messages, "tools": TOOLS, "temperature": 0}
    answer = api.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"fc-{name}"}).json()
    assert "choices" in answer, answer
    message = answer["choices"][0]["message"]
    sent = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        sent["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        sent["tool_calls"] = message["tool_calls"]
    usage = answer["usage"]
    return sent, Turn(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                      usage["completion_tokens"])


def neutral_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A call in the test's own (OpenAI) shape, whatever dialect gave it."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def anthropic_turn(api: TestClient, name: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], Turn]:
    """An Anthropic client: thinking blocks (with their signature) and tool_use blocks go back as they came."""
    shaped: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "tool":
            shaped.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]})
        elif m["role"] == "assistant":
            shaped.append({"role": "assistant", "content": m["blocks"]})
        else:
            shaped.append({"role": m["role"], "content": m["content"]})
    body = {"model": name, "system": messages[0]["content"], "messages": shaped, "max_tokens": 60000,
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in TOOLS]}
    answer = api.post("/v1/messages", json=body, headers={"X-Session-Id": f"fc-{name}"}).json()
    assert "content" in answer, answer
    blocks = answer["content"]
    sent: dict[str, Any] = {"role": "assistant", "blocks": blocks,
                            "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
                            "reasoning_content": "".join(b["thinking"] for b in blocks if b["type"] == "thinking")}
    calls = [neutral_call(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    if calls:
        sent["tool_calls"] = calls
    usage = answer["usage"]
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0)
    return sent, Turn(prompt, cached, usage["output_tokens"])


def responses_turn(api: TestClient, name: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], Turn]:
    """A Responses client without stored state (as Codex runs): the output items go back in the next input."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        elif m["role"] == "assistant":
            items.extend(m["items"])
        else:
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
    body = {"model": name, "input": items, "store": False, "tools": [
        {"type": "function", **t["function"]} for t in TOOLS]}
    answer = api.post("/v1/responses", json=body, headers={"X-Session-Id": f"fc-{name}"}).json()
    assert "output" in answer, answer
    output = answer["output"]
    text = "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])
    thought = "".join(c["text"] for i in output if i["type"] == "reasoning" for c in i.get("content") or [])
    sent: dict[str, Any] = {"role": "assistant", "items": output, "content": text, "reasoning_content": thought}
    calls = [neutral_call(i["call_id"], i["name"], i["arguments"]) for i in output if i["type"] == "function_call"]
    if calls:
        sent["tool_calls"] = calls
    usage = answer["usage"]
    return sent, Turn(usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"])


def ollama_turn(api: TestClient, name: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], Turn]:
    """An Ollama client: ``thinking`` and ``tool_calls`` (arguments as objects) go back on the message."""
    shaped: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant":
            shaped.append(m["message"])
        elif m["role"] == "tool":
            shaped.append({"role": "tool", "content": m["content"], "tool_name": m.get("name", "")})
        else:
            shaped.append({"role": m["role"], "content": m["content"]})
    body = {"model": name, "messages": shaped, "tools": TOOLS, "stream": False}
    answer = api.post("/api/chat", json=body, headers={"X-Session-Id": f"fc-{name}"}).json()
    assert "message" in answer, answer
    message = answer["message"]
    sent: dict[str, Any] = {"role": "assistant", "message": message, "content": message.get("content") or "",
                            "reasoning_content": message.get("thinking") or ""}
    calls = [neutral_call(f"ollama{n}", c["function"]["name"], c["function"]["arguments"])
             for n, c in enumerate(message.get("tool_calls") or [])]
    if calls:
        sent["tool_calls"] = calls
    return sent, Turn(answer["prompt_eval_count"], answer.get("prompt_cache_count") or 0, answer["eval_count"])


DIALECTS: dict[str, Callable[[TestClient, str, list[dict[str, Any]]], tuple[dict[str, Any], Turn]]] = {
    "openai": openai_turn, "anthropic": anthropic_turn, "responses": responses_turn, "ollama": ollama_turn,
}


def session(api: TestClient, tmp: Path, variant: str, dialect: str) -> list[tuple[Turn, int]]:
    """Plays the session; each turn's usage with the ceiling of its cached tokens."""
    family = FAMILIES[variant]
    text = source(family)
    weights = metadata_gguf(tmp / f"{variant}.gguf", arch=family.arch, context_length=131072, template=text)
    name = f"cache-{variant}-{dialect}"
    modelfile = f'FROM {weights}\nPARAMETER num_ctx 65536\nTEMPLATE """{text}"""\n'
    created = api.post("/api/create", json={"model": name, "modelfile": modelfile})
    assert created.status_code == 200, created.text
    # each dialect's session its own (the models share weights and template, so they share cached prompts)
    history: list[dict[str, Any]] = [{"role": "system", "content": f"({variant}, {dialect}) {SYSTEM}"},
                                     {"role": "user", "content": "The test in tests/test_a.py fails. Fix it."}]
    said: list[str] = []
    tails: list[int] = []  # each prompt's new part: the last tool result's text, to the generation prompt's end
    for number, reply in enumerate(replies(family)):  # what the model writes, turn by turn
        said.append(written(family, history, reply, guide_header=variant == "harmony-guide-header"))
        if not reply.get("tool_calls"):
            break
        history += [reply, {"role": "tool", "tool_call_id": f"call{number}", "content": RESULT}]
        rendered = chat_template.render(text, history, add_generation_prompt=True, tools=TOOLS).encode()
        tails.append(len(rendered) - rendered.rindex(RESULT.encode()))
    # The script goes in the first message (a template may escape tool results); each result marks a new turn.
    sent: list[dict[str, Any]] = [history[0], {**history[1], "content": history[1]["content"]
                                               + " [[turns:" + "|||".join(said) + "]]"}]
    results: list[tuple[Turn, int]] = []
    for number, reply in enumerate(replies(family)):
        got, turn = DIALECTS[dialect](api, name, sent)
        floor = 0 if not results else results[-1][0].prompt + len(said[number - 1].encode())
        ceiling = 0 if not results else turn.prompt - tails[number - 1]
        results.append((turn, ceiling))
        assert turn.cached <= ceiling or (not ceiling and number == 0)
        assert floor <= ceiling
        assert turn.completion == len(said[number].encode()), f"turn {number}: the model wrote {said[number]!r}"
        if not reply.get("tool_calls"):
            assert not got.get("tool_calls") and got["content"] == reply["content"], got
            assert (got.get("reasoning_content") or "") == reply["reasoning_content"], got
            break
        assert [c["function"]["name"] for c in got.get("tool_calls") or []] == [
            c["function"]["name"] for c in reply["tool_calls"]], f"turn {number}: {got}"
        sent += [got, {"role": "tool", "tool_call_id": got["tool_calls"][0]["id"], "content": RESULT,
                       "name": got["tool_calls"][0]["function"]["name"]}]
    return results


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("parser", sorted(FAMILIES))
def test_each_formats_replies_come_back_as_the_tokens_the_model_wrote(api: TestClient, tmp_path: Path,
                                                                        parser: str, dialect: str) -> None:
    results = session(api, tmp_path, parser, dialect)
    later = results[1:]
    hit = sum(t.cached for t, _ in later) / sum(c for _, c in later)
    report = ", ".join(f"{t.cached}/{c}" for t, c in later)
    if os.environ.get("FORMAT_CACHE_REPORT"):
        with open(os.environ["FORMAT_CACHE_REPORT"], "a") as out:
            out.write(json.dumps({"parser": parser, "dialect": dialect, "hit_of_ceiling": hit,
                                  "turns": [[t.prompt, t.cached, c] for t, c in results]}) + "\n")
    assert hit >= 0.99, f"{parser} through {dialect}: cached/ceiling per turn {report}"


def test_a_forced_call_after_a_prompt_that_opened_the_reasoning_is_a_call(api: TestClient, tmp_path: Path) -> None:
    """GLM-4.7's generation prompt ends with <think>; a forced call is all the grammar lets the model write, so it
    is read as the call, not as reasoning."""
    text = source(FAMILIES["glm-4.5"])
    weights = metadata_gguf(tmp_path / "glm.gguf", arch="deepseek2", context_length=131072, template=text)
    modelfile = f'FROM {weights}\nPARAMETER num_ctx 65536\nTEMPLATE """{text}"""\n'
    assert api.post("/api/create", json={"model": "forced-glm", "modelfile": modelfile}).status_code == 200
    body = {"model": "forced-glm", "messages": [{"role": "user", "content": "run it"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "run"}}}
    message = api.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "run"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"command": "x"}
    assert not message.get("reasoning_content")
