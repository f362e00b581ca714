"""How models write tool calls and reasoning, one module per family of formats.

``json_calls``: the families that write a call as JSON after a marker (Hermes/Qwen ``<tool_call>``, Llama 3,
Mistral's ``[TOOL_CALLS][...]`` and ``[TOOL_CALLS]NAME[ARGS]{...}``, DeepSeek-V3.1's tool-call-begin marker, bare
JSON), one streaming state machine, since they differ only in what comes before the JSON. ``xml_calls``: calls
written as tagged parameters (Qwen3-Coder's XML, GLM-4.5's key/value tags). ``harmony``: gpt-oss's channels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from localai.runtime.formats.harmony import HarmonyParser
from localai.runtime.formats.json_calls import OutputParser
from localai.runtime.formats.xml_calls import GLM45, QWEN3_CODER, TaggedCallParser
from localai.schema import Event, ToolCallEnd

FORMATS = ("hermes", "llama3", "mistral", "qwen3-coder", "harmony", "glm-4.5", "deepseek-v3.1")


class Parser(Protocol):
    calls: list[ToolCallEnd]

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def parser_for(name: str, *, tools: bool, reasoning: bool,
               functions: Mapping[str, Mapping[str, Any]] | None = None, opened: bool = False) -> Parser:
    """The streaming parser of format ``name`` (one of ``FORMATS``); ``functions``: the offered functions'
    parameter schemas by name (None: any name, values untyped); ``opened``: the prompt opened the reasoning
    (it ended with ``<think>``), so the output starts inside it."""
    if name == "qwen3-coder":
        return TaggedCallParser(QWEN3_CODER, tools=tools, reasoning=reasoning, functions=functions, opened=opened)
    if name == "glm-4.5":
        return TaggedCallParser(GLM45, tools=tools, reasoning=reasoning, functions=functions, opened=opened)
    if name == "harmony":
        return HarmonyParser(tools=tools, names=list(functions) if functions is not None else None)
    if name not in FORMATS and name not in ("json", "mistral-args"):  # json: a forced call as one bare JSON object
        raise ValueError(f"unknown tool-call format {name!r}")
    return OutputParser(tools=tools, reasoning=reasoning, names=list(functions) if functions is not None else None,
                        opened=opened)
