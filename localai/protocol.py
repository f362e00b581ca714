"""The small typed protocol between the daemon and a worker process.

Frames are a 4-byte big-endian length followed by a JSON object, sent over a socketpair that
the daemon creates and passes to the worker. The daemon never imports an engine: everything
it knows about a model arrives in a ``ready`` frame.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import threading
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, cast

if TYPE_CHECKING:
    from localai.schema import Event, FinishReason, TokenLogprob

log = logging.getLogger("localai.protocol")
HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024


class Sampling(TypedDict, total=False):
    """Sampling options as the engine takes them (Ollama's parameter names)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    typical_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    seed: int


# What a request that sets nothing samples with, on every engine (llama.cpp's own defaults, as Ollama's): the
# values a response reports as used when neither the request nor the Modelfile set them.
DEFAULT_SAMPLING: Sampling = {
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0,
    "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}


class ToolSpec(TypedDict):
    """A tool as a grammar needs it: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


class Constraint(TypedDict, total=False):
    """What the output must be: JSON (any object, or valid against ``schema``) or a tool call."""

    type: Literal["json_object", "json_schema", "tool_call"]
    schema: dict[str, Any]
    tools: list[ToolSpec]
    # json: a bare {"name": ..., "arguments": ...} object; the others, the family's own syntax
    format: Literal["hermes", "llama3", "mistral", "json", "mistral-args", "qwen3-coder", "glm-4.5", "harmony",
                    "deepseek-v3.1"]
    lazy: bool  # tool_call only: constrain from the moment a call starts, text before it is free


class GenerateOp(TypedDict):
    """Daemon → worker: evaluate a prompt and stream the completion."""

    op: Literal["generate"]
    id: str
    prompt: str
    max_tokens: int | None
    stop: list[str]
    sampling: Sampling
    session: NotRequired[str | None]
    ignore_eos: NotRequired[bool]
    constraint: NotRequired[Constraint | None]
    system_prefix: NotRequired[str | None]
    reserve: NotRequired[int]  # room the reply needs: a prompt leaving less is refused as context_length (to fit)
    follow_up: NotRequired[bool]  # a warm op will follow with the reply as the next turn renders it: save after it
    warm: NotRequired[bool]  # prefill only (no output) and save: the previous reply, as the next turn renders it
    pin_ttl: NotRequired[float | None]  # pin the saved entries this long (Anthropic cache_control breakpoints)
    # draft tokens from the context and verify them (engines/speculative); None: where the output stays bit-identical
    speculative: NotRequired[bool | None]
    media: NotRequired[dict[str, str]]  # images the prompt's marks name (base64 by sha256), for a vision projector
    # whose prefix cache it may reuse: a hash of the API key's id and the request's cache_salt ("" or absent: the
    # default partition, shared by every caller when no keys differ); never the key itself
    cache_partition: NotRequired[str]
    logprobs: NotRequired[int | None]  # report each generated token's logprob and this many alternatives (0-20)


class CancelOp(TypedDict):
    """Daemon → worker: stop generating for a request (the client went away)."""

    op: Literal["cancel"]
    id: str


class TokenizeOp(TypedDict):
    """Daemon → worker: list the tokens of a text, or only count them (a long text's list may not fit a frame)."""

    op: Literal["tokenize"]
    id: str
    text: str
    count_only: NotRequired[bool]
    media: NotRequired[dict[str, str]]  # as GenerateOp's


class EmbedOp(TypedDict):
    """Daemon → worker: embed texts in the separate embedding context (chat sequences are untouched)."""

    op: Literal["embed"]
    id: str
    texts: list[str]
    truncate: bool
    tokens: NotRequired[list[list[int]]]  # token ids a client sent in place of texts (checked to be the model's own)


class RerankOp(TypedDict):
    """Daemon → worker: score documents against a query with a reranker (a context of its own, like embed)."""

    op: Literal["rerank"]
    id: str
    query: str
    documents: list[str]
    truncate: bool


class ShutdownOp(TypedDict):
    """Daemon → worker: finish what is being prefilled, write the queued cache entries, exit."""

    op: Literal["shutdown"]


# What the serving loop takes; what crosses to a worker (the worker's main loop handles shutdown itself)
WorkOp = GenerateOp | CancelOp | TokenizeOp | EmbedOp | RerankOp
Op = WorkOp | ShutdownOp
OP_KINDS = frozenset({"generate", "cancel", "tokenize", "embed", "rerank", "shutdown"})


def decode_op(body: bytes) -> Op:
    """An op from its JSON body; a kind the protocol does not have is a ValueError (a broken peer)."""
    return _tagged(body, "op", OP_KINDS, "op")  # type: ignore[return-value]


class ModelInfo(TypedDict):
    """What a worker reports about its loaded model in the ``ready`` frame."""

    backend: str
    engine_version: str
    n_ctx: int
    n_ctx_train: int
    n_parallel: int
    n_vocab: int
    bos_token: str
    eos_token: str
    chat_template: str | None
    architecture: str
    flash_attention: bool
    kv_type: str
    placement: dict[str, Any]  # engines/placement.Placement.report(): layers on the GPU, bytes there, processor
    # what the prompt cache keeps of a sequence (blocks of attention KV, and checkpoints where part of the state
    # cannot be cut) and whether speculative decoding can run on it, in words
    state: NotRequired[str]
    speculative: NotRequired[str]


class Usage(TypedDict):
    """Token counts and engine timings of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_ms: float
    decode_ms: float
    drafted_tokens: NotRequired[int]  # speculative decoding: tokens guessed, and those the model agreed with
    accepted_tokens: NotRequired[int]


# -- frames: worker -> daemon (and what a target yields to runtime/generation.py) ----------------------------------
# Every frame is a JSON object whose ``ev`` names its kind; the union ``Frame`` is what crosses the boundary, and
# mypy narrows it on ``frame["ev"] == ...``. Build them with these constructors; read them with ``decode_frame``.


class CacheSource(TypedDict):
    """Where a request's reused prefix came from: ``live`` (its slot), a cache tier (``ram``, ``disk``), ``miss``."""

    source: str
    restored: int  # tokens restored from the cache
    restore_ms: float


class PromptFrame(TypedDict):
    """The request was taken: its prompt fits, is tokenized, and this many tokens of it were reused."""

    ev: Literal["prompt"]
    id: str
    prompt_tokens: int
    cached_tokens: int
    cache: NotRequired[CacheSource | None]
    replica: NotRequired[str | None]  # the remote replica serving it (remote models)


class TextFrame(TypedDict):
    """Generated text (whole UTF-8 characters, held back while a stop sequence may be starting)."""

    ev: Literal["text"]
    id: str
    text: str
    # the request asked for logprobs: those of the generated tokens this text completes (a token whose text is
    # cut by a stop sequence, or an end-of-turn token, has none)
    logprobs: NotRequired[list[TokenLogprob]]


class EventFrame(TypedDict):
    """An already parsed event (text, reasoning, a tool-call delta): a remote model's upstream parsed its output.
    In-process only: it never crosses a socket."""

    ev: Literal["event"]
    id: str
    event: Event


class DoneFrame(TypedDict):
    """The request ended: why (stop, length, cancelled, tool_calls), the stop sequence matched, its usage."""

    ev: Literal["done"]
    id: str
    finish_reason: FinishReason
    stop_sequence: str | None
    usage: Usage


ErrorKind = Literal["invalid", "constraint", "context_length", "engine", "too_large", "foreign_token_ids"]


class ErrorFrame(TypedDict):
    """The request (or op) failed; ``context_length`` says how far over (for fitting)."""

    ev: Literal["error"]
    id: str | None
    kind: ErrorKind
    message: str
    prompt_tokens: NotRequired[int]  # context_length: the prompt's tokens and the context
    n_ctx: NotRequired[int]


class TokensFrame(TypedDict):
    """A tokenize op's answer: the count, and the tokens unless only the count was asked."""

    ev: Literal["tokens"]
    id: str
    count: int
    tokens: NotRequired[list[int]]


class EmbeddingsFrame(TypedDict):
    """An embed op's answer."""

    ev: Literal["embeddings"]
    id: str
    vectors: list[list[float]]
    prompt_tokens: int


class RanksFrame(TypedDict):
    """A rerank op's answer: each document's score, in the order sent."""

    ev: Literal["ranks"]
    id: str
    scores: list[float]
    prompt_tokens: int


class StatsFrame(TypedDict):
    """The worker's prompt cache counters (cumulative), after each request."""

    ev: Literal["stats"]
    cache: dict[str, int]
    # the cache's first failed write, once, sent as it happens for the daemon's log (``cache`` is then empty)
    warning: NotRequired[str]


class ReadyFrame(TypedDict):
    """The model loaded: what the daemon knows of it."""

    ev: Literal["ready"]
    info: ModelInfo


class LoadErrorFrame(TypedDict):
    """The model could not load (the worker exits)."""

    ev: Literal["load_error"]
    message: str


class FatalFrame(TypedDict):
    """The engine failed (the worker exits; the daemon reloads the model on the next request)."""

    ev: Literal["fatal"]
    message: str


class IdleFrame(TypedDict):
    """Daemon side only: nothing came from the worker for the stream's keepalive interval."""

    ev: Literal["idle"]


# What a worker sends; what a request's stream carries (``Target.generate``: a worker's or an upstream's frames)
WorkerFrame = (ReadyFrame | LoadErrorFrame | FatalFrame | PromptFrame | TextFrame | DoneFrame | ErrorFrame
               | TokensFrame | EmbeddingsFrame | RanksFrame | StatsFrame)
RequestFrame = PromptFrame | TextFrame | EventFrame | DoneFrame | ErrorFrame | IdleFrame
FRAME_KINDS = frozenset({"ready", "load_error", "fatal", "prompt", "text", "done", "error", "tokens", "embeddings",
                         "ranks", "stats"})


def decode_frame(body: bytes) -> WorkerFrame:
    """A worker's frame from its JSON body; a kind the protocol does not have is a ValueError (a broken peer)."""
    return _tagged(body, "ev", FRAME_KINDS, "frame kind")  # type: ignore[return-value]


def _tagged(body: bytes, tag: str, kinds: frozenset[str], what: str) -> dict[str, Any]:
    """The JSON object of a frame body whose ``tag`` names one of ``kinds``."""
    value = decode(body)
    kind = value.get(tag)
    if not isinstance(kind, str) or kind not in kinds:
        raise ValueError(f"unknown {what} {str(kind)[:40]!r}")
    return value


IMAGE_MARK_START = "<__localai_image_"
IMAGE_MARK = re.compile(r"<__localai_image_([0-9a-f]{64})__>")


def image_mark(digest: str) -> str:
    """Where an image stands in a rendered prompt, for a model with a vision projector: a mark naming its sha256
    (the worker holds the bytes by that digest, sent with the request)."""
    return f"{IMAGE_MARK_START}{digest}__>"


class FrameTooLarge(ValueError):
    """A message that would exceed ``MAX_FRAME``: refused before sending, so the peer never sees it."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a frame of {size} bytes exceeds the {MAX_FRAME >> 20} MiB limit")
        self.size = size


def encode(message: Mapping[str, Any]) -> bytes:
    """One frame: header plus compact JSON; raises FrameTooLarge instead of writing one the peer would refuse."""
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(len(body))
    return HEADER.pack(len(body)) + body


def read_frame(stream: IO[bytes]) -> bytes | None:
    """The next frame's body from a byte stream (a helper process's stdin: the daemon writes it), or None when the
    stream ended."""
    header = read_exactly(stream, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    return read_exactly(stream, length)


def read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    """``size`` bytes from a stream; None when it ends first."""
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data.extend(chunk)
    return bytes(data)


def decode(body: bytes) -> dict[str, Any]:
    """The JSON object of one frame body."""
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ValueError("frame is not a JSON object")
    return value


class FrameSocket:
    """Blocking frame I/O on a socket, safe for one reader and many writers (worker side)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._write_lock = threading.Lock()

    def send(self, frame: WorkerFrame) -> None:
        data = encode(frame)
        with self._write_lock:
            self._sock.sendall(data)

    def emit(self, frame: WorkerFrame) -> None:
        """Send a frame from the serving loop: one over the size limit is replaced by a ``too_large`` error for its
        request (it has no other answer); a daemon that is gone is left to the reader, whose ``receive`` ends."""
        try:
            self.send(frame)
        except FrameTooLarge as exc:
            log.warning("not sending a %s frame: %s", frame["ev"], exc)
            request = cast("Mapping[str, str | None]", frame).get("id")  # stats and the load frames have none
            if request is not None:
                self.send(ErrorFrame(ev="error", id=request, kind="too_large",
                                     message=f"the answer is too large for one response ({exc}); send less per "
                                             "request"))
        except OSError:
            pass

    def receive(self) -> Op | None:
        """The next op, or None when the peer closed the socket (ValueError: not a frame of the protocol)."""
        header = self._read_exactly(HEADER.size)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes exceeds the limit")
        body = self._read_exactly(length)
        if body is None:
            return None
        return decode_op(body)

    def _read_exactly(self, size: int) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < size:
            chunk = self._sock.recv(size - len(chunks))
            if not chunk:
                return None
            chunks.extend(chunk)
        return bytes(chunks)
