"""What a GGUF file says about its model, read from its header with the ``gguf`` package (no engine)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# llama.cpp's ``general.file_type`` values (enum llama_ftype) for the common quantizations.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}


@dataclass
class GGUFMetadata:
    """The facts localai shows and schedules by."""

    architecture: str
    context_length: int
    quantization: str
    parameter_size: str
    chat_template: str | None
    name: str | None


def read_metadata(path: Path) -> GGUFMetadata:
    """Read a GGUF header. Raises ValueError for a file that is not GGUF."""
    from gguf import GGUFReader

    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model",):
            continue  # vocabularies are large and not needed here
        try:
            fields[key] = field.contents()
        except Exception:
            continue
    arch = str(fields.get("general.architecture", "unknown"))
    file_type = fields.get("general.file_type")
    size_label = fields.get("general.size_label")
    if not size_label:
        total = sum(int(t.n_elements) for t in reader.tensors)
        size_label = _human_count(total)
    template = fields.get("tokenizer.chat_template")
    return GGUFMetadata(
        architecture=arch,
        context_length=int(fields.get(f"{arch}.context_length", 0) or 0),
        quantization=FILE_TYPES.get(int(file_type), str(file_type)) if file_type is not None else "unknown",
        parameter_size=str(size_label),
        chat_template=str(template) if template else None,
        name=str(fields["general.name"]) if "general.name" in fields else None,
    )


def _human_count(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}".replace(".0", "")
    return str(count)
