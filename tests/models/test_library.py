"""The library of Modelfiles: every entry is valid, names resolve, errors list what exists."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from localai import paths
from localai.errors import InvalidRequest, ModelNotFound
from localai.models import hub, library
from localai.models.modelfile import parse_file
from localai.models.registry import PACKAGE_SOURCE

ROOT = paths.library_modelfiles_dir()


def test_the_library_has_a_dozen_laptop_models_each_complete() -> None:
    entries = library.entries()
    assert len(entries) >= 12
    assert {"qwen2.5-coder:1.5b", "qwen2.5-coder:7b", "qwen3:4b", "llama3.2:1b", "llama3.2:3b", "gemma3:4b",
            "phi4-mini:3.8b", "mistral:7b", "deepseek-coder:6.7b", "smollm2:135m", "qwen3-coder:30b", "gpt-oss:20b",
            "glm-4.7-flash:30b", "devstral-small-2:24b", "qwen3:4b-instruct-2507",
            "bge-reranker-v2-m3:568m"} <= {e.name for e in entries}
    assert library.rerankers() == ["bge-reranker-v2-m3:568m"]  # what a chat model asked to rerank points to
    for entry in entries:
        modelfile = parse_file(entry.path)
        assert entry.description, entry.name
        assert modelfile.parameters.get("stop") or entry.reranker, entry.name  # a reranker does not generate
        if modelfile.from_.startswith(PACKAGE_SOURCE):
            continue  # the embedded model: its trained context (8192) is its context
        # no window in the library: the memory rule gives each machine the largest it holds (an agent needs 64k)
        assert "num_ctx" not in modelfile.parameters, entry.name
        stated = re.search(r"Trained context: \d+", entry.path.read_text())  # the TUI's library table shows it
        assert stated or entry.tag.endswith(library.MLX_TAG_SUFFIX), entry.name
        assert hub.is_hub_reference(modelfile.from_), entry.name
        ref = hub.parse_reference(modelfile.from_)
        if not entry.tag.endswith(library.MLX_TAG_SUFFIX):  # MLX sources are 4-bit builds: a repository each
            assert ref.quant == "Q4_K_M", entry.name  # laptop-sized and present in every such repository


def test_every_library_family_ships_in_the_wheel() -> None:
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["localai.modelfiles"]
    for entry in library.entries():
        assert any(fnmatch.fnmatch(entry.path.relative_to(ROOT).as_posix(), pattern) for pattern in shipped), entry


@pytest.mark.parametrize(
    ("relative", "name"),
    [("pirate.Modelfile", "pirate:latest"), ("Pirate/V2.Modelfile", "pirate:v2"), ("a/b/c.Modelfile", None),
     ("notes.txt", None), ("my model.Modelfile", None), (".Modelfile", None), ("x/.Modelfile", None)],
)
def test_modelfile_names(tmp_path: Path, relative: str, name: str | None) -> None:
    assert library.modelfile_name(tmp_path, tmp_path / relative) == name


def test_resolve() -> None:
    assert library.resolve("QWEN2.5-coder:1.5B").path == ROOT / "qwen2.5-coder" / "1.5b.Modelfile"
    with pytest.raises(InvalidRequest, match=re.escape("comes in 1.5b, 3b, 7b")):
        library.resolve("qwen2.5-coder")
    with pytest.raises(ModelNotFound, match=re.escape("no qwen3:70b; qwen3 comes in 1.7b, 4b, 4b-instruct-2507, 8b")):
        library.resolve("qwen3:70b")
    with pytest.raises(ModelNotFound, match="not in the library") as error:
        library.resolve("starcoder2:15b")
    assert "deepseek-coder" in error.value.message


def test_a_family_with_one_tag_resolves_without_it(tmp_path: Path) -> None:
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "1b.Modelfile").write_text("# Solo: one size.\nFROM hf.co/a/b:Q4_K_M\n")
    entry = library.resolve("solo", tmp_path)
    assert entry.name == "solo:1b" and entry.description == "Solo: one size."
    assert library.resolve("solo:latest", tmp_path) == entry


def test_an_mlx_sibling_is_the_source_when_mlx_is_preferred(tmp_path: Path) -> None:
    (tmp_path / "duo").mkdir()
    (tmp_path / "duo" / "1b.Modelfile").write_text("# Duo 1B.\nFROM hf.co/a/duo-GGUF:Q4_K_M\n")
    (tmp_path / "duo" / "1b-mlx.Modelfile").write_text("# Duo 1B, MLX.\nFROM hf.co/mlx-community/duo-4bit\n")
    entry = library.resolve("duo", tmp_path)  # the MLX source is not a second size
    assert entry.name == "duo:1b"
    assert library.source_for(entry, "mlx", tmp_path).name == "duo:1b-mlx"
    assert library.source_for(entry, "llama.cpp", tmp_path) == entry
    assert library.source_for(entry, None, tmp_path) == entry
    mlx = library.resolve("duo:1b-mlx", tmp_path)  # asked for by name, on any engine
    assert library.source_for(mlx, "llama.cpp", tmp_path) == mlx == library.source_for(mlx, "mlx", tmp_path)
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "1b.Modelfile").write_text("# Solo.\nFROM hf.co/a/solo-GGUF:Q4_K_M\n")
    solo = library.resolve("solo", tmp_path)
    assert library.source_for(solo, "mlx", tmp_path) == solo  # no MLX source: the GGUF, which runs anywhere


def test_every_mlx_source_names_an_mlx_community_repository_and_a_gguf_sibling() -> None:
    sources = [entry for entry in library.entries() if entry.tag.endswith(library.MLX_TAG_SUFFIX)]
    assert len(sources) >= 8
    for entry in sources:
        assert parse_file(entry.path).from_.startswith("hf.co/mlx-community/"), entry.name
        assert library.resolve(entry.name[: -len(library.MLX_TAG_SUFFIX)]).path.exists()


@pytest.mark.parametrize(("name", "parser"), [("qwen3-coder:30b", "qwen3-coder"), ("gpt-oss:20b", "harmony"),
                                              ("glm-4.7-flash:30b", "glm-4.5"), ("devstral-small-2:24b", "mistral")])
def test_the_agent_models_name_their_tool_call_format(name: str, parser: str) -> None:
    entry = library.resolve(name)
    assert entry is not None
    assert parse_file(entry.path).parameters["parser"] == parser
