"""Placing a model's layers by free GPU memory (engines/placement.py), and how it is reported, without a GPU:
free memory injected, llama.cpp's own report parsed from its real log lines, the GGUF's tensor sizes checked
against the ``gguf`` package, and the CPU build's empty device list through a real daemon."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from localai.engines import llama_devices
from localai.engines.engine import LoadOptions
from localai.engines.llama_devices import LoadReport
from localai.engines.placement import DEVICE_RESERVE, Device, DoesNotFit, ModelSizes, Placement, device_bytes, place
from localai.models.gguf_meta import read_metadata
from tests.conftest import Daemon, chat, start_daemon

MiB = 1 << 20
GiB = 1 << 30
SIZES = ModelSizes(layer_bytes=[100 * MiB] * 30, output_bytes=300 * MiB, kv_bytes=30 * 20 * MiB,
                   total_bytes=30 * 100 * MiB + 600 * MiB)  # 300 MiB of token embeddings stay on the CPU


def gpu(free: int, name: str = "Vulkan0") -> Device:
    return Device(name, "test GPU", name.rstrip("0123456789"), "gpu", free, 24 * GiB)


def test_every_layer_fits() -> None:
    placed = place(SIZES, [gpu(20 * GiB)])
    assert (placed.layers, placed.layers_total) == (31, 31)
    assert placed.processor == "100% GPU"
    assert placed.device_bytes == 300 * MiB + 30 * 120 * MiB  # output layer, every layer's weights and KV
    assert placed.devices == [{"name": "Vulkan0", "description": "test GPU", "backend": "Vulkan"}]


@pytest.mark.parametrize("layers", [1, 2, 11, 30])
def test_free_memory_decides_the_layer_count(layers: int) -> None:
    # the output layer goes first (llama.cpp's order), then repeating layers of 120 MiB (weights + KV) each
    needed = 300 * MiB + (layers - 1) * 120 * MiB
    assert device_bytes(SIZES, layers) == needed
    exact = place(SIZES, [gpu(needed + DEVICE_RESERVE)])
    short = place(SIZES, [gpu(needed + DEVICE_RESERVE - 1)])
    assert (exact.layers, short.layers) == (layers, layers - 1)
    assert exact.device_bytes == needed


def test_partial_offload_is_reported_as_ollama_does() -> None:
    placed = place(SIZES, [gpu(300 * MiB + 14 * 120 * MiB + DEVICE_RESERVE)])
    assert placed.layers == 15
    share = round(100 * placed.device_bytes / placed.total_bytes)
    assert placed.processor == f"{100 - share}%/{share}% CPU/GPU" == "53%/47% CPU/GPU"
    assert "15 of 31 layers fit" in placed.reason


def test_nothing_fits_runs_on_the_cpu() -> None:
    placed = place(SIZES, [gpu(DEVICE_RESERVE + 299 * MiB)])
    assert (placed.layers, placed.device_bytes, placed.processor, placed.devices) == (0, 0, "100% CPU", [])
    assert "not one layer fits" in placed.reason


def test_no_device_and_cpu_devices() -> None:
    cpu = Device("CPU", "a CPU", "CPU", "cpu", 64 * GiB, 64 * GiB)
    for devices in ([], [cpu]):
        placed = place(SIZES, devices)
        assert (placed.layers, placed.processor) == (0, "100% CPU")


def test_num_gpu_overrides_free_memory() -> None:
    assert place(SIZES, [gpu(0)], num_gpu=5).layers == 5
    assert place(SIZES, [gpu(100 * GiB)], num_gpu=0).processor == "100% CPU"
    assert place(SIZES, [gpu(0)], num_gpu=999).layers == 31  # more than there are: all of them


def test_overhead_and_several_devices() -> None:
    one = 300 * MiB + 9 * 120 * MiB + DEVICE_RESERVE
    assert place(SIZES, [gpu(one)]).layers == 10
    assert place(SIZES, [gpu(one)], overhead=120 * MiB).layers == 9  # LOCALAI_GPU_OVERHEAD per device
    both = place(SIZES, [gpu(one, "CUDA0"), gpu(10 * 120 * MiB + DEVICE_RESERVE, "CUDA1")])
    assert both.layers == 20
    assert [d["name"] for d in both.devices] == ["CUDA0", "CUDA1"]


def test_a_model_that_does_not_fit_at_all_names_what_would() -> None:
    with pytest.raises(DoesNotFit) as caught:
        place(SIZES, [gpu(1 * GiB)], host_free=2 * GiB)
    message = str(caught.value)
    assert "needs 4.1 GiB (weights 3.5 GiB + KV cache 0.6 GiB)" in message
    assert "free in RAM" in message and "num_ctx" in message
    assert place(SIZES, [gpu(1 * GiB)], host_free=4 * GiB).layers == 2  # GPU + RAM hold it: no error


def test_uniform_sizes_for_a_split_gguf() -> None:
    sizes = ModelSizes.uniform(3100 * MiB, 30, 0)
    assert sizes.layer_bytes == [100 * MiB] * 30 and sizes.output_bytes == 100 * MiB


def test_layer_sizes_match_the_gguf_package(smollm2_path: Path) -> None:
    from gguf import GGUFReader

    meta = read_metadata(smollm2_path)
    reader = GGUFReader(smollm2_path)
    per_layer = [0] * 30
    counts = [0] * 30
    for tensor in reader.tensors:
        if tensor.name.startswith("blk."):
            index = int(tensor.name.split(".")[1])
            per_layer[index] += int(tensor.n_bytes)
            counts[index] += 1
    assert meta.layer_bytes is not None and len(meta.layer_bytes) == 30
    for ours, theirs, count in zip(meta.layer_bytes, per_layer, counts, strict=True):
        assert theirs <= ours < theirs + 32 * count  # each tensor padded to the file's 32-byte alignment
    embeddings = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert not any(t.name == "output.weight" for t in reader.tensors)  # SmolLM2 ties its output to the embeddings
    assert int(embeddings.n_bytes) <= meta.output_bytes < int(embeddings.n_bytes) + 4096


def test_damaged_tensor_offsets_give_no_sizes(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((4, 32), dtype=np.float32))
    writer.add_tensor("output.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_metadata(path)
    assert meta.layer_bytes == [512] and meta.output_bytes == 512
    data = path.read_bytes()
    path.write_bytes(data[:-600])  # the data section cut short: the file is refused, naming it truncated
    with pytest.raises(ValueError, match="truncated"):
        read_metadata(path)
    header_only = tmp_path / "header-only.gguf"  # metadata and no tensors (what tests write for large models)
    writer = gguf.GGUFWriter(header_only, "llama")
    writer.add_block_count(32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert (read_metadata(header_only).layer_bytes, read_metadata(header_only).output_bytes) == (None, 0)


# llama.cpp's own lines (src/llama-model.cpp, llama-kv-cache.cpp, llama-context.cpp), as a Vulkan load said them
VULKAN_LOG = """load_tensors: offloading output layer to GPU
load_tensors: offloading 29 repeating layers to GPU
load_tensors: offloaded 31/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    28.69 MiB
load_tensors:      Vulkan0 model buffer size =    92.09 MiB
llama_kv_cache:    Vulkan0 KV buffer size =    90.00 MiB
llama_context: Vulkan_Host  output buffer size =     0.38 MiB
llama_context:    Vulkan0 compute buffer size =   117.00 MiB
llama_context: Vulkan_Host compute buffer size =     9.01 MiB
"""


def test_llama_cpp_load_report_is_parsed() -> None:
    report = LoadReport()
    for line in VULKAN_LOG.splitlines(keepends=True):
        report.feed(line)
    assert (report.offloaded, report.layers_total) == (31, 31)
    assert report.device_bytes() == int(92.09 * MiB) + int(90.0 * MiB)  # model and KV on Vulkan0, no host buffer
    assert report.device_bytes(("compute",)) == int(117.0 * MiB)
    cpu = LoadReport()
    cpu.feed("load_tensors:   CPU_Mapped model buffer size =    88.02 MiB\n"
             "llama_kv_cache:        CPU KV buffer size =    90.00 MiB\n")
    assert (cpu.offloaded, cpu.device_bytes()) == (None, 0)
    cpu.feed("garbage \x00 line with buffer size = lots MiB\n")  # never raises on what it does not know
    assert cpu.device_bytes() == 0


def test_a_gpu_build_without_its_device_falls_back_with_a_log_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from localai.engines.llama_cpp import LlamaCppEngine

    monkeypatch.setattr(llama_devices, "devices", lambda: [Device("CPU", "a CPU", "CPU", "cpu", GiB, GiB)])
    monkeypatch.setattr(llama_devices, "backends", lambda: ["Vulkan", "CPU"])
    options = LoadOptions("model.gguf", 4096, layer_bytes=[MiB] * 4, output_bytes=MiB, weights_bytes=6 * MiB)
    with caplog.at_level(logging.WARNING, "localai.worker"):
        placed: Placement = LlamaCppEngine._place(None, options)  # type: ignore[arg-type]
    assert (placed.layers, placed.layers_total, placed.processor) == (0, 5, "100% CPU")
    assert "Vulkan backend found no device" in caplog.text and "GGML_VK_VISIBLE_DEVICES=0" in caplog.text


def test_the_cpu_build_lists_no_gpu() -> None:
    found = llama_devices.devices()
    if any(device.offloads for device in found):
        pytest.skip("this llama.cpp has a GPU: the GPU tier (tests/engines/gpu) checks it")
    assert [device.type for device in found] == ["cpu"]
    assert "CPU" in llama_devices.backends()  # beside RPC's, when llama.cpp has its RPC backend


@pytest.fixture
def cpu_daemon(tmp_path: Path, smollm2_path: Path) -> Daemon:
    return start_daemon(tmp_path / "daemon")


def test_ps_show_and_info_report_the_cpu(cpu_daemon: Daemon) -> None:
    with cpu_daemon:
        if any(device.offloads for device in llama_devices.devices()):
            pytest.skip("this llama.cpp has a GPU: the GPU tier (tests/engines/gpu) checks it")
        chat(cpu_daemon, [{"role": "user", "content": "Hi"}], max_tokens=2)
        (model,) = cpu_daemon.get("/api/ps").json()["models"]
        assert (model["size_vram"], model["processor"]) == (0, "100% CPU")
        assert model["placement"]["layers"] == 0 and model["placement"]["devices"] == []
        shown = cpu_daemon.request("POST", "/api/show", json={"model": "smollm2"}).json()
        assert shown["placement"]["processor"] == "100% CPU"
        info = cpu_daemon.get("/api/info", params={"model": "smollm2"}).json()
        assert "CPU" in info["llama_cpp"]["backends"] and not info["llama_cpp"]["gpu_offload"]
        assert info["model"]["engine"] == "llama.cpp" and info["model"]["placement"]["layers_total"] == 31
        assert info["model"]["loaded"]["processor"] == "100% CPU"
        printed = cpu_daemon.cli("ps")
        assert "100% CPU" in printed.stdout, printed
        described = cpu_daemon.cli("info", "smollm2")
        assert described.returncode == 0 and "backends: " in described.stdout, described
        assert "CPU" in described.stdout.split("backends: ")[1].splitlines()[0]
        assert "(no GPU offload)" in described.stdout  # RPC's backend is no local GPU
        assert "RPC            built in: `localai rpc-server` serves this machine" in described.stdout
        missing = cpu_daemon.cli("info", "no-such-model")
        assert missing.returncode != 0 and "no-such-model" in missing.stderr


# A mixture of experts: 30 layers of 100 MiB, 80 MiB of them expert tensors
MOE = ModelSizes(layer_bytes=[100 * MiB] * 30, output_bytes=300 * MiB, kv_bytes=30 * 20 * MiB,
                 total_bytes=30 * 100 * MiB + 600 * MiB, expert_bytes=[80 * MiB] * 30)


@pytest.mark.parametrize("kept", [1, 7, 30])
def test_a_mixture_of_experts_keeps_its_first_layers_experts_on_the_cpu_before_moving_layers(kept: int) -> None:
    """As llama.cpp's --n-cpu-moe: every layer on the GPU, the expert tensors of as few first layers as it takes
    kept on the CPU (attention and shared weights run on every token; a token's few experts run fine on the CPU)."""
    whole = device_bytes(MOE, 31)
    needed = whole - kept * 80 * MiB
    assert device_bytes(MOE, 31, kept) == needed
    exact = place(MOE, [gpu(needed + DEVICE_RESERVE)])
    short = place(MOE, [gpu(needed + DEVICE_RESERVE - 1)])
    assert (exact.layers, exact.cpu_moe, exact.device_bytes) == (31, kept, needed)
    assert short.cpu_moe == kept + 1 or (kept == 30 and short.layers < 31)
    assert exact.processor != "100% GPU" and exact.experts == f"experts of {kept}/30 layers on the CPU"
    assert f"the experts of {kept} of 30 layers on the CPU" in exact.reason
    assert exact.report()["experts"] == exact.experts


def test_when_every_layers_experts_on_the_cpu_is_not_enough_whole_layers_move_too() -> None:
    # every expert on the CPU leaves 20 MiB of weights + 20 MiB of KV per layer and the 300 MiB output layer
    room = 300 * MiB + 10 * 40 * MiB
    placed = place(MOE, [gpu(room + DEVICE_RESERVE)])
    assert (placed.layers, placed.cpu_moe) == (11, 30)
    assert placed.device_bytes == room


def test_num_cpu_moe_sets_it_and_a_dense_model_has_no_experts() -> None:
    assert place(MOE, [gpu(40 * GiB)]).cpu_moe == 0  # it all fits: nothing kept back
    asked = place(MOE, [gpu(40 * GiB)], num_cpu_moe=12)
    assert (asked.layers, asked.cpu_moe, asked.reason) == (31, 12, "num_cpu_moe 12")
    assert asked.device_bytes == device_bytes(MOE, 31) - 12 * 80 * MiB
    both = place(MOE, [gpu(40 * GiB)], num_gpu=10, num_cpu_moe=25)  # layers 21-29 offloaded; 21-24 keep experts
    assert both.device_bytes == device_bytes(MOE, 10) - 4 * 80 * MiB
    dense = place(SIZES, [gpu(300 * MiB + DEVICE_RESERVE)], num_cpu_moe=5)
    assert (dense.cpu_moe, dense.layers_moe, dense.experts) == (0, 0, "")
    assert place(MOE, []).experts == "experts on the CPU"


def test_the_experts_are_read_from_the_file(arch_fixtures: Path) -> None:
    for name in ("qwen3moe", "gpt-oss", "glm4moe", "qwen35moe", "qwen3next", "deepseek2"):
        meta = read_metadata(arch_fixtures / f"{name}.gguf")
        assert meta.expert_bytes and meta.layer_bytes and all(
            expert <= layer for expert, layer in zip(meta.expert_bytes, meta.layer_bytes, strict=True)), name
    for name in ("llama", "qwen35", "nemotron_h"):
        assert read_metadata(arch_fixtures / f"{name}.gguf").expert_bytes is None
