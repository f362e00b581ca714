"""Models already on disk (Ollama's pulls, LM Studio's folder, GGUFs in the Hugging Face cache), found and used in
place. Each layout is built on disk from the embedded smollm2 GGUF, linked, never copied."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from localai.models import discover
from localai.models.modelfile import parse
from localai.models.registry import Registry
from tests.conftest import start_daemon


def blob(root: Path, data: bytes | None = None, *, link: Path | None = None) -> str:
    """Store a blob the way Ollama does (``blobs/sha256-<hex>``); the GGUF is linked, not copied."""
    digest = hashlib.sha256(data if data is not None else link.read_bytes()).hexdigest()  # type: ignore[union-attr]
    path = root / "blobs" / f"sha256-{digest}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if link is not None:
        if not path.exists():
            os.link(link, path)
    else:
        path.write_bytes(data or b"")
    return f"sha256:{digest}"


def manifest(root: Path, name: str, layers: list[tuple[str, str]], host: str = "registry.ollama.ai") -> Path:
    model, tag = name.split(":")
    namespace, model = model.split("/") if "/" in model else ("library", model)
    path = root / "manifests" / host / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "config": {"digest": "sha256:" + "0" * 64},
                                "layers": [{"mediaType": f"application/vnd.ollama.image.{kind}", "digest": digest}
                                           for kind, digest in layers]}))
    return path


@pytest.fixture
def disks(tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    ollama = tmp_path / "ollama"
    model = blob(ollama, link=smollm2_path)
    params = blob(ollama, json.dumps({"temperature": 0.2, "stop": ["<|im_end|>", "User:"], "num_ctx": 2048,
                                      "mirostat": 1}).encode())
    system = blob(ollama, b"You are Smol, a terse assistant.")
    template = blob(ollama, b"{{ .System }} {{ .Prompt }}")  # a Go template: the GGUF's own template applies
    manifest(ollama, "smol:135m", [("model", model), ("params", params), ("system", system),
                                   ("template", template), ("license", blob(ollama, b"Apache-2.0"))])
    manifest(ollama, "someone/tiny:latest", [("model", model)])
    manifest(ollama, "seeing:latest", [("model", model), ("projector", blob(ollama, b"proj"))])
    manifest(ollama, "gone:latest", [("model", "sha256:" + "1" * 64)])
    (manifest(ollama, "broken:latest", [])).write_text("{not json")
    lmstudio = tmp_path / "lmstudio"
    folder = lmstudio / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF"
    folder.mkdir(parents=True)
    (folder / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(smollm2_path)
    (folder / "mmproj-SmolLM2-f16.gguf").symlink_to(smollm2_path)
    hf = tmp_path / "hf-hub"
    snapshot = hf / "models--bartowski--SmolLM2-135M-Instruct-GGUF" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(smollm2_path)
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("LOCALAI_LMSTUDIO_MODELS", str(lmstudio))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    monkeypatch.setattr(discover, "hf_cache_root", lambda: hf)
    return {"ollama": ollama, "lmstudio": lmstudio, "hf": hf, "model": model}


EXPECTED = {"smol:135m", "someone/tiny:latest",
            "lmstudio/huggingfacetb/smollm2-135m-instruct-gguf:smollm2-135m-instruct-q4_1",
            "hf.co/bartowski/smollm2-135m-instruct-gguf:smollm2-135m-instruct-q4_1"}


def test_models_on_disk_are_registered_in_place_and_forgotten_when_gone(disks: dict[str, Any], tmp_path: Path) -> None:
    registry = Registry.open(tmp_path / "registry.db")
    registry.create("someone/tiny", parse(f"FROM {disks['ollama'] / 'blobs' / disks['model'].replace(':', '-')}"))
    changed = discover.sync(registry, ["ollama", "lmstudio", "hf"])
    assert set(changed) == EXPECTED - {"someone/tiny:latest"}  # a model the user made keeps its name
    smol = registry.get("smol:135m")
    assert smol.path == str(disks["ollama"] / "blobs" / disks["model"].replace(":", "-"))  # used where it is
    assert smol.sha256 == disks["model"].split(":")[1]  # Ollama's verified digest: not hashed again
    assert smol.parameters == {"temperature": 0.2, "stop": ["<|im_end|>", "User:"], "num_ctx": 2048}  # no mirostat
    assert smol.system == "You are Smol, a terse assistant." and smol.license == "Apache-2.0"
    assert smol.template is None  # Ollama's Go template is not used: the GGUF's own applies
    names = set(registry.names())
    assert not any(n.startswith(("seeing", "gone", "broken")) or "mmproj" in n for n in names)
    assert discover.sync(registry, ["ollama", "lmstudio", "hf"]) == []  # nothing changed: nothing redone

    registry.remove("smol:135m")  # forgetting a found model never deletes the other tool's files
    assert Path(smol.path).is_file()
    (disks["lmstudio"] / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct-Q4_1.gguf").unlink()
    discover.sync(registry, ["ollama", "hf"])  # LM Studio's file is gone, and it is no longer looked at
    assert not any(n.startswith("lmstudio/") for n in registry.names())
    assert "smol:135m" in registry.names()  # still in Ollama: found again
    assert discover.sync(registry, []) == [] and not any(n.startswith(("smol", "hf.co")) for n in registry.names())


def test_the_daemon_lists_and_runs_ollamas_model_and_refuses_an_unknown_source(disks: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    with start_daemon(tmp_path / "home", discover="ollama,lmstudio,hf",
                      lmstudio_models=str(disks["lmstudio"])) as daemon, daemon.http() as http:
        names: set[str] = set()
        for _ in range(100):  # found on a thread after start
            names = {m["name"] for m in http.get("/api/tags").json()["models"]}
            if names >= EXPECTED:
                break
            time.sleep(0.1)
        assert names >= EXPECTED, names
        answer = http.post("/api/chat", json={"model": "smol:135m", "stream": False, "options": {"num_predict": 4},
                                              "messages": [{"role": "user", "content": "Who are you?"}]})
        assert answer.status_code == 200 and answer.json()["message"]["content"], answer.text
        shown = http.post("/api/show", json={"model": "smol:135m"}).json()
        assert shown["system"] == "You are Smol, a terse assistant."
        listed = daemon.cli("list")
        assert listed.returncode == 0 and "smol:135m" in listed.stdout
    env = {**os.environ, "LOCALAI_HOME": str(tmp_path / "other"), "LOCALAI_DISCOVER": "ollama,steam"}
    refused = subprocess.run([sys.executable, "-m", "localai", "serve"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode != 0 and "steam" in refused.stderr + refused.stdout
