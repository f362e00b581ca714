"""The fast tier: the real app (``create_app``) in-process over ASGI, with the scripted engine in a real worker.

Request shapes and error replies do not need a model: the dialects, validation, runtime, scheduler, worker
protocol and serving loop all run for real, and only the engine answers from a script. One app serves a whole
module (the worker starts once); each test's home is the module's home, so every test here must keep its data
apart (its own session ids and model names). The same paths run once with the real model in tests/api/daemon/.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from localai import paths
from localai.api.app import create_app
from localai.models.registry import Registry
from localai.runtime.runtime import Runtime
from localai.settings import Settings
from localai.workers.scheduler import Scheduler


@pytest.fixture(scope="module")
def api_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("api") / "home"


@pytest.fixture(autouse=True)
def isolated_home(api_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Overrides the suite's per-test home: in this tier a module shares one (its app's)."""
    for key in list(os.environ):
        if key.startswith(("LOCALAI_", "HF_", "HUGGING_FACE_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LOCALAI_HOME", str(api_home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    return api_home


def scripted_settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"engine": "scripted", "keep_alive": -1, "num_parallel": 2,
                                 "context_length": 4096, "num_thread": 1, "responses_max": 3}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def api_settings() -> Settings:
    """The module's settings (a module overrides this fixture to change them)."""
    return scripted_settings()


@pytest.fixture(scope="module")
def api(api_home: Path, api_settings: Settings) -> Iterator[TestClient]:
    """The app, started (lifespan included) on the scripted engine; ``api.app.state.runtime`` is its runtime."""
    previous = os.environ.get("LOCALAI_HOME")
    os.environ["LOCALAI_HOME"] = str(api_home)
    try:
        paths.ensure_home()
        registry = Registry.open()
        registry.ensure_embedded()
        settings = api_settings
        runtime = Runtime(settings, registry, Scheduler(settings))
        app = create_app(settings, runtime)
        with TestClient(app, base_url="http://localhost", raise_server_exceptions=True) as client:
            assert client.portal is not None
            runtime.registry = client.portal.call(registry.reopen)  # SQLite connections stay in their thread
            registry.close()
            yield client
    finally:
        if previous is None:
            os.environ.pop("LOCALAI_HOME", None)
        else:
            os.environ["LOCALAI_HOME"] = previous
