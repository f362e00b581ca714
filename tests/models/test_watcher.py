"""User Modelfiles: reconciling the registry with ``$LOCALAI_HOME/modelfiles``, and the daemon watching it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from localai import paths
from localai.models.registry import Registry
from localai.models.watcher import ModelfileWatcher
from tests.conftest import Daemon, start_daemon
from tests.observe import wait_for


@pytest.fixture
def registry(isolated_home: Path) -> Registry:
    registry = Registry.open()
    registry.ensure_embedded()
    return registry


@pytest.fixture
def watcher(registry: Registry) -> ModelfileWatcher:
    paths.user_modelfiles_dir().mkdir(parents=True)
    return ModelfileWatcher(paths.user_modelfiles_dir(), registry)


def errors(watcher: ModelfileWatcher) -> dict[str, str]:
    return {Path(item["path"]).name: item["error"] for item in watcher.report() if item["error"]}


def test_create_edit_break_and_delete(watcher: ModelfileWatcher, registry: Registry) -> None:
    pirate = watcher.root / "pirate.Modelfile"
    pirate.write_text('FROM smollm2\nSYSTEM """Arr."""\n')
    watcher.reconcile()
    assert registry.get("pirate").system == "Arr."
    assert watcher.report() == [{"path": str(pirate), "name": "pirate:latest", "error": None}]
    stamp = registry.get("pirate").modified_at
    watcher._applied.clear()  # as after a restart: unchanged files are compared, not rewritten
    watcher.reconcile()
    assert registry.get("pirate").modified_at == stamp

    pirate.write_text('FROM smollm2\nPARAMETER temperature 0.1\nSYSTEM """Arr!"""\n')
    watcher.reconcile()
    assert registry.get("pirate").parameters["temperature"] == 0.1 and registry.get("pirate").system == "Arr!"

    pirate.write_text("FROM smollm2\nPARAMETER bogus 1\n")
    (watcher.root / "parrot").mkdir()
    (watcher.root / "parrot" / "v2.Modelfile").write_text("FROM smollm2\nPARAMETER temperature 0.3\n")
    watcher.reconcile()
    assert "unknown parameter 'bogus'" in errors(watcher)["pirate.Modelfile"]
    assert registry.get("pirate").system == "Arr!"  # the last good version stays
    assert registry.get("parrot:v2").parameters["temperature"] == 0.3  # the others are unaffected

    pirate.unlink()
    watcher.reconcile()
    assert not registry.exists("pirate") and registry.exists("parrot:v2") and not errors(watcher)
    (watcher.root / "parrot" / "v2.Modelfile").unlink()
    watcher.reconcile()
    assert not registry.exists("parrot:v2") and registry.exists("smollm2")


def test_bad_names_missing_weights_and_models_built_on_others(watcher: ModelfileWatcher,
                                                              registry: Registry) -> None:
    (watcher.root / "My Model.Modelfile").write_text("FROM smollm2\n")
    (watcher.root / "derived.Modelfile").write_text("FROM zbase\nPARAMETER top_k 5\n")  # zbase comes later
    (watcher.root / "zbase.Modelfile").write_text("FROM smollm2\nPARAMETER temperature 0\n")
    (watcher.root / "remote.Modelfile").write_text("FROM hf.co/org/Never-Pulled-GGUF:Q4_K_M\n")
    (watcher.root / "garbage.Modelfile").write_bytes(b"\xff\xfe not text")
    (watcher.root / "a" / "b").mkdir(parents=True)
    (watcher.root / "a" / "b" / "too-deep.Modelfile").write_text("FROM smollm2\n")
    watcher.reconcile()
    derived = registry.get("derived")
    assert derived.parameters["top_k"] == 5 and derived.parameters["temperature"] == 0
    found = errors(watcher)
    assert "NAME.Modelfile or NAME/TAG.Modelfile" in found["My Model.Modelfile"]
    assert "NAME.Modelfile or NAME/TAG.Modelfile" in found["too-deep.Modelfile"]
    assert "run: localai pull hf.co/org/Never-Pulled-GGUF:Q4_K_M" in found["remote.Modelfile"]
    assert "cannot read Modelfile" in found["garbage.Modelfile"]
    assert set(found) == {"My Model.Modelfile", "too-deep.Modelfile", "remote.Modelfile", "garbage.Modelfile"}


def test_a_modelfile_from_unpulled_weights_builds_once_they_are_cached(watcher: ModelfileWatcher,
                                                                      registry: Registry,
                                                                      smollm2_path: Path) -> None:
    (watcher.root / "remote.Modelfile").write_text("FROM hf.co/org/Late-GGUF:Q4_1\nPARAMETER temperature 0\n")
    watcher.reconcile()
    assert "not downloaded yet" in errors(watcher)["remote.Modelfile"] and not registry.exists("remote")
    # What a pull leaves in the hub cache: refs/main -> snapshots/<commit>/<file> -> blobs/<sha256>.
    repo = paths.hf_hub_cache() / "models--org--Late-GGUF"
    commit = "c" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / ("b" * 64)
    blob.symlink_to(smollm2_path)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "late-Q4_1.gguf").symlink_to(blob)
    watcher.reconcile()  # what the daemon does after every pull
    record = registry.get("remote")
    assert not errors(watcher) and record.sha256 == "b" * 64 and record.path.endswith("late-Q4_1.gguf")


def test_a_file_written_while_the_watch_starts_is_not_missed(watcher: ModelfileWatcher,
                                                              registry: Registry) -> None:
    scan = watcher.reconcile
    scans = 0

    def reconcile() -> list[str]:
        nonlocal scans
        scans += 1
        removed = scan()
        if scans == 1:  # after the first scan, before watchfiles watches: the window a daemon start leaves
            (watcher.root / "early.Modelfile").write_text("FROM smollm2\n")
        return removed

    watcher.reconcile = reconcile  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        deadline = time.monotonic() + 60
        while not registry.exists("early") and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.1)
        watcher.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert registry.exists("early")


def _ps(daemon: Daemon) -> dict[str, Any]:
    with daemon.http() as http:
        return {model["name"]: model for model in http.get("/api/ps").json()["models"]}


def _generate(daemon: Daemon, model: str) -> None:
    with daemon.http() as http:
        response = http.post("/api/generate", json={"model": model, "prompt": "Hi", "stream": False,
                                                    "options": {"num_predict": 4}})
    assert response.status_code == 200, response.text


def _show(daemon: Daemon, model: str) -> dict[str, Any]:
    with daemon.http() as http:
        response = http.post("/api/show", json={"model": model})
    return dict(response.json()) if response.status_code == 200 else {}


def _broken(daemon: Daemon) -> dict[str, str]:
    with daemon.http() as http:
        return {Path(item["path"]).name: item["error"]
                for item in http.get("/api/modelfiles").json()["modelfiles"] if item["error"]}


def test_the_daemon_follows_user_modelfiles(isolated_home: Path, smollm2_path: Path) -> None:
    root = isolated_home / "modelfiles"
    with start_daemon(isolated_home) as daemon:
        pirate = root / "pirate.Modelfile"
        pirate.write_text('FROM smollm2\nPARAMETER num_ctx 2048\nSYSTEM """You are a pirate."""\n')
        wait_for(lambda: _show(daemon, "pirate"), "pirate to be created")
        _generate(daemon, "pirate")
        loaded = _ps(daemon)["pirate:latest"]
        assert loaded["context_length"] == 2048

        pirate.write_text('FROM smollm2\nPARAMETER num_ctx 1024\nSYSTEM """You are a parrot."""\n')
        wait_for(lambda: _show(daemon, "pirate").get("system") == "You are a parrot.", "pirate to change")
        _generate(daemon, "pirate")  # its load settings changed: reloaded on this request
        reloaded = _ps(daemon)["pirate:latest"]
        assert reloaded["context_length"] == 1024 and reloaded["pid"] != loaded["pid"]

        (root / "sailor.Modelfile").write_text("FROM smollm2\nPARAMETER temperature 0\n")
        pirate.write_text("FROM smollm2\nPARAMETER num_ctx lots\n")
        wait_for(lambda: "pirate.Modelfile" in _broken(daemon), "pirate to be reported broken")
        assert "num_ctx must be an integer" in _broken(daemon)["pirate.Modelfile"]
        assert _show(daemon, "sailor")  # created beside the broken one
        _generate(daemon, "pirate")  # the last good version still answers
        ps = daemon.cli("ps")
        assert "Broken Modelfiles" in ps.stdout and str(pirate) in ps.stdout and "num_ctx" in ps.stdout
        shown = daemon.cli("show", "pirate")
        assert "Modelfile error" in shown.stdout and "num_ctx must be an integer" in shown.stdout
        assert "pirate" in daemon.log() and "broken" in daemon.log()

        pirate.unlink()
        wait_for(lambda: not _show(daemon, "pirate"), "pirate to be removed")
        assert "pirate:latest" not in _ps(daemon)  # unloaded with it
        assert not _broken(daemon) and _show(daemon, "sailor")
        (root / "ghost.Modelfile").write_text("FROM nothing-installed\n")
        wait_for(lambda: "ghost.Modelfile" in _broken(daemon), "ghost to be reported")
        shown = daemon.cli("show", "ghost")
        assert shown.returncode == 1 and "Modelfile is broken" in shown.stderr and "ghost.Modelfile" in shown.stderr
