"""Rendering conversations and tools: deterministic, native tool templates and the Hermes fallback."""

from __future__ import annotations

from pathlib import Path

from localai.runtime import prompt
from localai.schema import Message, TextBlock, Tool, ToolCallBlock, ToolResultBlock

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
)
STRICT = (  # a template that refuses a system message anywhere but first
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system only first') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
)
TOOL = Tool("get_weather", "Weather for a city",
            {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}})
SAME_TOOL_OTHER_ORDER = Tool("get_weather", "Weather for a city",
                             {"properties": {"city": {"type": "string"}}, "type": "object", "required": ["city"]})
CONVERSATION = [
    Message("system", [TextBlock("Be brief.")]),
    Message("user", [TextBlock("Weather in Paris?")]),
    Message("assistant", [ToolCallBlock("call_1", "get_weather", {"city": "Paris"})]),
    Message("tool", [ToolResultBlock("call_1", "Sunny, 21C")]),
]


def rendered(template: str, tools: list[Tool], messages: list[Message] = CONVERSATION) -> str:
    spec = prompt.Template(template)
    return prompt.render(spec, prompt.template_messages(messages, spec, tools), tools)


def test_tool_schemas_render_identically_whatever_their_key_order() -> None:
    for template in (CHATML, NATIVE):
        assert rendered(template, [TOOL]) == rendered(template, [SAME_TOOL_OTHER_ORDER])


def test_template_without_tool_support_gets_hermes_instructions_and_call_text() -> None:
    text = rendered(CHATML, [TOOL])
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert text.index("Be brief.") < text.index("<tools>")  # tools follow the client's system prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 21C\n</tool_response>" in text
    assert prompt.Template(CHATML).tool_format == "hermes"


def test_native_template_receives_tools_and_structured_calls() -> None:
    text = rendered(NATIVE, [TOOL])
    assert text.startswith("TOOLS:")
    assert '<tool_call>get_weather{"city": "Paris"}</tool_call>' in text
    assert "[tool]Sunny, 21C" in text
    assert "<tools>" not in text


def test_a_template_that_renders_calls_but_not_the_tool_list_gets_the_tools_in_its_formats_own_words() -> None:
    """DeepSeek-V3.1's template renders calls and results in its markers and leaves the tool list to the system
    prompt: the tools are described as its model card does, calls stay native, and the parser is its own."""
    source = (Path(__file__).parents[1] / "templates" / "deepseek-v3.1.jinja").read_text()
    spec = prompt.Template(source)
    assert (spec.native_tools, spec.lists_tools, spec.tool_format) == (True, False, "deepseek-v3.1")
    assert prompt.format_choice({}, spec)[1] == "the chat template's calls; localai lists the tools in its words"
    text = prompt.render(spec, prompt.template_messages(CONVERSATION, spec, [TOOL]), [TOOL])
    assert "## Tools\nYou have access to the following tools:\n\n### get_weather\nDescription: Weather for a city"\
        in text
    assert text.index("Be brief.") < text.index("## Tools") < text.index("Weather in Paris?")
    assert "<tools>" not in text and "<tool_call>" not in text
    assert 'get_weather<\uff5ctool\u2581sep\uff5c>{"city": "Paris"}' in text  # the call, in its own markers
    # a PARSER naming the format over a template that knows no tools describes them the same way
    hermes = prompt.template_messages(CONVERSATION, prompt.Template(CHATML), [TOOL], style="deepseek-v3.1")
    assert "### get_weather" in hermes[0]["content"] and "<tools>" not in hermes[0]["content"]


def test_leading_system_and_developer_messages_merge() -> None:
    messages = [Message("system", [TextBlock("A")]), Message("developer", [TextBlock("B")]),
                Message("user", [TextBlock("hi")])]
    shaped = prompt.template_messages(messages, prompt.Template(CHATML), [])
    assert shaped[0] == {"role": "system", "content": "A\n\nB"}
    assert [m["role"] for m in shaped] == ["system", "user"]


def test_late_system_message_folds_into_the_next_user_turn_when_the_template_refuses_it() -> None:
    messages = [Message("user", [TextBlock("one")]), Message("assistant", [TextBlock("ok")]),
                Message("system", [TextBlock("mid-conversation note")]), Message("user", [TextBlock("two")])]
    text = rendered(STRICT, [], messages)
    assert "[user]mid-conversation note\n\ntwo" in text


def test_default_system_applies_only_without_one() -> None:
    spec = prompt.Template(CHATML)
    user = [Message("user", [TextBlock("hi")])]
    assert prompt.template_messages(user, spec, [], default_system="Modelfile SYSTEM")[0]["content"] == \
        "Modelfile SYSTEM"
    assert prompt.template_messages(CONVERSATION, spec, [], default_system="Modelfile SYSTEM")[0]["content"] == \
        "Be brief."


# Joins every system message into one system prompt at the start (as DeepSeek V3/R1's template does).
HOISTING = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\\n' -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}{{ '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_a_reminder_that_the_template_would_move_to_the_front_stays_in_place() -> None:
    """A mid-conversation system message (an agent's reminder) moved to the front changes the prompt's start, so
    the whole conversation would be recomputed: it goes into the next user turn instead, and each turn's prompt
    extends the previous one."""
    assert prompt.hoists_late_system(prompt.Template(HOISTING))
    assert not prompt.hoists_late_system(prompt.Template(CHATML))  # renders it in place: left alone
    assert not prompt.hoists_late_system(prompt.Template(STRICT))  # refuses it: folded on refusal already
    first = [Message("system", [TextBlock("Be brief.")]), Message("user", [TextBlock("one")])]
    second = [*first, Message("assistant", [TextBlock("ok")]), Message("developer", [TextBlock("reminder: tests")]),
              Message("user", [TextBlock("two")])]
    before, after = rendered(HOISTING, [], first), rendered(HOISTING, [], second)
    assert after.startswith(before.removesuffix("<|im_start|>assistant\n"))
    assert "<|im_start|>user\nreminder: tests\n\ntwo<|im_end|>" in after
    assert after.count("<|im_start|>system") == 1
