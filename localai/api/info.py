"""``/api/info`` (``localai info``): what this machine runs models on, and where a given model would run.

The devices come from the installed llama.cpp itself (``engines/llama_devices.py``), asked in a child process: a GPU
backend's first initialisation takes seconds and device memory the daemon should not keep. The answer is kept: the
devices are probed once (however many requests ask at the same time) and again only on ``?refresh=true``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from localai.api.common import ParsedBodyRoute, runtime_of
from localai.engines.placement import Device, DoesNotFit, ModelSizes, place
from localai.models.loading import (
    apple_silicon,
    available_memory,
    engine_choice,
    engine_for,
    load_options,
    mlx_importable,
    preferred_engine,
)
from localai.models.registry import ModelRecord
from localai.settings import Settings

router = APIRouter(route_class=ParsedBodyRoute)
PROBE_TIMEOUT = 120.0  # a first Vulkan or CUDA initialisation can compile or load kernels for a while


async def llama_cpp_report() -> dict[str, Any]:
    """The installed llama.cpp's backends and devices, or ``{"error": ...}`` saying why they could not be read."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "localai.engines.llama_devices",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), PROBE_TIMEOUT)
    except TimeoutError:
        process.kill()
        await process.wait()
        return {"error": f"llama.cpp's device probe took over {PROBE_TIMEOUT:.0f} s"}
    if process.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        return {"error": f"llama.cpp's device probe failed: {lines[-1] if lines else process.returncode}"}
    report: dict[str, Any] = json.loads(out)
    return report


@dataclass
class DeviceReport:
    """The last probe's answer, and the one probe in flight (requests that ask meanwhile wait for it)."""

    report: dict[str, Any] | None = None
    probed_at: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, refresh: bool = False) -> dict[str, Any]:
        asked = time.time()
        async with self.lock:
            if self.report is None or (refresh and self.probed_at < asked):
                self.report = await llama_cpp_report()
                self.probed_at = time.time()
            return {**self.report, "probed_at": self.probed_at}


def model_report(record: ModelRecord, settings: Settings, llama: dict[str, Any],
                 loaded: dict[str, Any] | None) -> dict[str, Any]:
    """Which engine ``record`` gets and why, and (on llama.cpp) the placement its next load would get."""
    engine, reason = engine_choice(record, settings.engine)
    result: dict[str, Any] = {"name": record.name, "engine": engine, "engine_reason": reason}
    try:
        engine_for(record, settings.engine)
    except Exception as exc:  # EngineUnavailable: the 400 a request would get, said here instead
        result["error"] = str(exc)
        return result
    if loaded is not None:
        result["loaded"] = loaded
    if engine != "llama.cpp" or "devices" not in llama:
        return result
    options = load_options(record, settings)
    layer_bytes = options["layer_bytes"]
    sizes = (ModelSizes(layer_bytes, options["output_bytes"], options["kv_bytes"], options["weights_bytes"],
                        options["expert_bytes"])
             if layer_bytes is not None else ModelSizes.uniform(options["weights_bytes"], 32, options["kv_bytes"]))
    devices = [Device(**device) for device in llama["devices"]]
    try:
        placed = place(sizes, devices, num_gpu=options["num_gpu"], overhead=options["gpu_overhead"],
                       host_free=available_memory(), num_cpu_moe=options["num_cpu_moe"])
    except DoesNotFit as exc:
        result["error"] = str(exc)
        return result
    result["placement"] = {**placed.report(), "num_ctx": options["num_ctx"], "kv_type": options["kv_type"],
                           "estimated": True}
    return result


@router.get("/api/info")
async def info(request: Request, model: str | None = None, refresh: bool = False) -> dict[str, Any]:
    """What this machine runs models on (``refresh``: probe the devices again, for their free memory now)."""
    settings: Settings = request.app.state.settings
    devices: DeviceReport = request.app.state.devices
    llama = await devices.get(refresh)
    result: dict[str, Any] = {
        "llama_cpp": llama,
        "mlx": {"installed": mlx_importable(), "apple_silicon": apple_silicon(),
                "preferred": preferred_engine(settings) == "mlx"},
        "gpu_overhead": settings.gpu_overhead,
        "host_free": available_memory(),
        # every model's RPC servers (LOCALAI_RPC_SERVERS); not greeted here: a server busy with a worker would
        # keep this answer waiting (an rpc-server serves one client at a time)
        "rpc_servers": list(settings.rpc_servers),
    }
    if model:
        runtime = runtime_of(request)
        record = await runtime.record(model)
        current = runtime.scheduler.loaded.get(record.name)
        loaded = dict(current.worker.info["placement"]) if current and current.worker.info else None
        result["model"] = await asyncio.to_thread(model_report, record, settings, llama, loaded)
    return result
