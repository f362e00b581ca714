import os
from pathlib import Path

import pytest

from localai.errors import ModelfileError, ModelNotFound
from localai.models.modelfile import parse
from localai.models.registry import EMBEDDED_MODEL, Registry, normalize


@pytest.fixture
def registry(isolated_home: Path) -> Registry:
    return Registry.open()


def test_embedded_model_registers_in_place(registry: Registry, smollm2_path: Path) -> None:
    record = registry.ensure_embedded()
    assert record is not None and record.name == EMBEDDED_MODEL
    assert record.path == str(smollm2_path)  # referenced, not copied
    assert record.context_length == 8192 and record.quantization == "Q4_1" and record.family == "llama"
    assert len(record.sha256) == 64
    assert registry.get("smollm2").name == EMBEDDED_MODEL  # the alias
    assert registry.get("SmolLM2:latest").name == EMBEDDED_MODEL
    assert registry.ensure_embedded() is None  # nothing changed: no second registration


def test_unknown_model_names_the_fix(registry: Registry) -> None:
    with pytest.raises(ModelNotFound) as error:
        registry.get("qwen2.5-coder")
    assert "localai pull qwen2.5-coder:1.5b" in error.value.message  # a family: its sizes


@pytest.mark.parametrize(("name", "said"), [
    ("qwen2.5-coder:1.5b", "run: localai pull qwen2.5-coder:1.5b"),
    ("bartowski/Some-Model-GGUF:Q4_K_M", "run: localai pull bartowski/Some-Model-GGUF:Q4_K_M"),
    ("qwen3", "qwen3 comes in 1.7b, 4b"),
    ("qwen2.5-coder:99b", "the library has no qwen2.5-coder:99b; qwen2.5-coder comes in 1.5b"),
    ("nosuch", "it is not in the library either: `localai list` shows the installed models, `localai list --library`"),
])
def test_a_missing_model_is_offered_a_pull_only_when_pull_knows_it(registry: Registry, name: str, said: str) -> None:
    with pytest.raises(ModelNotFound) as error:
        registry.get(name)
    assert said in error.value.message
    if said.startswith("it is not"):
        assert f"localai pull {name}" not in error.value.message


def test_create_from_model_inherits_and_overrides(registry: Registry) -> None:
    registry.ensure_embedded()
    record = registry.create("terse", parse('FROM smollm2\nPARAMETER temperature 0\nSYSTEM """Be terse."""\n'))
    assert record.name == "terse:latest"
    assert record.parameters["temperature"] == 0
    assert record.parameters["num_predict"] == 256  # inherited from smollm2's Modelfile
    assert record.system == "Be terse."


def test_create_from_gguf_path(registry: Registry, smollm2_path: Path) -> None:
    record = registry.create("direct:v1", parse(f"FROM {smollm2_path}\n"))
    assert record.path == str(smollm2_path) and record.size == smollm2_path.stat().st_size


def test_create_rejects_missing_and_non_gguf_files(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(ModelfileError, match="no such file"):
        registry.create("x", parse(f"FROM {tmp_path / 'missing.gguf'}\n"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(ModelfileError, match="not a GGUF file"):
        registry.create("x", parse(f"FROM {bogus}\n"))
    with pytest.raises(ModelfileError, match=r"neither a GGUF file, an http\(s\) URL of a remote model nor an"):
        registry.create("x", parse("FROM nothing-like-this\n"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for special in ("/dev/zero", str(fifo), str(tmp_path)):  # endless, blocking on open, a folder: never read
        with pytest.raises(ModelfileError, match="not a model file"):
            registry.create("x", parse(f"FROM {special}\n"))
    assert registry.names() == []


def test_copy_and_remove(registry: Registry) -> None:
    registry.ensure_embedded()
    registry.copy("smollm2", "mine")
    assert registry.get("mine").sha256 == registry.get("smollm2").sha256
    assert registry.remove("mine") == ["mine:latest"]
    assert set(registry.remove(EMBEDDED_MODEL)) == {EMBEDDED_MODEL, "smollm2:latest"}
    with pytest.raises(ModelNotFound):
        registry.remove("mine")


def test_normalize() -> None:
    assert normalize("Qwen") == "qwen:latest"
    assert normalize("hf.co/a/b:Q4_K_M") == "hf.co/a/b:q4_k_m"
    assert normalize("hf.co/a/b") == "hf.co/a/b:latest"
