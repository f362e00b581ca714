"""Weights on disk: split GGUFs, MLX directories, cached digests, and the registry built on them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from localai.errors import ModelfileError
from localai.models import weights
from localai.models.modelfile import parse
from localai.models.registry import Registry
from tests.hubserver import split_gguf


def test_split_parts_in_order_and_incomplete_splits(tmp_path: Path) -> None:
    parts = [tmp_path / f"m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for part in parts:
        part.write_bytes(b"x" * 10)
    assert weights.split_parts(parts[0]) == parts and weights.total_size(parts[0]) == 30
    with pytest.raises(ModelfileError, match="part 2 of a split GGUF"):
        weights.split_parts(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelfileError, match=re.escape("missing m-Q4_K_M-00003-of-00003.gguf")):
        weights.split_parts(parts[0])
    single = tmp_path / "single.gguf"
    assert weights.split_parts(single) == [single]


def test_cached_digest_trusts_blob_names_only(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / ("a" * 64)
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    link = tmp_path / "model.gguf"
    link.symlink_to(blob)
    assert weights.cached_digest(link) == "a" * 64
    plain = tmp_path / "plain.gguf"
    plain.write_bytes(b"weights")
    assert weights.cached_digest(plain) is None
    odd = tmp_path / "blobs" / "not-a-hash"
    odd.write_bytes(b"x")
    (tmp_path / "odd.gguf").symlink_to(odd)
    assert weights.cached_digest(tmp_path / "odd.gguf") is None


def _mlx_dir(root: Path, config: object) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (root / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return root


def test_mlx_metadata(tmp_path: Path) -> None:
    quantized = _mlx_dir(tmp_path / "q", {"model_type": "llama", "max_position_embeddings": 8192,
                                           "quantization": {"bits": 4}})
    meta = weights.read_mlx_metadata(quantized)
    assert (meta.architecture, meta.context_length, meta.quantization) == ("llama", 8192, "4bit")
    assert meta.chat_template == "{{ messages }}"
    nested = _mlx_dir(tmp_path / "n", {"model_type": "gemma3", "torch_dtype": "bfloat16",
                                        "text_config": {"max_position_embeddings": 131072}})
    assert weights.read_mlx_metadata(nested).quantization == "BF16"
    assert weights.read_mlx_metadata(nested).context_length == 131072
    broken = _mlx_dir(tmp_path / "b", [])
    with pytest.raises(ModelfileError, match="not a JSON object"):
        weights.read_mlx_metadata(broken)
    (broken / "config.json").write_text("{nope")
    with pytest.raises(ModelfileError, match="not readable JSON"):
        weights.read_mlx_metadata(broken)


def test_registry_creates_mlx_and_split_models(isolated_home: Path, tmp_path: Path, smollm2_path: Path) -> None:
    registry = Registry.open()
    mlx = _mlx_dir(tmp_path / "mlx", {"model_type": "qwen2", "max_position_embeddings": 4096,
                                       "quantization": {"bits": 8}})
    record = registry.create("tiny-mlx", parse(f"FROM {mlx}\n"))
    assert (record.format, record.engine, record.quantization) == ("mlx", "mlx", "8bit")
    assert len(record.sha256) == 64 and record.size == weights.total_size(mlx)
    (tmp_path / "split").mkdir()
    parts = split_gguf(smollm2_path, tmp_path / "split" / "s.gguf", parts=3)
    split = registry.create("split", parse(f"FROM {parts[0]}\n"))
    assert split.format == "gguf" and split.size == sum(part.stat().st_size for part in parts)
    assert split.context_length == 8192 and split.quantization == "Q4_1"
    os.unlink(parts[2])
    with pytest.raises(ModelfileError, match="incomplete"):
        registry.create("split2", parse(f"FROM {parts[0]}\n"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelfileError, match="not a model file"):
        registry.create("nothing", parse(f"FROM {empty}\n"))


def test_registry_refuses_unpulled_and_malformed_hub_references(isolated_home: Path) -> None:
    registry = Registry.open()
    with pytest.raises(ModelfileError, match=re.escape("not downloaded yet; run: localai pull hf.co/a/b:Q4_K_M")):
        registry.create("x", parse("FROM hf.co/a/b:Q4_K_M\n"))
    with pytest.raises(ModelfileError, match=re.escape("FROM hf.co/a: invalid model name")):
        registry.create("x", parse("FROM hf.co/a\n"))
