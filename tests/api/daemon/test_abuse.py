"""Bad and hostile requests against one real daemon with the real model: the cases that need llama.cpp or a real
server (the event loop while something slow runs, a client that disconnects, the daemon's file permissions).
The rest of the abuse run's cases run in-process on the scripted engine (tests/api/test_limits.py)."""

from __future__ import annotations

import concurrent.futures
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.test_limits import bad_options_never_touch_the_model, chat
from tests.conftest import Daemon, start_daemon
from tests.observe import counted


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("abuse") / "home"
    home.mkdir(mode=0o755)  # an existing home, made with a permissive umask
    instance = start_daemon(home, keep_alive="-1")
    yield instance
    instance.stop()


def healthy(daemon: Daemon, timeout: float = 10.0) -> bool:
    with daemon.http(timeout=timeout) as http:
        return http.get("/health").status_code == 200


# -- 2. options are validated; the engine thread cannot be wedged --------------------------------------

@pytest.mark.parametrize(("options", "needle"), [
    ({"stop": [1]}, "options.stop"),  # reached llama.cpp's engine thread, which died and left the worker hanging
    ({"num_ctx": -1}, "num_ctx must be between"),  # unloaded the model, then failed to load it
])
def test_bad_options_are_400s_and_never_touch_the_model(daemon: Daemon, options: dict[str, Any], needle: str) -> None:
    with daemon.http() as http:
        bad_options_never_touch_the_model(http, options, needle)


# -- 6. slow work off the event loop; stored responses are bounded -------------------------------------

def test_health_answers_while_create_hashes_its_weights(daemon: Daemon, smollm2_path: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.gguf"  # smollm2's header, then a sparse 1.5 GB tail: seconds of hashing, no disk used
    big.write_bytes(smollm2_path.read_bytes())
    os.truncate(big, 3 << 29)
    # Not "still hashing after a 0.5 s sleep" (true only on a machine slow enough): /health is asked over and over
    # until the create is answered. Hashing on the event loop answers none of them before it ends (at most the one
    # in flight when it does); off the loop, each is answered in a millisecond or two while 1.5 GB is read: hundreds.
    answered = 0
    with concurrent.futures.ThreadPoolExecutor() as pool, daemon.http(timeout=300) as http:
        creating = pool.submit(http.post, "/api/create", json={"model": "big", "modelfile": f"FROM {big}\n"})
        with daemon.http(timeout=60) as health:
            while not creating.done():
                assert health.get("/health").status_code == 200
                answered += 1 if not creating.done() else 0
        assert creating.result(timeout=300).status_code == 200
    assert answered >= 5, f"/health was answered {answered} times while the create hashed its weights"


def test_health_answers_while_the_cache_listing_reads_a_file(daemon: Daemon) -> None:
    folder = daemon.home / "cache" / ("e" * 32)
    folder.mkdir(parents=True, exist_ok=True)
    fifo = folder / "stuck.kv"
    os.mkfifo(fifo)  # reading it blocks until the test writes: an entry on a very slow disk
    try:
        with concurrent.futures.ThreadPoolExecutor() as pool, daemon.http() as http:
            listing = pool.submit(http.get, "/api/cache")
            time.sleep(0.5)
            assert healthy(daemon, timeout=5)
            assert not listing.done()
            while not listing.done():  # each open for writing, then close, lets one blocked read see the end
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    time.sleep(0.05)
            assert listing.result(timeout=60).status_code == 200
    finally:
        fifo.unlink()


# -- 9. Unicode, templates, disconnects ----------------------------------------------------------------

@pytest.mark.timeout(240)
def test_a_runaway_template_is_stopped_and_never_blocks_the_daemon(daemon: Daemon) -> None:
    loops = "{% set r = range(99999) %}{% for a in r %}{% for b in r %}{% for c in r %}"
    modelfile = f'FROM smollm2\nTEMPLATE """{loops}x{{% endfor %}}{{% endfor %}}{{% endfor %}}"""\n'
    later = ('FROM smollm2\nTEMPLATE """{% if messages | length > 4 %}' + loops + '{% endfor %}{% endfor %}'
             '{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"""\n')
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool, daemon.http(timeout=200) as http:
        refused = http.post("/api/create", json={"model": "runaway", "modelfile": modelfile})
        assert refused.status_code == 400 and "deadline" in refused.json()["error"], refused.text
        assert http.post("/api/create", json={"model": "runaway-later", "modelfile": later}).status_code == 200
        asking = [pool.submit(chat, http, model="runaway-later", messages=long) for _ in range(6)]
        time.sleep(1)
        assert healthy(daemon, timeout=5)  # rendering runs in render processes, never on the event loop
        assert chat(http, options={"num_predict": 2}).status_code == 200  # another model is not held
        for future in asking:
            response = future.result(timeout=200)
            assert response.status_code == 400 and "runaway-later" in response.json()["error"], response.text


@pytest.mark.timeout(240)
def test_a_non_streamed_request_stops_when_its_client_goes_away(daemon: Daemon) -> None:
    """A request that ran to its token limit is counted in /metrics with the outcome "length", a stopped one as
    "cancelled". So the check holds on any machine: before, a slot free within 30 s passed wherever 3500 tokens took
    under 30 s, stopped or not (a machine fast enough to finish before the client leaves now fails it, saying so).
    A model of its own (sharing smollm2's worker): the suite's daemon is shared, and another test's request that runs
    to its limit meanwhile counts under its own model, not this one's (CI once saw 7 "length" where 6 were expected)."""
    model = "smollm2-leaver"
    body = {"model": model, "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 3500, "ignore_eos": True}
    with daemon.http() as http:
        assert http.post("/api/create", json={"model": model, "modelfile": "FROM smollm2\n"}).status_code == 200
        assert http.post("/api/chat", json={"model": model, "stream": False, "options": {"num_predict": 1},
                                            "messages": [{"role": "user", "content": "Say hi."}]}).status_code == 200
        assert counted(http, "localai_requests_total", model, "length") == 1  # the counter is there and counts
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=3))
        while counted(http, "localai_requests_total", model) < 2:
            time.sleep(0.2)  # polling for its outcome (the test's timeout bounds it), not ordering anything
        assert counted(http, "localai_requests_total", model, "length") == 1, \
            "the request ran to its limit: it was never stopped"
        assert counted(http, "localai_requests_total", model, "cancelled") == 1


@pytest.mark.timeout(240)
def test_an_abandoned_streams_tokens_reach_the_metrics(daemon: Daemon) -> None:
    """A stream whose client leaves is stopped; the tokens it computed and generated until then are counted in
    /metrics (a cancelled request), not lost with the connection. (A model of its own: other tests' abandoned
    requests count under theirs.)"""
    model = "smollm2-abandoned"
    body = {"model": model, "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with daemon.http() as http:
        assert http.post("/api/create", json={"model": model, "modelfile": "FROM smollm2\n"}).status_code == 200
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")) >= 3
        deadline = time.monotonic() + 60  # the worker stops it at its next step; its last frame then counts
        while not counted(http, "localai_requests_total", model, "cancelled") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert counted(http, "localai_requests_total", model, "cancelled") == 1
        assert counted(http, "localai_completion_tokens_total", model) >= 2


def test_files_under_an_existing_home_are_private(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert chat(http, options={"num_predict": 1}).status_code == 200
    assert stat.S_IMODE(daemon.home.stat().st_mode) == 0o700
    created = [path for path in daemon.home.rglob("*") if path.is_file() and not path.is_symlink()]
    assert created
    written_by_tests = {"daemon.log", "pins.json"}
    for path in created:
        if path.name in written_by_tests or path.name.startswith(".tmp-"):
            continue
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_the_daemon_is_still_healthy_and_answers(daemon: Daemon) -> None:
    with daemon.http() as http:
        assert http.get("/health").status_code == 200
        assert chat(http, options={"num_predict": 2}).status_code == 200
    listing = subprocess.run([sys.executable, "-m", "localai", "ps"], env=daemon.env, capture_output=True,
                             text=True, timeout=60)
    assert listing.returncode == 0 and "smollm2" in listing.stdout
