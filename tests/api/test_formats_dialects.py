"""Each model family's tool-call format through every dialect, streamed and not: the scripted engine says what a
Qwen3-Coder, gpt-oss (Harmony), GLM-4.5, Devstral or DeepSeek-V3.1 model writes (chosen with the Modelfile's
PARSER line), and each dialect's client gets the calls with their exact arguments, the reasoning apart, and no
markup in the text. A long file write (2,000 lines of code full of markup) goes through each format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.api.test_formats_cases import DIALECTS as READERS
from tests.metagguf import metadata_gguf
from tests.runtime.formats.test_formats_roundtrip import SCHEMAS, write

LINES = 2000
FILE = "\n".join(f"<a x='{n}'>&" + ('"ü' if n % 7 else "</p>") for n in range(LINES)) + "\n"  # markup, 2,000 lines
STYLES = {"qwen3-coder": "qwen3-coder", "harmony": "harmony", "glm-4.5": "glm-4.5", "mistral-args": "mistral",
          "deepseek-v3.1": "deepseek-v3.1"}
TOOLS = [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model trained on 262k tokens (metadata only: the scripted engine plays it)."""
    return metadata_gguf(tmp_path_factory.mktemp("gguf") / "long.gguf", arch="qwen3moe", context_length=262144)


def model(api: TestClient, weights: Path, style: str) -> str:
    name = f"fmt-{style}"
    created = api.post("/api/create", json={"model": name, "modelfile": (
        f"FROM {weights}\nPARSER {STYLES[style]}\nPARAMETER num_ctx 120000\n")})
    assert created.status_code == 200, created.text
    return name


def reply(style: str, *, long: bool) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    calls: list[tuple[str, dict[str, Any]]] = [("edit", {"file": "a.py", "line": 3, "options": {"x": [1, None]}})]
    if long:
        calls = [("write_file", {"path": "src/big.py", "content": FILE}), *calls]
    thinking = style in ("harmony", "glm-4.5", "deepseek-v3.1")  # the families whose models reason first
    return "I will write it.", "The user wants a file." if thinking else "", calls


def said(style: str, long: bool) -> str:
    text, reasoning, calls = reply(style, long=long)
    return "[[say:" + write(style, text, reasoning, calls) + "]]"


def read(dialect: str, api: TestClient, name: str, ask: str, stream: bool) -> tuple[str, list[tuple[str, Any]]]:
    """The reply's text and calls as ``dialect``'s client gets them (tests/api/test_formats_cases.py's readers)."""
    text, _, calls = READERS[dialect](api, {"model": name, "messages": [{"role": "user", "content": ask}]}, stream)
    return text, calls




@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("dialect", list(READERS))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_each_format_through_each_dialect(api: TestClient, weights: Path, style: str, dialect: str,
                                          stream: bool) -> None:
    long = dialect == "openai"  # the 2,000-line file once per format and way of sending (it is 100k tokens here)
    text, _, calls = reply(style, long=long)
    got_text, got_calls = read(dialect, api, model(api, weights, style), said(style, long), stream)
    assert got_text.strip() == text
    assert got_calls == calls


# What each family's own template holds (abridged: the parts that tell the formats apart), and the architecture its
# GGUF names. Detection reads the template; the architecture alone does not decide (a fine-tune may change it).
TEMPLATES = {
    "qwen3-coder": ("qwen3moe", "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n<function=NAME>\n"
                                "<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>{{ messages }}"),
    "harmony": ("gpt-oss", "<|start|>system<|message|>{{ messages }}<|end|><|start|>assistant<|channel|>final"
                           "<|message|>{% for t in tools %}{{ t }}{% endfor %}tool_call"),
    "glm-4.5": ("glm4moe", "{% for t in tools %}{{ t }}{% endfor %}<tool_call>{{ name }}<arg_key>k</arg_key>"
                           "<arg_value>v</arg_value></tool_call><think></think>{{ messages }}"),
    "deepseek-v3.1": ("deepseek2", "{% for t in tools %}{{ t }}{% endfor %}tool_calls<\uff5ctool\u2581calls"
                                   "\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>x<\uff5ctool"
                                   "\u2581sep\uff5c>{{ messages }}"),
    "mistral": ("llama", "{% for t in tools %}{{ t }}{% endfor %}tool_call[TOOL_CALLS]{{ name }}[ARGS]{{ messages }}"),
    "hermes": ("qwen2", "{% for t in tools %}{{ t }}{% endfor %}<tool_call>{{ messages }}</tool_call>"),
}


@pytest.mark.parametrize("style", list(TEMPLATES))
def test_the_format_comes_from_the_models_template_and_show_says_so(api: TestClient, tmp_path: Path,
                                                                      style: str) -> None:
    arch, template = TEMPLATES[style]
    path = metadata_gguf(tmp_path / f"{style}.gguf", arch=arch, context_length=262144, template=template)
    name = f"detect-{style}"
    assert api.post("/api/create", json={"model": name, "modelfile": f"FROM {path}\n"}).status_code == 200
    shown = api.post("/api/show", json={"model": name}).json()
    assert shown["parser"] == {"name": style, "from": "the chat template"}
    assert shown["details"]["family"] == arch
    # PARSER overrides it, and the Modelfile says so
    assert api.post("/api/create", json={"model": name + "-x", "modelfile": f"FROM {path}\nPARSER hermes\n"}
                    ).status_code == 200
    shown = api.post("/api/show", json={"model": name + "-x"}).json()
    assert shown["parser"] == {"name": "hermes", "from": "PARSER in the Modelfile"}
    assert "PARSER hermes" in shown["modelfile"]


def test_a_parser_name_localai_does_not_know_is_refused_at_create(api: TestClient, weights: Path) -> None:
    refused = api.post("/api/create", json={"model": "bad-parser", "modelfile": f"FROM {weights}\nPARSER qwen4\n"})
    assert refused.status_code == 400
    assert "PARSER 'qwen4' is not a tool-call format localai knows" in refused.text
    assert "qwen3-coder" in refused.text
    assert api.post("/api/show", json={"model": "bad-parser"}).status_code == 404


FORCED = {  # what the grammar makes each family write when a call is forced (the scripted engine writes the same)
    "qwen3-coder": "<tool_call>\n<function=write_file>\n<parameter=path>\nx\n</parameter>\n<parameter=content>\nx\n"
                   "</parameter>\n</function>\n</tool_call>",
    "glm-4.5": "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>x</arg_value>\n<arg_key>content</arg_key>\n"
               "<arg_value>x</arg_value>\n</tool_call>",
    "harmony": "<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>"
               '{"path": "x", "content": "x"}',
    "deepseek-v3.1": "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>write_file"
                     '<\uff5ctool\u2581sep\uff5c>{"path": "x", "content": "x"}<\uff5ctool\u2581call\u2581end\uff5c>'
                     "<\uff5ctool\u2581calls\u2581end\uff5c>",
    # the metadata's template has no [ARGS]: Mistral's array form
    "mistral-args": '[{"name": "write_file", "arguments": {"path": "x", "content": "x"}}]',
}


@pytest.mark.parametrize("style", sorted(FORCED))
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_a_forced_call_is_written_in_the_familys_own_syntax(api: TestClient, weights: Path, style: str,
                                                             dialect: str) -> None:
    """tool_choice required (Anthropic: any) forces one call in the family's own syntax, special tokens and all
    (llama.cpp's grammars match them as text), and it is read back as the call."""
    name = model(api, weights, style)
    tool = TOOLS[0]
    if dialect == "openai":
        body = {"model": name, "messages": [{"role": "user", "content": "go"}],
                "tools": [{"type": "function", "function": tool}], "tool_choice": "required"}
        answer = api.post("/v1/chat/completions", json=body).json()
        call = answer["choices"][0]["message"]["tool_calls"][0]["function"]
        got, written = (call["name"], json.loads(call["arguments"])), answer["usage"]["completion_tokens"]
    else:
        body = {"model": name, "messages": [{"role": "user", "content": "go"}], "max_tokens": 500,
                "tools": [{"name": tool["name"], "input_schema": tool["parameters"]}], "tool_choice": {"type": "any"}}
        answer = api.post("/v1/messages", json=body).json()
        block = next(b for b in answer["content"] if b["type"] == "tool_use")
        got, written = (block["name"], block["input"]), answer["usage"]["output_tokens"]
        assert answer["stop_reason"] == "tool_use"
    assert got == ("write_file", {"path": "x", "content": "x"})
    assert written == len(FORCED[style].encode())  # the scripted engine's tokens are bytes


def test_show_and_ps_give_the_memory_a_model_takes_at_its_window(api: TestClient, weights: Path) -> None:
    name = model(api, weights, "qwen3-coder")  # num_ctx 120000 in its Modelfile
    memory = api.post("/api/show", json={"model": name}).json()["memory"]
    assert (memory["num_ctx"], memory["kv_type"], memory["chosen_by"]) == (120000, "f16", "num_ctx")
    per_token = 48 * 4 * (128 + 128) * 2  # the metadata's layers x KV heads x (K + V) x f16
    assert memory["kv_bytes"] == per_token * 120000 * memory["sequences"]
    assert memory["total_bytes"] == memory["weights_bytes"] + memory["kv_bytes"]
    api.post("/api/generate", json={"model": name})  # load it
    entry = next(m for m in api.get("/api/ps").json()["models"] if m["name"] == f"{name}:latest")
    assert entry["kv_bytes"] == memory["kv_bytes"] and entry["size"] == memory["total_bytes"]
    assert entry["context_length"] == 120000


EFFORT_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                   "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                   "<|start|>assistant")


@pytest.mark.parametrize(("dialect", "ask", "level"), [
    ("openai", {"reasoning_effort": "high"}, "high"), ("openai", {"reasoning_effort": "minimal"}, "low"),
    ("openai", {}, "medium"), ("responses", {"reasoning": {"effort": "low"}}, "low"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 32000}}, "high"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ("anthropic", {"thinking": {"type": "disabled"}}, "low"), ("ollama", {"think": "high"}, "high"),
    ("anthropic", {"output_config": {"effort": "high"}}, "high"),
    ("anthropic", {"output_config": {"effort": "low"}, "thinking": {"type": "enabled", "budget_tokens": 32000}},
     "low"),
])
def test_reasoning_effort_reaches_a_harmony_models_prompt(api: TestClient, tmp_path: Path, dialect: str,
                                                          ask: dict[str, Any], level: str) -> None:
    """Each dialect's way of asking for more or less reasoning becomes Harmony's reasoning level in the prompt
    (seen in the prompt's length: the scripted engine's tokens are bytes)."""
    path = metadata_gguf(tmp_path / "oss.gguf", arch="gpt-oss", context_length=131072, template=EFFORT_TEMPLATE)
    created = api.post("/api/create", json={"model": "effort", "modelfile": (
        f'FROM {path}\nTEMPLATE """{EFFORT_TEMPLATE}"""\n')})  # the scripted engine reports no template of its own
    assert created.status_code == 200, created.text
    user = [{"role": "user", "content": "[[say:<|channel|>final<|message|>ok]]"}]
    if dialect == "openai":
        usage = api.post("/v1/chat/completions", json={"model": "effort", "messages": user, **ask}).json()["usage"]
        prompt = usage["prompt_tokens"]
    elif dialect == "responses":
        prompt = api.post("/v1/responses", json={"model": "effort", "input": user, **ask}).json()["usage"][
            "input_tokens"]
    elif dialect == "anthropic":
        usage = api.post("/v1/messages", json={"model": "effort", "messages": user, "max_tokens": 64000, **ask}
                         ).json()["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage.get("cache_creation_input_tokens", 0)
    else:
        prompt = api.post("/api/chat", json={"model": "effort", "messages": user, "stream": False, **ask}
                          ).json()["prompt_eval_count"]
    base = len(EFFORT_TEMPLATE.split("{{")[0]) + len("<|end|><|start|>user<|message|>") + len(user[0]["content"]) \
        + len("<|end|><|start|>assistant")
    assert prompt == base + len(level)


THINKING_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}"
                     "{% if m.get('thinking') %}<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
                     "<|message|>{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant")


def test_past_reasoning_reaches_the_template_as_thinking(api: TestClient, tmp_path: Path) -> None:
    """gpt-oss's template reads a past turn's analysis from ``thinking`` (and applies Harmony's rule for keeping
    it); the reasoning an OpenAI client sends back as reasoning_content reaches it there."""
    path = metadata_gguf(tmp_path / "oss.gguf", arch="gpt-oss", context_length=131072)
    modelfile = f'FROM {path}\nTEMPLATE """{THINKING_TEMPLATE}"""\n'
    assert api.post("/api/create", json={"model": "thinking", "modelfile": modelfile}).status_code == 200
    turns = [{"role": "user", "content": "[[say:ok]]"}, {"role": "assistant", "content": "hi",
                                                          "reasoning_content": "the analysis"},
             {"role": "user", "content": "again"}]
    with_it = api.post("/v1/chat/completions", json={"model": "thinking", "messages": turns}).json()["usage"]
    del turns[1]["reasoning_content"]
    without = api.post("/v1/chat/completions", json={"model": "thinking", "messages": turns}).json()["usage"]
    extra = len("<|channel|>analysis<|message|>the analysis<|end|>")
    assert with_it["prompt_tokens"] - without["prompt_tokens"] == extra


def test_a_forced_call_on_a_model_whose_template_uses_args_is_written_in_that_form(api: TestClient,
                                                                                  tmp_path: Path) -> None:
    """Devstral's template writes [TOOL_CALLS]NAME[ARGS]: a forced call takes that form, not the array."""
    source = (Path(__file__).parent.parent / "templates" / "devstral-small.jinja").read_text()
    weights = metadata_gguf(tmp_path / "devstral.gguf", arch="llama", context_length=131072, template=source)
    modelfile = f'FROM {weights}\nPARAMETER num_ctx 60000\nTEMPLATE """{source}"""\n'
    assert api.post("/api/create", json={"model": "forced-devstral", "modelfile": modelfile}).status_code == 200
    body = {"model": "forced-devstral", "messages": [{"role": "user", "content": "go"}],
            "tools": [{"type": "function", "function": TOOLS[0]}], "tool_choice": "required"}
    answer = api.post("/v1/chat/completions", json=body).json()
    call = answer["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("write_file", {"path": "x", "content": "x"})
    assert answer["usage"]["completion_tokens"] == len('[TOOL_CALLS]write_file[ARGS]{"path": "x", "content": "x"}')
