"""The MLX grammars against the replies the parsers round-trip: tests/runtime/formats/test_formats_roundtrip.py's
seeded generator writes 1,000 calls per format the way each family writes them (arguments full of markup, unicode
and nested JSON); each, tokenized by a tokenizer that has the family's special tokens, must be accepted whole by the
forced-call grammar the MLX engine builds for it (llguidance), and parse back to the same call. A grammar that
refused what the family writes would push a model off its own syntax."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest

from localai.engines.engine import LoadOptions
from localai.engines.grammars import NATIVE_FORCED, TAGGED_CALLS
from localai.engines.lark_calls import forced_call_grammar
from localai.runtime.formats import parser_for
from localai.schema import ToolCallEnd
from tests.engines.mlx.test_mlx_tool_syntax import SPECIALS, with_specials
from tests.runtime.formats.test_formats_roundtrip import SCHEMAS, arguments, write

CASES = int(os.environ.get("GRAMMAR_CASES", "1000"))
TOOLS = [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]


def closes_a_value(style: str, args: dict[str, Any]) -> bool:
    """A tagged format's text value that holds its own end: the grammar ends a value where its closing tag is
    written (qwen3-coder's "\n</parameter>", which may come early; GLM's special </arg_value>, whose text a value may
    not hold), the parser at the last one before the next tag."""
    if style not in TAGGED_CALLS:
        return False
    value_close = TAGGED_CALLS[style][5]
    tag = value_close.strip("\n")
    end = value_close[:value_close.index(tag) + len(tag)]
    if tag in SPECIALS[style]:
        return any(isinstance(value, str) and tag in value for value in args.values())
    return any(isinstance(value, str) and (value + end).find(end) < len(value) for value in args.values())


def as_a_model_writes(hf: Any, style: str, name: str, args: dict[str, Any]) -> list[int]:
    """The call's tokens as the model would write them: its markers as the family's special tokens, and its string
    arguments as text even where they spell a marker (code may quote one; the tokenizer would otherwise cut it out
    as the special token, which the model does not write inside a value)."""
    holders = {f"@@{index}@@": value for index, value in enumerate(v for v in args.values() if isinstance(v, str))}
    template = write(style, "", "", [(name, {key: next((h for h, v in holders.items() if v is value), value)
                                             if isinstance(value, str) else value for key, value in args.items()})])
    tokens: list[int] = []
    for piece in re.split(r"(@@\d+@@)", template):
        if piece in holders:
            value = holders[piece]
            shown = value if style in TAGGED_CALLS else json.dumps(value, ensure_ascii=False)[1:-1]
            tokens += hf.encode(shown, add_special_tokens=False, split_special_tokens=True)
        elif piece:
            tokens += hf.encode(piece, add_special_tokens=False)
    return tokens


@pytest.mark.parametrize("style", sorted(NATIVE_FORCED))
def test_a_thousand_calls_as_the_family_writes_them_are_accepted_by_the_mlx_grammar(
        style: str, mlx_arch_fixtures: dict[str, Path], tmp_path: Path) -> None:
    from localai.engines.mlx import MlxEngine

    folder = with_specials(mlx_arch_fixtures["llama"], tmp_path / style, SPECIALS[style])
    engine = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=256, n_parallel=1))
    grammar = forced_call_grammar({"type": "tool_call", "format": style, "tools": TOOLS},  # type: ignore[typeddict-item]
                                  engine._special_ids(), engine._validate)
    matcher = engine._compiled(grammar)
    rng = random.Random(f"mlx-{style}")
    checked = skipped = 0
    for case in range(CASES):
        name = rng.choice(list(SCHEMAS))
        args = arguments(rng, name)
        if closes_a_value(style, args):
            skipped += 1
            continue
        text = write(style, "", "", [(name, args)])
        tokens = as_a_model_writes(engine.hf, style, name, args)
        if style == "harmony":  # <|call|> ends the message: the model's end token, where the grammar has ended
            assert tokens[-1] == engine._special_ids()["<|call|>"]
            tokens = tokens[:-1]
        matcher.reset()
        assert matcher.consume_tokens(tokens) and matcher.is_accepting(), (style, case, matcher.get_error(), text)
        parser = parser_for("mistral" if style == "mistral-args" else style, tools=True, reasoning=False,
                            functions=SCHEMAS)
        calls = [e for e in [*parser.feed(text), *parser.finish()] if isinstance(e, ToolCallEnd)]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)], (style, case, text)
        checked += 1
    print(f"{style}: {checked} calls accepted, {skipped} skipped (a text value holding its closing tag)")
    assert checked >= CASES * 0.8
