"""The GGUF header reader: the same facts as the gguf package's full reader, on real and written files, and a clear
ValueError (never another exception, never a hang) for every damaged header."""

from __future__ import annotations

import os
import random
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from localai.models.gguf_meta import (
    FILE_TYPES,
    AttentionShape,
    GGUFMetadata,
    GGUFValueType,
    _Header,
    _human_count,
    _parse,
    read_metadata,
)


def reference(path: Path) -> GGUFMetadata:
    """What ``gguf.GGUFReader`` (which parses every element of every field) says about the same file."""
    reader = gguf.GGUFReader(path)

    def field(key: str) -> Any:
        item = reader.fields.get(key)
        return item.contents() if item is not None else None

    arch = str(field("general.architecture") or "unknown")
    label = field("general.size_label")
    if not label:
        total = sum(int(tensor.n_elements) for tensor in reader.tensors)
        label = _human_count(total)
    file_type = field("general.file_type")
    layers = int(field(f"{arch}.block_count") or 0)
    heads = int(field(f"{arch}.attention.head_count") or 0)
    kv = field(f"{arch}.attention.head_count_kv")
    head_size = field(f"{arch}.attention.key_length") or (
        int(field(f"{arch}.embedding_length") or 0) // heads if heads else 0)
    window = int(field(f"{arch}.attention.sliding_window") or 0)
    attention = AttentionShape(layers, list(kv) if isinstance(kv, list) else [int(kv or heads)] * layers,
                               int(head_size), int(field(f"{arch}.attention.value_length") or head_size),
                               window, 0.5 if window else 0.0) if layers and head_size else None
    # each tensor's bytes run to the next one's start (padding included), the last one's to the end of the file
    ordered = sorted(reader.tensors, key=lambda tensor: int(tensor.data_offset))
    ends = [int(tensor.data_offset) for tensor in ordered[1:]] + [path.stat().st_size]
    sizes = {tensor.name: end - int(tensor.data_offset) for tensor, end in zip(ordered, ends, strict=True)}
    layer_bytes = [sum(size for name, size in sizes.items() if name.startswith(f"blk.{index}."))
                   for index in range(layers)] if layers else None
    output_bytes = sum(size for name, size in sizes.items() if name.startswith("output"))
    if "output.weight" not in sizes:
        output_bytes += sizes.get("token_embd.weight", 0)
    pooling = field(f"{arch}.pooling_type")
    return GGUFMetadata(
        architecture=arch, context_length=int(field(f"{arch}.context_length") or 0),
        quantization=FILE_TYPES.get(file_type, str(file_type)) if file_type is not None else "unknown",
        parameter_size=str(label), chat_template=field("tokenizer.chat_template") or None,
        name=field("general.name"), attention=attention, layer_bytes=layer_bytes, output_bytes=output_bytes,
        pooling=pooling if pooling is not None and pooling != 0xFFFFFFFF else None,
        file_type=field("general.type") or "model", adapter_type=field("adapter.type"),
        width=int(field(f"{arch}.embedding_length") or 0) * (1 + int(field(f"{arch}.n_deepstack_layers") or 0)),
        has_vision=bool(field("clip.has_vision_encoder")),
        projection_width=int(field("clip.vision.projection_dim") or 0),
        projector_type=field("clip.vision.projector_type") or field("clip.projector_type") or None,
        shapes={tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors},  # ggml's ne order
        split=int(field("split.count") or 1) > 1,
    )


def written(path: Path, *, size_label: str | None = None, nested: bool = True) -> Path:
    """A small GGUF with every value type, string and nested arrays, and tensors of 1 to 4 dimensions."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("Written Model")
    writer.add_context_length(4096)
    writer.add_file_type(15)
    if size_label:
        writer.add_size_label(size_label)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "héllo", "", "world"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5] * 200)
    writer.add_array("tokenizer.ggml.token_type", [1] * 200)
    if nested:
        writer.add_array("test.nested", [[1, 2, 3], [4]])
    writer.add_bool("test.bool", True)
    writer.add_int8("test.i8", -3)
    writer.add_uint16("test.u16", 7)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", 2.5)
    writer.add_string("test.string", "é" * 10)
    for name, shape in (("a", (3000,)), ("b", (40, 50)), ("c", (2, 3, 4)), ("d", (2, 2, 2, 2))):
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_value_types_are_numbered_as_the_gguf_package_numbers_them() -> None:
    assert {kind.name: kind.value for kind in GGUFValueType} == {kind.name: kind.value for kind in gguf.GGUFValueType}


def test_real_models_read_as_the_full_reader_reads_them(smollm2_path: Path, gemma3_path: Path) -> None:
    assert asdict(read_metadata(smollm2_path)) == asdict(reference(smollm2_path))
    smol = read_metadata(smollm2_path)
    assert (smol.architecture, smol.context_length, smol.quantization, smol.parameter_size) == (
        "llama", 8192, "Q4_1", "135M")
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    gemma = read_metadata(gemma3_path)  # 262k-token vocabulary: the full reader takes seconds, so facts, not parity
    shape = asdict(gemma).pop("attention")
    assert gemma.layer_bytes is not None and len(gemma.layer_bytes) == 18 and gemma.output_bytes > 0
    sizes = ("attention", "layer_bytes", "output_bytes", "expert_bytes", "shapes", "split")
    assert gemma.shapes["blk.0.attn_k.weight"] == (640, 256) and not gemma.split  # ggml's ne order: [in, out]
    assert {k: v for k, v in asdict(gemma).items() if k not in sizes} == {
        "architecture": "gemma3", "context_length": 32768, "quantization": "Q4_K_M", "parameter_size": "270M",
        "chat_template": None, "name": "Gemma 3 270m", "pooling": None, "file_type": "model", "adapter_type": None,
        "width": 640, "has_vision": False, "projection_width": 0, "projector_type": None}
    assert (shape["layers"], shape["kv_heads"][0], shape["key_length"], shape["sliding_window"]) == (18, 1, 256, 512)
    assert shape["sliding_share"] == 5 / 6  # llama.cpp's Gemma 3 pattern: every sixth layer attends to everything
    assert gemma.attention is not None
    per_token = 18 * 256 * 2 * 2
    # a sliding layer keeps its window and a micro-batch, in 256-cell steps (llama.cpp: 96 + 15 MiB at 32k)
    assert gemma.attention.kv_bytes(32768) == pytest.approx(per_token * (32768 / 6 + 1024 * 5 / 6))
    assert gemma.attention.kv_bytes(32768) == pytest.approx(111 * 2**20)
    assert gemma.attention.tokens_within(gemma.attention.kv_bytes(20000)) in (19999, 20000)
    assert smol.attention is not None and smol.attention.bytes_per_token() == 30 * 3 * 128 * 2  # 23,040 B a token


def test_a_reranker_and_a_lora_read_as_the_full_reader_reads_them(arch_fixtures: Path) -> None:
    """The reranker fixture says rank pooling (a reranker); a LoRA says it is an adapter; a chat model neither."""
    for name in ("reranker", "llama-lora-a", "llama"):
        path = arch_fixtures / f"{name}.gguf"
        assert asdict(read_metadata(path)) == asdict(reference(path))
    reranker, lora, llama = (read_metadata(arch_fixtures / f"{name}.gguf") for name in ("reranker", "llama-lora-a",
                                                                                         "llama"))
    assert (reranker.pooling, reranker.reranker, reranker.file_type) == (4, True, "model")
    assert (lora.file_type, lora.adapter_type, lora.reranker) == ("adapter", "lora", False)
    assert (llama.pooling, llama.reranker, llama.file_type, llama.adapter_type) == (None, False, "model", None)


def test_a_projector_and_a_deepstack_model_read_as_the_full_reader_reads_them(arch_fixtures: Path,
                                                                              tmp_path: Path) -> None:
    """What a PROJECTOR line is checked by: a projector's kind, whether it sees images and the width it feeds; a
    model's embedding width, times 1 + its deepstack layers (Qwen3-VL)."""
    from tests.mmproj import write_mmproj, write_qwen_mmproj

    gemma, qwen = write_mmproj(tmp_path / "gemma.gguf"), write_qwen_mmproj(tmp_path / "qwen.gguf", deepstack=1)
    for path in (gemma, qwen, arch_fixtures / "qwen3vl-deepstack.gguf"):
        assert asdict(read_metadata(path)) == asdict(reference(path))
    read = read_metadata(qwen)
    assert (read.has_vision, read.projection_width, read.projector_type) == (True, 256, "qwen3vl_merger")
    assert read_metadata(gemma).projector_type == "gemma3"
    assert read_metadata(arch_fixtures / "qwen3vl-deepstack.gguf").width == 2 * 256


@pytest.mark.parametrize("size_label", [None, "7B"])
def test_a_written_file_with_every_value_type_reads_as_the_full_reader_reads_it(tmp_path: Path,
                                                                               size_label: str | None) -> None:
    path = written(tmp_path / "w.gguf", size_label=size_label)
    meta = read_metadata(path)
    assert asdict(meta) == asdict(reference(path))
    # without a size label, the tensors' elements are counted: 3000 + 2000 + 24 + 16
    assert meta.parameter_size == (size_label or "5K") and meta.name == "Written Model"
    assert meta.context_length == 4096 and meta.quantization == "Q4_K_M"


def header_end(path: Path) -> int:
    """A byte before which the tensor infos surely end: the data section starts after them, padded to its
    alignment (32 bytes), and is not part of the header."""
    reader = gguf.GGUFReader(path)
    return int(reader.data_offset) - 31


def test_every_truncation_of_the_header_is_a_clear_error(tmp_path: Path) -> None:
    source = written(tmp_path / "w.gguf")
    data = source.read_bytes()
    end = header_end(source)
    cut = tmp_path / "cut.gguf"
    positions = sorted(set(range(0, 64)) | set(range(64, end, 7)))
    for at in positions:
        cut.write_bytes(data[:at])
        with pytest.raises(ValueError, match=r"truncated|not a GGUF file|runs past the end") as error:
            read_metadata(cut)
        assert str(cut) in str(error.value)


def test_damaged_headers_name_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"

    def header(*parts: bytes) -> Path:
        path.write_bytes(b"GGUF" + b"".join(parts))
        return path

    with pytest.raises(ValueError, match="version 1; only versions 2 and 3"):
        read_metadata(header(struct.pack("<I", 1), bytes(64)))
    with pytest.raises(ValueError, match="a big-endian GGUF; only little-endian files are read"):
        read_metadata(header(struct.pack(">IQQ", 3, 0, 0), bytes(64)))
    with pytest.raises(ValueError, match=r"count \(1152921504606846976\) runs past the end"):
        read_metadata(header(struct.pack("<IQQ", 3, 0, 2**60)))
    key = struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc"
    with pytest.raises(ValueError, match="not UTF-8"):
        read_metadata(header(struct.pack("<IQQ", 3, 0, 1), key, struct.pack("<IB", 0, 1)))
    name = struct.pack("<Q", 1) + b"k"
    with pytest.raises(ValueError, match="unknown GGUF value type 42"):
        read_metadata(header(struct.pack("<IQQ", 3, 0, 1), name, struct.pack("<I", 42), bytes(16)))
    nesting = struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000))
    with pytest.raises(ValueError, match="nested more than 4 deep"):  # no RecursionError on a hostile file
        read_metadata(header(struct.pack("<IQQ", 3, 0, 1), name, nesting, bytes(64)))
    many = struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 99)
    with pytest.raises(ValueError, match="a tensor with 99 dimensions"):
        read_metadata(header(many, bytes(64)))


def test_random_damage_is_a_value_error_or_a_reading_never_a_crash(tmp_path: Path) -> None:
    source = written(tmp_path / "w.gguf")
    data = bytearray(source.read_bytes())
    end = header_end(source)
    damaged = tmp_path / "damaged.gguf"
    chance = random.Random(13)
    outcomes = {"error": 0, "read": 0}
    for _ in range(400):
        copy = bytearray(data)
        for _ in range(chance.randint(1, 4)):
            copy[chance.randrange(4, end)] = chance.randrange(256)
        damaged.write_bytes(copy)
        try:
            meta = read_metadata(damaged)
        except ValueError:
            outcomes["error"] += 1
        else:
            assert isinstance(meta.parameter_size, str)
            outcomes["read"] += 1
    assert outcomes["error"] and outcomes["read"]  # both kinds of damage happened, and neither crashed


def test_a_file_cut_short_while_it_is_read_is_an_error_not_a_crash(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull or a delete can shorten a model file under the reader: a short read, never a SIGBUS (no mmap)."""
    path = written(tmp_path / "w.gguf")
    end = header_end(path)
    monkeypatch.setattr(_Header, "CHUNK", 64)  # read in small steps, so most of the header is read after the cut
    with path.open("rb") as handle:
        header = _Header(handle, path)  # takes the file's size as it is now
        os.truncate(path, end // 2)
        with pytest.raises(ValueError, match="is truncated"):
            _parse(header)
        assert header.size > end  # it was cut after the reader sized it: the short read itself was caught


def test_the_ggml_type_sizes_are_the_gguf_packages() -> None:
    from localai.models.gguf_meta import GGML_TYPE_SIZES

    assert {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()} == GGML_TYPE_SIZES


def test_a_file_whose_tensor_data_is_cut_off_is_refused(smollm2_path: Path, tmp_path: Path) -> None:
    """The header is whole but the tensors are not (an interrupted copy): refused when read, not at every chat."""
    whole = smollm2_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:len(whole) - 4096])
    with pytest.raises(ValueError, match="is truncated: its tensors end at byte"):
        read_metadata(cut)
    read_metadata(smollm2_path)  # the whole file reads
