"""Pins: entries kept from eviction until a time, shared through ``<cache>/pins.json`` by every process.

Workers extend pins (Anthropic ``cache_control``), the daemon and ``localai cache pin`` add and remove them, and
every evictor reads them. Each change is a read-modify-write under an exclusive lock on ``pins.json.lock``, written
atomically, so concurrent writers (processes or threads) never lose each other's pins.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from localai import paths
from localai.errors import InvalidRequest
from localai.promptcache.blocks import file_lock, write_atomic

PINS_FILE = "pins.json"
# Every evictor re-reads pins.json (a worker's engine thread on its saves), so what one caller may put in it is
# bounded: names twice the session header's 1,024 characters (room for a sub-agent's session under its parent's),
# so many session pins per owner (an API key, or the machine's owner), so many entry pins in all (a key can pin
# only its own entries; the workers' cache_control pins are entries that exist).
MAX_PIN_NAME = 2048
MAX_SESSION_PINS = 256
MAX_ENTRY_PINS = 4096


@dataclass
class Pin:
    """Keeps entries (their whole chains of blocks) from eviction until ``expires_at``: all of a session's, or one
    entry (a prefix). A session pin made with an API key (when several share the daemon) has that key's id as its
    ``owner``: it holds only the key's own entries of that session, and only that key (or the machine's owner)
    removes it. "" is the machine's owner."""

    session: str | None
    entry: str | None
    expires_at: float
    owner: str = ""


def pins_path(root: Path | None = None) -> Path:
    return (root or paths.cache_dir()) / PINS_FILE


def load_pins(root: Path | None = None, *, now: float | None = None) -> list[Pin]:
    """Pins still in force (expired ones are ignored)."""
    try:
        raw = json.loads(pins_path(root).read_text())
    except (OSError, ValueError):
        return []
    moment = time.time() if now is None else now
    pins = []
    for item in raw if isinstance(raw, list) else []:
        try:
            pin = Pin(session=item.get("session"), entry=item.get("entry"), expires_at=float(item["expires_at"]),
                      owner=str(item.get("owner") or ""))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if pin.expires_at > moment and math.isfinite(pin.expires_at):  # a hand-edited Infinity is no pin
            pins.append(pin)
    return pins


def update_pins(change: Callable[[list[Pin]], list[Pin]], root: Path | None = None) -> list[Pin]:
    """Replace the pins in force with ``change(pins)``, atomically with respect to every other writer."""
    path = pins_path(root)
    with file_lock(path.with_name(PINS_FILE + ".lock")):
        pins = change(load_pins(root))
        write_atomic(path, [json.dumps([asdict(pin) for pin in pins]).encode()])
        return pins


def pinned_until(pins: list[Pin], entry_id: str, session: str | None, partition: str | None = None) -> float | None:
    """Until when an entry is pinned: by its id, or by its session (``partition``: the entry's, when known; a key's
    session pin holds only that key's entries)."""
    times = [p.expires_at for p in pins if p.entry == entry_id or (
        p.session and p.session == session and (partition is None or _owns(p.owner, partition)))]
    return max(times) if times else None


def _owns(owner: str, partition: str) -> bool:
    return not owner or partition.split(".", 1)[0] == owner


def add_pin(*, session: str | None, entry: str | None, ttl: float, root: Path | None = None, owner: str = "") -> Pin:
    """Pin a session or an entry for ``ttl`` seconds, replacing the same pin of the same ``owner`` (never
    another key's)."""
    if bool(session) == bool(entry):
        raise InvalidRequest("pin either a session or an entry", param="session")
    field, name = ("session", session) if session else ("entry", entry or "")
    if len(name) > MAX_PIN_NAME:
        raise InvalidRequest(f"a pinned {field} is at most {MAX_PIN_NAME} characters, not {len(name)}", param=field)
    if ttl <= 0:
        raise InvalidRequest("ttl must be positive", param="ttl")
    pin = Pin(session=session, entry=entry, expires_at=time.time() + ttl, owner=owner if session else "")

    def change(pins: list[Pin]) -> list[Pin]:
        kept = [p for p in pins if not _same(p, session, entry, pin.owner)]
        if len(kept) == len(pins):  # a new pin, not one renewed
            _check_room(kept, pin)
        return [*kept, pin]

    update_pins(change, root)
    return pin


def _check_room(pins: list[Pin], pin: Pin) -> None:
    """InvalidRequest when ``pin``'s owner holds as many session pins as one may (or, for an entry, when there
    are as many entry pins as there may be)."""
    if pin.session:
        held = sum(1 for p in pins if p.session and p.owner == pin.owner)
        if held >= MAX_SESSION_PINS:
            raise InvalidRequest(f"{MAX_SESSION_PINS} sessions are pinned already (the most one API key may pin); "
                                 "unpin one first (`localai cache unpin --session`, DELETE /api/cache/pin)",
                                 param="session")
    elif sum(1 for p in pins if p.entry) >= MAX_ENTRY_PINS:
        raise InvalidRequest(f"{MAX_ENTRY_PINS} entries are pinned already (the most there may be); unpin one first "
                             "(`localai cache unpin --entry`, DELETE /api/cache/pin)", param="entry")


def _same(pin: Pin, session: str | None, entry: str | None, owner: str | None) -> bool:
    return pin.session == session and pin.entry == entry and (owner is None or pin.owner == owner)


def extend_pin(entry: str, ttl: float, root: Path | None = None) -> None:
    """Keep an entry pinned at least ``ttl`` seconds from now (a longer pin it has stays)."""
    until = time.time() + ttl

    def change(pins: list[Pin]) -> list[Pin]:
        if any(p.entry == entry and p.session is None and p.expires_at >= until for p in pins):
            return pins
        kept = [p for p in pins if not (p.entry == entry and p.session is None)]
        return [*kept, Pin(session=None, entry=entry, expires_at=until)]

    update_pins(change, root)


def remove_pin(*, session: str | None, entry: str | None, root: Path | None = None, owner: str | None = None) -> bool:
    """Remove a session's or an entry's pin: ``owner``'s only (an API key's), or anyone's (None: the machine's
    owner). Whether one was removed."""
    before: list[int] = []

    def change(pins: list[Pin]) -> list[Pin]:
        before.append(len(pins))
        return [p for p in pins if not _same(p, session, entry, owner if session else None)]

    return len(update_pins(change, root)) != before[0]


def drop_expired(root: Path | None = None) -> None:
    update_pins(lambda pins: pins, root)  # load_pins leaves out the expired ones
