"""The GPU tier (``make test-gpu``): runs on whatever device the installed llama.cpp offloads to (Mesa's llvmpipe
through Vulkan on a machine without a GPU, a real GPU elsewhere). Without one the tests skip, unless
``GPU_TIER_REQUIRED=1`` (``make test-gpu`` sets it): there a missing device is a failure.

``GPU_TEST_GGUF`` runs the tier on another GGUF than SmolLM2-135M (the lent GPU machine, which cannot be sent the
98 MB file, gets a cut-down copy of it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localai.engines import llama_devices
from localai.engines.placement import Device


@pytest.fixture(scope="session")
def gpu() -> Device:
    found = [device for device in llama_devices.devices() if device.offloads]
    if not found:
        message = (f"llama.cpp finds no GPU (backends: {', '.join(llama_devices.backends())}); for Mesa's llvmpipe "
                   "set GGML_VK_VISIBLE_DEVICES=0; `make test-gpu` builds a Vulkan llama.cpp")
        if os.environ.get("GPU_TIER_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


@pytest.fixture(scope="session")
def gguf_path(gpu: Device, request: pytest.FixtureRequest) -> Path:
    if os.environ.get("GPU_TEST_GGUF"):
        return Path(os.environ["GPU_TEST_GGUF"])
    path: Path = request.getfixturevalue("smollm2_path")
    return path
