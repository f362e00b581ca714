"""Render a conversation to prompt text with the model's Jinja chat template (GGUF or Modelfile)."""

from __future__ import annotations

import datetime as dt
import functools
import json
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localai.errors import InvalidRequest

# Used when a model ships no template at all.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    return env.from_string(source)


def render(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``; template errors become a 400 naming the problem."""
    try:
        compiled = compile_template(template or CHATML)
        return compiled.render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **extra,
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"the model's chat template rejected the conversation: {exc}", param="messages") from exc
