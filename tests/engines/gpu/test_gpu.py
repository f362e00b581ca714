"""The GPU path on a real device: placement by free memory carried out by llama.cpp and reported exactly, the
prompt cache's state round trip with the KV cache on the device (and after a restart), greedy answers close to the
CPU's, and a device that disappears falling back to the CPU."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import httpx
import llama_cpp as L
import numpy as np
import pytest

from localai.engines import llama_devices
from localai.engines.engine import BatchItem, LoadOptions
from localai.engines.llama_cpp import LlamaCppEngine
from localai.engines.placement import DEVICE_RESERVE, Device, ModelSizes, device_bytes
from localai.models.gguf_meta import read_metadata
from localai.promptcache.blocks import BLOCK_TOKENS
from tests.conftest import Daemon, start_daemon

pytestmark = pytest.mark.gpu
PROMPT = ("You are a careful assistant. Summarize the following notes about the build in two sentences. "
          "The parser reads the header, the tensors are mapped, the layers are placed on the device, the KV cache "
          "is allocated beside them, and the prompt is evaluated in batches of up to 512 tokens. ") * 4


def options(path: Path, **extra: Any) -> LoadOptions:
    meta = read_metadata(path)
    return LoadOptions(model_path=str(path), num_ctx=1024, n_parallel=3, n_threads=os.cpu_count() or 2,
                       layer_bytes=meta.layer_bytes, output_bytes=meta.output_bytes,
                       weights_bytes=path.stat().st_size, **extra)


def prefill(engine: LlamaCppEngine, seq: int, tokens: list[int], logits_from: int | None = None) -> None:
    """Evaluate ``tokens`` into ``seq``; logits for every position from ``logits_from`` (default: the last)."""
    first = len(tokens) - 1 if logits_from is None else logits_from
    for at in range(0, len(tokens), engine.n_batch):
        chunk = tokens[at:at + engine.n_batch]
        engine.decode([BatchItem(seq, t, at + i, at + i >= first) for i, t in enumerate(chunk)])


def argmax(engine: LlamaCppEngine, row: int) -> int:
    n_vocab = int(L.llama_vocab_n_tokens(engine.vocab))
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(engine.ctx, row), shape=(n_vocab,))
    return int(np.argmax(logits))


def greedy(engine: LlamaCppEngine, seq: int, tokens: list[int], count: int) -> list[int]:
    prefill(engine, seq, tokens)
    out = [argmax(engine, -1)]
    for step in range(count - 1):
        engine.decode([BatchItem(seq, out[-1], len(tokens) + step, True)])
        out.append(argmax(engine, 0))
    return out


@pytest.fixture(scope="module")
def on_device(gguf_path: Path) -> LlamaCppEngine:
    return LlamaCppEngine(options(gguf_path))


def test_every_layer_on_the_device_as_llama_cpp_reports_it(on_device: LlamaCppEngine, gpu: Device) -> None:
    placed = on_device.placement
    assert placed.layers == placed.layers_total == len(on_device.options.layer_bytes or []) + 1
    assert placed.processor == "100% GPU"
    assert [d["name"] for d in placed.devices] == [gpu.name]
    estimate = device_bytes(ModelSizes(on_device.options.layer_bytes or [], on_device.options.output_bytes, 0,
                                       on_device.options.weights_bytes), placed.layers)
    # llama.cpp's own buffers (weights + KV on the device) against the GGUF's sizes: the weights part agrees
    assert placed.device_bytes > estimate * 0.95, (placed.device_bytes, estimate)


def test_free_memory_injected_picks_the_layer_count(gguf_path: Path, gpu: Device,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    base = options(gguf_path, kv_bytes=64 << 20)
    sizes = ModelSizes(base.layer_bytes or [], base.output_bytes, base.kv_bytes, base.weights_bytes)
    wanted = 7
    free = DEVICE_RESERVE + device_bytes(sizes, wanted) + 1000  # room for 7 layers, not 8
    assert device_bytes(sizes, wanted + 1) > free - DEVICE_RESERVE
    injected = Device(gpu.name, gpu.description, gpu.backend, gpu.type, free, gpu.total)
    monkeypatch.setattr(llama_devices, "devices", lambda: [injected])
    engine = LlamaCppEngine(base)
    placed = engine.placement
    assert (placed.layers, placed.layers_total) == (wanted, len(sizes.layer_bytes) + 1)  # as llama.cpp logged it
    share = round(100 * placed.device_bytes / placed.total_bytes)
    assert placed.processor == f"{100 - share}%/{share}% CPU/GPU"
    assert 0 < placed.device_bytes < placed.total_bytes


def test_the_cache_state_round_trips_bit_for_bit_with_the_kv_on_the_device(
        on_device: LlamaCppEngine, gguf_path: Path) -> None:
    engine = on_device
    tokens = engine.tokenize(PROMPT)[:300]
    for seq in range(3):
        engine.seq_clear(seq)
    prefill(engine, 1, tokens)
    state = bytes(engine.seq_state(1))
    ranges = [(a, min(a + BLOCK_TOKENS, len(tokens))) for a in range(0, len(tokens), BLOCK_TOKENS)]
    layout, pieces, rest = engine.state_split(state, len(tokens), ranges) or ({}, [], b"")
    assert len(pieces) == len(ranges) and rest == b""
    assert engine.state_join(layout, pieces, [b - a for a, b in ranges], rest) == state
    # the carving is the CPU's: the same layout from a CPU-only engine on the same model
    cpu = LlamaCppEngine(options(gguf_path, num_gpu=0))
    prefill(cpu, 1, tokens)
    cpu_layout, cpu_pieces, _ = cpu.state_split(bytes(cpu.seq_state(1)), len(tokens), ranges) or ({}, [], b"")
    assert cpu_layout == layout and [len(p) for p in cpu_pieces] == [len(p) for p in pieces]
    # restored on the device after the sequence is cleared: it reads back identical and continues identically
    n_vocab = int(L.llama_vocab_n_tokens(engine.vocab))
    engine.decode([BatchItem(1, tokens[-1], len(tokens), True)])
    original = np.ctypeslib.as_array(L.llama_get_logits_ith(engine.ctx, 0), shape=(n_vocab,)).copy()
    engine.seq_clear(1)
    assert engine.seq_restore(1, bytearray(state))
    assert bytes(engine.seq_state(1)) == state
    engine.decode([BatchItem(1, tokens[-1], len(tokens), True)])
    again = np.ctypeslib.as_array(L.llama_get_logits_ith(engine.ctx, 0), shape=(n_vocab,))
    assert np.array_equal(original, again)


def test_greedy_answers_agree_with_the_cpu(on_device: LlamaCppEngine, gguf_path: Path) -> None:
    """Top-1 agreement of the device with the CPU at each position of the CPU's own greedy answer (teacher forced,
    so one split does not derail the rest): >= 95%."""
    cpu = LlamaCppEngine(options(gguf_path, num_gpu=0))
    tokens = cpu.tokenize(PROMPT)[:200]
    answer = greedy(cpu, 0, tokens, 40)
    on_device.seq_clear(2)
    prefill(on_device, 2, tokens + answer[:-1], logits_from=len(tokens) - 1)
    assert len(tokens) + len(answer) <= on_device.n_batch  # one batch: its rows are the batch's positions
    picked = [argmax(on_device, len(tokens) - 1 + i) for i in range(len(answer))]
    agree = sum(a == b for a, b in zip(answer, picked, strict=True)) / len(answer)
    print(f"top-1 agreement with the CPU: {agree:.1%} of {len(answer)} positions")
    assert agree >= 0.95


def create(daemon: Daemon, path: Path) -> None:
    response = daemon.request("POST", "/api/create", json={"model": "gpumodel", "from": str(path)})
    assert response.status_code == 200, response.text


def ask(daemon: Daemon, **options: Any) -> dict[str, Any]:
    body = {"model": "gpumodel", "messages": [{"role": "system", "content": PROMPT},
                                               {"role": "user", "content": "Two sentences, please."}],
            "stream": False, "options": {"temperature": 0, "num_predict": 6, **options}}
    with httpx.Client(base_url=daemon.base_url, timeout=600) as http:
        response = http.post("/api/chat", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def loaded(daemon: Daemon) -> dict[str, Any]:
    (model,) = daemon.get("/api/ps").json()["models"]
    return dict(model)


def test_ps_info_and_show_report_real_offload(tmp_path: Path, gguf_path: Path, gpu: Device) -> None:
    with start_daemon(tmp_path / "home", load_timeout="600") as daemon:
        create(daemon, gguf_path)
        ask(daemon)
        model = loaded(daemon)
        placement = model["placement"]
        assert model["processor"] == "100% GPU" and placement["layers"] == placement["layers_total"] > 1
        assert model["size_vram"] == placement["device_bytes"] > 0
        assert placement["devices"][0]["name"] == gpu.name
        shown = daemon.request("POST", "/api/show", json={"model": "gpumodel"}).json()
        assert shown["placement"]["processor"] == "100% GPU"
        printed = daemon.cli("ps")
        assert "100% GPU" in printed.stdout, printed
        info = daemon.cli("info", "gpumodel")
        assert gpu.backend in info.stdout and gpu.name in info.stdout, info
        assert "100% GPU" in info.stdout, info.stdout
        print(printed.stdout, info.stdout, sep="\n")

        ask(daemon, num_gpu=10)  # a load option: the model reloads with 10 layers offloaded
        partial = loaded(daemon)
        assert re.fullmatch(r"\d+%/\d+% CPU/GPU", partial["processor"]), partial
        assert partial["placement"]["layers"] == 10
        assert 0 < partial["size_vram"] < model["size_vram"]
        print(daemon.cli("ps").stdout)


def test_restore_after_a_restart_with_the_kv_on_the_device(tmp_path: Path, gguf_path: Path) -> None:
    home = tmp_path / "home"
    with start_daemon(home, load_timeout="600") as daemon:
        create(daemon, gguf_path)
        first = ask(daemon)
        assert loaded(daemon)["processor"] == "100% GPU"
    with start_daemon(home, load_timeout="600") as daemon:
        again = ask(daemon)
        assert again["prompt_eval_count"] == first["prompt_eval_count"]
        assert again["prompt_cache_count"] > 0, again  # restored from the disk cache, written by the first daemon
        assert again["message"]["content"] == first["message"]["content"]


def test_a_device_that_disappears_falls_back_to_the_cpu(tmp_path: Path, gguf_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "")  # Vulkan: no device index given, none used
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with start_daemon(tmp_path / "home", load_timeout="600") as daemon:
        create(daemon, gguf_path)
        answer = ask(daemon, num_predict=2)
        assert answer["done"]
        model = loaded(daemon)
        assert (model["processor"], model["size_vram"]) == ("100% CPU", 0)
        log = (daemon.home / "logs" / "workers.log").read_text()
        assert "found no device" in log and "running on the CPU" in log, log[-2000:]


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_a_mixture_of_experts_keeps_experts_on_the_cpu_before_layers(arch_fixtures: Path, name: str, gpu: Device,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE fixture with free memory injected so every layer fits only with the first layer's experts in host
    memory: llama.cpp keeps them there (its own buffer report), every layer is offloaded, the reports say where the
    experts are, and the answer agrees with the CPU's."""
    path = arch_fixtures / f"{name}.gguf"
    meta = read_metadata(path)
    base = options(path, kv_bytes=0, expert_bytes=meta.expert_bytes)
    sizes = ModelSizes(base.layer_bytes or [], base.output_bytes, 0, base.weights_bytes, meta.expert_bytes)
    whole = device_bytes(sizes, len(sizes.layer_bytes) + 1)
    free = DEVICE_RESERVE + whole - 1  # not everything: one layer's experts stay on the CPU
    injected = Device(gpu.name, gpu.description, gpu.backend, gpu.type, free, gpu.total)
    monkeypatch.setattr(llama_devices, "devices", lambda: [injected])
    engine = LlamaCppEngine(base)
    placed = engine.placement
    assert (placed.layers, placed.cpu_moe) == (placed.layers_total, 1), placed
    assert placed.experts == f"experts of 1/{placed.layers_moe} layers on the CPU"
    host = sum(size for key, size in engine.load_report.buffers.items()
               if key.split()[1] == "model" and key.startswith("CPU"))
    assert host >= (meta.expert_bytes or [0])[0] * 0.9, engine.load_report.buffers  # the experts, in host memory
    cpu = LlamaCppEngine(options(path, num_gpu=0))
    tokens = cpu.tokenize(PROMPT)[:100]
    assert greedy(cpu, 0, tokens, 6) == greedy(engine, 0, tokens, 6)
