"""A quantized KV cache on MLX (PARAMETER kv_type q8_0 or q4_0: mlx-lm's QuantizedKVCache): cut into the prompt
cache's token blocks like a plain one, restored exactly, under a fingerprint of its own; a model whose heads cannot be
quantized in groups says so at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from localai.engines.engine import BatchItem, LoadOptions
from localai.errors import ModelfileError
from localai.models.modelfile import parse


def test_a_quantized_mlx_cache_is_cut_into_blocks_and_restores_exactly(mlx_model_path: Path, tmp_path: Path) -> None:
    from localai.engines.mlx import MlxEngine
    from tests.mlxarch import write

    folder = write("llama", tmp_path / "llama-64", mlx_model_path, head_dim=64)  # a head size groups of 64 divide
    plain = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=512, n_parallel=1, n_batch=64))
    engine = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=512, n_parallel=2, n_batch=64, kv_type="q4_0"))
    assert engine.info()["kv_type"] == "q4"
    assert engine.fingerprint_parts() != plain.fingerprint_parts()  # never mixed with f16 entries
    tokens = list(range(300, 450))
    for start in range(0, len(tokens), 64):
        engine.decode([BatchItem(0, token, start + i, False) for i, token in enumerate(tokens[start:start + 64])])
    state = engine.seq_state(0)
    split = engine.state_split(state, len(tokens), [(0, 64), (64, 128), (128, 150)])
    assert split is not None
    layout, pieces, rest = split
    assert rest == b"" and engine.state_join(layout, pieces, [64, 64, 22], rest) == state
    prefix = engine.state_join(layout, pieces[:2], [64, 64], rest)
    assert engine.seq_keep(0, 128) and engine.seq_state(0) == prefix
    assert engine.seq_restore(1, prefix)
    engine.decode([BatchItem(0, tokens[128], 128, True), BatchItem(1, tokens[128], 128, True)])
    sampler = engine.new_sampler({"temperature": 0}, None)
    assert engine.sample(sampler, 0) == engine.sample(sampler, 1)


def test_a_model_whose_heads_cannot_be_quantized_says_so(mlx_arch_fixtures: dict[str, Path]) -> None:
    from localai.engines.mlx import MlxEngine

    with pytest.raises(RuntimeError, match=r"quantized KV cache.*kv_type f16"):  # head size 16: no group fits
        MlxEngine(LoadOptions(model_path=str(mlx_arch_fixtures["llama"]), num_ctx=512, n_parallel=1, n_batch=64,
                              kv_type="q8_0"))


def test_kv_type_is_a_load_parameter_with_three_values() -> None:
    assert parse("FROM x\nPARAMETER kv_type q8_0\n").parameters["kv_type"] == "q8_0"
    with pytest.raises(ModelfileError, match="kv_type"):
        parse("FROM x\nPARAMETER kv_type q3\n")
