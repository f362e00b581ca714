"""A full disk under the prompt cache: the home on a small tmpfs, agent sessions that write more cache than fits.
Every reply is still answered (the cache keeps less), nothing half-written is left, the daemon stays healthy.
Needs permission to mount a tmpfs (root, as on CI): without it the test fails, saying so (a skip went unnoticed)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.stress.common import half_written
from tests.conftest import start_daemon

FILLER = " ".join(f"line {i}: the build step compiles module {i} and links it." for i in range(40))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk test needs root, as `make "
                    "test` has on CI; run it as root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_costs_the_cache_entries_never_a_reply(small_disk: Path, smollm2_path: Path,
                                                           tmp_path: Path) -> None:
    home = small_disk / "home"
    # the daemon's stderr off the full disk, as a terminal's is: the worker's log (home/logs) is on it
    with start_daemon(home, keep_alive="-1", log_path=tmp_path / "daemon.log") as daemon, daemon.http() as http:
        replies = []
        for session in range(3):
            messages = [{"role": "system", "content": f"You are agent {session}. {FILLER}"}]
            for turn in range(2):
                messages.append({"role": "user", "content": f"Turn {turn}: {FILLER}"})
                response = http.post("/v1/chat/completions", headers={"x-session-id": f"s{session}"}, json={
                    "model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0})
                assert response.status_code == 200, response.text
                replies.append(response.json()["choices"][0]["message"]["content"])
                messages.append({"role": "assistant", "content": replies[-1]})
        assert shutil.disk_usage(small_disk).free < 1 << 20  # the disk did fill: the check proved something
        # The first failed write is in the daemon's log, once (the worker's log could not take it either)
        told = [line for line in daemon.log().splitlines() if "the prompt cache could not write a file" in line]
        assert len(told) == 1 and "No space left on device" in told[0], daemon.log()[-3000:]
        pids = {m["pid"] for m in http.get("/api/ps").json()["models"]}
        assert len(pids) == 1  # one worker served it all: none crashed and was reloaded
        listing = daemon.cli("cache", "ls")
        assert listing.returncode == 0, listing.stderr
        assert http.get("/health").status_code == 200
    # Stopped: no write is in flight, so any temp file left is one a failed write did not clean up
    assert not half_written(home), half_written(home)
