"""Fixtures the engine tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as L
import pytest


@pytest.fixture(scope="module")
def vocab(smollm2_path: Path) -> Iterator[Any]:
    """smollm2's vocabulary (llama.cpp's own), for grammars and tokens checked against the real tokenizer."""
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(smollm2_path).encode(), L.llama_model_default_params())
    yield L.llama_model_get_vocab(model)
    L.llama_model_free(model)
