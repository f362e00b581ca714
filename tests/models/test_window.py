"""The context-window rule (models/loading.py): the largest window up to the trained context whose KV cache fits
the memory left after the weights, f16 or q8_0 KV where that is what makes an agent's 64k fit, advice where even
32k does not; read from metadata-only GGUFs of today's coding models (their weights are not reachable here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localai.models.loading import AGENT_WINDOW, attention_of, fit_window, window
from localai.models.registry import ModelRecord
from localai.settings import Settings
from tests.metagguf import metadata_gguf

GiB = 1 << 30
# (architecture, layers, KV heads, key size, value size, sliding window, weights in bytes), from the models'
# published configs. GLM-4.7-Flash converts as deepseek2 with latent attention: one KV "head" of the latent (512) and
# the rotary part (64), no V cache.
MODELS = {
    "qwen3-coder:30b": ("qwen3moe", 48, 4, 128, 128, 0, int(18.6e9)),
    "gpt-oss:20b": ("gpt-oss", 24, 8, 64, 64, 128, int(13.8e9)),
    "glm-4.7-flash": ("deepseek2", 47, 1, 576, 512, 0, int(18.0e9)),
}


@pytest.fixture(params=list(MODELS))
def record(request: pytest.FixtureRequest, tmp_path: Path) -> ModelRecord:
    arch, layers, kv_heads, head, value, window_size, size = MODELS[request.param]
    extra = {f"{arch}.attention.sliding_window": window_size} if window_size else {}
    if arch == "deepseek2":
        extra = {f"{arch}.attention.key_length_mla": 256, f"{arch}.attention.value_length_mla": 256}
    path = metadata_gguf(tmp_path / "m.gguf", arch=arch, context_length=262144, layers=layers, kv_heads=kv_heads,
                         head_dim=head, value_dim=value, extra=extra)
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
    shape = attention_of(record)
    assert shape is not None
    for extra in (2.5, 3, 4, 8, 16, 64):  # GiB free beside the weights
        free = int(record.size + extra * GiB)
        fitted = fit_window(record, settings(), available=free)
        sizes.append(fitted.num_ctx)
        assert fitted.total_bytes() <= free  # it never plans past the memory it was given
        if fitted.kv_type == "q8_0":  # only when f16 would have left the agent short of 64k
            assert shape.tokens_within(free - record.size - max(GiB, free // 10), "f16") < AGENT_WINDOW
            assert fitted.num_ctx >= AGENT_WINDOW
    # more memory, a larger window (q8_0 KV may give more tokens just below where f16 first holds 64k: past 64k
    # the rule keeps f16's precision)
    kinds = [fit_window(record, settings(), available=int(record.size + e * GiB)).kv_type
             for e in (2.5, 3, 4, 8, 16, 64)]
    for kind in ("f16", "q8_0"):
        same = [size for size, k in zip(sizes, kinds, strict=True) if k == kind]
        assert same == sorted(same)
    assert sizes[-1] > sizes[0]


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


def gguf_record(path: Path) -> ModelRecord:
    return ModelRecord(name=path.stem, source="test", path=str(path), format="gguf", sha256="0" * 64, size=1,
                       family="", quantization="Q4_K_M", parameter_size="", context_length=131072)


def test_latent_attention_keeps_no_values_and_sliding_layers_keep_their_window(tmp_path: Path) -> None:
    """GLM-4.7-Flash (deepseek2, latent attention): llama.cpp allocates K only, 576 wide; gpt-oss slides every
    other layer over 128 tokens (llama.cpp's patterns), and a file's own pattern overrides the architecture's."""
    glm = metadata_gguf(tmp_path / "glm.gguf", arch="deepseek2", context_length=202752, layers=47, kv_heads=1,
                        head_dim=576, value_dim=512, extra={"deepseek2.attention.key_length_mla": 256,
                                                            "deepseek2.attention.value_length_mla": 256})
    shape = attention_of(gguf_record(glm))
    assert shape is not None and shape.bytes_per_token() == 47 * 576 * 2
    oss = metadata_gguf(tmp_path / "oss.gguf", arch="gpt-oss", context_length=131072, layers=24, kv_heads=8,
                        head_dim=64, extra={"gpt-oss.attention.sliding_window": 128})
    shape = attention_of(gguf_record(oss))
    assert shape is not None and shape.sliding_share == 0.5
    assert shape.kv_bytes(131072) == 24 * 8 * 128 * 2 * (131072 / 2 + 768 / 2)  # the window and a micro-batch
    own = metadata_gguf(tmp_path / "own.gguf", arch="gpt-oss", context_length=131072, layers=24, kv_heads=8,
                        head_dim=64, extra={"gpt-oss.attention.sliding_window": 128,
                                            "gpt-oss.attention.sliding_window_pattern": 4})
    shape = attention_of(gguf_record(own))
    assert shape is not None and shape.sliding_share == 0.75
