"""Render a conversation to prompt text with the model's Jinja chat template (GGUF or Modelfile).

Templates come from GGUF files and Modelfiles, so they are not trusted: they run in Jinja's immutable
sandbox, cannot include, import or extend other templates (checked when a model is created), and every
render is bounded in time and size: a template that loops for hours or builds gigabytes of text is
stopped with a 400 instead of taking a thread and the machine's memory. The checks here stop what they see (a call,
an attribute, a ``*``); a bare loop sees none of them, so the daemon renders in processes of its own that are
killed at the deadline (``models/renderer.py``), and this module is what runs inside them.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import threading
import time
from typing import Any, TypedDict

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localai.errors import InvalidRequest

# Used when a model ships no template at all.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RENDER_SECONDS = 5.0  # real templates render in milliseconds, even for 100k-token conversations (a render process
# sets it to what its job has left)
MAX_OUTPUT_CHARS = 64 << 20  # beyond the worker protocol's frame limit anyway


class TemplateLimitExceeded(jinja2.TemplateError):
    """A template ran past the time or size a render may take."""


class TemplateTimeout(TemplateLimitExceeded):
    """A template ran past its deadline (seen at a call, an attribute or output; a bare loop is stopped by the
    render process being killed)."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus a deadline checked at every call, attribute, item and ``*``/``**`` a template evaluates."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._render = threading.local()

    def begin(self, seconds: float) -> None:
        self._render.deadline = time.monotonic() + seconds

    def check(self) -> None:
        deadline = getattr(self._render, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise TemplateTimeout(f"rendering took longer than {RENDER_SECONDS:g} s")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check()
        return _bounded(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check()
        return _bounded(super().getitem(obj, argument))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.check()
        if operator == "*" and isinstance(right, int) and isinstance(left, str | list | tuple):
            _size_check(len(left) * right)
        if operator == "*" and isinstance(left, int) and isinstance(right, str | list | tuple):
            _size_check(len(right) * left)
        if operator == "**" and isinstance(right, int | float) and abs(right) > 1024:
            raise TemplateLimitExceeded("exponent too large")
        return super().call_binop(context, operator, left, right)


def _size_check(size: int) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise TemplateLimitExceeded(f"a value of {size} characters or items is over the limit")


def _bounded(value: Any) -> Any:
    if isinstance(value, str | list) and len(value) > MAX_OUTPUT_CHARS:
        _size_check(len(value))
    return value


def check_source(source: str, where: str = "TEMPLATE") -> None:
    """Refuse a template that does not parse, or that reaches for other templates or files
    (``include``, ``import``, ``extends``): raises ``jinja2.TemplateError`` naming the line."""
    environment = _environment()
    try:
        tree = environment.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise jinja2.TemplateSyntaxError(f"{where}: {exc.message}", exc.lineno) from exc
    except RecursionError:
        raise jinja2.TemplateSyntaxError(f"{where}: the template is nested too deeply", 1) from None
    for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
        kind = type(node).__name__.lower().replace("fromimport", "import")
        raise jinja2.TemplateSyntaxError(
            f"{where}: '{kind}' is not allowed in a chat template (it would read other files)", node.lineno)


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedEnvironment:
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                             loader=None, auto_reload=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    check_source(source)
    return _environment().from_string(source)


class RenderCall(TypedDict):
    """One render, as data (it crosses to a render process as JSON): the template, the conversation and the
    variables the template gets besides ``messages``, ``bos_token``, ``eos_token`` and ``add_generation_prompt``."""

    source: str | None
    messages: list[dict[str, Any]]
    bos_token: str
    eos_token: str
    add_generation_prompt: bool
    extra: dict[str, Any]


def render_call(call: RenderCall) -> str:
    """The prompt text for a call, here in this process. A template that rejects a system message in the middle of
    a conversation gets it folded into the next user turn instead; one that moves such messages to the front gets
    them folded too, so the prompt's start does not change with each one."""
    source, messages = call["source"], call["messages"]
    options = {"bos_token": call["bos_token"], "eos_token": call["eos_token"],
               "add_generation_prompt": call["add_generation_prompt"], **call["extra"]}
    if any(m.get("role") == "system" for m in messages[1:]) \
            and hoists_late_system(source, call["bos_token"], call["eos_token"]):
        messages = fold_late_system(messages)
    try:
        return render(source, messages, **options)
    except InvalidRequest as exc:
        folded = fold_late_system(messages)
        if folded == messages or isinstance(exc.__cause__, TemplateLimitExceeded):
            raise
        return render(source, folded, **options)


@functools.lru_cache(maxsize=64)
def hoists_late_system(source: str | None, bos_token: str = "", eos_token: str = "") -> bool:
    """Whether the template moves a system message from the middle of a conversation to the front (some join every
    system message into one system prompt). Agents send such messages as reminders; moved to the front, each new
    one changes the prompt's start, and the cached prefix of the whole conversation is lost."""
    probe = [{"role": "system", "content": "\u2063first-system\u2063"}, {"role": "user", "content": "\u2063user\u2063"},
             {"role": "assistant", "content": "\u2063reply\u2063"},
             {"role": "system", "content": "\u2063late-system\u2063"},
             {"role": "user", "content": "\u2063next\u2063"}]
    try:
        text = render(source, probe, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=True)
    except Exception:  # refuses late system messages: render_call() folds them already
        return False
    late, user = text.find("\u2063late-system\u2063"), text.find("\u2063user\u2063")
    return 0 <= late < user


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first turn, merged into the following user message."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for position, message in enumerate(messages):
        if message.get("role") == "system" and position > 0:
            pending.append(str(message.get("content")))
            continue
        if pending and message.get("role") == "user":
            message = {**message, "content": "\n\n".join([*pending, str(message.get("content"))])}
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def render(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``; template errors and overruns become a 400 naming the problem."""
    environment = _environment()
    try:
        compiled = compile_template(template or CHATML)
        environment.begin(RENDER_SECONDS)
        parts: list[str] = []
        size = 0
        for part in compiled.generate(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                      add_generation_prompt=add_generation_prompt, **extra):
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateLimitExceeded(f"the prompt grew past {MAX_OUTPUT_CHARS} characters")
            environment.check()
            parts.append(part)
        return "".join(parts)
    except TemplateLimitExceeded as exc:
        raise InvalidRequest(f"the model's chat template was stopped: {exc}", param="messages") from exc
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"the model's chat template rejected the conversation: {exc}", param="messages") from exc
    except RecursionError as exc:
        raise InvalidRequest("the model's chat template recursed too deeply", param="messages") from exc
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as exc:  # range(10**8), 1/0, ...
        raise InvalidRequest(f"the model's chat template failed: {type(exc).__name__}: {exc}",
                             param="messages") from exc
