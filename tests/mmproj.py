"""A tiny vision projector with random weights, written with the gguf package: llama.cpp's Gemma 3 projector type
(a SigLIP encoder, average pooling, a soft-embedding norm and an input projection; tensor names and keys as
tools/mtmd/clip.cpp reads them), as wide as the text model it goes with (smollm2: 576). A 32x32 image in 8x8
patches is 16 patches, pooled 2x2: 4 image positions."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

POSITIONS = 4  # what llama.cpp reports for an image through this projector


def _projector_writer(path: Path, kind: str, *, width: int, ff: int, blocks: int, text_width: int, heads: int,
                      image: int, patch: int) -> gguf.GGUFWriter:
    """A projector file's writer with the header keys every vision projector of tools/mtmd/clip.cpp reads."""
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.name", f"tiny random {kind} projector")
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", ff)
    writer.add_uint32("clip.vision.block_count", blocks)
    writer.add_uint32("clip.vision.projection_dim", text_width)
    writer.add_uint32("clip.vision.attention.head_count", heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_uint32("clip.vision.image_size", image)
    writer.add_uint32("clip.vision.patch_size", patch)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_uint32("general.file_type", 0)
    return writer


def write_mmproj(path: Path, *, text_width: int = 576, width: int = 32, ff: int = 64, heads: int = 2,
                 image: int = 32, patch: int = 8, merge: int = 2, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    writer = _projector_writer(path, "gemma3", width=width, ff=ff, blocks=1, text_width=text_width, heads=heads,
                               image=image, patch=patch)
    writer.add_uint32("clip.vision.projector.scale_factor", merge)

    def random(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    random("v.patch_embd.weight", width, 3, patch, patch)
    random("v.patch_embd.bias", width)
    random("v.position_embd.weight", (image // patch) ** 2, width)
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        random(f"v.blk.0.{part}.weight", width, width)
        random(f"v.blk.0.{part}.bias", width)
    for norm in ("ln1", "ln2"):
        ones(f"v.blk.0.{norm}.weight", width)
        random(f"v.blk.0.{norm}.bias", width)
    random("v.blk.0.ffn_up.weight", ff, width)
    random("v.blk.0.ffn_up.bias", ff)
    random("v.blk.0.ffn_down.weight", width, ff)
    random("v.blk.0.ffn_down.bias", width)
    ones("v.post_ln.weight", width)
    random("v.post_ln.bias", width)
    ones("mm.soft_emb_norm.weight", width)
    random("mm.input_projection.weight", width, text_width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen_mmproj(path: Path, *, text_width: int = 256, width: int = 32, ff: int = 64, heads: int = 2,
                      image: int = 32, patch: int = 4, deepstack: int = 0, seed: int = 0) -> Path:
    """llama.cpp's Qwen3-VL projector type (``qwen3vl_merger``: Qwen3-VL and Qwen3.5/3.6), tiny and random: a ViT
    whose patches take 2D M-RoPE positions, merged 2x2 into one embedding each, and, with ``deepstack``, that many
    deepstack mergers whose outputs ride beside each embedding (Qwen3-VL's text model adds them to its first layers;
    Qwen3.5 has none). Its images take ``max(rows, columns)`` positions for ``rows x columns`` embeddings."""
    rng = np.random.default_rng(seed)
    writer = _projector_writer(path, "qwen3vl_merger", width=width, ff=ff, blocks=max(1, deepstack),
                               text_width=text_width, heads=heads, image=image, patch=patch)
    writer.add_uint32("clip.vision.spatial_merge_size", 2)

    def random(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    merged = width * 4
    random("v.patch_embd.weight", width, 3, patch, patch)
    random("v.patch_embd.weight.1", width, 3, patch, patch)
    random("v.patch_embd.bias", width)
    random("v.position_embd.weight", (image // patch) ** 2, width)
    for layer in range(max(1, deepstack)):
        random(f"v.blk.{layer}.attn_qkv.weight", 3 * width, width)
        random(f"v.blk.{layer}.attn_qkv.bias", 3 * width)
        random(f"v.blk.{layer}.attn_out.weight", width, width)
        random(f"v.blk.{layer}.attn_out.bias", width)
        for norm in ("ln1", "ln2"):
            ones(f"v.blk.{layer}.{norm}.weight", width)
            random(f"v.blk.{layer}.{norm}.bias", width)
        random(f"v.blk.{layer}.ffn_up.weight", ff, width)
        random(f"v.blk.{layer}.ffn_up.bias", ff)
        random(f"v.blk.{layer}.ffn_down.weight", width, ff)
        random(f"v.blk.{layer}.ffn_down.bias", width)
        if layer < deepstack:
            ones(f"v.deepstack.{layer}.norm.weight", merged)
            random(f"v.deepstack.{layer}.norm.bias", merged)
            random(f"v.deepstack.{layer}.fc1.weight", merged, merged)
            random(f"v.deepstack.{layer}.fc1.bias", merged)
            random(f"v.deepstack.{layer}.fc2.weight", text_width, merged)
            random(f"v.deepstack.{layer}.fc2.bias", text_width)
    ones("v.post_ln.weight", width)
    random("v.post_ln.bias", width)
    random("mm.0.weight", merged, merged)
    random("mm.0.bias", merged)
    random("mm.2.weight", text_width, merged)
    random("mm.2.bias", text_width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
