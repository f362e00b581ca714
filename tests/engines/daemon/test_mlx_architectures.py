"""The prompt cache through a real daemon on MLX folders of the architectures agents run on (random weights written
from mlx-lm's own model classes: tests/mlxarch.py): hybrids with linear attention (Qwen3.5, Qwen3-Next), Mamba
(Nemotron-H) or short convolutions (LFM2), sliding windows (Gemma 3, gpt-oss), MoE and latent attention. The same
walk as the GGUF fixtures' (tests/engines/daemon/test_architectures.py): every reuse path answers exactly as a cold
daemon does, and reuses at least 95% of what the dense control (the llama folder: the same tokenizer and template)
reuses on the same conversation. Plus what a folder mlx-lm cannot load gets: a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import start_daemon
from tests.engines.daemon.test_architectures import (
    after_restart,
    ask,
    check_answers,
    check_reuse,
    cold_answers,
    create,
    fitted,
    paths,
)
from tests.mlxarch import ARCHS

NAMES = [name for name in ARCHS if name != "llama"]
SMALL = "PARAMETER num_ctx 512\n"


@pytest.fixture(scope="module")
def dense_control(mlx_arch_fixtures: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, dict[str, Any]]:
    """The llama folder's walk: what a dense model reuses on the same conversation (run once for every case)."""
    return walk(tmp_path_factory.mktemp("mlx-control"), "control", mlx_arch_fixtures["llama"])


def walk(home: Path, name: str, folder: Path) -> dict[str, dict[str, Any]]:
    with start_daemon(home) as daemon:
        create(daemon, name, folder)
        create(daemon, f"{name}-512", folder, SMALL)
        seen = paths(daemon, name)
        seen.update(fitted(daemon, f"{name}-512"))
    with start_daemon(home) as daemon:  # a restart: only the disk remembers
        after_restart(daemon, name, seen)
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_every_mlx_reuse_path_answers_as_a_cold_daemon_and_reuses_as_the_dense_control(
        mlx_arch_fixtures: dict[str, Path], dense_control: dict[str, dict[str, Any]], name: str,
        tmp_path: Path) -> None:
    folder = mlx_arch_fixtures[name]
    mine = walk(tmp_path / name, name, folder)
    keys = check_answers(tmp_path / "cold", name, folder, mine, SMALL)
    check_reuse(f"mlx {name}", mine, dense_control, keys)


def test_a_folder_mlx_lm_cannot_load_is_a_clear_error(mlx_arch_fixtures: dict[str, Path], tmp_path: Path) -> None:
    """A model_type this mlx-lm does not know names it and mlx-lm's version; a folder without its weights says so;
    the daemon and the other models go on."""
    import importlib.metadata

    future = tmp_path / "future"
    shutil.copytree(mlx_arch_fixtures["llama"], future)
    config = json.loads((future / "config.json").read_text())
    (future / "config.json").write_text(json.dumps({**config, "model_type": "futurenet"}))
    hollow = tmp_path / "hollow"
    shutil.copytree(mlx_arch_fixtures["llama"], hollow)
    (hollow / "model.safetensors").unlink()
    version = importlib.metadata.version("mlx-lm")
    with start_daemon(tmp_path / "home") as daemon:
        for model, folder in (("future", future), ("hollow", hollow)):
            with daemon.http() as http:
                created = http.post("/api/create", json={"model": model, "modelfile": f"FROM {folder}\n"})
                if created.status_code != 200:  # refused at create: the message says why
                    assert created.status_code == 400, created.text
                    message = created.text
                else:
                    refused = http.post("/v1/chat/completions", json={
                        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                    assert refused.status_code in (400, 422, 500, 503), refused.text
                    message = refused.text
            if model == "future":
                assert "futurenet" in message and version in message, message
            else:
                assert "without its weights" in message, message
        create(daemon, "llama", mlx_arch_fixtures["llama"])
        assert ask(daemon, "llama", [{"role": "user", "content": "hi"}], "fine")["text"] is not None


def test_a_damaged_mlx_checkpoint_is_recomputed_never_served(mlx_arch_fixtures: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """A hybrid's checkpoints on disk damaged between two daemons: the next turn recomputes and answers as a cold
    daemon does."""
    from tests.conftest import corrupt_cache_files

    folder = mlx_arch_fixtures["qwen3_5"]
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 20},
                {"role": "user", "content": "What does parse_args do?"}]
    with start_daemon(tmp_path / "home") as daemon:
        create(daemon, "q", folder)
        first = ask(daemon, "q", messages, "s")
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And then?"}]
    assert corrupt_cache_files(tmp_path / "home")
    with start_daemon(tmp_path / "home") as daemon:
        again = ask(daemon, "q", messages, "s")
        assert "dropping damaged cache" in (tmp_path / "home" / "logs" / "workers.log").read_text()
    assert again["text"] == cold_answers(tmp_path / "cold", [("q", folder, "", messages)])[0]
    assert again["cached"] == 0
