import pytest

from localai import paths
from localai.settings import Settings, parse_duration, parse_host


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5m", 300), ("300", 300), ("1h30m", 5400), ("-1", -1), ("0", 0), ("250ms", 0.25), (12, 12),
     ("7d", 604800), ("1d12h", 129600)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5 minutes", "m5", "1w", "100000000h", "4000d", 1e400, 10**400, float("nan"),
                                  -(10**12)])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:9000", ("127.0.0.1", 9000)), ("http://localhost:8080", ("localhost", 8080)),
     ("0.0.0.0", ("0.0.0.0", 11435)), ("[::1]:7", ("::1", 7))],
)
def test_hosts(text: str, expected: tuple[str, int]) -> None:
    assert parse_host(text) == expected


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALAI_KEEP_ALIVE", "10m")
    monkeypatch.setenv("LOCALAI_ORIGINS", "http://a.test, http://b.test")
    monkeypatch.setenv("LOCALAI_MAX_QUEUE", "7")
    settings = Settings()
    assert settings.keep_alive == 600
    assert settings.origins == ["http://a.test", "http://b.test"]
    assert settings.max_queue == 7
    assert settings.bind == ("127.0.0.1", 11435)


def test_invalid_environment_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALAI_MAX_QUEUE", "zero")
    with pytest.raises(ValueError):
        Settings()


def test_paths_follow_localai_home_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LOCALAI_HOME", str(tmp_path / "a"))
    assert paths.socket_path() == tmp_path / "a" / "localai.sock"
    monkeypatch.setenv("LOCALAI_HOME", str(tmp_path / "b"))
    assert paths.database_path() == tmp_path / "b" / "localai.db"


def test_min_free_space(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().min_free_space == 1 << 30
    monkeypatch.setenv("LOCALAI_MIN_FREE_SPACE", "0")
    assert Settings().min_free_space == 0
    monkeypatch.setenv("LOCALAI_MIN_FREE_SPACE", "-1")
    with pytest.raises(ValueError):
        Settings()


def test_cpu_repack_is_off_by_default_only_where_llama_cpp_has_amx_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from localai.engines.engine import LoadOptions
    from localai.engines.llama_cpp import repacks_weights
    from localai.models.loading import load_options
    from localai.models.registry import ModelRecord

    amx = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |"
    plain = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | REPACK = 1 |"
    assert not repacks_weights("auto", amx) and repacks_weights("auto", plain)
    assert repacks_weights("on", amx) and not repacks_weights("off", plain)
    assert Settings().cpu_repack == "auto"
    monkeypatch.setenv("LOCALAI_CPU_REPACK", "off")
    assert Settings().cpu_repack == "off"
    monkeypatch.setenv("LOCALAI_CPU_REPACK", "sometimes")
    with pytest.raises(ValueError, match="cpu_repack"):
        Settings()
    monkeypatch.setenv("LOCALAI_CPU_REPACK", "on")
    record = ModelRecord(name="m", source="m.gguf", path="/m.gguf", format="gguf", sha256="", size=1, family="llama",
                         quantization="Q4_1", parameter_size="135M", context_length=8192)
    assert LoadOptions(**load_options(record, Settings())).cpu_repack == "on"  # what the worker is given
