"""The MLX engine's fixtures: a real MLX model made from the embedded SmolLM2 GGUF, and a daemon serving it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Daemon, start_daemon
from tests.mlxmodel import convert

MLX_MODEL = "smol-mlx"


@pytest.fixture(scope="session")
def mlx_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """SmolLM2-135M-Instruct's own weights as an MLX folder (float16; about 7 s to write)."""
    from localai.scheduler import mlx_importable

    if not mlx_importable():  # a failure, not a skip: `make test` installs the extra, so CI always runs these
        pytest.fail("the MLX engine's tests need `pip install -e '.[mlx]'` (make test installs it)")
    return convert(smollm2_path, tmp_path_factory.mktemp("mlx") / "SmolLM2-135M-Instruct-mlx")


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
