"""Managing the persisted prompt cache from outside a worker: list, stats, pins, remove, prune.

Used by ``localai cache ...`` (directly on ``$LOCALAI_HOME/cache``, no daemon needed) and by the
``/api/cache`` endpoints. Workers notice: a removed file is a miss, and pins are re-read at eviction time.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from localai import paths
from localai.errors import InvalidRequest
from localai.session_cache import CorruptEntry, read_header

PINS_FILE = "pins.json"


@dataclass
class EntryInfo:
    id: str
    fingerprint: str
    tokens: int
    bytes: int
    session: str | None
    kind: str
    last_used: float
    pinned_until: float | None


@dataclass
class Pin:
    """Keeps entries from eviction until ``expires_at``: all of a session's, or one entry (a prefix)."""

    session: str | None
    entry: str | None
    expires_at: float


def pins_path(root: Path | None = None) -> Path:
    return (root or paths.cache_dir()) / PINS_FILE


def load_pins(root: Path | None = None, *, now: float | None = None) -> list[Pin]:
    """Pins still in force (expired ones are ignored)."""
    path = pins_path(root)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    moment = time.time() if now is None else now
    pins = []
    for item in raw if isinstance(raw, list) else []:
        try:
            pin = Pin(session=item.get("session"), entry=item.get("entry"), expires_at=float(item["expires_at"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if pin.expires_at > moment and math.isfinite(pin.expires_at):  # a hand-edited Infinity is no pin
            pins.append(pin)
    return pins


def save_pins(pins: list[Pin], root: Path | None = None) -> None:
    path = pins_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".tmp-{os.getpid()}-{PINS_FILE}")
    temp.write_text(json.dumps([asdict(pin) for pin in pins]))
    os.replace(temp, path)


def pinned_until(pins: list[Pin], entry_id: str, session: str | None) -> float | None:
    times = [p.expires_at for p in pins if p.entry == entry_id or (p.session and p.session == session)]
    return max(times) if times else None


def add_pin(*, session: str | None, entry: str | None, ttl: float, root: Path | None = None) -> Pin:
    if bool(session) == bool(entry):
        raise InvalidRequest("pin either a session or an entry", param="session")
    if ttl <= 0:
        raise InvalidRequest("ttl must be positive", param="ttl")
    pins = [p for p in load_pins(root) if not (p.session == session and p.entry == entry)]
    pin = Pin(session=session, entry=entry, expires_at=time.time() + ttl)
    save_pins([*pins, pin], root)
    return pin


def remove_pin(*, session: str | None, entry: str | None, root: Path | None = None) -> bool:
    pins = load_pins(root)
    kept = [p for p in pins if not (p.session == session and p.entry == entry)]
    save_pins(kept, root)
    return len(kept) != len(pins)


def read_kind_and_session(path: Path) -> tuple[str, str | None]:
    """An entry file's kind and session, from its header ("history", None when unreadable)."""
    try:
        header, _ = read_header(path, path.parent.name)
    except (OSError, CorruptEntry, KeyError, ValueError):
        return "history", None
    return str(header.get("kind", "history")), header.get("session")


def list_entries(root: Path | None = None) -> list[EntryInfo]:
    base = root or paths.cache_dir()
    pins = load_pins(base)
    entries = []
    for path in sorted(base.glob("*/*.kv")):
        if path.name.startswith("."):
            continue  # a write in progress (.tmp-*), not an entry yet
        try:
            header, tokens = read_header(path, path.parent.name)
            stat = path.stat()
        except (OSError, CorruptEntry, KeyError, ValueError):
            continue
        entries.append(EntryInfo(
            id=path.stem, fingerprint=path.parent.name, tokens=len(tokens), bytes=stat.st_size,
            session=header.get("session"), kind=header.get("kind", "history"), last_used=stat.st_mtime,
            pinned_until=pinned_until(pins, path.stem, header.get("session")),
        ))
    return entries


def stats(root: Path | None = None) -> dict[str, Any]:
    entries = list_entries(root)
    return {
        "entries": len(entries), "bytes": sum(e.bytes for e in entries),
        "tokens": sum(e.tokens for e in entries), "pinned": sum(1 for e in entries if e.pinned_until),
        "sessions": len({e.session for e in entries if e.session}),
        "fingerprints": len({e.fingerprint for e in entries}), "pins": len(load_pins(root)),
    }


def remove_entries(*, entry: str | None = None, session: str | None = None, root: Path | None = None) -> int:
    """Delete one entry, or all of a session's; returns how many."""
    if not entry and not session:
        raise InvalidRequest("name an entry or a session to remove", param="entry")
    removed = 0
    base = root or paths.cache_dir()
    for info in list_entries(base):
        if info.id == entry or (session and info.session == session):
            (base / info.fingerprint / f"{info.id}.kv").unlink(missing_ok=True)
            removed += 1
    return removed


def prune(*, max_bytes: int, older_than: float | None = None, root: Path | None = None) -> int:
    """Delete unpinned entries unused for ``older_than`` seconds, then LRU ones until under ``max_bytes``."""
    base = root or paths.cache_dir()
    entries = list_entries(base)
    now = time.time()
    removed = 0
    survivors = []
    for info in entries:
        if info.pinned_until is None and older_than is not None and now - info.last_used > older_than:
            (base / info.fingerprint / f"{info.id}.kv").unlink(missing_ok=True)
            removed += 1
        else:
            survivors.append(info)
    total = sum(e.bytes for e in survivors)
    for info in sorted(survivors, key=eviction_rank):
        if total <= max_bytes:
            break
        if info.pinned_until is not None:
            continue
        (base / info.fingerprint / f"{info.id}.kv").unlink(missing_ok=True)
        total -= info.bytes
        removed += 1
    save_pins(load_pins(base), base)  # drops expired pins
    return removed


def eviction_rank(info: EntryInfo) -> tuple[int, float]:
    """Evicted first: conversation history, then system-prompt prefixes; least recently used first."""
    return (1 if info.kind == "system" else 0, info.last_used)
