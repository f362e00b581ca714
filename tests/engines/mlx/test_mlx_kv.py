"""A quantized KV cache on MLX (PARAMETER kv_type q8_0 or q4_0: mlx-lm's QuantizedKVCache): cut into the prompt
cache's token blocks like a plain one, restored exactly, under a fingerprint of its own; a model whose heads cannot be
quantized in groups says so at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from localai.engines.engine import LoadOptions
from localai.errors import ModelfileError
from localai.models.modelfile import parse
from tests.engines.mlx.conftest import assert_blocks_round_trip


def test_a_quantized_mlx_cache_is_cut_into_blocks_and_restores_exactly(mlx_model_path: Path, tmp_path: Path) -> None:
    from localai.engines.mlx import MlxEngine
    from tests.mlxarch import write

    folder = write("llama", tmp_path / "llama-64", mlx_model_path, head_dim=64)  # a head size groups of 64 divide
    plain = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=512, n_parallel=1, n_batch=64))
    engine = MlxEngine(LoadOptions(model_path=str(folder), num_ctx=512, n_parallel=2, n_batch=64, kv_type="q4_0"))
    assert engine.info()["kv_type"] == "q4"
    assert engine.fingerprint_parts() != plain.fingerprint_parts()  # never mixed with f16 entries
    assert_blocks_round_trip(engine, list(range(300, 450)))

def test_a_model_whose_heads_cannot_be_quantized_says_so(mlx_arch_fixtures: dict[str, Path]) -> None:
    from localai.engines.mlx import MlxEngine

    with pytest.raises(RuntimeError, match=r"quantized KV cache.*kv_type f16"):  # head size 16: no group fits
        MlxEngine(LoadOptions(model_path=str(mlx_arch_fixtures["llama"]), num_ctx=512, n_parallel=1, n_batch=64,
                              kv_type="q8_0"))


def test_kv_type_is_a_load_parameter_with_three_values() -> None:
    assert parse("FROM x\nPARAMETER kv_type q8_0\n").parameters["kv_type"] == "q8_0"
    with pytest.raises(ModelfileError, match="kv_type"):
        parse("FROM x\nPARAMETER kv_type q3\n")
