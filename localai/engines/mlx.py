"""The MLX engine: MLX safetensors models through mlx-lm, inside a worker process.

Each sequence is one mlx-lm prompt cache (a list of per-layer caches). A decode step runs the sequences that decode
(one token each, or a token and its drafts, right-padded) in one batched forward pass over mlx-lm's batch caches
(``mlx_batch``), and each prompt chunk in a pass of its own beside it, as mlx-lm's BatchGenerator does (a chunk is
``prefill_chunk`` tokens, so a long prompt delays the others' next token by one chunk at most). Sampling is
mlx-lm's filters and penalties with a per-request random key (so ``seed`` is honoured); grammars are
llguidance's matcher over the model's tokenizer, its mask applied to the logits with ``mx.where`` (portable,
unlike llguidance's Metal kernel). A sequence's state is serialized layer by layer (``mlx_state``): the attention KV
is cut into the prompt cache's token blocks like llama.cpp's, and the layers that cannot be cut by token (a sliding
window, hybrids' recurrent state) are kept as checkpoints under the same rules as the llama.cpp engine's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from mlx_lm.utils import load

from localai.engines import mlx_state
from localai.engines.engine import (
    BatchItem,
    DecodeFailed,
    LoadOptions,
    prefill_chunk,
    stable_by_probes,
    top_logprobs,
)
from localai.engines.grammars import HERMES_TRIGGER, NATIVE_FORCED, GrammarError, lark_for
from localai.engines.lark_calls import forced_call_grammar, lazy_call_grammar
from localai.engines.mlx_batch import DecodeGroup, batchable, ragged
from localai.engines.placement import Placement, cpu_only
from localai.engines.speculative import MAX_DRAFT
from localai.promptcache.store import StateBytes
from localai.protocol import DEFAULT_SAMPLING, Constraint, ModelInfo, Sampling

log = logging.getLogger("localai.worker")
# kv_type -> the bits of mlx-lm's QuantizedKVCache (groups of KV_GROUP values share a scale and a bias)
KV_BITS = {"q8_0": 8, "q4_0": 4}
KV_GROUP = 64
# the most tokens a sequence brings to the batched pass (a token and its drafts); more is a prompt chunk
RAGGED_MAX = 1 + MAX_DRAFT
# A drafting row padded beside single tokens costs the padding's compute: free where decode is memory-bound (a
# GPU), not on a CPU, where a pass's own cost is about 4 tokens' (SmolLM2 float16 on this 2-core CPU: 0.21 s a
# pass and 0.077 s a token at 4 streams; a drafting sequence beside 3 others padded to 13 positions each took
# 49.8 s where passes of its own took 40.1 s). On a CPU the drafts share the pass while the padding costs less
# than a pass of their own; on a GPU always.
CPU_PADDING_ALLOWED = 4
VERSIONS = f"mlx {importlib.metadata.version('mlx')} mlx-lm {importlib.metadata.version('mlx-lm')}"



@dataclass
class MlxSampler:
    """One request's sampling: filters, penalties over what it generated, its own random key, its grammar."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    processors: list[Any]
    key: Any
    matcher: Any = None
    history: list[int] = field(default_factory=list)
    lazy: tuple[int, str] | None = None  # a trigger token and the grammar that applies once it is sampled


class MlxEngine:
    """A loaded MLX model with ``n_parallel`` sequences."""

    backend: ClassVar[str] = "mlx"

    def __init__(self, options: LoadOptions, *, debug: bool = False) -> None:
        self.options = options
        path = Path(options.model_path)
        try:
            loaded = load(str(path))
        except ValueError as exc:  # "Model type X not supported.": a family newer than this mlx-lm
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
            raise RuntimeError(f"mlx-lm {importlib.metadata.version('mlx-lm')} cannot load this folder's model_type "
                               f"{model_type!r} ({exc}); a newer mlx-lm may: pip install -U mlx-lm") from exc
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.config = json.loads((path / "config.json").read_text())
        trained = int(self.config.get("max_position_embeddings") or options.num_ctx)
        self.n_ctx_train = trained
        self.n_ctx = min(options.num_ctx, trained)
        self.n_seq = options.n_parallel
        self.n_batch = options.n_batch
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        self.prefill_chunk = prefill_chunk(options.n_batch, on_gpu=on_gpu,
                                           weights_bytes=_weights_bytes(self.model))
        self.hf = self.tokenizer._tokenizer
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self.eos_token = int(self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None
                             else sorted(self.eos_ids)[0])
        self.kv_bits = KV_BITS.get(options.kv_type)  # a quantized KV cache (PARAMETER kv_type q8_0 or q4_0)
        self._warm_up()
        self.caches = [self._new_cache() for _ in range(self.n_seq)]
        self.lengths = [0] * self.n_seq  # tokens each sequence's caches hold
        self.group = DecodeGroup()  # the sequences decoding together, their caches merged
        self.layer_types = [type(layer) for layer in self.caches[0]]  # what every sequence's caches are
        self.batches = batchable(self.caches[0])
        self.ragged = self.batches and ragged(self.caches[0])  # rows of different lengths share a pass
        self.padding_allowed = 1 << 30 if on_gpu else CPU_PADDING_ALLOWED  # padded positions a pass may compute
        # A sliding window or recurrent layers cannot be cut back to any earlier token: such a sequence returns only to
        # checkpoints (the layers that cannot be cut, as they were at a token), as on the llama.cpp engine
        self.checkpoints = not all(mlx_state.is_cuttable(layer) for layer in self.caches[0])
        self.can_trim = True  # seq_keep refuses a cut it cannot make, and the serving loop goes to a checkpoint
        self.can_draft = not self.checkpoints  # a rotating or recurrent cache cannot drop a rejected draft
        self.drafts_exact = False  # a forward pass of several tokens is not bit-identical to one of each
        self.n_vocab = int(self.config.get("vocab_size") or len(self.hf))
        self._rows: dict[int, Any] = {}  # batch position -> logits of the last decode
        self._pieces: dict[int, bytes] = {}
        self._added = {int(index): str(token.content)
                       for index, token in (getattr(self.hf, "added_tokens_decoder", {}) or {}).items()}
        self._byte_decoder = _byte_decoder() if _is_byte_level(self.hf) else None
        self._guidance: Any = None  # llguidance's tokenizer, built on the first constrained request (~1 s)
        self.kv_dtype = mlx_state.dtype_name(self.model.model.embed_tokens.weight.dtype) if hasattr(
            self.model, "model") and hasattr(self.model.model, "embed_tokens") else "unknown"

    def _warm_up(self) -> None:
        """One prompt pass and one decode step on a throwaway cache, in the loading thread: some models keep arrays
        outside their parameters that stay lazy until first used (gpt-oss's YaRN frequencies), and the worker
        serves from another thread, where evaluating a graph made on this thread's stream fails."""
        cache = self._new_cache()
        try:
            mx.eval(self.model(mx.array([[self.eos_token] * 2]), cache=cache))
            mx.eval(self.model(mx.array([[self.eos_token]]), cache=cache))
        except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
            if self.kv_bits is None:
                raise
            raise RuntimeError(f"this model's attention does not take a quantized KV cache in mlx-lm "
                               f"{importlib.metadata.version('mlx-lm')} ({exc}); load it with kv_type f16") from exc

    def _new_cache(self) -> list[Any]:
        """A sequence's empty caches: mlx-lm's for the model, its plain KV caches quantized where asked."""
        cache = mlx_cache.make_prompt_cache(self.model)
        if self.kv_bits is None:
            return cache
        return [mlx_cache.QuantizedKVCache(group_size=KV_GROUP, bits=self.kv_bits)
                if type(layer) is mlx_cache.KVCache else layer for layer in cache]

    # -- model facts -----------------------------------------------------------------------------

    def info(self) -> ModelInfo:
        return ModelInfo(
            backend=self.backend, engine_version=VERSIONS,
            n_ctx=self.n_ctx, n_ctx_train=self.n_ctx_train, n_parallel=self.n_seq, n_vocab=self.n_vocab,
            bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "",
            chat_template=getattr(self.hf, "chat_template", None),
            architecture=str(self.config.get("model_type", "unknown")), flash_attention=False,
            kv_type=f"q{self.kv_bits}" if self.kv_bits else self.kv_dtype, placement=self.placement().report(),
        )

    def placement(self) -> Placement:
        """MLX runs the whole model on its default device: Apple's GPU through Metal (unified memory), else the
        CPU (MLX's CPU backend on Linux)."""
        total = self.options.weights_bytes + self.options.kv_bytes
        if mx.default_device().type != mx.DeviceType.gpu:
            return cpu_only(total, 1, "MLX runs on its CPU backend here")
        device = {"name": "Metal", "description": "Apple GPU (unified memory)", "backend": "MLX Metal"}
        return Placement(1, 1, total, total, [device], "MLX puts the whole model on the GPU")

    def fingerprint_parts(self) -> dict[str, Any]:
        template = self.options.template or getattr(self.hf, "chat_template", None) or ""
        return {
            "model_sha256": self.options.model_sha256 or self.options.model_path,
            "engine": VERSIONS, "kv_dtype": self.kv_dtype,
            "kv_quantization": {"bits": self.kv_bits, "group_size": KV_GROUP} if self.kv_bits else None,
            "caches": [kind.__name__ for kind in self.layer_types],
            "chat_template": hashlib.sha256(template.encode()).hexdigest(),
        }

    def tokenize(self, text: str) -> list[int]:
        tokens = list(self.hf.encode(text, add_special_tokens=False))
        bos = self.tokenizer.bos_token
        if getattr(self.hf, "add_bos_token", False) and bos and not text.startswith(bos):
            tokens.insert(0, int(self.hf.convert_tokens_to_ids(bos)))
        return tokens

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def _piece(self, token: int) -> bytes:
        text = self.hf.convert_ids_to_tokens(token)
        if text is None:
            return b""
        added = self._added.get(token)
        if added is not None:  # an added token (the chat's markers, special or not) stands for its text as written
            return added.encode()
        if self._byte_decoder is not None:
            return bytes(self._byte_decoder.get(char, 0) for char in text)
        if text.startswith("<0x") and text.endswith(">") and len(text) == 6:  # SentencePiece byte fallback
            return bytes([int(text[3:5], 16)])
        return str(text).replace("\u2581", " ").encode()

    def is_end(self, token: int) -> bool:
        return token in self.eos_ids

    # -- sampling --------------------------------------------------------------------------------

    def new_sampler(self, sampling: Sampling, constraint: Constraint | None) -> MlxSampler:
        options: dict[str, Any] = {**DEFAULT_SAMPLING, **{k: v for k, v in sampling.items() if v is not None}}
        lazy = self._lazy(constraint)
        matcher = None if lazy is not None else self._matcher(constraint)
        last_n = int(options["repeat_last_n"])
        context = self.n_ctx if last_n < 0 else max(1, min(last_n, self.n_ctx))
        processors = make_logits_processors(
            repetition_penalty=float(options["repeat_penalty"]) if options["repeat_penalty"] != 1.0 else None,
            repetition_context_size=context,
            presence_penalty=float(options["presence_penalty"]) or None, presence_context_size=context,
            frequency_penalty=float(options["frequency_penalty"]) or None, frequency_context_size=context,
        )
        seed = options.get("seed")
        key = mx.random.key(int(seed) & 0xFFFFFFFF) if seed is not None else mx.random.key(
            int.from_bytes(np.random.bytes(4), "little"))
        return MlxSampler(temperature=float(options["temperature"]), top_k=int(options["top_k"]),
                          top_p=float(options["top_p"]), min_p=float(options["min_p"]), processors=processors,
                          key=key, matcher=matcher, lazy=lazy)

    def _matcher(self, constraint: Constraint | None) -> Any:
        """The request's grammar matcher (None for free text, and for a lazy grammar until its trigger)."""
        if not constraint or (constraint.get("type") == "tool_call" and constraint.get("lazy")):
            return None
        if constraint.get("type") == "tool_call" and constraint.get("format") in NATIVE_FORCED:
            grammar: str | None = forced_call_grammar(constraint, self._special_ids(), self._validate)
        else:
            grammar = lark_for(constraint, self._validate)
        return None if grammar is None else self._compiled(grammar)

    def _lazy(self, constraint: Constraint | None) -> tuple[int, str] | None:
        """For ``auto`` tool calls, the trigger token and the grammar that applies once it is sampled. As on
        llama.cpp: only where the trigger is one token (a model that writes <tool_call> in pieces gets its calls
        parsed, unconstrained)."""
        if not constraint or constraint.get("type") != "tool_call" or not constraint.get("lazy"):
            return None
        trigger = self.hf.encode(HERMES_TRIGGER, add_special_tokens=False)
        if len(trigger) != 1:
            return None
        return trigger[0], lazy_call_grammar(constraint, self._special_ids(), self._validate)

    def _validate(self, grammar: str) -> str:
        """llguidance's verdict on a grammar for this tokenizer ("" when it is fine); builds its tokenizer once."""
        from llguidance import LLMatcher

        if self._guidance is None:
            import llguidance.hf

            self._guidance = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.n_vocab,
                                                          eos_token=self.eos_token)

        return str(LLMatcher.validate_grammar(grammar, self._guidance))

    def _compiled(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._guidance, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar built for this request was refused: {matcher.get_error()}")
        return matcher

    def _special_ids(self) -> dict[str, int]:
        """The tokenizer's special tokens by their text (a grammar names them by id)."""
        decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
        return {str(token.content): int(index) for index, token in decoder.items() if getattr(token, "special", False)}

    def free_sampler(self, sampler: Any) -> None:
        pass

    def sample(self, sampler: Any, row: int) -> int:
        assert isinstance(sampler, MlxSampler)
        if sampler.matcher is not None and sampler.matcher.is_stopped():
            return self.eos_token  # the grammar is complete: nothing may follow it
        logits = self._rows[row][None, :]
        if sampler.processors and sampler.history:
            history = mx.array(sampler.history)
            for processor in sampler.processors:
                logits = processor(history, logits)
        if sampler.matcher is not None and not sampler.matcher.is_stopped():
            bits = np.unpackbits(np.frombuffer(sampler.matcher.compute_bitmask(), np.uint8), bitorder="little")
            allowed = np.zeros(logits.shape[-1], dtype=bool)
            allowed[:min(len(bits), logits.shape[-1])] = bits[:logits.shape[-1]].astype(bool)
            logits = mx.where(mx.array(allowed)[None, :], logits, -mx.inf)
        if sampler.temperature <= 0:
            token = int(np.asarray(mx.argmax(logits, axis=-1))[0])
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if sampler.top_k > 0:
                logprobs = apply_top_k(logprobs, sampler.top_k)
            if 0 < sampler.top_p < 1:
                logprobs = apply_top_p(logprobs, sampler.top_p)
            if sampler.min_p > 0:
                logprobs = apply_min_p(logprobs, sampler.min_p)
            sampler.key, subkey = mx.random.split(sampler.key)
            token = int(np.asarray(mx.random.categorical(logprobs * (1 / sampler.temperature), key=subkey))[0])
        if sampler.matcher is not None and not sampler.matcher.is_stopped():
            sampler.matcher.consume_token(token)
        elif sampler.lazy is not None and token == sampler.lazy[0]:
            sampler.matcher = self._compiled(sampler.lazy[1])  # the call begins: from here on it is constrained
            sampler.lazy = None
        sampler.history.append(token)
        return token

    def logprobs(self, row: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        return top_logprobs(np.asarray(self._rows[row].astype(mx.float32)), token, top)

    # -- evaluation ------------------------------------------------------------------------------

    def decode(self, batch: list[BatchItem]) -> None:
        """Evaluate a step: the sequences with one token each (decoding) in one batched forward pass, each
        sequence with several (a prompt chunk, a token and its drafts) in a pass of its own."""
        groups: dict[int, list[tuple[int, BatchItem]]] = {}
        for row, item in enumerate(batch):
            groups.setdefault(item.seq, []).append((row, item))
        for seq, items in groups.items():
            if items[0][1].pos != self.lengths[seq]:
                raise DecodeFailed(f"position {items[0][1].pos} does not follow sequence {seq}'s "
                                   f"{self.lengths[seq]} tokens")
        together = [seq for seq, items in groups.items() if self._together(items)] if self.batches else []
        width = max((len(groups[seq]) for seq in together), default=1)
        if width > 1 and len(together) * width - sum(len(groups[seq]) for seq in together) > self.padding_allowed:
            together = [seq for seq in together if len(groups[seq]) == 1]  # drafting rows in passes of their own
        if len(together) < 2:
            together = []
        rows: dict[int, Any] = {}
        try:
            if together:
                group = self.group.gather(together, self.caches)
                width = max(len(groups[seq]) for seq in group.seqs)  # the drafting rows may have left (above)
                tokens = mx.array([[item.token for _, item in groups[seq]]
                                   + [groups[seq][-1][1].token] * (width - len(groups[seq])) for seq in group.seqs])
                logits = self.model(tokens, cache=group.cache)
                for index, seq in enumerate(group.seqs):
                    for column, (row, item) in enumerate(groups[seq]):
                        if item.logits:
                            rows[row] = logits[index, column].astype(mx.float32)
                    self.lengths[seq] += len(groups[seq])
                    group.drop(seq, width - len(groups[seq]))  # its right padding
                mx.eval(list(rows.values()), group.state())  # no graph carried over
            for seq, items in groups.items():
                if seq in together:
                    continue
                cache = self._cache(seq)
                logits = self.model(mx.array([[item.token for _, item in items]]), cache=cache)
                wanted = [(row, index) for index, (row, item) in enumerate(items) if item.logits]
                for row, index in wanted:
                    rows[row] = logits[0, index].astype(mx.float32)
                self.lengths[seq] += len(items)
                mx.eval([rows[row] for row, _ in wanted], [layer.state for layer in cache])
        except (RuntimeError, ValueError, MemoryError) as exc:
            raise DecodeFailed(f"MLX failed to evaluate the batch: {exc}") from exc
        self._rows = rows

    def _together(self, items: list[tuple[int, BatchItem]]) -> bool:
        """Whether a sequence's tokens of a step go in the batched pass: one token, or (where rows can differ in
        length) a token and its drafts, every one wanting logits. Prompt chunks go in a pass of their own."""
        return len(items) == 1 or (self.ragged and len(items) <= RAGGED_MAX and all(item.logits for _, item in items))

    def _cache(self, seq: int) -> list[Any]:
        """A sequence's own caches, taken out of the decoding group first when it is in it."""
        self.group.release(seq, self.caches)
        return self.caches[seq]

    # -- sequences -------------------------------------------------------------------------------

    def seq_keep(self, seq: int, n_tokens: int) -> bool:
        current = self.lengths[seq]
        if n_tokens >= current:
            return True
        if self.ragged and seq in self.group.seqs:  # rejected drafts: dropped from its row, which stays in the batch
            self.group.drop(seq, current - n_tokens)
            self.lengths[seq] = n_tokens
            return True
        cache = self._cache(seq)
        if not all(layer.is_trimmable() for layer in cache):
            return False
        for layer in cache:
            layer.trim(current - n_tokens)
        self.lengths[seq] = n_tokens
        return True

    images_encoded = 0

    def span_end(self, tokens: list[int], index: int) -> tuple[int, int] | None:
        return None  # images are not seen through MLX

    def seq_clear(self, seq: int) -> None:
        self.group.release(seq, self.caches)
        self.caches[seq] = self._new_cache()
        self.lengths[seq] = 0

    def seq_state(self, seq: int) -> StateBytes:
        """Per layer: its class and items (a KVCache's arrays only up to its offset), then the bytes."""
        cache = self._cache(seq)
        if not self.lengths[seq]:
            return b""
        return mlx_state.encode(cache, self.lengths[seq])

    def seq_restore(self, seq: int, state: StateBytes, tokens: list[int] | None = None) -> bool:
        try:
            cache, n_tokens = mlx_state.decode(state)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, struct.error) as exc:
            log.warning("an MLX cache state did not load: %s", exc)
            return False
        if [type(layer) for layer in cache] != self.layer_types:
            log.warning("an MLX cache state's layers do not match the model's")
            return False
        if any(layer.offset != n_tokens for layer in cache if mlx_state.is_cuttable(layer)):
            log.warning("an MLX cache state's layers do not hold the %d tokens it names", n_tokens)
            return False
        self.group.release(seq, self.caches)
        self.caches[seq] = cache
        self.lengths[seq] = n_tokens
        return True

    def seq_checkpoint(self, seq: int) -> bytes:
        """The layers that cannot be cut by token (a window, recurrent state), as they are now."""
        return mlx_state.checkpoint(self._cache(seq), self.lengths[seq])

    def seq_rollback(self, seq: int, checkpoint: bytes, n_tokens: int) -> bool:
        """Back to a checkpoint taken at ``n_tokens``: its layers put back, the KV layers cut there."""
        cache = self._cache(seq)
        try:
            kept, at = mlx_state.decode(mlx_state.rest_of(checkpoint))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, struct.error) as exc:
            log.warning("an MLX checkpoint did not load: %s", exc)
            self.seq_clear(seq)
            return False
        whole = [index for index, layer in enumerate(cache) if not mlx_state.is_cuttable(layer)]
        if len(whole) != len(kept) or at != n_tokens or n_tokens > self.lengths[seq] or any(
                type(cache[index]) is not type(layer) for index, layer in zip(whole, kept, strict=True)):
            self.seq_clear(seq)
            return False
        for index, layer in zip(whole, kept, strict=True):
            cache[index] = layer
        for layer in cache:
            if mlx_state.is_cuttable(layer):
                layer.trim(layer.offset - n_tokens)
        self.lengths[seq] = n_tokens
        return True

    def stable_prefix(self, text: str, tokens: list[int]) -> int:
        return stable_by_probes(self.tokenize, text, tokens)

    # -- the prompt cache's blocks ---------------------------------------------------------------

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        """Cut a state by token range (the KV layers); windows and recurrent layers are its rest, kept whole."""
        return mlx_state.split(state, n_tokens, ranges)

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes:
        """The inverse of ``state_split``: a state for ``seq_restore``."""
        try:
            return mlx_state.join(layout, pieces, lengths, rest)
        except (KeyError, TypeError, IndexError, struct.error) as exc:
            raise ValueError(f"an MLX state does not match its layout: {exc}") from exc

    # -- embeddings ------------------------------------------------------------------------------

    def rerank(self, query: str, documents: list[str], *, truncate: bool) -> tuple[list[float], int]:
        from localai.engines.engine import RerankUnsupported

        raise RerankUnsupported("rerankers run on the llama.cpp engine (a reranker GGUF), not on MLX")

    def embed(self, inputs: list[list[int]], *, truncate: bool) -> tuple[list[list[float]], int]:
        """Mean-pooled final hidden states, L2-normalised (a chat model's, like the llama.cpp engine's)."""
        inner = getattr(self.model, "model", None)
        if inner is None:
            from localai.engines.engine import EmbeddingsUnsupported

            raise EmbeddingsUnsupported("this MLX model has no embeddings")
        limit = min(self.n_ctx, 2048)
        vectors, counted = [], 0
        for index, tokens in enumerate(inputs):
            if not tokens:
                raise ValueError(f"input {index} is empty")
            if len(tokens) > limit:
                if not truncate:
                    raise ValueError(f"input {index} is {len(tokens)} tokens, over the embedding context of {limit}; "
                                     "shorten it or allow truncation")
                tokens = tokens[:limit]
            hidden = inner(mx.array([tokens])).astype(mx.float32)
            pooled = mx.mean(hidden[0], axis=0)
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled), 1e-12)
            vectors.append([float(v) for v in np.asarray(pooled)])
            counted += len(tokens)
        return vectors, counted


def _weights_bytes(model: Any) -> int:
    """The bytes of a model's parameters (what a forward pass reads)."""
    flat: list[Any] = list(tree_flatten(model.parameters()))
    return sum(int(pair[1].nbytes) for pair in flat)


def _is_byte_level(hf: Any) -> bool:
    try:
        decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)]
    return "ByteLevel" in kinds


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of the 256 bytes is shown as a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}
