"""Pins are shared by workers, the daemon's request threads and the CLI: no writer may lose another's pin."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from localai.promptcache import pins


def test_two_writers_whose_reads_interleave_both_keep_their_pin(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-modify-write race, injected: the first writer pauses between reading and writing until the second
    has had its chance to read. Unlocked, both read no pins and the second write drops the first's pin."""
    second_started = threading.Event()
    first_read = threading.Event()
    real_load = pins.load_pins

    def load(root: Path | None = None, *, now: float | None = None) -> list[pins.Pin]:
        found = real_load(root, now=now)
        if threading.current_thread().name == "first":
            first_read.set()
            second_started.wait(0.5)  # the lock keeps "second" out, so this times out; unlocked it would not
        return found

    monkeypatch.setattr(pins, "load_pins", load)
    first = threading.Thread(target=pins.add_pin, name="first", kwargs={"session": "a", "entry": None, "ttl": 60,
                                                                        "root": tmp_path})
    first.start()
    assert first_read.wait(5)
    second = threading.Thread(target=lambda: (second_started.set(), pins.add_pin(
        session="b", entry=None, ttl=60, root=tmp_path)), name="second")
    second.start()
    first.join()
    second.join()
    assert sorted(p.session or "" for p in real_load(tmp_path)) == ["a", "b"]


def test_many_threads_and_processes_adding_pins_lose_none(tmp_path: Path) -> None:
    script = ("import sys; from pathlib import Path; from localai.promptcache import pins\n"
              "for i in range(30): pins.extend_pin(f'{sys.argv[1]}-{i}', 600, Path(sys.argv[2]))\n")
    processes = [subprocess.Popen([sys.executable, "-c", script, f"p{n}", str(tmp_path)]) for n in range(3)]
    threads = [threading.Thread(target=lambda n=n: [pins.extend_pin(f"t{n}-{i}", 600, tmp_path) for i in range(30)])
               for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(process.wait(60) == 0 for process in processes)
    entries = {p.entry for p in pins.load_pins(tmp_path)}
    assert len(entries) == 7 * 30
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # no temp file left behind


def test_removing_a_pin_says_whether_there_was_one_and_expired_pins_are_dropped(tmp_path: Path) -> None:
    pins.add_pin(session="s", entry=None, ttl=60, root=tmp_path)
    pins.add_pin(session=None, entry="e", ttl=60, root=tmp_path)
    assert pins.remove_pin(session="s", entry=None, root=tmp_path) is True
    assert pins.remove_pin(session="s", entry=None, root=tmp_path) is False
    pins.update_pins(lambda found: [*found, pins.Pin(session="old", entry=None, expires_at=1.0)], tmp_path)
    assert "old" in pins.pins_path(tmp_path).read_text()
    pins.drop_expired(tmp_path)
    assert [p.entry for p in pins.load_pins(tmp_path)] == ["e"]
    assert "old" not in pins.pins_path(tmp_path).read_text()


def test_a_damaged_pins_file_reads_as_no_pins_and_the_next_write_replaces_it(tmp_path: Path) -> None:
    pins.pins_path(tmp_path).write_text("{not json")
    assert pins.load_pins(tmp_path) == []
    pins.add_pin(session="s", entry=None, ttl=60, root=tmp_path)
    assert [p.session for p in pins.load_pins(tmp_path)] == ["s"]


def test_a_pin_needs_exactly_one_target_and_a_positive_ttl(tmp_path: Path) -> None:
    from localai.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        pins.add_pin(session="s", entry="e", ttl=60, root=tmp_path)
    with pytest.raises(InvalidRequest):
        pins.add_pin(session=None, entry=None, ttl=60, root=tmp_path)
    with pytest.raises(InvalidRequest):
        pins.add_pin(session="s", entry=None, ttl=0, root=tmp_path)
