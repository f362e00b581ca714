"""One local generation, decided in one place: from a model's record, its loaded worker and a request, the template,
the rendered prompt and its system prefix, the tool-call format (forced or free), the output constraint, the
parser of what the model writes, and the typed ``GenerateOp`` the worker takes."""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from localai.errors import InvalidRequest
from localai.metrics import Metrics
from localai.models import renderer
from localai.models.chat_template import RenderCall
from localai.models.registry import ModelRecord
from localai.protocol import Constraint, DoneFrame, GenerateOp, RequestFrame, Sampling, image_mark
from localai.runtime import prompt as prompting
from localai.runtime.fitting import output_reserve
from localai.runtime.formats import Parser, parser_for
from localai.schema import (
    GenerationRequest,
    Message,
    ReasoningBlock,
    TextBlock,
    ToolCallBlock,
    ToolCallEnd,
    ToolResultBlock,
)
from localai.settings import Settings
from localai.text import common_prefix_length
from localai.workers.handle import new_request_id
from localai.workers.scheduler import LoadedModel

SAMPLING_KEYS = frozenset(Sampling.__annotations__)
NEXT_TURN = "\u2063localai-next-turn\u2063"  # the next message, when rendering a reply as the next turn will
# Families whose models open with <think> (GLM-4.5+, DeepSeek-V3.1 in thinking mode) even when a Modelfile's PARSER
# names them over a template that does not show it (Harmony's analysis channel is parsed whenever it is the format).
THINKING_FORMATS = frozenset({"glm-4.5", "deepseek-v3.1"})


# what stands for the instructions a prewarm without any will be followed by (LocalTarget.warm_segment)
STAND_IN_SYSTEM = "[[instructions]]"


def bare_prewarm(request: GenerationRequest, messages: list[Message] | None) -> bool:
    """A prewarm before the conversation's first message (Codex's ``generate: false``, ``input: []``): it warms
    the prefix the turns will share, and is no turn of the conversation itself."""
    return request.prefill_only and messages is not None and not any(m.role in ("user", "tool") for m in messages)


@dataclass
class LocalTarget:
    """A lease on a local worker, and everything that decides a generation on it: the prompt is rendered here (in a
    render process) and the worker generates."""

    record: ModelRecord
    loaded: LoadedModel
    settings: Settings
    retries_on_crash: bool = True
    metrics: Metrics | None = None  # where a request its client left counts (its generation never saw its end)

    @functools.cached_property
    def template(self) -> prompting.Template:
        return template_of(self.record, self.loaded)

    @functools.cached_property
    def tool_format(self) -> prompting.ToolFormat:
        """How the model writes tool calls: its Modelfile's PARSER, else what its chat template shows."""
        return prompting.format_choice(self.record.parameters, self.template)[0]

    async def operation(self, request: GenerationRequest, messages: list[Message] | None) -> GenerateOp:
        """The op for ``request`` with ``messages`` (fitted), the prompt rendered."""
        params = self.record.parameters
        model_stops = list(params.get("stop", [])) if isinstance(params.get("stop"), list) else []  # type: ignore[arg-type]
        stop = list(dict.fromkeys([*(request.stop or []), *model_stops]))
        max_tokens = request.max_tokens
        if max_tokens is None and isinstance(params.get("num_predict"), int) and int(params["num_predict"]) >= 0:  # type: ignore[arg-type]
            max_tokens = int(params["num_predict"])  # type: ignore[arg-type]
        prompt, system_prefix = await self.render(request, messages)
        info = self.loaded.worker.info
        images = media_of(request.images, prompt)
        if request.prefill_only:
            max_tokens = 0  # a warm op: the prompt is evaluated and saved, nothing is generated
        return GenerateOp(
            op="generate", id=new_request_id(), prompt=prompt,
            reserve=output_reserve(max_tokens, info["n_ctx"] if info else 0),
            system_prefix=system_prefix,
            max_tokens=max_tokens, stop=stop, sampling=requested_sampling(self.record, request),  # type: ignore[typeddict-item]
            session=request.session_id, ignore_eos=request.ignore_eos, pin_ttl=request.cache_ttl,
            cache_partition=request.cache_partition, logprobs=request.logprobs,
            constraint=self.constraint(request),
            follow_up=messages is not None and self.settings.cache_max_bytes > 0 and not request.prefill_only
            and request.follow_up,
            warm=request.prefill_only,
            speculative=request.speculative if request.speculative is not None
            else {"on": True, "off": False}.get(str(params.get("speculative", "auto"))),
            **({"media": images} if images else {}),  # type: ignore[typeddict-item]
        )

    def size(self, op: GenerateOp) -> int:
        return len(op["prompt"])

    def generate(self, op: GenerateOp) -> AsyncIterator[RequestFrame]:
        return self.loaded.worker.generate(op, idle=self.settings.stream_keepalive, abandoned=self._abandoned)

    def _abandoned(self, done: DoneFrame) -> None:
        """A request whose client left: what it computed and generated until the worker stopped it counts."""
        if self.metrics is not None:
            usage = done["usage"]
            self.metrics.request_done(self.record.name, usage["prompt_tokens"], usage["cached_tokens"],
                                      usage["completion_tokens"], done["finish_reason"],
                                      usage.get("drafted_tokens", 0), usage.get("accepted_tokens", 0))

    async def render(self, request: GenerationRequest, messages: list[Message] | None, *,
                     system: bool = True) -> tuple[str, str | None]:
        """The prompt text (``messages`` and tools through the chat template, or the raw completion prompt) and,
        with ``system``, the rendered system-and-tools segment when it is a prefix of the prompt (cached as shared).
        The template runs in a render process (``models/renderer.py``), never here: it is not trusted. A template
        that fails or overruns is a 400 naming the model."""
        if messages is None:
            return request.prompt or "", None
        if bare_prewarm(request, messages):
            return await self.warm_segment(request, messages), None
        calls = await asyncio.to_thread(self._render_calls, request, messages, system)
        try:
            outcomes = await asyncio.wrap_future(renderer.pool().submit(calls))
        except renderer.RenderFailed as exc:
            exc.message, exc.param = f"model '{self.record.name}': {exc.message}", "messages"
            raise
        main = outcomes[0]
        if main.text is None:
            raise InvalidRequest(f"model '{self.record.name}': {main.error}", param="messages")
        for index, outcome in enumerate(outcomes[1:]):  # the segment with a first user message's header, or without
            text = outcome.text or ""
            if index == 0:
                text = text[:max(0, text.find(NEXT_TURN))]
            if text and main.text.startswith(text):
                return main.text, text
        return main.text, None

    async def warm_segment(self, request: GenerationRequest, messages: list[Message]) -> str:
        """A prewarm with no user message yet (Codex's ``generate: false`` with ``input: []``): the instructions and
        tools rendered up to where a first user message's content will start, the prefix every turn of the session
        shares (some templates refuse a conversation without a user message, so one stands in and is cut off).

        A prewarm with no instructions either (Codex 0.171 sends only its tools) is followed by a turn that brings
        its own (Codex's developer messages), and a template that writes the system text before the tools (Qwen's,
        Harmony's) puts them in front of the tools: that turn shares only what a stand-in system message leaves
        in place, so only that is warmed, not a tools block no turn reuses."""
        async def up_to_user(leading: list[Message]) -> str:
            rendered, _ = await self.render(replace(request, prefill_only=False),
                                            [*leading, Message(role="user", content=[TextBlock(NEXT_TURN)])],
                                            system=False)
            cut = rendered.find(NEXT_TURN)
            return rendered[:cut] if cut > 0 else ""

        segment = await up_to_user(messages)
        if not any(m.role in ("system", "developer") for m in messages):
            instructed = await up_to_user([Message(role="system", content=[TextBlock(STAND_IN_SYSTEM)]), *messages])
            segment = segment[:common_prefix_length(segment, instructed)]
        return segment

    def _render_calls(self, request: GenerationRequest, messages: list[Message], system: bool) -> list[RenderCall]:
        """The prompt's render and, with ``system``, the system-and-tools segment's (called off the event loop:
        shaping a long conversation and its tools' schemas takes a while)."""
        template, style, record = self.template, self.tool_format, self.record
        shaped = prompting.template_messages(messages, template, request.tools, default_system=record.system,
                                             extra_messages=[{"role": m["role"], "content": m["content"]}
                                                             for m in record.messages], style=style)
        calls = [prompting.render_call(template, shaped, request.tools, reasoning=request.reasoning,
                                       effort=request.reasoning_effort)]
        leading = []
        for message in messages:
            if message.role not in ("system", "developer"):
                break
            leading.append(message)
        if system and (leading or request.tools or record.system):  # a Modelfile's SYSTEM: personas share it
            # The segment runs up to where a first user message's content starts: its header is shared too (a model
            # whose state returns only to checkpoints keeps one there), and some templates refuse a conversation
            # without a user message (Qwen3's "No user query found"); else (an assistant message first) the system
            # part alone
            for following in ([Message(role="user", content=[TextBlock(NEXT_TURN)])], []):
                segment = prompting.template_messages([*leading, *following], template, request.tools,
                                                      default_system=record.system, style=style)
                calls.append(prompting.render_call(template, segment, request.tools, add_generation_prompt=False,
                                                   reasoning=request.reasoning, effort=request.reasoning_effort))
        return calls

    async def next_turn_prefix(self, request: GenerationRequest, messages: list[Message] | None, text: str,
                               calls: list[ToolCallEnd], reasoning: str) -> str | None:
        """The conversation with this reply, rendered up to where the next message's content will start."""
        if messages is None:
            return None
        content: list[Any] = [ReasoningBlock(reasoning)] if reasoning else []
        content += [TextBlock(text)] if text or not calls else []
        content += [ToolCallBlock(call.id, call.name, call.parsed_arguments()) for call in calls]
        if calls:
            following = Message(role="tool", content=[ToolResultBlock(calls[0].id, NEXT_TURN, name=calls[0].name)])
        else:
            following = Message(role="user", content=[TextBlock(NEXT_TURN)])
        rendered, _ = await self.render(request, [*messages, Message(role="assistant", content=content), following],
                                        system=False)
        cut = rendered.find(NEXT_TURN)
        return rendered[:cut] if cut > 0 else None

    def parser(self, request: GenerationRequest, prompt: str | None = None) -> Parser | None:
        """What reads the model's output into text, reasoning and tool calls; None when it is plain text."""
        chosen = self.tool_format
        forced = self.forced_style(request)
        style: str = forced or chosen  # a forced call: what the grammar makes the model write
        thinks = (self.template.thinks or chosen in THINKING_FORMATS) and request.reasoning is not False \
            and not request.raw
        tools = request.parses_tool_calls() and request.messages is not None
        if style == "harmony" and not request.raw:
            thinks = True  # its analysis channel is reasoning, asked for or not
        if not tools and not thinks:
            return None
        # A forced call is all the grammar lets the model write, even after a prompt that opened the reasoning
        opened = thinks and forced is None and prompt is not None and prompt.rstrip().endswith("<think>")
        return parser_for(style, tools=tools, reasoning=thinks, opened=opened,
                          functions={tool.name: tool.parameters for tool in request.tools})

    def forced_style(self, request: GenerationRequest) -> str | None:
        """The form a forced call (tool_choice required or named) is constrained to; None when none is forced.
        The grammar (``constraint``) and the parser (``parser``) both follow it."""
        if not request.tools or request.tool_choice.mode not in ("required", "function"):
            return None
        return forced_format(self.tool_format, self.template)

    def constraint(self, request: GenerationRequest) -> Constraint | None:
        """The grammar the output must follow: a forced or lazy tool call, or the response format."""
        choice = request.tool_choice
        forced = self.forced_style(request)
        if forced is not None:
            tools = request.tools
            if choice.mode == "function":
                tools = [tool for tool in request.tools if tool.name == choice.name]
                if not tools:
                    raise InvalidRequest(f"tool_choice names '{choice.name}', which is not among the tools",
                                         param="tool_choice")
            return Constraint(type="tool_call", format=forced,  # type: ignore[typeddict-item]
                              tools=[{"name": t.name, "parameters": t.parameters} for t in tools])
        if request.response_format is not None:
            if request.response_format.type == "json_schema":
                return Constraint(type="json_schema", schema=request.response_format.schema or {})
            return Constraint(type="json_object")
        if request.tools and choice.mode == "auto" and self.tool_format == "hermes":
            # Free text, but once the model opens <tool_call> the call must be well formed.
            return Constraint(type="tool_call", format="hermes", lazy=True,
                              tools=[{"name": t.name, "parameters": t.parameters} for t in request.tools])
        return None


def template_of(record: ModelRecord, loaded: LoadedModel) -> prompting.Template:
    """The model's chat template: its Modelfile's TEMPLATE, else the one its weights carry."""
    info = loaded.worker.info
    assert info is not None
    return prompting.Template(record.template or info["chat_template"], info["bos_token"], info["eos_token"])


def requested_sampling(record: ModelRecord, request: GenerationRequest) -> dict[str, Any]:
    """The sampling a request asks for: its own values over its Modelfile's (the engine's defaults fill the rest)."""
    return {**{k: v for k, v in record.parameters.items() if k in SAMPLING_KEYS}, **request.sampling.as_dict()}


def forced_format(style: prompting.ToolFormat, template: prompting.Template) -> str:
    """The form a forced call is constrained to: the family's own syntax, on both engines (llama.cpp's grammars match
    special tokens by their spelled-out pieces, llguidance's by id: engines/lark_calls.py), and Mistral's [ARGS]
    form where the template uses it."""
    if style == "mistral":
        return "mistral-args" if "[ARGS]" in (template.source or "") else "mistral"
    return style


def media_of(images: dict[str, bytes], prompt: str) -> dict[str, str]:
    """The images a rendered prompt marks (fitting may have dropped some), base64 by digest, for the worker."""
    return {digest: base64.b64encode(data).decode() for digest, data in images.items()
            if image_mark(digest) in prompt}
