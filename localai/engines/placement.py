"""Where a GGUF model's layers go: as many as the GPU's free memory holds, the rest on the CPU.

llama.cpp offloads by a layer count (``n_gpu_layers``): the output layer first, then the repeating layers from the
last one down; each offloaded layer keeps its KV cache on the device too. This module picks that count from the
devices' free memory (llama.cpp's own report, ``engines/llama_devices.py``) and the sizes the daemon read from the
GGUF header (each layer's tensors, the output layer, the KV cache at the window asked), and says how a placement is
reported (Ollama's ``100% GPU`` / ``48%/52% CPU/GPU`` / ``100% CPU``). Pure: no llama.cpp here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEVICE_RESERVE = 512 << 20  # per device: llama.cpp's compute buffers, the driver's own, other programs' growth
OFFLOAD_TYPES = ("gpu", "igpu")  # the device types llama.cpp offloads layers to


@dataclass(frozen=True)
class Device:
    """One device llama.cpp can run on, as it reports it."""

    name: str  # llama.cpp's: "CUDA0", "Vulkan0", "CPU"
    description: str  # the hardware: "NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"
    backend: str  # the ggml backend: "CUDA", "Vulkan", "Metal", "CPU"
    type: str  # "gpu", "igpu", "cpu", "accel"
    free: int
    total: int

    @property
    def offloads(self) -> bool:
        return self.type in OFFLOAD_TYPES


@dataclass(frozen=True)
class ModelSizes:
    """What placing a model needs to know of it: the weights of each repeating layer and of the output layer (the
    token embeddings when the output is tied to them), and the KV cache of every sequence at the window."""

    layer_bytes: list[int]
    output_bytes: int
    kv_bytes: int
    total_bytes: int  # the whole file: weights that stay on the CPU (the token embeddings) count here
    expert_bytes: list[int] | None = None  # each layer's expert tensors (a mixture of experts), part of layer_bytes

    @classmethod
    def uniform(cls, total_bytes: int, layers: int, kv_bytes: int) -> ModelSizes:
        """Sizes for a model whose tensors were not read (a split GGUF): every layer alike, the output one of them."""
        layers = max(layers, 1)
        each = total_bytes // (layers + 1)
        return cls([each] * layers, each, kv_bytes, total_bytes)


class DoesNotFit(ValueError):
    """The model does not fit in the devices' and the system's free memory together."""


@dataclass
class Placement:
    """How many of a model's layers run on the GPU, the bytes that puts there, and why."""

    layers: int  # offloaded, as llama.cpp counts them (the output layer is one)
    layers_total: int  # repeating layers + the output layer
    device_bytes: int  # weights and KV cache on the devices
    total_bytes: int  # weights and KV cache in all
    devices: list[dict[str, Any]] = field(default_factory=list)  # the devices used: name, description, backend
    reason: str = ""
    cpu_moe: int = 0  # the first layers whose expert tensors stay on the CPU (llama.cpp's --n-cpu-moe)
    layers_moe: int = 0  # the layers with experts (0: not a mixture of experts)
    layer_devices: list[dict[str, str]] = field(default_factory=list)  # llama.cpp's: [{device, layers: "0-13"}]

    @property
    def uses_rpc(self) -> bool:
        """Whether some of its layers are on another machine's device (llama.cpp's RPC backend)."""
        return self.layers > 0 and any(device.get("backend") == "RPC" for device in self.devices)

    @property
    def processor(self) -> str:
        """Ollama's words: ``100% GPU`` when every layer is on the device, ``100% CPU`` when none is, else the share
        of the bytes on each (the token embeddings stay on the CPU in llama.cpp even with every layer offloaded)."""
        if self.layers <= 0 or self.device_bytes <= 0:
            return "100% CPU"
        # layers on other machines' devices (llama.cpp's RPC backend) and none on a local GPU: say where they are
        remote = bool(self.devices) and all(device.get("backend") == "RPC" for device in self.devices)
        where = "RPC" if remote else "GPU"
        if self.layers >= self.layers_total and not self.cpu_moe:
            return f"100% {where}"
        gpu = min(99, max(1, round(100 * self.device_bytes / max(self.total_bytes, 1))))
        return f"{100 - gpu}%/{gpu}% CPU/{where}"

    @property
    def experts(self) -> str:
        """Where a mixture of experts' expert tensors are, in words ("" for a dense model)."""
        if not self.layers_moe:
            return ""
        if self.layers <= 0:
            return "experts on the CPU"
        if not self.cpu_moe:
            return "experts on the GPU" if self.layers >= self.layers_total else "experts with their layers"
        return f"experts of {min(self.cpu_moe, self.layers_moe)}/{self.layers_moe} layers on the CPU"

    def report(self) -> dict[str, Any]:
        return {**asdict(self), "processor": self.processor, "experts": self.experts}


def cpu_only(total_bytes: int, layers_total: int, reason: str) -> Placement:
    return Placement(0, layers_total, 0, total_bytes, [], reason)


def device_bytes(sizes: ModelSizes, layers: int, cpu_moe: int = 0) -> int:
    """The bytes ``layers`` offloaded layers (llama.cpp's count: the output layer, then the last repeating ones)
    put on the devices: their weights and their share of the KV cache, less the experts of the first ``cpu_moe``
    layers (kept on the CPU)."""
    n = len(sizes.layer_bytes)
    kv_per_layer = sizes.kv_bytes / n if n else 0
    if layers <= 0:
        return 0
    repeating = min(layers - 1, n)
    moved = sizes.output_bytes + sum(sizes.layer_bytes[n - repeating:]) + kv_per_layer * repeating
    experts = sizes.expert_bytes or []
    moved -= sum(experts[index] for index in range(max(n - repeating, 0), min(cpu_moe, n, len(experts))))
    return int(moved)


def budget(devices: list[Device], overhead: int = 0) -> int:
    """The bytes the offloading devices can take: each one's free memory less its reserve and ``overhead``."""
    return sum(max(0, d.free - DEVICE_RESERVE - overhead) for d in devices if d.offloads)


def place(sizes: ModelSizes, devices: list[Device], *, num_gpu: int = -1, overhead: int = 0,
          host_free: int | None = None, num_cpu_moe: int = -1) -> Placement:
    """The layers to offload: ``num_gpu`` when it is set (>= 0), else as many as the devices' free memory holds.
    A mixture of experts that does not fit whole first keeps the expert tensors of its first layers on the CPU
    (as few as it takes, every other tensor on the GPU: attention and the shared weights run on every token, a
    token's few experts are cheap to run on the CPU), and moves whole layers only when every layer's experts on
    the CPU is not enough. ``num_cpu_moe`` (>= 0) sets how many layers keep their experts on the CPU.

    Raises ``DoesNotFit`` when, with the most the devices hold, the rest is larger than ``host_free`` (the system's
    free memory; None: not checked), naming what would fit."""
    n = len(sizes.layer_bytes)
    total_layers = n + 1
    total = sizes.total_bytes + sizes.kv_bytes
    offload = [d for d in devices if d.offloads]
    used = [{"name": d.name, "description": d.description, "backend": d.backend} for d in offload]
    moe = sum(1 for size in sizes.expert_bytes or [] if size)
    if not offload:
        return Placement(0, total_layers, 0, total, [], "no GPU: llama.cpp found no device to offload to",
                         layers_moe=moe)
    if num_gpu >= 0 or num_cpu_moe >= 0:
        layers = min(num_gpu, total_layers) if num_gpu >= 0 else total_layers
        cpu_moe = min(max(num_cpu_moe, 0), n) if moe else 0
        asked = ", ".join(f"{name} {value}" for name, value in (("num_gpu", num_gpu), ("num_cpu_moe", num_cpu_moe))
                          if value >= 0)
        return Placement(layers, total_layers, device_bytes(sizes, layers, cpu_moe), total, used if layers else [],
                         asked, cpu_moe, moe)
    room = budget(offload, overhead)
    layers, cpu_moe = total_layers, 0
    if device_bytes(sizes, layers) > room and moe:
        while cpu_moe < n and device_bytes(sizes, layers, cpu_moe) > room:
            cpu_moe += 1
    if device_bytes(sizes, layers, cpu_moe) > room:
        layers = 0
        while layers < total_layers and device_bytes(sizes, layers + 1, cpu_moe) <= room:
            layers += 1
    on_device = device_bytes(sizes, layers, cpu_moe)
    free = ", ".join(f"{d.name} {d.free / 2**30:.1f} GiB free" for d in offload)
    experts = f", the experts of {cpu_moe} of {moe} layers on the CPU" if cpu_moe else ""
    if layers == total_layers:
        reason = (f"every layer fits{experts}: {on_device / 2**30:.2f} GiB of {room / 2**30:.2f} GiB usable "
                  f"({free})")
    elif layers:
        reason = (f"{layers} of {total_layers} layers fit in {room / 2**30:.2f} GiB usable ({free}){experts}; the "
                  "rest run on the CPU")
    else:
        reason = f"not one layer fits in {room / 2**30:.2f} GiB usable ({free}): running on the CPU"
        cpu_moe = 0
    if host_free is not None and total - on_device > host_free:
        raise DoesNotFit(
            f"the model needs {total / 2**30:.1f} GiB (weights {sizes.total_bytes / 2**30:.1f} GiB + KV cache "
            f"{sizes.kv_bytes / 2**30:.1f} GiB); {on_device / 2**30:.1f} GiB fit on the GPU ({free}) and "
            f"{host_free / 2**30:.1f} GiB are free in RAM. What fits: weights and KV cache up to "
            f"{(on_device + host_free) / 2**30:.1f} GiB: a smaller window (num_ctx), fewer sequences "
            "(LOCALAI_NUM_PARALLEL), a q8_0 KV cache, or a smaller quantization")
    return Placement(layers, total_layers, on_device, total, used if layers else [], reason, cpu_moe, moe)
