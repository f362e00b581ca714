"""How a model is loaded: which engine runs it, with what context, and the load options its worker gets.

The scheduler loads by these rules; ``show``, ``list`` and the dialects report them; a library pull picks its
source by the preferred engine.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localai import paths
from localai.errors import EngineUnavailable
from localai.models.gguf_meta import AttentionShape, GGUFMetadata, read_metadata
from localai.models.modelfile import LOAD_PARAMETERS
from localai.models.registry import ModelRecord
from localai.settings import Settings, default_cache_ram_bytes

AGENT_WINDOW = 65536  # what coding agents need at least (Ollama's launch guide says 64,000 tokens)
SMALL_WINDOW = 32768  # below this an agent's prompt (15-30k tokens) does not fit: say how to make room
WINDOW_STEP = 1024


@dataclass(frozen=True)
class Window:
    """The context a model is loaded with, and the memory that takes (what show, ps and launch report)."""

    num_ctx: int
    kv_type: str
    weights_bytes: int
    kv_bytes: int  # every sequence's KV cache at this window
    available_bytes: int | None  # free memory it was fitted against (None: the window was given, not fitted)
    chosen_by: str  # "num_ctx", "LOCALAI_CONTEXT_LENGTH", or "memory"
    advice: str = ""  # how to make room, when even a 32k window does not fit

    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes


def available_memory() -> int:
    """Memory the system can give a new model now (Linux: MemAvailable; elsewhere half the physical memory)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


@functools.lru_cache(maxsize=64)
def _metadata(path: str, mtime_ns: int) -> GGUFMetadata | None:
    try:
        return read_metadata(Path(path))
    except (OSError, ValueError):
        return None


def gguf_metadata(path: str) -> GGUFMetadata | None:
    """A GGUF file's header facts, read once per version of the file (None when it is not a readable GGUF)."""
    try:
        return _metadata(path, os.stat(path).st_mtime_ns)
    except OSError:
        return None


def is_reranker(record: ModelRecord) -> bool:
    """A reranker's weights (rank pooling through a classifier head): it scores documents, it does not chat."""
    if record.format != "gguf" or not record.path:
        return False
    meta = gguf_metadata(record.path)
    return meta is not None and meta.reranker


def attention_of(record: ModelRecord) -> AttentionShape | None:
    """The model's attention shape from its GGUF header (None for MLX folders, remote models, unreadable files)."""
    if record.format != "gguf" or not record.path:
        return None
    meta = gguf_metadata(record.path)
    return meta.attention if meta is not None else None


def kv_bytes(shape: AttentionShape | None, num_ctx: int, sequences: int, kv_type: str) -> int:
    """The KV cache of ``sequences`` sequences of ``num_ctx`` tokens (sliding-window layers hold their window)."""
    if shape is None:
        return 0
    return int(shape.kv_bytes(num_ctx, kv_type) * sequences)


def fit_window(record: ModelRecord, settings: Settings, *, available: int | None = None,
               kv_type: str | None = None) -> Window:
    """The largest window, up to the trained context, whose KV cache (every sequence's) fits the memory left after
    the weights: f16 KV, or q8_0 when that is what makes an agent's 64k fit (``kv_type``: that type, as asked); a
    model whose shape is not known gets ``LOCALAI_CONTEXT_LENGTH``'s default."""
    asked = kv_type
    trained = record.context_length or settings.context_length
    shape = attention_of(record)
    sequences = settings.num_parallel
    if shape is None:
        num_ctx = min(trained, settings.context_length)
        return Window(num_ctx, asked or "f16", record.size, 0, None, "LOCALAI_CONTEXT_LENGTH")
    free = available_memory() if available is None else available
    budget = free - record.size - max(1 << 30, free // 10)  # room for compute buffers and everything else
    fits: dict[str, int] = {}
    for kv_type in (asked,) if asked else ("f16", "q8_0"):
        fits[kv_type] = min(trained, shape.tokens_within(budget / sequences, kv_type) // WINDOW_STEP * WINDOW_STEP)
    goal = min(trained, AGENT_WINDOW)
    kv_type = asked or ("f16" if fits["f16"] >= goal or fits["q8_0"] < goal else "q8_0")
    num_ctx = fits[kv_type]
    advice = ""
    if num_ctx < min(trained, SMALL_WINDOW):
        advice = (f"only {num_ctx} tokens of context fit in the {free / 2**30:.1f} GiB free beside the "
                  f"{record.size / 2**30:.1f} GiB of weights ({sequences} sequences); for an agent's 32k+ window use "
                  "a smaller quantization, fewer sequences (LOCALAI_NUM_PARALLEL), or set num_ctx and accept "
                  "the swap")
        num_ctx = max(num_ctx, min(trained, 2048))  # something to load with; the advice says why it is small
    return Window(num_ctx, kv_type, record.size, kv_bytes(shape, num_ctx, sequences, kv_type), free, "memory",
                  advice)


def window(record: ModelRecord, settings: Settings, overrides: dict[str, Any] | None = None,
           *, available: int | None = None) -> Window:
    """The window a model is loaded with: ``num_ctx`` (request, then Modelfile), else ``LOCALAI_CONTEXT_LENGTH`` when
    it is set, else the largest the machine holds (``fit_window``); never more than the trained context."""
    params: dict[str, Any] = {**record.parameters, **(overrides or {})}
    trained = record.context_length or settings.context_length
    shape = attention_of(record)
    kv_type = str(params.get("kv_type") or "f16")  # PARAMETER kv_type, else f16 (or q8_0 where fitted)
    if params.get("num_ctx"):
        num_ctx = int(params["num_ctx"])
        num_ctx = min(num_ctx, record.context_length) if record.context_length else num_ctx
        return Window(num_ctx, kv_type, record.size, kv_bytes(shape, num_ctx, settings.num_parallel, kv_type), None,
                      "num_ctx")
    if "context_length" in settings.model_fields_set or shape is None:
        num_ctx = min(trained, settings.context_length)
        return Window(num_ctx, kv_type, record.size, kv_bytes(shape, num_ctx, settings.num_parallel, kv_type), None,
                      "LOCALAI_CONTEXT_LENGTH")
    return fit_window(record, settings, available=available, kv_type=params.get("kv_type"))


def context_size(record: ModelRecord, settings: Settings, overrides: dict[str, Any] | None = None) -> int:
    """The context a model is loaded with (see ``window``)."""
    return window(record, settings, overrides).num_ctx


def load_options(record: ModelRecord, settings: Settings, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The worker's load options for a model: Modelfile parameters, then request options, then defaults."""
    params: dict[str, Any] = {**record.parameters, **(overrides or {})}
    chosen = window(record, settings, overrides)
    meta = gguf_metadata(record.path) if record.format == "gguf" and record.path else None
    return {
        "model_path": record.path,
        "num_ctx": chosen.num_ctx,
        "kv_type": chosen.kv_type,
        "n_parallel": settings.num_parallel,
        "n_threads": int(params.get("num_thread") or settings.threads()),
        "n_batch": int(params.get("num_batch") or 512),
        "num_gpu": int(params.get("num_gpu", -1)),
        "num_cpu_moe": int(params.get("num_cpu_moe", -1)),
        # llama.cpp RPC servers the layers spread over: the Modelfile's, else every model's (LOCALAI_RPC_SERVERS)
        "rpc_servers": list(params.get("rpc") or settings.rpc_servers),
        "use_mmap": bool(params.get("use_mmap", True)),
        "flash_attention": settings.flash_attention,
        "cpu_repack": settings.cpu_repack,
        # a projector's weights change what an image's positions hold: they are part of the cache's fingerprint
        # so do LoRA adapters' weights and scales (a session cached with one adapter is not served without it)
        "model_sha256": record.sha256 + (f"+mmproj:{record.projector_sha256}" if record.projector else "")
        + "".join(f"+lora:{a['sha256']}@{float(a['scale']):g}" for a in record.adapters),
        "projector_path": record.projector,
        "adapters": [{"path": a["path"], "scale": float(a["scale"])} for a in record.adapters],
        # No chat template: the worker only hashed it into its cache's fingerprint, and models that share a worker
        # (``load_key``) may each have their own; prompts are rendered in the daemon, and cached blocks are keyed
        # by their tokens, so the weights' own template is the one the fingerprint names.
        "cache_dir": str(paths.cache_dir()),
        "cache_max_bytes": settings.cache_max_bytes,
        "cache_ram_bytes": settings.cache_ram_bytes if settings.cache_ram_bytes is not None
        else default_cache_ram_bytes(),
        # for placing layers on a GPU (engines/placement.py): the same sizes the window was fitted with
        "layer_bytes": meta.layer_bytes if meta is not None else None,
        "output_bytes": meta.output_bytes if meta is not None else 0,
        "expert_bytes": meta.expert_bytes if meta is not None else None,
        "weights_bytes": record.size,
        "kv_bytes": chosen.kv_bytes,
        "gpu_overhead": settings.gpu_overhead,
    }


def load_key(record: ModelRecord, settings: Settings, overrides: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """What decides how a model is loaded; models with the same key share one worker (and its prompt cache).

    The engine, the weights, the adapters and the load parameters as asked (``num_ctx``, ``num_gpu``, ...), from the
    Modelfile and the request. A model FROM another with only its own SYSTEM, TEMPLATE, MESSAGEs or sampling (an
    agent persona) has its base's key. The window is in it as asked, not as fitted: a window fitted to the free
    memory would come out smaller once the first model's worker holds its share, and split them.
    """
    params: dict[str, Any] = {**record.parameters, **(overrides or {})}
    asked = tuple((name, tuple(value) if isinstance(value := params[name], list) else value)
                  for name in sorted(LOAD_PARAMETERS) if params.get(name) is not None)
    return (engine_for(record, settings.engine), record.format, record.path, record.sha256,
            tuple((a["path"], a["sha256"], a["scale"]) for a in record.adapters), record.projector, asked)


RUNS = {"llama.cpp": ("gguf",), "mlx": ("mlx",), "scripted": ("gguf", "mlx")}  # which weights each engine loads


def engine_choice(record: ModelRecord, preferred: str | None = None) -> tuple[str, str]:
    """Which engine ``record`` runs on and why, without checking that it can (``localai info`` says the why)."""
    pinned = record.parameters.get("engine")
    if isinstance(pinned, str):
        return pinned, f"its Modelfile pins it (PARAMETER engine {pinned})"
    if preferred is not None and record.format in RUNS.get(preferred, ()):
        return preferred, "the preferred engine (LOCALAI_ENGINE) reads its weights"
    return record.engine, f"its weights are {record.format.upper()}"


def chosen_engine(record: ModelRecord, preferred: str | None = None) -> str:
    """Which engine ``record`` runs on, without checking that it can (what ``show`` and ``list`` report)."""
    return engine_choice(record, preferred)[0]


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
