"""A tagged call's values are typed from the tool's schema as the grammar read it (``engines/schema_refs.py``):
references with RFC 6901 escapes followed, an ``allOf`` merged; a reference that resolves to nothing leaves the
value text, as an undescribed parameter's is."""

from __future__ import annotations

import pytest

from localai.runtime.formats import parser_for
from tests.engines.test_schema_refs import ESCAPED
from tests.runtime.formats.test_formats_roundtrip import outcome

CALLS = {"qwen3-coder": "<tool_call>\n<function=f>\n<parameter=x>\n{x}\n</parameter>\n<parameter=y>\n{y}\n"
                        "</parameter>\n<parameter=w>\n{w}\n</parameter>\n</function>\n</tool_call>",
         "glm-4.5": "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{x}</arg_value>\n<arg_key>y</arg_key>\n"
                    "<arg_value>{y}</arg_value>\n<arg_key>w</arg_key>\n<arg_value>{w}</arg_value>\n</tool_call>"}


@pytest.mark.parametrize("style", list(CALLS))
def test_escaped_refs_and_all_of_type_a_tagged_calls_values(style: str) -> None:
    parser = parser_for(style, tools=True, reasoning=False, functions={"f": ESCAPED})
    _, _, calls = outcome([*parser.feed(CALLS[style].format(x=1, y="q", w=3)), *parser.finish()])
    assert calls == [("f", {"x": 1, "y": "q", "w": 3})]  # w, an allOf of an integer, was the text "3"


@pytest.mark.parametrize("style", list(CALLS))
def test_a_ref_to_nothing_leaves_the_value_text(style: str) -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/gone"}, "y": {"$ref": "https://x.test/a"},
                                               "w": {"allOf": [{"$ref": "#/$defs/gone"}]}}}
    parser = parser_for(style, tools=True, reasoning=False, functions={"f": schema})
    _, _, calls = outcome([*parser.feed(CALLS[style].format(x=1, y="q", w=3)), *parser.finish()])
    assert calls == [("f", {"x": "1", "y": "q", "w": "3"})]
