"""A conversation and its tools, rendered to prompt text through the model's chat template.

Rendering is deterministic: tool schemas are serialized with sorted keys and messages in a fixed
shape, so the same conversation always yields the same tokens and the prefix cache keeps hitting.
Templates that know about tools (they mention ``tools``) get them natively; for the others the
tools are described in the system message, in the words the model's own format documents (DeepSeek-V3.1's
template renders calls but leaves the tool list to the system prompt) or else as Hermes ``<tool_call>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from localai.models import chat_template
from localai.runtime.formats.json_calls import DEEPSEEK_CLOSE, DEEPSEEK_OPEN, DEEPSEEK_OUTER, DEEPSEEK_SEP, SPACE
from localai.schema import Message, ReasoningBlock, TextBlock, Tool, ToolCallBlock, ToolResultBlock

# What in a template's source shows DeepSeek-V3.1's calls (its Jinja spells the markers in pieces)
DEEPSEEK_MARKERS = (f"tool{SPACE}sep", f"tool{SPACE}call{SPACE}begin")
ToolFormat = Literal["hermes", "llama3", "mistral", "qwen3-coder", "harmony", "glm-4.5", "deepseek-v3.1"]
# What in a chat template says how its model writes calls, most specific first (Qwen3-Coder's template also
# has <tool_call>; Harmony's has no call tags at all, only its channels).
FORMAT_MARKERS: tuple[tuple[tuple[str, ...], ToolFormat], ...] = (
    (("<|channel|>",), "harmony"),
    (("<function=", "<parameter="), "qwen3-coder"),
    (("<arg_key>",), "glm-4.5"),
    (DEEPSEEK_MARKERS, "deepseek-v3.1"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3"),
    (("ipython",), "llama3"),
)

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call the functions described below, inside <tools></tools>, when they help with the request.\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)

# DeepSeek-V3.1's tool section, in the shape its model card documents: the template renders calls and results,
# the system prompt lists the tools.
DEEPSEEK_TOOLS = (
    "## Tools\nYou have access to the following tools:\n\n{tools}"
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{DEEPSEEK_OUTER[0]}{DEEPSEEK_OPEN}tool_call_name{DEEPSEEK_SEP}tool_call_arguments{DEEPSEEK_CLOSE}"
    f"{{{{additional_tool_calls}}}}{DEEPSEEK_OUTER[1]}\n\n"
    "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces"
)


@dataclass(frozen=True)
class Template:
    """A chat template and the model facts rendering needs."""

    source: str | None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def native_tools(self) -> bool:
        """The template renders assistant ``tool_calls`` and tool results itself."""
        return self.lists_tools or self._renders_calls_in_own_format

    @property
    def lists_tools(self) -> bool:
        """The template renders the ``tools`` list itself too."""
        return bool(self.source) and "tools" in self.source and "tool_call" in self.source  # type: ignore[operator]

    @property
    def _renders_calls_in_own_format(self) -> bool:
        """Calls rendered in a known format's own markers, the tool list left to the system prompt (DeepSeek-V3.1)."""
        source = self.source or ""
        return "tool_calls" in source and all(marker in source for marker in DEEPSEEK_MARKERS)

    @property
    def thinks(self) -> bool:
        """The model emits ``<think>`` reasoning (Qwen3, DeepSeek-R1 and their kin)."""
        return bool(self.source) and "<think>" in self.source  # type: ignore[operator]

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes a tool call (what the output parser and grammar expect)."""
        source = self.source or ""
        if "<|channel|>" in source:
            return "harmony"  # its template renders tools in its own developer message, never as Hermes text
        if not self.native_tools:
            return "hermes"  # localai describes the tools and asks for Hermes calls
        for markers, name in FORMAT_MARKERS:
            if all(marker in source for marker in markers):
                return name
        return "hermes"


def format_choice(parameters: Mapping[str, Any], template: Template) -> tuple[ToolFormat, str]:
    """How a model writes tool calls, and where that was decided: its Modelfile's PARSER (checked against the
    format names at create time), else what its chat template shows."""
    chosen = parameters.get("parser")
    if isinstance(chosen, str):
        return chosen, "PARSER in the Modelfile"  # type: ignore[return-value]
    if template.lists_tools:
        return template.tool_format, "the chat template"
    if template.native_tools:
        return template.tool_format, "the chat template's calls; localai lists the tools in its words"
    return template.tool_format, "localai's tool prompt: the template has no tools"


def canonical(value: Any) -> Any:
    """``value`` with every mapping's keys sorted, so equal schemas serialize identically."""
    return json.loads(json.dumps(value, sort_keys=True))


def tool_json(tool: Tool) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": canonical(tool.parameters)}}


def describe_tools(tools: list[Tool], style: ToolFormat = "hermes") -> str:
    """The system-message section that teaches a template that does not list tools to call ``tools``: in
    DeepSeek-V3.1's own words for its format, else asking for Hermes calls."""
    if style == "deepseek-v3.1":
        return DEEPSEEK_TOOLS.format(tools="".join(
            f"### {tool.name}\nDescription: {tool.description or ''}\n\n"
            f"Parameters: {json.dumps(canonical(tool.parameters), ensure_ascii=False)}\n\n" for tool in tools))
    lines = "\n".join(json.dumps(tool_json(tool), ensure_ascii=False) for tool in tools)
    return TOOLS_PREAMBLE.format(tools=lines)


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as a Hermes-format model writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def template_messages(messages: list[Message], template: Template, tools: list[Tool], *,
                      default_system: str | None = None,
                      extra_messages: list[dict[str, Any]] | None = None,
                      style: ToolFormat | None = None) -> list[dict[str, Any]]:
    """Messages in the shape chat templates expect.

    Leading system and developer messages merge into one system message (several templates accept
    only one, first). Without native tool support, tool calls become ``<tool_call>`` text and tool
    results user turns wrapped in ``<tool_response>``.
    """
    native = template.native_tools
    leading: list[str] = []
    index = 0
    while index < len(messages) and messages[index].role in ("system", "developer"):
        leading.append(messages[index].text())
        index += 1
    system = "\n\n".join(part for part in leading if part) or (default_system if not leading else "")
    if tools and not template.lists_tools:
        system = (system + "\n\n" if system else "") + describe_tools(tools, style or template.tool_format)
    rendered: list[dict[str, Any]] = []
    if system or leading:
        rendered.append({"role": "system", "content": system})
    rendered.extend(extra_messages or [])
    names: dict[str, str] = {}
    for message in messages[index:]:
        rendered.extend(_message(message, native, names))
    return rendered


def _message(message: Message, native: bool, names: dict[str, str]) -> list[dict[str, Any]]:
    role = "system" if message.role == "developer" else message.role
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallBlock] = []
    results: list[ToolResultBlock] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ReasoningBlock):
            reasoning.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append(block)
            names[block.id] = block.name
        elif isinstance(block, ToolResultBlock):
            results.append(block)
    out: list[dict[str, Any]] = []
    for result in results:
        name = result.name or names.get(result.tool_call_id, "")
        if native:
            out.append({"role": "tool", "content": result.content, "tool_call_id": result.tool_call_id, "name": name})
        else:
            out.append({"role": "user", "content": f"<tool_response>\n{result.content}\n</tool_response>"})
    text = "".join(texts)
    if results and not text and not calls:
        return out
    entry: dict[str, Any] = {"role": "user" if role == "tool" else role, "content": text}
    if message.name:
        entry["name"] = message.name
    if reasoning:
        # Qwen3, GLM and DeepSeek templates read reasoning_content; gpt-oss's reads thinking and keeps or drops past
        # analysis by Harmony's rule (kept only before the tool calls of the turn in progress)
        entry["reasoning_content"] = entry["thinking"] = "".join(reasoning)
    if calls:
        if native:
            entry["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls
            ]
        else:
            entry["content"] = "\n".join([*([text] if text else []), *(call_text(c.name, c.arguments) for c in calls)])
    out.append(entry)
    return out


def render_call(template: Template, messages: list[dict[str, Any]], tools: list[Tool], *,
                add_generation_prompt: bool = True, reasoning: bool | None = None,
                effort: str | None = None) -> chat_template.RenderCall:
    """What rendering ``messages`` (already shaped) takes, as data: a render process runs it
    (``models/renderer.py``), a test may run it here with ``render``."""
    extra: dict[str, Any] = {}
    if tools and template.lists_tools:
        extra["tools"] = [tool_json(tool) for tool in tools]
    if reasoning is not None and template.thinks:
        extra["enable_thinking"] = reasoning
    if effort is not None or (reasoning is False and template.tool_format == "harmony"):
        extra["reasoning_effort"] = effort or "low"  # Harmony cannot stop reasoning: the least it does is low
    return chat_template.RenderCall(source=template.source, messages=messages, bos_token=template.bos_token,
                                    eos_token=template.eos_token, add_generation_prompt=add_generation_prompt,
                                    extra=extra)


def render(template: Template, messages: list[dict[str, Any]], tools: list[Tool], *,
           add_generation_prompt: bool = True, reasoning: bool | None = None, effort: str | None = None) -> str:
    """Prompt text for already-shaped ``messages``, rendered in this process (the daemon renders through
    ``models/renderer.py`` instead: a template is not trusted)."""
    return chat_template.render_call(render_call(template, messages, tools, add_generation_prompt=add_generation_prompt,
                                                 reasoning=reasoning, effort=effort))


def hoists_late_system(template: Template) -> bool:
    """Whether the template moves a late system message to the front (``chat_template.hoists_late_system``)."""
    return chat_template.hoists_late_system(template.source, template.bos_token, template.eos_token)


fold_late_system = chat_template.fold_late_system
