"""What an engine supplies to the engine-neutral serving loop (``engines/serving.py``).

An engine owns a loaded model and ``n_seq`` sequences of KV state. The serving loop decides which request runs
on which sequence, what goes into each decode step, when state is saved to or restored from the prompt cache,
and how text, stops and usage are reported; the engine only evaluates tokens, samples, and moves KV state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from localai.promptcache.store import StateBytes
from localai.protocol import Constraint, ModelInfo, Sampling
from localai.text import common_prefix_length


@dataclass
class LoadOptions:
    """How to load a model (from the daemon's load options); a change in any of these means a reload.
    Each engine uses what applies to it."""

    model_path: str
    num_ctx: int
    n_parallel: int = 4
    n_threads: int = 2
    n_batch: int = 512
    num_gpu: int = -1
    num_cpu_moe: int = -1  # the first layers whose expert tensors stay on the CPU (-1: by free memory)
    rpc_servers: list[str] = field(default_factory=list)  # llama.cpp RPC servers (host:port) to place layers on
    use_mmap: bool = True
    flash_attention: bool = False
    cpu_repack: str = "auto"  # auto, on, off: llama.cpp's weight repacking (extra buffer types)
    kv_type: str = "f16"
    model_sha256: str = ""
    projector_path: str | None = None  # a vision projector (mmproj GGUF): images reach the model through mtmd
    adapters: list[dict[str, Any]] = field(default_factory=list)  # LoRA GGUFs applied to the context: {path, scale}
    template: str | None = None
    cache_dir: str | None = None
    cache_max_bytes: int = 8 << 30
    cache_ram_bytes: int = 256 << 20
    # For placing layers on a GPU (engines/placement.py), from the GGUF header and the window's KV estimate:
    layer_bytes: list[int] | None = None  # each repeating layer's weights (None: not read; llama.cpp offloads all)
    output_bytes: int = 0
    expert_bytes: list[int] | None = None  # each layer's expert tensors (a mixture of experts)
    weights_bytes: int = 0
    kv_bytes: int = 0
    gpu_overhead: int = 0  # bytes to leave free on each GPU (LOCALAI_GPU_OVERHEAD)
    host_free: int | None = None  # the system's free memory when the load began (not part of the reload key)


class BatchItem(NamedTuple):
    """One token of a decode step: which sequence, at which position, and whether its logits are wanted."""

    seq: int
    token: int
    pos: int
    logits: bool


class DecodeFailed(Exception):
    """A decode step failed; ``no_room`` when the KV cache is full (idle sequences can be dropped and retried)."""

    def __init__(self, message: str, *, no_room: bool = False) -> None:
        super().__init__(message)
        self.no_room = no_room


class EmbeddingsUnsupported(ValueError):
    """This engine has no embeddings; the request gets a 400 saying so."""


class RerankUnsupported(ValueError):
    """This model (or engine) is not a reranker; the request gets a 400 saying so."""


# What may follow a kept reply (a message's content) in the next turn: a letter, a space, a newline, a digit
STABLE_PROBES = ("x", " x", "\n", "1")


def stable_by_probes(tokenize: Callable[[str], list[int]], text: str, tokens: list[int]) -> int:
    """``Engine.stable_prefix`` for an engine with a tokenizer: how many of ``tokens`` stay the same whatever of
    ``STABLE_PROBES`` follows ``text``."""
    return min(common_prefix_length(tokens, tokenize(text + probe)) for probe in STABLE_PROBES)


class NoCheckpoints:
    """For an engine whose states are cut anywhere by token or kept whole per entry: no checkpoints to take or
    return to, and a text's tokens all stable (the prompt cache then never asks for the rest)."""

    checkpoints: bool = False

    def stable_prefix(self, text: str, tokens: list[int]) -> int:
        return len(tokens)

    def seq_checkpoint(self, seq: int) -> bytes:
        raise NotImplementedError("this engine keeps no checkpoints")

    def seq_rollback(self, seq: int, checkpoint: bytes, n_tokens: int) -> bool:
        return False


# ``prefill_chunk`` on a CPU. For small models prefill runs at the same rate in chunks of 32 to 512 tokens (this
# 2-core machine: SmolLM2 on llama.cpp 257-274 tokens/s, on MLX 14), and a step's time is about its tokens times the
# weights read for each: there the chunk is what keeps a step of a model of SmolLM2's size (96 MiB) to 64 tokens
# (0.24 s instead of 2 s for a 512-token step on llama.cpp), more for smaller ones (at most num_batch). At the sizes
# agents run that no longer holds: a real-shaped Qwen3-1.7B (Q4_K, 1.45 GiB; tests/scalemodels.py) prefills at
# 116 tokens/s in 32-token ubatches and 149 in 512-token ones (llama-bench, 2 threads), and a Qwen3.5 hybrid pays
# the serving loop's per-chunk work 16 times for a 500-token prompt (0.81x llama-server's prefill). From
# ``FULL_BATCH_WEIGHTS`` up the chunk is num_batch, as on a GPU and in llama-server (a step of a cold prompt then
# holds the other sequences' next token as long as llama-server's does). The chunk is fixed for a load (a chunk's
# size changes the kernels' arithmetic: greedy replies must not depend on timing).
CPU_PREFILL_CHUNK = 64
CPU_CHUNK_BYTES = CPU_PREFILL_CHUNK * (96 << 20)  # tokens x weight bytes in one CPU prefill step
MIN_CPU_CHUNK = 32
FULL_BATCH_WEIGHTS = 512 << 20


def prefill_chunk(n_batch: int, on_gpu: bool, weights_bytes: int = 0) -> int:
    """An engine's ``prefill_chunk``: ``n_batch`` on a GPU and for weights of ``FULL_BATCH_WEIGHTS`` or more; on a
    CPU below that, by the weights' size (``CPU_CHUNK_BYTES``), a power of two from ``MIN_CPU_CHUNK`` to
    ``n_batch`` (``CPU_PREFILL_CHUNK`` when the size is not known)."""
    if on_gpu or weights_bytes >= FULL_BATCH_WEIGHTS:
        return n_batch
    tokens = CPU_CHUNK_BYTES // weights_bytes if weights_bytes > 0 else CPU_PREFILL_CHUNK
    tokens = 1 << max(0, tokens.bit_length() - 1)  # a power of two at most tokens
    return max(1, min(n_batch, max(MIN_CPU_CHUNK, tokens)))


def top_logprobs(logits: Any, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``Engine.logprobs`` from one row of logits (any float array): log-softmax over the whole vocabulary, the
    ``top`` highest best first (equal values by token id)."""
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    highest = float(values.max())
    total = highest + math.log(float(np.exp(values - highest).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        count = min(top, values.size)
        picked = np.argpartition(-values, count - 1)[:count]
        best = sorted(((int(i), float(values[i]) - total) for i in picked), key=lambda pair: (-pair[1], pair[0]))
    return float(values[token]) - total, best


class Engine(Protocol):
    """A loaded model behind the serving loop."""

    backend: ClassVar[str]
    n_ctx: int  # tokens per sequence
    n_seq: int  # sequences (sessions live at once)
    n_batch: int  # most tokens in one decode step
    can_trim: bool  # a restored state can be cut back to any shorter prefix (not so for sliding-window caches)
    # Part of a sequence's state cannot be cut by token (a sliding window, recurrent layers): the sequence returns
    # only to checkpoints, that part taken at a token (seq_checkpoint) and put back there (seq_rollback)
    checkpoints: bool
    can_draft: bool  # the last few tokens can always be dropped (speculative decoding's rejected drafts)
    # A position evaluated in a batch after others of its sequence gets bit for bit the logits it gets alone: drafts
    # then change nothing in the output, and speculative decoding is on by default
    drafts_exact: bool
    # Prompt tokens a request evaluates a step (its prompt's chunks are the same whatever runs beside it): the longer,
    # the longer the other sequences wait for their next token
    prefill_chunk: int

    @property
    def images_encoded(self) -> int:
        """Images a vision projector encoded so far (reported with the cache's counters)."""
        ...

    def info(self) -> ModelInfo:
        """What the daemon learns about the model in the worker's ``ready`` frame."""
        ...

    def fingerprint_parts(self) -> dict[str, Any]:
        """Everything that must match for saved KV state to be valid here (model hash, engine build, layout)."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a rendered prompt: special tokens parsed, BOS added once when the model wants one."""
        ...

    def stable_prefix(self, text: str, tokens: list[int]) -> int:
        """How many of ``tokens`` (``text``'s) stay the same whatever text follows: a text's last tokens may merge
        with what comes next (where a checkpoint engine keeps the end of a kept reply)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token stands for (pieces of a UTF-8 character are joined by the caller)."""
        ...

    def is_end(self, token: int) -> bool:
        """Whether a token ends generation (EOS, end of turn)."""
        ...

    def new_sampler(self, sampling: Sampling, constraint: Constraint | None) -> Any:
        """A sampler for one request; raises ``GrammarError`` when the constraint cannot be built."""
        ...

    def free_sampler(self, sampler: Any) -> None: ...

    def decode(self, batch: list[BatchItem]) -> None:
        """Evaluate one step's tokens (several sequences at once); raises ``DecodeFailed``."""
        ...

    def sample(self, sampler: Any, row: int) -> int:
        """The next token from the logits of batch position ``row`` of the last decode (it is then accepted)."""
        ...

    def logprobs(self, row: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """``token``'s log-probability at batch position ``row`` of the last decode and the ``top`` likeliest tokens
        there, best first: from the model's logits before any sampling step (penalties, grammar, temperature), as
        llama.cpp's server reports them (``top_logprobs``)."""
        ...

    def seq_keep(self, seq: int, n_tokens: int) -> bool:
        """Keep only the first ``n_tokens`` positions of a sequence; False when the state cannot be cut there."""
        ...

    def seq_clear(self, seq: int) -> None: ...

    def seq_checkpoint(self, seq: int) -> bytes:
        """The part of the sequence's state that cannot be cut by token, as it is now (``checkpoints`` engines)."""
        ...

    def seq_rollback(self, seq: int, checkpoint: bytes, n_tokens: int) -> bool:
        """Return the sequence to a checkpoint taken when it held ``n_tokens`` tokens (the rest of its KV cut
        there); False, the sequence cleared, when the engine refuses it."""
        ...

    def seq_state(self, seq: int) -> StateBytes:
        """One sequence's KV state, serialized (empty when the engine could not write it)."""
        ...

    def seq_restore(self, seq: int, state: StateBytes, tokens: list[int] | None = None) -> bool:
        """Load a serialized state holding ``tokens`` into a sequence; False when the engine refuses it (an engine
        whose positions are not token indices, the Qwen-VL family's images, maps them from the tokens)."""
        ...

    def span_end(self, tokens: list[int], index: int) -> tuple[int, int] | None:
        """The run of prompt tokens that must be evaluated in one pass and that ``index`` falls strictly inside (an
        image whose positions attend each other: Gemma 3), as (first, end) indices; None where a chunk may end."""
        ...

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        """Cut a ``seq_state`` by token ranges for the prompt cache's blocks: (layout as JSON-able data, one
        payload per range, the part that cannot be cut, such as sliding-window layers), or None when this engine's
        state can only be kept whole. Raises ``ValueError`` for a state it does not understand."""
        ...

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes:
        """The inverse of ``state_split``: a state for ``seq_restore`` holding ``sum(lengths)`` tokens."""
        ...

    def embed(self, inputs: list[list[int]], *, truncate: bool) -> tuple[list[list[float]], int]:
        """One L2-normalised vector per input and the tokens evaluated; raises ``EmbeddingsUnsupported`` or
        ``ValueError`` for bad input. Must not touch the chat sequences."""
        ...

    def rerank(self, query: str, documents: list[str], *, truncate: bool) -> tuple[list[float], int]:
        """Each document's relevance to ``query`` (a reranker's classifier head) and the tokens evaluated; raises
        ``RerankUnsupported`` for a model that is not a reranker, ``ValueError`` for bad input. Must not touch the
        chat sequences."""
        ...
