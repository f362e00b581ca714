"""A model's weights on disk: one GGUF file, the parts of a split GGUF, or an MLX directory.

The registry stores one path per model: the GGUF (for a split GGUF, its first part, which is what
llama.cpp opens; it finds the other parts beside it) or the MLX directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from localai.errors import ModelfileError
from localai.models.gguf_meta import GGUFMetadata

SPLIT_PART = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")  # a git object id or an LFS sha256


def split_parts(path: Path) -> list[Path]:
    """Every part of the split GGUF that ``path`` starts, in order; ``[path]`` for a single file.

    Raises ModelfileError when ``path`` is not the first part or a part is missing.
    """
    match = SPLIT_PART.match(path.name)
    if match is None:
        return [path]
    index, count = int(match["index"]), int(match["count"])
    if index != 1:
        raise ModelfileError(f"{path.name} is part {index} of a split GGUF; give its first part (-00001-of-...)")
    parts = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise ModelfileError(f"split GGUF {path.name} is incomplete: missing {', '.join(missing)}")
    return parts


def is_mlx_dir(path: Path) -> bool:
    """An MLX (Hugging Face format) model directory: config.json plus safetensors weights."""
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def files(path: Path) -> list[Path]:
    """The files that make up the weights at ``path``."""
    if path.is_dir():
        return sorted(item for item in path.rglob("*") if item.is_file())
    return split_parts(path)


def total_size(path: Path) -> int:
    return sum(item.stat().st_size for item in files(path))


def cached_digest(path: Path) -> str | None:
    """The sha256 of weights that sit in the Hugging Face cache, without reading them.

    Cached files are links to blobs named by their content hash, verified when they were pulled (the
    sha256 for weights, a git object id for small files): a single file's digest is its blob's name,
    several files get the sha256 of their names and blob names. None when any file is not such a link.
    """
    if path.parent.name == "blobs" and re.fullmatch(r"sha256-[0-9a-f]{64}", path.name):
        return path.name[7:]  # an Ollama blob: named by the sha256 Ollama verified when it pulled it
    entries: list[str] = []
    for item in files(path):
        if not item.is_symlink():
            return None
        blob = Path(os.readlink(item)).name  # the blob the snapshot names (itself maybe a link elsewhere)
        if not _BLOB_NAME.match(blob):
            return None
        entries.append(f"{item.relative_to(path) if path.is_dir() else item.name} {blob}")
    if not path.is_dir() and len(entries) == 1 and len(entries[0].rsplit(" ", 1)[1]) == 64:
        return entries[0].rsplit(" ", 1)[1]
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def read_mlx_metadata(path: Path) -> GGUFMetadata:
    """What an MLX directory's config.json says, in the same shape as a GGUF header."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelfileError(f"{path / 'config.json'} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelfileError(f"{path / 'config.json'} is not a JSON object")
    text: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    quantization = config.get("quantization") or config.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("bits"):
        quant = f"{quantization['bits']}bit"
    else:
        quant = str(config.get("torch_dtype") or text.get("torch_dtype") or "unknown").upper().replace("FLOAT", "F")
    template = None
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            value = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("chat_template")
            template = value if isinstance(value, str) else None
        except (OSError, ValueError, AttributeError):
            template = None
    return GGUFMetadata(
        architecture=str(config.get("model_type") or "unknown"),
        context_length=int(text.get("max_position_embeddings") or 0),
        quantization=quant,
        parameter_size="unknown",
        chat_template=template,
        name=config.get("_name_or_path") if isinstance(config.get("_name_or_path"), str) else None,
    )
