"""The devices the installed llama.cpp can run on, from ggml's own device registry, and what a load put on them.

llama-cpp-python binds llama.h but not ggml-backend.h; the few device calls are bound here with ctypes on the
libggml it ships. ``python -m localai.engines.llama_devices`` prints the report as JSON: the daemon runs it in a
child process for ``localai info`` (initialising a GPU backend costs memory and seconds the daemon should not hold).

The Vulkan backend skips CPU-type devices (Mesa's llvmpipe) unless ``GGML_VK_VISIBLE_DEVICES`` names them.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from localai.engines.placement import Device

TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_size_t
# The ggml calls bound here (ggml-backend.h, which llama-cpp-python does not bind): devices, registries, and what
# the RPC backend needs (engines/llama_rpc.py) to register servers and serve.
_SIGNATURES: tuple[tuple[str, list[Any], Any], ...] = (
    ("ggml_backend_dev_count", [], _SIZE), ("ggml_backend_dev_get", [_SIZE], _POINTER),
    ("ggml_backend_dev_name", [_POINTER], ctypes.c_char_p),
    ("ggml_backend_dev_description", [_POINTER], ctypes.c_char_p),
    ("ggml_backend_dev_memory", [_POINTER, ctypes.POINTER(_SIZE), ctypes.POINTER(_SIZE)], None),
    ("ggml_backend_dev_type", [_POINTER], ctypes.c_int),
    ("ggml_backend_dev_backend_reg", [_POINTER], _POINTER),
    ("ggml_backend_reg_name", [_POINTER], ctypes.c_char_p),
    ("ggml_backend_reg_count", [], _SIZE), ("ggml_backend_reg_get", [_SIZE], _POINTER),
    ("ggml_backend_dev_buffer_type", [_POINTER], _POINTER),
    ("ggml_backend_reg_by_name", [ctypes.c_char_p], _POINTER),
    ("ggml_backend_reg_get_proc_address", [_POINTER, ctypes.c_char_p], _POINTER),
    ("ggml_backend_register", [_POINTER], None),
)


@functools.cache
def libggml() -> Any:
    """The libggml that libllama uses, one handle per process with the calls above bound (a new handle's would
    return C ints, pointers cut to 32 bits). llama-cpp-python's ``_ggml`` opens ``lib/libggml.so`` by path while
    libllama links ``libggml.so.0`` by its soname, and the wheel holds them as two files, so the loader maps two
    copies: two device registries. GPUs are in both (registered statically), but an RPC server added to the wrong
    one is never seen by a model load."""
    from pathlib import Path

    from llama_cpp import _ggml

    folder = Path(str(_ggml.libggml._name)).parent
    by_soname = sorted(folder.glob("libggml.so.*"), key=lambda path: len(path.name)) + sorted(
        folder.glob("libggml.*.dylib"), key=lambda path: len(path.name))
    lib = ctypes.CDLL(str(by_soname[0])) if by_soname else _ggml.libggml
    for name, args, result in _SIGNATURES:
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value else ""


def backends() -> list[str]:
    """The ggml backends this llama.cpp build registered ("CPU", "Vulkan", "CUDA", "Metal", ...)."""
    lib = libggml()
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def cpu_buffer_type() -> int | None:
    """llama.cpp's host buffer type (its CPU device's), where tensors overridden to stay on the CPU go."""
    lib = libggml()
    for index in range(lib.ggml_backend_dev_count()):
        handle = lib.ggml_backend_dev_get(index)
        if TYPES.get(lib.ggml_backend_dev_type(handle)) == "cpu":
            found = lib.ggml_backend_dev_buffer_type(handle)
            return int(found) if found else None
    return None


def devices() -> list[Device]:
    """Every device llama.cpp sees, with its free and total memory now."""
    lib = libggml()
    found = []
    for index in range(lib.ggml_backend_dev_count()):
        handle = lib.ggml_backend_dev_get(index)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        found.append(Device(
            name=_text(lib.ggml_backend_dev_name(handle)),
            description=_text(lib.ggml_backend_dev_description(handle)),
            backend=_text(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(handle))),
            type=TYPES.get(lib.ggml_backend_dev_type(handle), "unknown"),
            free=int(free.value), total=int(total.value),
        ))
    return found


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"^\w+: +(\S+) (model|KV|RS|compute) buffer size = +([\d.]+) MiB")


_LOAD_ERROR = re.compile(r"error loading model: (.+)")
_LAYER = re.compile(r"layer +(\d+) assigned to device (.+?), is_swa")


@dataclass
class LoadReport:
    """What llama.cpp said while loading a model: the layers it offloaded and each buffer it allocated (its own
    measure of the bytes on each device, where the placement's figures are an estimate made beforehand)."""

    offloaded: int | None = None
    layers_total: int | None = None
    buffers: dict[str, int] = field(default_factory=dict)  # "Vulkan0 model" -> bytes
    error: str | None = None  # why a load failed, in llama.cpp's words
    layers: dict[int, str] = field(default_factory=dict)  # each repeating layer's device ("CPU", "RPC0[host:port]")

    def feed(self, text: str) -> None:
        for line in text.splitlines():
            if (match := _LOAD_ERROR.search(line)) is not None:
                self.error = match[1].strip()
            elif (match := _LAYER.search(line)) is not None:
                self.layers[int(match[1])] = match[2].strip()
            elif (match := _OFFLOADED.search(line)) is not None:
                self.offloaded, self.layers_total = int(match[1]), int(match[2])
            elif (match := _BUFFER.match(line.strip())) is not None:
                key = f"{match[1]} {match[2]}"
                self.buffers[key] = self.buffers.get(key, 0) + int(float(match[3]) * (1 << 20))

    def layer_spans(self) -> list[dict[str, str]]:
        """Which layers went to which device, in runs: ``[{"device": "RPC0[10.0.0.2:50052]", "layers": "0-13"}]``."""
        spans: list[dict[str, Any]] = []
        for index in sorted(self.layers):
            device = self.layers[index]
            if spans and spans[-1]["device"] == device and spans[-1]["last"] == index - 1:
                spans[-1]["last"] = index
            else:
                spans.append({"device": device, "first": index, "last": index})
        return [{"device": span["device"], "layers": f"{span['first']}" if span["first"] == span["last"]
                 else f"{span['first']}-{span['last']}"} for span in spans]

    def device_bytes(self, kinds: tuple[str, ...] = ("model", "KV", "RS")) -> int:
        """Bytes in buffers that are not the CPU's (host buffers are named CPU, CPU_Mapped, CUDA_Host, ...)."""
        return sum(size for key, size in self.buffers.items()
                   if key.split()[1] in kinds and not key.startswith("CPU") and "_Host" not in key.split()[0])


def report() -> dict[str, Any]:
    """The whole picture for ``localai info``: this llama.cpp's version, backends, and devices with free memory."""
    import llama_cpp as L

    found = devices()  # once: each device's memory is asked of its driver
    return {
        "llama_cpp_python": L.__version__,
        "backends": backends(),
        # a local GPU (llama_supports_gpu_offload also says yes for a build with the RPC backend, GPU or not)
        "gpu_offload": any(device.type in ("gpu", "igpu") for device in found),
        "rpc": bool(L.llama_supports_rpc()),  # the RPC backend: layers on other machines (localai rpc-server)
        "devices": [asdict(device) for device in found],
    }


if __name__ == "__main__":
    json.dump(report(), sys.stdout)
