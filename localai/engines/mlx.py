"""The MLX engine: MLX safetensors models through mlx-lm, inside a worker process.

Each sequence is one mlx-lm prompt cache (a list of per-layer caches). A decode step runs one forward pass per
sequence that has tokens in the step (several sequences are interleaved step by step, not fused into one padded
batch: the serving loop's batches mix prefill chunks and single decode tokens of different lengths). Sampling is
mlx-lm's filters and penalties with a per-request random key (so ``seed`` is honoured); grammars are
llguidance's matcher over the model's tokenizer, its mask applied to the logits with ``mx.where`` (portable,
unlike llguidance's Metal kernel). A sequence's KV state is serialized layer by layer (only the used part of each
buffer), so the shared prompt cache stores MLX entries beside llama.cpp's, under their own fingerprint.
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
from mlx_lm.models import cache as mlx_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from mlx_lm.utils import load

from localai.engines.engine import BatchItem, DecodeFailed, LoadOptions, NoCheckpoints
from localai.engines.grammars import GrammarError, lark_for
from localai.engines.placement import Placement, cpu_only
from localai.promptcache.store import StateBytes
from localai.protocol import DEFAULT_SAMPLING, Constraint, ModelInfo, Sampling

log = logging.getLogger("localai.worker")
VERSIONS = f"mlx {importlib.metadata.version('mlx')} mlx-lm {importlib.metadata.version('mlx-lm')}"

_UNTRIMMABLE = (mlx_cache.RotatingKVCache, mlx_cache.ArraysCache)


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


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _array_bytes(array: Any) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)  # numpy has no bfloat16: move the bits as they are
    return bytes(np.asarray(array).tobytes())


def _array_from(data: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> Any:
    if dtype == "bfloat16":
        return mx.array(np.frombuffer(data, np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(np.frombuffer(data, np.dtype(dtype)).reshape(shape))


def _storage_dtype(name: str) -> Any:
    """The numpy type a serialized array's bytes are read as (bfloat16's bits travel as uint16)."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def _parse_state(state: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """``seq_state``'s header, and where the arrays' bytes begin."""
    try:
        (length,) = struct.unpack_from("<I", state)
        header = json.loads(bytes(state[4:4 + length]))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"not an MLX cache state: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("layers"), list):
        raise ValueError("not an MLX cache state: no layers")
    return header, 4 + length


class MlxEngine(NoCheckpoints):
    """A loaded MLX model with ``n_parallel`` sequences."""

    backend: ClassVar[str] = "mlx"

    def __init__(self, options: LoadOptions, *, debug: bool = False) -> None:
        self.options = options
        path = Path(options.model_path)
        loaded = load(str(path))
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.config = json.loads((path / "config.json").read_text())
        trained = int(self.config.get("max_position_embeddings") or options.num_ctx)
        self.n_ctx_train = trained
        self.n_ctx = min(options.num_ctx, trained)
        self.n_seq = options.n_parallel
        self.n_batch = options.n_batch
        self.hf = self.tokenizer._tokenizer
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self.eos_token = int(self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None
                             else sorted(self.eos_ids)[0])
        self.caches = [mlx_cache.make_prompt_cache(self.model) for _ in range(self.n_seq)]
        self.can_trim = not any(isinstance(layer, _UNTRIMMABLE) for layer in self.caches[0])
        self.can_draft = self.can_trim  # a rotating or recurrent cache cannot drop a rejected draft
        self.drafts_exact = False  # a forward pass of several tokens is not bit-identical to one of each
        self.n_vocab = int(self.config.get("vocab_size") or len(self.hf))
        self._rows: dict[int, Any] = {}  # batch position -> logits of the last decode
        self._pieces: dict[int, bytes] = {}
        self._byte_decoder = _byte_decoder() if _is_byte_level(self.hf) else None
        self._guidance: Any = None  # llguidance's tokenizer, built on the first constrained request (~1 s)
        self.kv_dtype = _dtype_name(self.model.model.embed_tokens.weight.dtype) if hasattr(
            self.model, "model") and hasattr(self.model.model, "embed_tokens") else "unknown"

    # -- model facts -----------------------------------------------------------------------------

    def info(self) -> ModelInfo:
        return ModelInfo(
            backend=self.backend, engine_version=VERSIONS,
            n_ctx=self.n_ctx, n_ctx_train=self.n_ctx_train, n_parallel=self.n_seq, n_vocab=self.n_vocab,
            bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "",
            chat_template=getattr(self.hf, "chat_template", None),
            architecture=str(self.config.get("model_type", "unknown")), flash_attention=False,
            kv_type=self.kv_dtype, placement=self.placement().report(),
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
            "kv_quantization": None, "caches": [type(layer).__name__ for layer in self.caches[0]],
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
        if token in getattr(self.hf, "all_special_ids", ()):
            return str(text).encode()
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
        matcher = self._matcher(constraint)
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
                          key=key, matcher=matcher)

    def _matcher(self, constraint: Constraint | None) -> Any:
        if not constraint:
            return None
        from llguidance import LLMatcher

        if self._guidance is None:
            import llguidance.hf

            self._guidance = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.n_vocab,
                                                          eos_token=self.eos_token)
        grammar = lark_for(constraint, lambda text: str(LLMatcher.validate_grammar(text, self._guidance)))
        if grammar is None:
            return None
        matcher = LLMatcher(self._guidance, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar built for this request was refused: {matcher.get_error()}")
        return matcher

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
        sampler.history.append(token)
        return token

    # -- evaluation ------------------------------------------------------------------------------

    def decode(self, batch: list[BatchItem]) -> None:
        """One forward pass per sequence in the step, in the order the sequences appear."""
        groups: dict[int, list[tuple[int, BatchItem]]] = {}
        for row, item in enumerate(batch):
            groups.setdefault(item.seq, []).append((row, item))
        rows: dict[int, Any] = {}
        try:
            for seq, items in groups.items():
                cache = self.caches[seq]
                offset = cache[0].offset if hasattr(cache[0], "offset") else 0
                if items[0][1].pos != offset:
                    raise DecodeFailed(f"position {items[0][1].pos} does not follow sequence {seq}'s {offset} tokens")
                tokens = mx.array([[item.token for _, item in items]])
                logits = self.model(tokens, cache=cache)
                wanted = [(row, index) for index, (row, item) in enumerate(items) if item.logits]
                for row, index in wanted:
                    rows[row] = logits[0, index].astype(mx.float32)
                mx.eval([rows[row] for row, _ in wanted], [layer.state for layer in cache])  # no graph carried over
        except DecodeFailed:
            raise
        except (RuntimeError, ValueError, MemoryError) as exc:
            raise DecodeFailed(f"MLX failed to evaluate the batch: {exc}") from exc
        self._rows = rows

    # -- sequences -------------------------------------------------------------------------------

    def seq_keep(self, seq: int, n_tokens: int) -> bool:
        cache = self.caches[seq]
        current = getattr(cache[0], "offset", 0)
        if n_tokens >= current:
            return True
        if not all(layer.is_trimmable() for layer in cache):
            return False
        for layer in cache:
            layer.trim(current - n_tokens)
        return True

    def seq_clear(self, seq: int) -> None:
        self.caches[seq] = mlx_cache.make_prompt_cache(self.model)

    def seq_state(self, seq: int) -> StateBytes:
        """Per layer: its class, meta state and arrays (a KVCache's only up to its offset), then the bytes."""
        layers: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        for layer in self.caches[seq]:
            if isinstance(layer, mlx_cache.KVCache):
                keys: Any = layer.keys
                values: Any = layer.values
                if keys is None:
                    return b""
                items: list[Any] = [keys[..., :layer.offset, :], values[..., :layer.offset, :], layer.offset]
            else:
                items = list(layer.state)
            described = []
            for item in items:
                if isinstance(item, mx.array):
                    data = _array_bytes(item)
                    described.append({"dtype": _dtype_name(item.dtype), "shape": list(item.shape), "bytes": len(data)})
                    chunks.append(data)
                else:
                    described.append({"value": item})
            layers.append({"class": type(layer).__name__, "meta": getattr(layer, "meta_state", None),
                           "items": described})
        header = json.dumps({"layers": layers}).encode()
        return struct.pack("<I", len(header)) + header + b"".join(chunks)

    def seq_restore(self, seq: int, state: StateBytes) -> bool:
        try:
            (length,) = struct.unpack_from("<I", state)
            header = json.loads(bytes(state[4:4 + length]))
            position = 4 + length
            cache = []
            for layer in header["layers"]:
                items = []
                for item in layer["items"]:
                    if "dtype" in item:
                        data = state[position:position + item["bytes"]]
                        position += item["bytes"]
                        items.append(_array_from(data, item["dtype"], item["shape"]))
                    else:
                        items.append(item["value"])
                kind = getattr(mlx_cache, layer["class"])
                if kind is mlx_cache.KVCache:
                    restored = mlx_cache.KVCache()  # type: ignore[no-untyped-call]
                    restored.state = tuple(items)
                elif layer.get("meta") is not None:  # mlx-lm versions whose caches keep scalars in a meta state
                    restored = kind.from_state(tuple(items), layer["meta"])
                else:
                    restored = kind.from_state(tuple(items))
                cache.append(restored)
        except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            log.warning("an MLX cache state did not load: %s", exc)
            return False
        if len(cache) != len(self.caches[seq]):
            return False
        self.caches[seq] = cache
        return True

    # -- embeddings ------------------------------------------------------------------------------

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        """Cut a state of plain KV caches by token range: a piece holds, layer after layer, the keys and then the
        values of its tokens. A model with other caches (rotating windows, recurrent state) is kept whole."""
        header, position = _parse_state(state)
        if not all(layer["class"] == "KVCache" and len(layer["items"]) == 3 for layer in header["layers"]):
            return None
        layers, arrays = [], []
        for layer in header["layers"]:
            described = []
            for item in layer["items"][:2]:
                shape = item["shape"]
                if len(shape) != 4 or shape[2] != n_tokens:
                    raise ValueError(f"a KV array of shape {shape} does not hold {n_tokens} tokens on its third axis")
                dtype = _storage_dtype(item["dtype"])
                arrays.append(np.frombuffer(state, dtype, count=int(np.prod(shape)), offset=position).reshape(shape))
                position += item["bytes"]
                described.append({"dtype": item["dtype"], "shape": [shape[0], shape[1], shape[3]]})
            layers.append({"meta": layer["meta"], "arrays": described})
        if position != len(state):
            raise ValueError("the MLX state has bytes after its last array")
        pieces = [b"".join(array[:, :, start:end, :].tobytes() for array in arrays) for start, end in ranges]
        return {"mlx": 1, "layers": layers}, pieces, b""

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes:
        """The state of consecutive pieces (``state_split``'s), as ``seq_state`` writes it."""
        if not layout or layout.get("mlx") != 1:
            return rest
        described = [item for layer in layout["layers"] for item in layer["arrays"]]
        parts: list[list[Any]] = [[] for _ in described]
        for piece, length in zip(pieces, lengths, strict=True):
            position = 0
            for index, item in enumerate(described):
                batch, heads, width = item["shape"]
                dtype = _storage_dtype(item["dtype"])
                count = batch * heads * length * width
                parts[index].append(np.frombuffer(piece, dtype, count=count, offset=position)
                                    .reshape(batch, heads, length, width))
                position += count * dtype.itemsize
            if position != len(piece):
                raise ValueError("a cache block does not match the MLX layout")
        total = sum(lengths)
        layers, chunks = [], []
        for number, layer in enumerate(layout["layers"]):
            items: list[dict[str, Any]] = []
            for index in (2 * number, 2 * number + 1):
                data = np.concatenate(parts[index], axis=2).tobytes()
                batch, heads, width = described[index]["shape"]
                items.append({"dtype": described[index]["dtype"], "shape": [batch, heads, total, width],
                              "bytes": len(data)})
                chunks.append(data)
            items.append({"value": total})
            layers.append({"class": "KVCache", "meta": layer["meta"], "items": items})
        header = json.dumps({"layers": layers}).encode()
        return struct.pack("<I", len(header)) + header + b"".join(chunks)

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
