"""What a GGUF file says about its model, read from its header (no engine).

The header (GGUF versions 2 and 3: ggml's docs/gguf.md) is walked keeping the few keys localai shows and skipping
the rest by length. The ``gguf`` package's ``GGUFReader`` parses every element of every array first - the
vocabulary's strings, scores and merges - which took 1.6 s for SmolLM2 (49k tokens) and 7.7 s for Gemma 3 (262k)
on a 2-core machine, at every model creation and the first ``/api/show`` of each model; this takes 13 and 35 ms.
The tests hold it to ``GGUFReader``'s results.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

# llama.cpp's ``general.file_type`` values (enum llama_ftype) for the common quantizations.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}


class GGUFValueType(IntEnum):
    """The header's value types, numbered as the GGUF format numbers them."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# the scalar value types' layouts (little-endian files; llama.cpp writes no others in practice)
_SCALARS: dict[int, struct.Struct] = {kind: struct.Struct(fmt) for kind, fmt in (
    (GGUFValueType.UINT8, "<B"), (GGUFValueType.INT8, "<b"), (GGUFValueType.UINT16, "<H"),
    (GGUFValueType.INT16, "<h"), (GGUFValueType.UINT32, "<I"), (GGUFValueType.INT32, "<i"),
    (GGUFValueType.FLOAT32, "<f"), (GGUFValueType.BOOL, "<?"), (GGUFValueType.UINT64, "<Q"),
    (GGUFValueType.INT64, "<q"), (GGUFValueType.FLOAT64, "<d"),
)}
_U32, _U64 = _SCALARS[GGUFValueType.UINT32], _SCALARS[GGUFValueType.UINT64]
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
UNSPECIFIED_POOLING = 0xFFFFFFFF  # LLAMA_POOLING_TYPE_UNSPECIFIED (-1) as a GGUF uint32
_WANTED = ("general.alignment", "split.count", "general.architecture", "general.file_type", "general.size_label",
           "general.name", "general.type", "adapter.type", "tokenizer.chat_template", "clip.has_vision_encoder",
           "clip.vision.projection_dim", "clip.projector_type", "clip.vision.projector_type")
# The attention shape, read per architecture (``{arch}.<key>``): what the KV cache holds per token.
_SHAPE_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
               "attention.key_length", "attention.value_length", "attention.sliding_window",
               "attention.sliding_window_pattern", "attention.key_length_mla", "attention.value_length_mla",
               "attention.recurrent_layers", "full_attention_interval", "feed_forward_length", "ssm.conv_kernel",
               "ssm.inner_size", "ssm.state_size", "ssm.group_count", "shortconv.l_cache")
# Every n-th layer attends to the whole context and the others slide, unless the file gives its own pattern
# (llama.cpp's load_swa_pattern defaults per architecture)
SLIDING_PATTERN = {"gemma3": 6, "gemma-embedding": 6, "gemma3n": 5, "gemma2": 2, "gpt-oss": 2, "cohere2": 4,
                   "llama4": 4, "exaone4": 4, "olmo2": 4}
MAX_DIMS = 8  # GGML_MAX_DIMS is 4; a larger count is a damaged file
# ggml's tensor types: (elements per block, bytes per block), as the gguf package's GGML_QUANT_SIZES gives them (a
# test compares the two): what the last tensor needs, so a file whose data is cut off is refused at create
GGML_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                   9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
                   15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
                   21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
                   28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
                   40: (64, 36), 41: (128, 18)}
MAX_KEPT_ITEMS = 4096  # a per-layer array kept (longer ones are skipped: no model has that many layers)
MAX_NESTING = 4  # arrays of arrays (llama.cpp writes none); deeper is a damaged or hostile file


UBATCH = 512  # llama.cpp's micro-batch at localai's n_batch: a sliding window's cache holds it beside the window
CELL_PAD = 256  # llama.cpp rounds a KV cache's cells up to this


@dataclass
class AttentionShape:
    """What one token costs the KV cache: per layer, ``kv_heads`` heads of keys and of values (0 for a layer without
    attention: a recurrent one); plus, for hybrid models, the recurrent layers' fixed state per sequence."""

    layers: int
    kv_heads: list[int]  # per layer (a single count repeated when the file gives one)
    key_length: int
    value_length: int
    sliding_window: int = 0  # layers with a window keep at most this many tokens (0: none)
    sliding_share: float = 0.0  # the share of the KV per token in sliding layers
    values: bool = True  # False for multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): K holds it all
    recurrent_bytes: int = 0  # recurrent layers' state (Mamba-2, Gated DeltaNet, short convolutions) per sequence

    def bytes_per_token(self, kv_type: str = "f16") -> float:
        """K and V of every attention layer for one token, at the KV cache's element type."""
        per_element = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "f32": 4.0}[kv_type]
        return sum(self.kv_heads) * (self.key_length + (self.value_length if self.values else 0)) * per_element

    def window_cells(self, num_ctx: int) -> int:
        """The cells a sliding layer's cache holds per sequence (llama.cpp keeps a micro-batch beside the window)."""
        return min(num_ctx, -(-(self.sliding_window + UBATCH) // CELL_PAD) * CELL_PAD)

    def kv_bytes(self, num_ctx: int, kv_type: str = "f16") -> float:
        """One sequence's KV cache at ``num_ctx`` tokens (sliding layers hold their window) and recurrent state."""
        per_token = self.bytes_per_token(kv_type)
        if not self.sliding_window or self.sliding_window >= num_ctx:
            return per_token * num_ctx + self.recurrent_bytes
        sliding = self.sliding_share * self.window_cells(num_ctx)
        return per_token * ((1 - self.sliding_share) * num_ctx + sliding) + self.recurrent_bytes

    def tokens_within(self, budget: float, kv_type: str = "f16") -> int:
        """The most tokens whose KV cache and recurrent state (one sequence) fit ``budget`` bytes."""
        per_token = self.bytes_per_token(kv_type)
        budget -= self.recurrent_bytes
        if budget <= 0:
            return 0
        if per_token <= 0:
            return 1 << 30  # no attention layer: a longer context costs nothing more
        plain = int(budget // per_token)
        if not self.sliding_window or plain <= self.sliding_window or self.sliding_share >= 1:
            return plain
        fixed = per_token * self.sliding_share * self.window_cells(plain)
        return max(plain, int((budget - fixed) // (per_token * (1 - self.sliding_share))))


@dataclass
class GGUFMetadata:
    """The facts localai shows and schedules by."""

    architecture: str
    context_length: int
    quantization: str
    parameter_size: str
    chat_template: str | None
    name: str | None
    attention: AttentionShape | None = None  # None when the file does not say (the memory rule then guesses)
    layer_bytes: list[int] | None = None  # each repeating layer's tensors (None: a split GGUF, read in part)
    output_bytes: int = 0  # the output layer's (the token embeddings' when the output is tied to them)
    expert_bytes: list[int] | None = None  # each layer's expert tensors, part of layer_bytes (a mixture of experts)
    pooling: int | None = None  # ``{arch}.pooling_type``: llama.cpp's enum (RANK_POOLING: a reranker)
    file_type: str = "model"  # ``general.type``: "model", or "adapter" for a LoRA GGUF
    adapter_type: str | None = None  # ``adapter.type`` of an adapter ("lora")
    width: int = 0  # what a token's embedding holds: the model's width (times 1 + its deepstack layers: Qwen3-VL)
    # a projector (architecture "clip"): whether it sees images, the width of what it feeds the model, its kind
    has_vision: bool = False
    projection_width: int = 0
    projector_type: str | None = None
    # each tensor's dimensions as llama.cpp counts them (ne: the fastest-varying first); a split GGUF's first part
    # holds only some of the model's tensors (``split``)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    split: bool = False

    @property
    def reranker(self) -> bool:
        """A reranker (bge-reranker, Qwen3-Reranker, jina): a classifier head read with rank pooling; it scores
        a query against documents and does not chat."""
        return self.pooling == RANK_POOLING


class _Header:
    """A cursor over a GGUF file's header that raises ValueError (never reads past the end).

    The file is read forward in chunks as the cursor needs it, not mapped: a model file truncated or replaced while
    it is read (a pull, a delete) is then a short read, not a SIGBUS that would end the daemon."""

    CHUNK = 1 << 20

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self.handle, self.path = handle, path
        self.size = os.fstat(handle.fileno()).st_size
        self.data = bytearray()
        self.at = 0

    def _truncated(self) -> ValueError:
        return ValueError(f"{self.path} is truncated: its GGUF header runs past byte {len(self.data)}")

    def need(self, size: int) -> None:
        """Make ``size`` bytes from the cursor readable."""
        end = self.at + size
        if size < 0 or end > self.size:
            raise self._truncated()
        if end > len(self.data):
            self.handle.seek(len(self.data))
            self.data += self.handle.read(max(end - len(self.data), self.CHUNK))
            if end > len(self.data):  # the file shrank since it was opened
                raise self._truncated()

    def take(self, layout: struct.Struct) -> Any:
        self.need(layout.size)
        (value,) = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return value

    def skip(self, size: int) -> None:
        self.need(size)
        self.at += size

    def string(self) -> str:
        length = self.take(_U64)
        start = self.at
        self.skip(length)
        try:
            return bytes(self.data[start:self.at]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: a GGUF string at byte {start} is not UTF-8") from exc

    def skip_strings(self, count: int) -> None:
        """Skip ``count`` strings (a vocabulary: the one loop that runs hundreds of thousands of times)."""
        data, at = self.data, self.at  # ``need`` extends ``data`` in place
        for _ in range(count):
            if at + 8 > len(data):
                self.at = at
                self.need(8)
            (length,) = _U64.unpack_from(data, at)
            at += 8 + length
            if at > self.size:
                raise self._truncated()
        self.at = at

    def count(self, minimum_size: int) -> int:
        """A count of items of at least ``minimum_size`` bytes each, checked against the bytes left."""
        number = self.take(_U64)
        if number * minimum_size > self.size - self.at:
            raise ValueError(f"{self.path}: a GGUF count ({number}) runs past the end of the file")
        return int(number)

    def value(self, kind: int, keep: bool, depth: int = 0) -> Any:
        """Read (``keep``) or skip one value of type ``kind``."""
        if kind in _SCALARS:
            value = self.take(_SCALARS[kind])
            return value if keep else None
        if kind == GGUFValueType.STRING:
            if keep:
                return self.string()
            self.skip(self.take(_U64))
            return None
        if kind == GGUFValueType.ARRAY:
            item = self.take(_U32)
            if depth >= MAX_NESTING:
                raise ValueError(f"{self.path}: GGUF arrays nested more than {MAX_NESTING} deep")
            if item in _SCALARS:
                size = _SCALARS[item].size
                count = self.count(size)
                if keep and count <= MAX_KEPT_ITEMS:  # per-layer values (head counts, recurrent layers)
                    return [self.take(_SCALARS[item]) for _ in range(count)]
                self.skip(count * size)
            elif item == GGUFValueType.STRING:
                self.skip_strings(self.count(8))
            elif item == GGUFValueType.ARRAY:
                for _ in range(self.count(12)):
                    self.value(item, keep=False, depth=depth + 1)
            else:
                raise ValueError(f"{self.path}: unknown GGUF array element type {item} at byte {self.at - 4}")
            return None
        raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self.at - 4}")


def read_metadata(path: Path) -> GGUFMetadata:
    """Read a GGUF header. Raises ValueError for a file that is not GGUF or whose header is damaged."""
    with path.open("rb") as handle:
        return _parse(_Header(handle, path))


def _parse(header: _Header) -> GGUFMetadata:
    path = header.path
    if header.size < 4:
        raise ValueError(f"{path} is not a GGUF file")
    header.skip(4)
    if header.data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version = header.take(_U32)
    if version not in (2, 3):
        if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise ValueError(f"{path} is a big-endian GGUF; only little-endian files are read")
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are read")
    n_tensors = header.count(8 + 4 + 8 + 4 + 8)  # the smallest tensor info: empty name, one dimension
    n_fields = header.count(8 + 4 + 1)  # the smallest field: empty key, one byte
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = header.string()
        wanted = (key in _WANTED or key.endswith(".context_length") or key.endswith(_SHAPE_KEYS)
                  or key.endswith((".pooling_type", ".n_deepstack_layers")))
        value = header.value(header.take(_U32), keep=wanted)
        if wanted:
            fields[key] = value
    arch = str(fields.get("general.architecture") or "unknown")
    size_label = fields.get("general.size_label")
    total = 0
    tensors: list[tuple[str, int]] = []  # name, offset in the data section
    shapes: dict[str, tuple[int, ...]] = {}
    last = -1  # the offset of the tensor that starts last, and where the tensor data ends (it is the last one)
    end = 0
    for _ in range(n_tensors):
        tensor_name = header.string()
        dims = header.take(_U32)
        if dims > MAX_DIMS:
            raise ValueError(f"{path}: a tensor with {dims} dimensions")
        shape = tuple(header.take(_U64) for _ in range(dims))
        shapes[tensor_name] = shape
        elements = math.prod(shape)
        total += elements
        kind = header.take(_U32)
        offset = header.take(_U64)
        tensors.append((tensor_name, offset))
        if offset > last:
            per_block, block_bytes = GGML_TYPE_SIZES.get(kind, (1, 0))  # a type not known here: its start at least
            last, end = offset, offset + -(-elements // per_block) * block_bytes
    if not size_label:
        size_label = _human_count(total)
    layer_bytes, output_bytes, expert_bytes = None, 0, None
    alignment = fields.get("general.alignment")
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    data_start = -(-header.at // alignment) * alignment
    if tensors and data_start + end > header.size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {data_start + end:,} but the file has "
                         f"{header.size:,} bytes (an interrupted download or copy?); fetch it again")
    split = isinstance(fields.get("split.count"), int) and fields["split.count"] > 1
    if not split:
        layer_bytes, output_bytes, expert_bytes = _tensor_sizes(tensors, header.size - data_start,
                                                                 _attention_layers(fields, arch))
    file_type = fields.get("general.file_type")
    template = fields.get("tokenizer.chat_template")
    context = fields.get(f"{arch}.context_length")
    name = fields.get("general.name")
    attention = _attention(fields, arch)
    pooling = fields.get(f"{arch}.pooling_type")
    return GGUFMetadata(
        architecture=arch,
        context_length=int(context) if isinstance(context, int) else 0,
        quantization=FILE_TYPES.get(int(file_type), str(file_type)) if isinstance(file_type, int) else "unknown",
        parameter_size=str(size_label),
        chat_template=str(template) if template else None,
        name=str(name) if name is not None else None,
        attention=attention,
        layer_bytes=layer_bytes,
        output_bytes=output_bytes,
        expert_bytes=expert_bytes if expert_bytes and any(expert_bytes) else None,
        pooling=pooling if isinstance(pooling, int) and pooling != UNSPECIFIED_POOLING else None,
        file_type=str(fields.get("general.type") or "model"),
        adapter_type=str(fields["adapter.type"]) if fields.get("adapter.type") else None,
        width=_number(fields, arch, "embedding_length") * (1 + _number(fields, arch, "n_deepstack_layers")),
        has_vision=bool(fields.get("clip.has_vision_encoder")),
        projection_width=_number(fields, "clip.vision", "projection_dim"),
        projector_type=str(fields.get("clip.vision.projector_type") or fields.get("clip.projector_type") or "")
        or None,
        shapes=shapes,
        split=split,
    )


def lora_mismatch(adapter: GGUFMetadata, base: GGUFMetadata) -> str | None:
    """Why llama.cpp would refuse the LoRA ``adapter`` on ``base`` when the model loads (llama_adapter_lora_init's
    checks: each A and B pair whole, its tensor in the base, A [in, rank] and B [rank, out] in ggml's order, the
    token embeddings' pair flipped), or None. A split base's tensors outside its first part are not checked."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in adapter.shapes.items():
        for half in ("a", "b"):
            if name.endswith(f".lora_{half}"):
                pairs.setdefault(name[:-len(".lora_a")], {})[half] = shape
    for target, halves in sorted(pairs.items()):
        if len(halves) < 2:
            have = next(iter(halves))
            return f"its tensor {target}.lora_{have} has no lora_{'b' if have == 'a' else 'a'}"
        model = base.shapes.get(target)
        if model is None:
            if base.split:
                continue
            return f"its tensor {target} is not in the base model (a LoRA made for another model?)"
        a, b = halves["a"], halves["b"]
        if len(model) < 2 or len(a) < 2 or len(b) < 2:
            fits = False
        elif target == "token_embd.weight":
            fits = model[0] == b[1] and model[1] == a[1]
        else:
            fits = model[0] == a[0] and model[1] == b[1] and a[1] == b[0]
        if not fits:
            return (f"its tensor {target} (A {list(a)}, B {list(b)}) does not fit the base model's {list(model)} (a "
                    "LoRA made for another size of this model?)")
    return None


_BLOCK = re.compile(r"^blk\.(\d+)\.")
# A mixture of experts' expert tensors (llama.cpp's LLM_FFN_EXPS_REGEX, what --n-cpu-moe keeps on the CPU)
_EXPERTS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")


def _attention_layers(fields: dict[str, Any], arch: str) -> int:
    value = fields.get(f"{arch}.block_count")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _tensor_sizes(tensors: list[tuple[str, int]], data_size: int,
                  layers: int) -> tuple[list[int] | None, int, list[int] | None]:
    """Each repeating layer's bytes, the output layer's, and each layer's expert tensors', from the tensors' offsets
    (each tensor runs to the next one's start, padding included). None when the offsets do not make sense (the file
    is damaged or cut)."""
    if not tensors:  # a header-only file (metadata written for tests, or a damaged one): nothing to place by
        return None, 0, None
    ordered = sorted(tensors, key=lambda item: item[1])
    sizes: dict[str, int] = {}
    for (name, start), (_, end) in zip(ordered, [*ordered[1:], ("", data_size)], strict=True):
        if end < start:
            return None, 0, None
        sizes[name] = end - start
    per_layer, experts = [0] * layers, [0] * layers
    for name, size in sizes.items():
        if (match := _BLOCK.match(name)) is not None and int(match[1]) < layers:
            per_layer[int(match[1])] += size
            if _EXPERTS.search(name):
                experts[int(match[1])] += size
    output = sum(size for name, size in sizes.items() if name.startswith("output"))
    if "output.weight" not in sizes:  # tied: llama.cpp puts a copy of the token embeddings in the output layer
        output += sizes.get("token_embd.weight", 0)
    return (per_layer if layers else None), output, (experts if layers else None)


def _number(fields: dict[str, Any], arch: str, key: str) -> int:
    """``{arch}.<key>`` as an integer, 0 where the file does not give one."""
    value = fields.get(f"{arch}.{key}")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _attention(fields: dict[str, Any], arch: str) -> AttentionShape | None:
    def number(key: str) -> int:
        return _number(fields, arch, key)

    def per_layer(key: str, default: int) -> list[int]:
        value = fields.get(f"{arch}.{key}")
        if isinstance(value, list):  # per layer (some architectures vary it)
            return [int(item) for item in value if isinstance(item, int)][:layers]
        return [int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default] \
            * layers

    layers = number("block_count")
    heads = number("attention.head_count")
    kv_heads = per_layer("attention.head_count_kv", heads)
    feed_forward = per_layer("feed_forward_length", 1)
    recurrent = _recurrent_layers(fields, arch, layers, kv_heads, feed_forward)
    # Nemotron-H's feed-forward layers have neither attention nor a state (whatever head count the file gives)
    mlp_only = [arch.startswith("nemotron_h") and feed_forward[il] > 0 for il in range(layers)]
    kv_heads = [0 if recurrent[il] or mlp_only[il] else heads_kv for il, heads_kv in enumerate(kv_heads)]
    key_length = number("attention.key_length") or (number("embedding_length") // heads if heads else 0)
    value_length = number("attention.value_length") or key_length
    if not layers or not key_length or not (any(kv_heads) or any(recurrent)):
        return None
    window = number("attention.sliding_window")
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and pattern:  # per layer: true where it slides
        slides = [bool(item) for item in pattern][:layers]
    else:
        every = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0 \
            else SLIDING_PATTERN.get(arch, 2)
        slides = [il % every < every - 1 for il in range(layers)]
    slides += [False] * (layers - len(slides))
    attending = sum(kv_heads)
    share = sum(heads_kv for heads_kv, slide in zip(kv_heads, slides, strict=True) if slide) / attending \
        if attending else 0.0
    mla = bool(number("attention.key_length_mla") and number("attention.value_length_mla"))
    return AttentionShape(layers, kv_heads, key_length, value_length, window, share if window else 0.0,
                          values=not mla, recurrent_bytes=sum(recurrent) * _recurrent_state(fields, arch))


# Architectures whose recurrent layers are those without attention heads (llama.cpp's models/<arch>.cpp)
_RECURRENT_WHERE_NO_HEADS = {"granitehybrid", "jamba", "lfm2", "lfm2moe", "kimi-linear", "bailingmoe3", "plamo2"}
_ALL_RECURRENT = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "falcon-h1"}


def _recurrent_layers(fields: dict[str, Any], arch: str, layers: int, kv_heads: list[int],
                      feed_forward: list[int]) -> list[bool]:
    """Which layers keep a recurrent state instead of a KV cache: as the file lists them, else as llama.cpp decides
    for the architecture."""
    listed = fields.get(f"{arch}.attention.recurrent_layers")
    if isinstance(listed, list) and listed:
        return ([bool(item) for item in listed] + [False] * layers)[:layers]
    if arch in _ALL_RECURRENT:
        return [True] * layers
    if arch in ("qwen35", "qwen35moe", "qwen3next"):  # Gated DeltaNet, every n-th layer attention
        interval = fields.get(f"{arch}.full_attention_interval")
        every = interval if isinstance(interval, int) and interval > 0 else 4
        return [(il + 1) % every != 0 for il in range(layers)]
    if arch in ("nemotron_h", "nemotron_h_moe"):  # Mamba-2 layers have neither attention nor a feed-forward
        return [kv_heads[il] == 0 and feed_forward[il] == 0 for il in range(layers)]
    if arch in _RECURRENT_WHERE_NO_HEADS:
        return [heads == 0 for heads in kv_heads]
    return [False] * layers


def _recurrent_state(fields: dict[str, Any], arch: str) -> int:
    """One recurrent layer's state for one sequence, in bytes (llama.cpp keeps it in f32): the convolution's last
    columns and the SSM state (llama_hparams::n_embd_r and n_embd_s)."""
    def number(key: str) -> int:
        return _number(fields, arch, key)

    l_cache = number("shortconv.l_cache")
    if l_cache:  # LFM2's short convolutions
        conv = number("embedding_length") * (l_cache - 1)
    else:
        conv = max(0, number("ssm.conv_kernel") - 1) * (number("ssm.inner_size")
                                                        + 2 * number("ssm.group_count") * number("ssm.state_size"))
    return 4 * (conv + number("ssm.state_size") * number("ssm.inner_size"))


def _human_count(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}".replace(".0", "")
    return str(count)
