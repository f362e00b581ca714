"""The context-window rule (models/loading.py): the largest window up to the trained context whose KV cache fits
the memory left after the weights, f16 or q8_0 KV where that is what makes an agent's 64k fit, advice where even
32k does not; read from metadata-only GGUFs of today's coding models (their weights are not reachable here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localai.models.loading import AGENT_WINDOW, attention_of, fit_window, kv_bytes, window
from localai.models.registry import ModelRecord
from localai.settings import Settings
from tests.metagguf import metadata_gguf

GiB = 1 << 30
# (architecture, layers, KV heads, head size, sliding window, weights in bytes), from the models' published configs
MODELS = {
    "qwen3-coder:30b": ("qwen3moe", 48, 4, 128, 0, int(18.6e9)),
    "gpt-oss:20b": ("gpt-oss", 24, 8, 64, 128, int(13.8e9)),
    "glm-4.7-flash": ("glm4moe", 47, 8, 128, 0, int(18.0e9)),
}


@pytest.fixture(params=list(MODELS))
def record(request: pytest.FixtureRequest, tmp_path: Path) -> ModelRecord:
    arch, layers, kv_heads, head, window_size, size = MODELS[request.param]
    extra = {f"{arch}.attention.sliding_window": window_size} if window_size else {}
    path = metadata_gguf(tmp_path / "m.gguf", arch=arch, context_length=262144, layers=layers, kv_heads=kv_heads,
                         head_dim=head, extra=extra)
    return ModelRecord(name=request.param, source="test", path=str(path), format="gguf", sha256="0" * 64, size=size,
                       family=arch, quantization="Q4_K_M", parameter_size="30B", context_length=262144)


def settings(**values: object) -> Settings:
    return Settings(num_parallel=1, **values)  # type: ignore[arg-type]


def test_a_machine_with_room_gets_the_trained_context(record: ModelRecord) -> None:
    fitted = fit_window(record, settings(), available=512 * GiB)
    assert (fitted.num_ctx, fitted.kv_type, fitted.advice) == (262144, "f16", "")
    assert fitted.kv_bytes > 0 and fitted.total_bytes() == record.size + fitted.kv_bytes


def test_the_window_is_the_largest_that_fits_and_q8_kv_where_that_makes_64k_fit(record: ModelRecord) -> None:
    sizes = []
    for free in (24, 32, 40, 48, 64, 96):
        fitted = fit_window(record, settings(), available=free * GiB)
        sizes.append(fitted.num_ctx)
        assert fitted.total_bytes() <= free * GiB  # it never plans past the memory it was given
        per_f16 = kv_bytes(attention_of(record), 1024, 1, "f16")
        if fitted.kv_type == "q8_0":  # only when f16 would have left the agent short of 64k
            assert (free * GiB - record.size - max(GiB, free * GiB // 10)) // (per_f16 // 1024) < AGENT_WINDOW
            assert fitted.num_ctx >= AGENT_WINDOW
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]  # more memory, a larger window


def test_where_even_32k_does_not_fit_it_says_how_to_make_room(record: ModelRecord) -> None:
    fitted = fit_window(record, settings(), available=record.size + 2 * GiB)
    assert fitted.num_ctx < 32768
    assert "smaller quantization" in fitted.advice and "num_ctx" in fitted.advice


def test_sequences_share_the_memory(record: ModelRecord) -> None:
    one = fit_window(record, settings(), available=64 * GiB)
    four = fit_window(record, Settings(num_parallel=4), available=64 * GiB)
    assert four.num_ctx < one.num_ctx or one.num_ctx == 262144


def test_num_ctx_and_the_setting_win_over_the_fit(record: ModelRecord) -> None:
    assert window(record, settings(), {"num_ctx": 40000}).num_ctx == 40000
    assert window(record, settings(), {"num_ctx": 10**7}).num_ctx == 262144  # never past the trained context
    assert window(record, settings(context_length=16384)).num_ctx == 16384
    assert window(record, settings(), available=512 * GiB).chosen_by == "memory"
