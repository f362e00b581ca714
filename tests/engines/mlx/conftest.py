"""The MLX engine's fixtures: a real MLX model made from the embedded SmolLM2 GGUF, and a daemon serving it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, start_daemon

MLX_MODEL = "smol-mlx"


def create_mlx_model(daemon: Daemon, path: Path, name: str = MLX_MODEL, extra: str = "") -> str:
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": name, "modelfile": f"FROM {path}\n{extra}"})
    assert response.status_code == 200, response.text
    return name


@pytest.fixture(scope="session")
def mlx_daemon(tmp_path_factory: pytest.TempPathFactory, mlx_model_path: Path) -> Iterator[Daemon]:
    """One daemon with the MLX model loaded, shared by the tests that do not restart or kill anything."""
    instance = start_daemon(tmp_path_factory.mktemp("mlx-daemon"), keep_alive="-1")
    create_mlx_model(instance, mlx_model_path)
    yield instance
    instance.stop()


def assert_blocks_round_trip(engine: Any, tokens: list[int]) -> tuple[Any, list[bytes], bytes, bytes]:
    """Prefill 150 ``tokens`` on sequence 0, cut its state into blocks of 64, 64 and 22 tokens and join them back:
    the same bytes; the first two alone are the state of that prefix, which sequence 0 cut back holds and sequence 1
    restores, and both continue with the same token. Returns (layout, pieces, rest, the whole state)."""
    from localai.engines.engine import BatchItem

    assert len(tokens) == 150
    for start in range(0, len(tokens), 64):
        engine.decode([BatchItem(0, token, start + i, False) for i, token in enumerate(tokens[start:start + 64])])
    state = engine.seq_state(0)
    split = engine.state_split(state, len(tokens), [(0, 64), (64, 128), (128, 150)])
    assert split is not None
    layout, pieces, rest = split
    assert rest == b"" and len(pieces) == 3
    assert engine.state_join(layout, pieces, [64, 64, 22], rest) == state
    prefix = engine.state_join(layout, pieces[:2], [64, 64], rest)
    assert engine.seq_keep(0, 128)
    assert engine.seq_state(0) == prefix
    assert engine.seq_restore(1, prefix)
    engine.decode([BatchItem(0, tokens[128], 128, True), BatchItem(1, tokens[128], 128, True)])
    sampler = engine.new_sampler({"temperature": 0}, None)
    assert engine.sample(sampler, 0) == engine.sample(sampler, 1)
    return layout, pieces, rest, state
