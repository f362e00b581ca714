"""What one caller may put in pins.json, which every evictor re-reads: names of bounded length, so many session pins
per owner (an API key), so many entry pins in all; past them a 400 naming the field, and the file unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from localai.errors import InvalidRequest
from localai.promptcache import pins


def test_a_pinned_name_is_at_most_max_pin_name_characters(isolated_home: Path) -> None:
    pins.add_pin(session="s" * pins.MAX_PIN_NAME, entry=None, ttl=60)
    for field in ("session", "entry"):
        words = f"a pinned {field} is at most 2048 characters, not 24000000"
        with pytest.raises(InvalidRequest, match=words) as refused:
            pins.add_pin(**{"session": None, "entry": None, field: "x" * 24_000_000}, ttl=60)  # type: ignore[arg-type]
        assert refused.value.param == field
    assert len(pins.pins_path().read_bytes()) < 3 * pins.MAX_PIN_NAME  # the long ones never reached the file


def test_one_owner_pins_at_most_max_session_pins_sessions(isolated_home: Path) -> None:
    for number in range(pins.MAX_SESSION_PINS):
        pins.add_pin(session=f"s{number}", entry=None, ttl=60, owner="key-a")
    before = pins.pins_path().read_bytes()
    with pytest.raises(InvalidRequest, match="256 sessions are pinned already") as refused:
        pins.add_pin(session="one-more", entry=None, ttl=60, owner="key-a")
    assert refused.value.param == "session" and pins.pins_path().read_bytes() == before
    pins.add_pin(session="s7", entry=None, ttl=120, owner="key-a")  # renewing one is no new pin
    pins.add_pin(session="one-more", entry=None, ttl=60, owner="key-b")  # another key has room of its own
    assert pins.remove_pin(session="s0", entry=None, owner="key-a")
    pins.add_pin(session="one-more", entry=None, ttl=60, owner="key-a")  # room again after an unpin
    assert len(pins.load_pins()) == pins.MAX_SESSION_PINS + 1


def test_entry_pins_stop_at_max_entry_pins_but_the_workers_extensions_do_not(isolated_home: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins, "MAX_ENTRY_PINS", 3)
    for entry in ("e1", "e2"):
        pins.add_pin(session=None, entry=entry, ttl=60)
    pins.extend_pin("e3", 60)  # a worker's cache_control pin: an entry that exists
    with pytest.raises(InvalidRequest, match="3 entries are pinned already") as refused:
        pins.add_pin(session=None, entry="e4", ttl=60)
    assert refused.value.param == "entry"
    pins.add_pin(session=None, entry="e1", ttl=120)  # renewed
    pins.extend_pin("e5", 60)
    assert {p.entry for p in pins.load_pins()} == {"e1", "e2", "e3", "e5"}


def test_the_cli_refuses_a_name_too_long_in_one_line(isolated_home: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "localai", "cache", "pin", "--session", "x" * 3000],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "at most 2048 characters" in result.stderr
    assert "Traceback" not in result.stderr and not pins.pins_path().exists()
