"""A deterministic stand-in engine for tests: no model, the real worker process, protocol and serving loop.

Selected with ``LOCALAI_ENGINE=scripted`` (or ``PARAMETER engine scripted``). Tokens are the prompt's bytes
(``EOS`` is 256). The reply is "Hello from the scripted engine." unless the prompt holds directives:

- ``[[say:TEXT]]`` (the last one counts): reply TEXT; ``[[say64:BASE64]]``: the same for a TEXT that may hold
  ``]]`` (it counts before ``say``);
- ``[[turns:FIRST|||SECOND|||...]]``: reply the part for this turn, counted by the assistant turns the prompt
  already holds (ChatML's ``<|im_start|>assistant``; the last part once they run out): an agent's tool call, then
  its answer once the tool's result is back; where the prompt holds ``[[next]]`` marks (a client puts one in each
  tool result), the turn is counted by them instead, for templates other than ChatML;
- ``[[echo]]``: reply the prompt itself, as the engine got it (what a dialect's request rendered to);
- ``[[slow]]``: a long reply at 20 tokens per second (for disconnects and Esc);
- ``[[crash]]``: the decode step raises, so the engine thread fails and the worker exits.

A constraint is honoured with a minimal valid instance: JSON for a schema, a forced tool call in the form the
constraint names (as the grammar would force it). KV state is the token list itself, so the prompt cache (save,
restore, trim, disk) runs for real.
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from localai.engines.engine import BatchItem, DecodeFailed, LoadOptions, NoCheckpoints, RerankUnsupported
from localai.engines.grammars import JSON_ARGUMENT_CALLS, NATIVE_FORCED, TAGGED_CALLS
from localai.engines.placement import cpu_only
from localai.promptcache.store import StateBytes
from localai.protocol import Constraint, ModelInfo, Sampling

EOS = 256
DEFAULT_REPLY = "Hello from the scripted engine."
SLOW_REPLY = "tick " * 2000
_SAY = re.compile(r"\[\[say:(.*?)\]\]", re.S)
_SAY64 = re.compile(r"\[\[say64:([A-Za-z0-9+/=]*)\]\]")
_TURNS = re.compile(r"\[\[turns:(.*?)\]\]", re.S)
ASSISTANT_TURN = "<|im_start|>assistant"
NEXT_TURN = "[[next]]"
ECHO = "[[echo]]"


@dataclass
class ScriptedSampler:
    """Where a request is in its scripted reply."""

    constraint: Constraint | None
    reply: bytes | None = None
    position: int = 0
    slow: bool = False


def minimal_instance(schema: Any) -> Any:
    """The smallest value valid against common JSON schemas (required properties, first enum value)."""
    if not isinstance(schema, dict):
        return {}
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return minimal_instance(schema[key][0])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties") or {}
        return {name: minimal_instance(properties.get(name, {})) for name in schema.get("required") or []}
    if kind == "array":
        return [minimal_instance(schema.get("items", {})) for _ in range(int(schema.get("minItems", 0)))]
    if kind == "string":
        return "x" * max(1, int(schema.get("minLength", 1)))
    if kind in ("integer", "number"):
        return int(schema.get("minimum", 0)) if kind == "integer" else float(schema.get("minimum", 0))
    if kind == "boolean":
        return True
    return None


def native_call(style: str, name: str, arguments: dict[str, Any]) -> str:
    """A call written in a family's own syntax, as ``grammars.native_call_grammar`` forces it."""
    if style in JSON_ARGUMENT_CALLS:
        before, between, after = JSON_ARGUMENT_CALLS[style]
        return before + name + between + json.dumps(arguments) + after
    call_open, name_open, name_close, key_open, key_close, value_close, call_close = TAGGED_CALLS[style]
    values = "".join(key_open + key + key_close + (value if isinstance(value, str) else json.dumps(value))
                     + value_close for key, value in arguments.items())
    return call_open + name_open + name + name_close + values + call_close


class ScriptedEngine(NoCheckpoints):
    """Answers from a script instead of a model."""

    backend: ClassVar[str] = "scripted"
    can_trim = True
    can_draft = True
    drafts_exact = True

    def __init__(self, options: LoadOptions) -> None:
        self.options = options
        self.n_ctx = options.num_ctx
        self.n_seq = options.n_parallel
        self.n_batch = options.n_batch
        self.prefill_chunk = options.n_batch
        self.sequences: list[list[int]] = [[] for _ in range(self.n_seq)]
        self._rows: list[int] = []  # the sequence of each batch position that asked for logits

    def info(self) -> ModelInfo:
        return ModelInfo(backend=self.backend, engine_version="scripted 1", n_ctx=self.n_ctx, n_ctx_train=self.n_ctx,
                         n_parallel=self.n_seq, n_vocab=257, bos_token="", eos_token="", chat_template=None,
                         architecture="scripted", flash_attention=False, kv_type="none",
                         placement=cpu_only(0, 0, "the scripted engine runs no model").report())

    def fingerprint_parts(self) -> dict[str, Any]:
        return {"engine": "scripted 1", "model_sha256": self.options.model_sha256 or self.options.model_path,
                "n_ctx": self.n_ctx, "n_seq": self.n_seq, "template": self.options.template or ""}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < EOS else b""

    def is_end(self, token: int) -> bool:
        return token == EOS

    def new_sampler(self, sampling: Sampling, constraint: Constraint | None) -> ScriptedSampler:
        return ScriptedSampler(constraint)

    def free_sampler(self, sampler: Any) -> None:
        pass

    def decode(self, batch: list[BatchItem]) -> None:
        rows = []
        for item in batch:
            history = self.sequences[item.seq]
            if item.pos != len(history):
                raise DecodeFailed(f"position {item.pos} does not follow sequence {item.seq}'s {len(history)} tokens")
            history.append(item.token)
            rows.append(item.seq)
        self._rows = rows

    def sample(self, sampler: Any, row: int) -> int:
        assert isinstance(sampler, ScriptedSampler)
        if sampler.reply is None:
            prompt = bytes(t for t in self.sequences[self._rows[row]] if t < EOS).decode(errors="replace")
            if "[[crash]]" in prompt:
                raise RuntimeError("scripted crash")  # unguarded in the decode loop: the worker exits
            sampler.slow = "[[slow]]" in prompt
            sampler.reply = self._reply(prompt, sampler).encode()
        if sampler.slow:
            time.sleep(0.05)
        if sampler.position >= len(sampler.reply):
            return EOS
        sampler.position += 1
        return sampler.reply[sampler.position - 1]

    def logprobs(self, row: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """The script is certain: its token at probability 1 (log 0), nothing else possible."""
        return 0.0, [(token, 0.0)][:top]

    def _reply(self, prompt: str, sampler: ScriptedSampler) -> str:
        constraint = sampler.constraint or {}
        if constraint.get("type") == "tool_call" and not constraint.get("lazy") and constraint.get("tools"):
            tool = constraint["tools"][0]
            style = constraint.get("format", "hermes")
            key = "parameters" if style == "llama3" else "arguments"
            call = {"name": tool["name"], key: minimal_instance(tool["parameters"])}
            if style in NATIVE_FORCED:
                return native_call(style, tool["name"], call["arguments"])
            if style == "hermes":
                return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
            return json.dumps([call] if style == "mistral" else call)  # the forms grammars.py constrains to
        if constraint.get("type") == "json_schema":
            return json.dumps(minimal_instance(constraint.get("schema") or {}))
        if constraint.get("type") == "json_object":
            return '{"scripted": true}'
        if sampler.slow:
            return SLOW_REPLY
        if ECHO in prompt:
            return prompt
        turns = _TURNS.findall(prompt)
        if turns:
            parts = turns[0].split("|||")
            turn = prompt.count(NEXT_TURN) or max(prompt.count(ASSISTANT_TURN) - 1, 0)
            return str(parts[min(turn, len(parts) - 1)])
        encoded = _SAY64.findall(prompt)
        if encoded:
            return base64.b64decode(encoded[-1]).decode()
        said = _SAY.findall(prompt)
        return said[-1] if said else DEFAULT_REPLY

    def seq_keep(self, seq: int, n_tokens: int) -> bool:
        del self.sequences[seq][n_tokens:]
        return True

    images_encoded = 0

    def span_end(self, tokens: list[int], index: int) -> tuple[int, int] | None:
        return None

    def seq_clear(self, seq: int) -> None:
        self.sequences[seq] = []

    def seq_state(self, seq: int) -> StateBytes:
        return array.array("i", self.sequences[seq]).tobytes()

    def seq_restore(self, seq: int, state: StateBytes, tokens: list[int] | None = None) -> bool:
        held = array.array("i")
        held.frombytes(state)
        self.sequences[seq] = held.tolist()
        return True

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        return None  # kept whole: the prompt cache stores the state as one snapshot per entry

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes:
        return rest

    def rerank(self, query: str, documents: list[str], *, truncate: bool) -> tuple[list[float], int]:
        raise RerankUnsupported("the scripted engine is not a reranker")

    def embed(self, inputs: list[list[int]], *, truncate: bool) -> tuple[list[list[float]], int]:
        vectors = []
        for index, tokens in enumerate(inputs):
            if not tokens:
                raise ValueError(f"input {index} is empty")
            digest = hashlib.sha256(bytes(t % 256 for t in tokens)).digest()
            values = [byte - 127.5 for byte in digest]
            norm = math.sqrt(sum(v * v for v in values))
            vectors.append([v / norm for v in values])
        return vectors, sum(len(tokens) for tokens in inputs)
