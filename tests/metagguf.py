"""GGUFs with metadata only (no tensors), written with the ``gguf`` package: what the format detection and the
context-window rule read, for models whose weights are not reachable here (Qwen3-Coder, gpt-oss, GLM-4.7)."""

from __future__ import annotations

from pathlib import Path

import gguf

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def metadata_gguf(path: Path, *, arch: str, context_length: int, template: str = CHATML, layers: int = 48,
                  kv_heads: int = 4, head_dim: int = 128, embedding: int = 2048, name: str = "Metadata Only",
                  extra: dict[str, int] | None = None, value_dim: int | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(context_length)
    writer.add_block_count(layers)
    writer.add_embedding_length(embedding)
    writer.add_head_count(max(1, embedding // head_dim))
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(value_dim or head_dim)
    writer.add_file_type(15)
    writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
