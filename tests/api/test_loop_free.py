"""The event loop never waits on the database or the model files (issue 60, item 6): a route that writes SQLite
while another connection holds the write lock waits on a worker thread (up to the busy timeout) while /health and
other routes answer; /api/ps, show and the models listings read the GGUF header (a stat, a parse when the file
changed) and the registry off the loop. The in-process app on the scripted engine; the lock is taken by a second
connection and the route's arrival at the database is signalled by a wrapped ``Registry.copy``, not slept for."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from localai import paths
from localai.api import ollama_models
from localai.models import loading
from localai.models.registry import Registry


@pytest.fixture
def loop_thread(api: TestClient) -> int:
    assert api.portal is not None
    return int(api.portal.call(threading.get_ident))


def test_a_route_waiting_for_the_locked_database_leaves_health_and_other_routes_answering(
        api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, returned = threading.Event(), threading.Event()
    copy = Registry.copy

    def signalled_copy(self: Registry, source: str, destination: str) -> Any:
        entered.set()
        try:
            return copy(self, source, destination)
        finally:
            returned.set()

    monkeypatch.setattr(Registry, "copy", signalled_copy)
    locker = sqlite3.connect(paths.database_path(), isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # a write transaction: every other writer waits for it
    with ThreadPoolExecutor(1) as pool:
        try:
            copied = pool.submit(api.post, "/api/copy", json={"source": "smollm2:135m", "destination": "waits:x"})
            assert entered.wait(30)
            assert api.get("/health").status_code == 200
            assert api.get("/api/tags").status_code == 200  # a read (WAL: the lock does not stop readers)
            assert not returned.is_set()  # the copy still waits for the lock: the loop answered beside it
        finally:
            locker.execute("COMMIT")
            locker.close()
        assert copied.result(30).status_code == 200
    assert api.post("/api/show", json={"model": "waits:x"}).status_code == 200


@pytest.fixture
def header_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The thread of every GGUF header read (each one stats the file, and parses it when it changed)."""
    threads: list[int] = []

    def recorded(read: Callable[[str], Any]) -> Callable[[str], Any]:
        def read_and_record(path: str) -> Any:
            threads.append(threading.get_ident())
            return read(path)
        return read_and_record

    monkeypatch.setattr(loading, "gguf_metadata", recorded(loading.gguf_metadata))
    monkeypatch.setattr(ollama_models, "gguf_metadata", recorded(ollama_models.gguf_metadata))
    yield threads


def test_ps_show_and_the_models_listings_read_no_file_on_the_loop(api: TestClient, loop_thread: int,
                                                                   header_reads: list[int]) -> None:
    assert api.post("/api/generate", json={"model": "smollm2:135m"}).status_code == 200  # loaded, for /api/ps
    header_reads.clear()
    assert [m["name"] for m in api.get("/api/ps").json()["models"]] == ["smollm2:135m"]
    assert header_reads and loop_thread not in header_reads
    for ask in (lambda: api.post("/api/show", json={"model": "smollm2:135m"}), lambda: api.get("/v1/models"),
                lambda: api.get("/v1/models/smollm2:135m")):
        header_reads.clear()
        assert ask().status_code == 200
        assert header_reads and loop_thread not in header_reads


def test_a_requests_registry_lookup_runs_off_the_loop(api: TestClient, loop_thread: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lookups: list[int] = []
    get = Registry.get

    def recorded_get(self: Registry, name: str) -> Any:
        lookups.append(threading.get_ident())
        return get(self, name)

    monkeypatch.setattr(Registry, "get", recorded_get)
    chat = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "[[say:hi]]"}], "stream": False}
    assert api.post("/v1/chat/completions", json=chat).status_code == 200
    assert api.post("/api/chat", json=chat).status_code == 200
    assert api.post("/v1/messages", json={**chat, "max_tokens": 8}).status_code == 200
    assert lookups and loop_thread not in lookups
