"""How a model is loaded: which engine runs it, with what context, and the load options its worker gets.

The scheduler loads by these rules; ``show``, ``list`` and the dialects report them; a library pull picks its
source by the preferred engine.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from typing import Any

from localai import paths
from localai.errors import EngineUnavailable
from localai.models.registry import ModelRecord
from localai.settings import Settings, default_cache_ram_bytes


def context_size(record: ModelRecord, settings: Settings, overrides: dict[str, Any] | None = None) -> int:
    """The context a model is loaded with: ``num_ctx`` (request, then Modelfile), else ``LOCALAI_CONTEXT_LENGTH``;
    never more than the trained context (the engine would cap it there)."""
    params: dict[str, Any] = {**record.parameters, **(overrides or {})}
    trained = record.context_length or settings.context_length
    num_ctx = int(params.get("num_ctx") or min(trained, settings.context_length))
    return min(num_ctx, record.context_length) if record.context_length else num_ctx


def load_options(record: ModelRecord, settings: Settings, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The worker's load options for a model: Modelfile parameters, then request options, then defaults."""
    params: dict[str, Any] = {**record.parameters, **(overrides or {})}
    return {
        "model_path": record.path,
        "num_ctx": context_size(record, settings, overrides),
        "n_parallel": settings.num_parallel,
        "n_threads": int(params.get("num_thread") or settings.threads()),
        "n_batch": int(params.get("num_batch") or 512),
        "num_gpu": int(params.get("num_gpu", -1)),
        "use_mmap": bool(params.get("use_mmap", True)),
        "flash_attention": settings.flash_attention,
        "cpu_repack": settings.cpu_repack,
        "model_sha256": record.sha256,
        "template": record.template,
        "cache_dir": str(paths.cache_dir()),
        "cache_max_bytes": settings.cache_max_bytes,
        "cache_ram_bytes": settings.cache_ram_bytes if settings.cache_ram_bytes is not None
        else default_cache_ram_bytes(),
    }


RUNS = {"llama.cpp": ("gguf",), "mlx": ("mlx",), "scripted": ("gguf", "mlx")}  # which weights each engine loads


def chosen_engine(record: ModelRecord, preferred: str | None = None) -> str:
    """Which engine ``record`` runs on, without checking that it can (what ``show`` and ``list`` report)."""
    pinned = record.parameters.get("engine")
    if isinstance(pinned, str):
        return pinned
    if preferred is not None and record.format in RUNS.get(preferred, ()):
        return preferred
    return record.engine


_MLX_FOUND = False


def mlx_importable() -> bool:
    """Whether the MLX engine's packages are there (checked without loading them: the daemon stays small). Once
    found, that is remembered; a miss is checked again, so installing the extra needs no daemon restart."""
    global _MLX_FOUND
    if not _MLX_FOUND:
        try:
            _MLX_FOUND = all(importlib.util.find_spec(name) is not None for name in ("mlx.core", "mlx_lm"))
        except (ImportError, ValueError):  # a broken or shadowed mlx package
            return False
    return _MLX_FOUND


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def preferred_engine(settings: Settings) -> str | None:
    """The engine a library pull takes the source of: LOCALAI_ENGINE, else MLX on Apple Silicon where mlx is
    installed, else none (each weights' own engine: llama.cpp for GGUF)."""
    if settings.engine is not None:
        return settings.engine
    return "mlx" if apple_silicon() and mlx_importable() else None


def engine_for(record: ModelRecord, preferred: str | None = None) -> str:
    """The engine a worker runs for ``record``, checked before any spawn.

    A Modelfile's ``PARAMETER engine`` pins it (a 400 when it cannot load these weights); otherwise
    ``LOCALAI_ENGINE`` (``preferred``) where it can load them, else the weights' own engine. MLX needs the
    ``mlx`` package: where it is not installed the answer is a 400 naming the extra.
    """
    engine = chosen_engine(record, preferred)
    if record.format not in RUNS[engine]:
        raise EngineUnavailable(f"'{record.name}' pins engine {engine}, which cannot load {record.format} "
                                "weights; remove PARAMETER engine or point FROM at weights it loads", param="model")
    if engine == "mlx" and not mlx_importable():
        extra = "localai[mlx]" if sys.platform == "darwin" else "localai[mlx]' (mlx-lm with mlx[cpu]"
        raise EngineUnavailable(
            f"'{record.name}' runs on the MLX engine, and mlx is not installed here; install it with: "
            f"pip install '{extra}', or pull a GGUF build of the model (localai pull hf.co/OWNER/REPO-GGUF:Q4_K_M)",
            param="model",
        )
    return engine
