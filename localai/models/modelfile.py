"""Ollama-style Modelfiles: parse, validate and render them.

``TEMPLATE`` holds a Jinja chat template (the Hugging Face / GGUF kind), not Ollama's Go template.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localai.errors import ModelfileError
from localai.settings import rpc_endpoint

INT_PARAMETERS = frozenset(
    {"num_ctx", "num_predict", "num_keep", "num_batch", "num_thread", "num_gpu", "num_cpu_moe", "main_gpu", "seed",
     "top_k", "repeat_last_n", "priority"}
)
FLOAT_PARAMETERS = frozenset(
    {"temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
     "timeout", "connect_timeout"}
)
BOOL_PARAMETERS = frozenset({"use_mmap", "fit_context"})
# rpc: a llama.cpp RPC server (host:port) that the model's layers spread over, one line each (llama-server's --rpc)
LIST_PARAMETERS = frozenset({"stop", "replica", "rpc"})
# Free text: a remote model's id upstream, and the environment variable holding its API key (never the key).
STRING_PARAMETERS = frozenset({"upstream_model", "api_key_env"})
# The engine a model runs on (see models/loading.engine_for); `scripted` is the test stand-in (no model is loaded).
ENGINES = ("llama.cpp", "mlx", "scripted")
# What serves a remote model (auto: detected from its /v1/models); see localai.upstreams.pool.
UPSTREAM_KINDS = ("auto", "openai", "vllm", "sglang", "dynamo", "llama-server", "llama-cpp-python", "localai")
# How a model writes tool calls and reasoning (localai/runtime/formats): `PARSER NAME` overrides what the model's
# template says, as in Ollama's Modelfiles.
PARSERS = ("hermes", "llama3", "mistral", "qwen3-coder", "harmony", "glm-4.5", "deepseek-v3.1")
CHOICE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "engine": ENGINES, "routing": ("session", "round_robin"), "upstream_kind": UPSTREAM_KINDS, "parser": PARSERS,
    # drafts from the context (engines/speculative.py); auto: where they leave the output bit-identical
    "speculative": ("auto", "on", "off"),
    # the KV cache's type (default: f16, or q8_0 where only that fits an agent's window): llama.cpp's cache types,
    # mlx-lm's QuantizedKVCache of 8 or 4 bits on MLX
    "kv_type": ("f16", "q8_0", "q4_0"),
}
# Parameters that only mean something for a remote model (FROM http://HOST:PORT/v1).
REMOTE_PARAMETERS = frozenset({"upstream_model", "replica", "api_key_env", "timeout", "connect_timeout", "routing",
                               "upstream_kind", "priority"})
SECRET_PARAMETERS = frozenset({"api_key", "key", "token", "password"})  # refused with a pointer to api_key_env
PARAMETERS = (INT_PARAMETERS | FLOAT_PARAMETERS | BOOL_PARAMETERS | LIST_PARAMETERS | STRING_PARAMETERS
              | frozenset(CHOICE_PARAMETERS))
# Parameters that change how the model is loaded (a change means a reload), not how it samples.
LOAD_PARAMETERS = frozenset({"num_ctx", "num_batch", "num_gpu", "num_cpu_moe", "main_gpu", "use_mmap", "num_thread",
                             "kv_type", "rpc"})
# What each numeric parameter may be. Values outside would crash or overflow the engine (1e400), allocate without
# limit (repeat_last_n 200000000) or make no sense (num_ctx -1); they are refused naming the parameter and range.
BOUNDS: dict[str, tuple[float, float]] = {
    "num_ctx": (128, 1 << 24), "num_predict": (-2, 1 << 24), "num_keep": (-1, 1 << 24),
    "num_batch": (1, 16384), "num_thread": (1, 1024), "num_gpu": (-1, 100_000), "main_gpu": (0, 255),
    "num_cpu_moe": (-1, 100_000),  # the first layers whose expert tensors stay on the CPU (-1: by free memory)
    "seed": (-(1 << 63), (1 << 64) - 1), "top_k": (0, 1 << 20), "repeat_last_n": (-1, 1 << 20),
    "temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "typical_p": (0.0, 1.0),
    "repeat_penalty": (0.0, 100.0), "presence_penalty": (-100.0, 100.0), "frequency_penalty": (-100.0, 100.0),
    "timeout": (0.01, 86400.0), "connect_timeout": (0.01, 600.0), "priority": (-1000, 1000),
}
MAX_STOPS = 16
MAX_STOP_CHARS = 256
# The largest chat templates models ship are about 20 KB (gpt-oss: 17 KB); parsing takes about 1 s a megabyte of
# such a template (more for a hostile one), on a thread that contends with the event loop's
MAX_TEMPLATE_CHARS = 256 * 1024
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})
INSTRUCTIONS = frozenset({"from", "parameter", "template", "system", "adapter", "license", "message", "requires",
                          "parser", "projector"})

ParameterValue = int | float | bool | str | list[str]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Modelfile:
    """The parsed contents of a Modelfile."""

    from_: str
    parameters: dict[str, ParameterValue] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    adapters: list[str] = field(default_factory=list)
    license: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    requires: str | None = None
    # A vision projector (an mmproj GGUF): `PROJECTOR path`, or a second FROM as Ollama writes it
    projector: str | None = None

    def render(self) -> str:
        """The Modelfile text that reproduces this model (what ``localai show --modelfile`` prints)."""
        lines = [f"FROM {self.from_}"]
        for name, value in self.parameters.items():
            if name == "parser":
                lines.append(f"PARSER {value}")
                continue
            for item in value if isinstance(value, list) else [value]:
                lines.append(f"PARAMETER {name} {_render_value(item)}")
        if self.template is not None:
            lines.append(f'TEMPLATE """{self.template}"""')
        if self.system is not None:
            lines.append(f'SYSTEM """{self.system}"""')
        lines.extend(f"ADAPTER {adapter}" for adapter in self.adapters)
        if self.projector is not None:
            lines.append(f"PROJECTOR {self.projector}")
        for message in self.messages:
            lines.append(f'MESSAGE {message["role"]} """{message["content"]}"""')
        if self.license is not None:
            lines.append(f'LICENSE """{self.license}"""')
        if self.requires is not None:
            lines.append(f"REQUIRES {self.requires}")
        return "\n".join(lines) + "\n"


def _render_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (" " in value or not value or '"' in value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def parse_file(path: Path) -> Modelfile:
    """Parse a Modelfile on disk; a relative ``FROM`` path resolves against the file's directory."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelfileError(f"cannot read Modelfile {path}: {exc}") from exc
    modelfile = parse(text, source=str(path))
    candidate = (path.parent / modelfile.from_).expanduser()
    if _looks_like_path(modelfile.from_) and not Path(modelfile.from_).expanduser().is_absolute():
        modelfile.from_ = str(candidate.resolve())
    projector = modelfile.projector
    if projector is not None and _looks_like_path(projector) and not Path(projector).expanduser().is_absolute():
        modelfile.projector = str((path.parent / projector).expanduser().resolve())
    modelfile.adapters = anchored_adapters(modelfile.adapters, path.parent)
    return modelfile


MAX_ADAPTER_SCALE = 100.0  # an adapter's scale at most, either sign (llama-server sets none; 1 is the trained one)


def split_adapter(argument: str) -> tuple[str, float]:
    """``ADAPTER path [scale]``: the path and its scale (1.0 when none is given; a path that is itself a file with a
    space and a number in its name stays whole). Ollama's form is the path alone."""
    named, _, last = argument.rpartition(" ")
    if named and not Path(argument).expanduser().exists():
        try:
            scale = float(last)
        except ValueError:
            return argument, 1.0
        if not math.isfinite(scale) or abs(scale) > MAX_ADAPTER_SCALE:
            raise ModelfileError(f"ADAPTER {argument}: the scale must be a number from -{MAX_ADAPTER_SCALE:g} to "
                                 f"{MAX_ADAPTER_SCALE:g} (1 applies the adapter as trained)")
        return named.strip(), scale
    return argument, 1.0


def anchored_adapters(adapters: list[str], folder: Path) -> list[str]:
    """``ADAPTER`` arguments with relative paths resolved against ``folder`` (the Modelfile's), scales kept."""
    anchored = []
    for argument in adapters:
        named, scale = split_adapter(argument)
        if _looks_like_path(named) and not Path(named).expanduser().is_absolute():
            resolved = str((folder / named).expanduser().resolve())
            argument = resolved if named == argument else f"{resolved} {scale:g}"
        anchored.append(argument)
    return anchored


def _looks_like_path(value: str) -> bool:
    if ":" in value.split("/", 1)[0]:
        return False  # a scheme such as package: or hf.co/..., not a file
    return value.startswith((".", "/", "~")) or value.lower().endswith(".gguf")


def parse(text: str, *, source: str = "Modelfile") -> Modelfile:
    """Parse Modelfile text. Errors name the line and what is wrong."""
    from_: str | None = None
    template_line = 0
    result = Modelfile(from_="")
    for lineno, instruction, argument in _instructions(text, source):
        where = f"{source}, line {lineno}"
        if instruction == "from":
            if not argument:
                raise ModelfileError(f"{where}: FROM needs a model name or a GGUF path")
            if from_ is not None:  # Ollama's way of adding a vision projector: a second FROM
                if result.projector is not None:
                    raise ModelfileError(f"{where}: a third FROM; the second is the vision projector (mmproj GGUF), "
                                         "and a model has one")
                result.projector = argument
                continue
            from_ = argument
        elif instruction == "projector":
            if not argument:
                raise ModelfileError(f"{where}: PROJECTOR needs the path of a vision projector (an mmproj GGUF)")
            if result.projector is not None:
                raise ModelfileError(f"{where}: a second projector; a model has one")
            result.projector = argument
        elif instruction == "parameter":
            name, value = _parameter(argument, where)
            if name in LIST_PARAMETERS:
                existing = result.parameters.setdefault(name, [])
                assert isinstance(existing, list) and isinstance(value, list)
                existing.extend(value)
            else:
                result.parameters[name] = value
        elif instruction == "template":
            result.template = argument
            template_line = lineno
        elif instruction == "system":
            result.system = argument
        elif instruction == "adapter":
            result.adapters.append(argument)
        elif instruction == "license":
            result.license = argument
        elif instruction == "requires":
            result.requires = argument
        elif instruction == "parser":
            result.parameters["parser"] = _parser_name(argument, where)
        elif instruction == "message":
            role, _, content = argument.partition(" ")
            role = role.lower()
            if role not in MESSAGE_ROLES:
                raise ModelfileError(
                    f"{where}: MESSAGE role {role!r} is not one of {', '.join(sorted(MESSAGE_ROLES))}"
                )
            result.messages.append({"role": role, "content": _unquote(content.strip())})
    if from_ is None:
        raise ModelfileError(f"{source}: no FROM line; a Modelfile must say which model it builds on")
    result.from_ = from_
    if result.template is not None and "{{ ." in result.template.replace("{{- .", "{{ ."):
        raise ModelfileError(
            f"{source}: TEMPLATE looks like an Ollama Go template; localai takes a Jinja chat template "
            "(the kind stored in GGUF files as tokenizer.chat_template)"
        )
    if result.template is not None:
        check_template(result.template, f"{source}, line {template_line}", template_line)
    return result


def _template_refusal(template: str, where: str) -> tuple[str, int] | None:
    """Why a chat template cannot be used, or None: over ``MAX_TEMPLATE_CHARS`` (line 0), or not parsing, nested too
    deeply or reading other files (the reason without ``where``, and its line in the template)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        return f"{len(template):,} characters, over the limit of {MAX_TEMPLATE_CHARS:,}", 0
    import jinja2

    from localai.models.chat_template import check_source

    try:
        check_source(template, where)
    except jinja2.TemplateSyntaxError as exc:
        message = exc.message or "invalid template"
        if message.startswith(where):
            message = message[len(where):].lstrip(": ")
        return message, exc.lineno or 1
    return None


def check_template(template: str, where: str, first_line: int = 1) -> None:
    """Refuse a TEMPLATE that does not parse, reads other files or is over ``MAX_TEMPLATE_CHARS``, naming the
    Modelfile line. Parsing a large one takes a while: callers in the daemon run this off the event loop."""
    refused = _template_refusal(template, where)
    if refused is None:
        return
    reason, line = refused
    if not line:
        raise ModelfileError(f"{where}: TEMPLATE is {reason}; a chat template is a few kilobytes")
    prefix = where.rsplit(", line", 1)[0]
    raise ModelfileError(f"{prefix}, line {first_line + line - 1}: TEMPLATE {reason}")


def check_weights_template(template: str, where: str) -> None:
    """The chat template the weights carry (a GGUF header's) held to TEMPLATE's bounds (``check_template``): refused
    naming ``where`` and the fix, a TEMPLATE of the model's own. Such a template could never render a request."""
    refused = _template_refusal(template, where)
    if refused is None:
        return
    reason, line = refused
    fix = "give the model a TEMPLATE of its own in a Modelfile"
    if not line:
        raise ModelfileError(f"{where} is {reason}; {fix}")
    raise ModelfileError(f"{where}: {reason} (its line {line}); {fix}")


def _parser_name(argument: str, where: str) -> str:
    name = _unquote(argument.strip()).lower()
    if name not in PARSERS:
        raise ModelfileError(f"{where}: PARSER {argument.strip()[:40]!r} is not a tool-call format localai knows; "
                             f"one of: {', '.join(PARSERS)}")
    return name


def _parameter(argument: str, where: str) -> tuple[str, ParameterValue]:
    name, _, raw = argument.partition(" ")
    name = name.strip().lower()
    raw = _unquote(raw.strip())
    if not name or raw == "":
        raise ModelfileError(f"{where}: PARAMETER needs a name and a value, e.g. PARAMETER temperature 0.7")
    if name not in PARAMETERS and name not in SECRET_PARAMETERS:
        raise ModelfileError(f"{where}: unknown parameter {name!r}; known: {', '.join(sorted(PARAMETERS))}")
    return name, coerce_parameter(name, raw, where)


def coerce_parameter(name: str, raw: Any, where: str = "parameter") -> ParameterValue:
    """Convert a raw parameter value (Modelfile text or a JSON value) to its type within its bounds, or raise
    ModelfileError naming the parameter."""
    if name in INT_PARAMETERS or name in FLOAT_PARAMETERS:
        return _number(name, raw, where)
    if name in BOOL_PARAMETERS:
        if isinstance(raw, bool):
            return raw
        lowered = str(raw).lower() if isinstance(raw, str | int) else ""
        if lowered not in ("true", "false", "1", "0"):
            raise ModelfileError(f"{where}: {name} must be true or false, got {raw!r}")
        return lowered in ("true", "1")
    if name in CHOICE_PARAMETERS:
        if raw not in CHOICE_PARAMETERS[name]:
            raise ModelfileError(f"{where}: {name} must be one of {', '.join(CHOICE_PARAMETERS[name])}, "
                                 f"got {str(raw)[:40]!r}")
        return str(raw)
    if name in STRING_PARAMETERS:
        if not isinstance(raw, str) or not raw or len(raw) > 256:
            raise ModelfileError(f"{where}: {name} must be a string of 1 to 256 characters, got {str(raw)[:40]!r}")
        if name == "api_key_env" and not _ENV_NAME.fullmatch(raw):
            raise ModelfileError(f"{where}: api_key_env names an environment variable (letters, digits and _), "
                                 f"got {raw[:40]!r}; the key itself never goes in a Modelfile")
        return raw
    if name in LIST_PARAMETERS:
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ModelfileError(f"{where}: {name} must be a string or a list of strings, got {raw!r}"[:300])
        if len(items) > MAX_STOPS or any(len(item) > MAX_STOP_CHARS for item in items):
            raise ModelfileError(f"{where}: {name} takes at most {MAX_STOPS} strings of at most "
                                 f"{MAX_STOP_CHARS} characters")
        if name == "rpc":
            try:
                return list(dict.fromkeys(rpc_endpoint(item) for item in items))
            except ValueError as exc:
                raise ModelfileError(f"{where}: {exc} (the address `localai rpc-server` listens on)") from exc
        return list(items)
    if name in SECRET_PARAMETERS:
        raise ModelfileError(f"{where}: a Modelfile never holds an API key (it would be stored in clear); put the key "
                             "in an environment variable of the daemon and name it: PARAMETER api_key_env NAME")
    raise ModelfileError(f"{where}: unknown parameter {name!r}")


def _number(name: str, raw: Any, where: str) -> int | float:
    integer = name in INT_PARAMETERS
    kind = "an integer" if integer else "a number"
    value: int | float
    try:
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise ValueError
        if integer:
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise ValueError
                value = int(raw)
            else:
                value = int(raw)
        else:
            value = float(raw)
    except (ValueError, OverflowError):
        raise ModelfileError(f"{where}: {name} must be {kind}, got {str(raw)[:40]!r}") from None
    low, high = (int(bound) for bound in BOUNDS[name]) if integer else BOUNDS[name]
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        shown = f"{int(low)} and {int(high)}" if integer else f"{low:g} and {high:g}"
        raise ModelfileError(f"{where}: {name} must be between {shown}, got {str(raw)[:40]}")
    return value


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        inner = value[1:-1]
        return inner.replace('\\"', '"').replace("\\\\", "\\")
    return value


def _instructions(text: str, source: str) -> list[tuple[int, str, str]]:
    """Split Modelfile text into (line number, instruction, argument); handles triple-quoted blocks."""
    result: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        lineno = index + 1
        stripped = lines[index].strip()
        index += 1
        if not stripped or stripped.startswith("#"):
            continue
        word, _, rest = stripped.partition(" ")
        instruction = word.lower()
        if instruction not in INSTRUCTIONS:
            raise ModelfileError(
                f"{source}, line {lineno}: unknown instruction {word!r}; "
                "expected FROM, PARAMETER, TEMPLATE, SYSTEM, MESSAGE, ADAPTER, PROJECTOR, LICENSE, REQUIRES or PARSER"
            )
        rest = rest.strip()
        if '"""' in rest:
            head, _, after = rest.partition('"""')
            if '"""' in after:
                body, _, tail = after.partition('"""')
                if tail.strip():
                    raise ModelfileError(f"{source}, line {lineno}: text after closing \"\"\"")
            else:
                chunks = [after]
                while True:
                    if index >= len(lines):
                        raise ModelfileError(f"{source}, line {lineno}: unterminated \"\"\" block")
                    line = lines[index]
                    index += 1
                    if '"""' in line:
                        closing, _, tail = line.partition('"""')
                        chunks.append(closing)
                        if tail.strip():
                            raise ModelfileError(f"{source}, line {index}: text after closing \"\"\"")
                        break
                    chunks.append(line)
                body = "\n".join(chunks)
            argument = (head + body) if head.strip() else body
        else:
            argument = rest if instruction in ("parameter", "message") else _unquote(rest)
        result.append((lineno, instruction, argument))
    return result
