"""The MLX engine's fixtures: a real MLX model made from the embedded SmolLM2 GGUF, and a daemon serving it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
