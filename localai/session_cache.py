"""Persisted prompt (KV) state: entries of (tokens, engine state bytes) on disk and in RAM.

An entry is one sequence's KV state after evaluating ``tokens``. A request restores the entry that
shares the longest token prefix with its prompt, from any session, and trims it to that prefix.

File format (``<cache>/<fingerprint>/<id>.kv``): ``MAGIC``, a u32 header length, a JSON header
(fingerprint, token count, payload size, CRC32 of tokens+payload), the tokens as int32, then the
payload. Files are written to a temp name, fsynced and renamed, so a crash mid-write leaves no entry;
the checksum is verified on every load, and a file that fails is deleted, logged, and never served.
Entries live under their compatibility fingerprint, so a different model, engine build, context size,
KV type or attention layout never even sees them.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("localai.cache")

MAGIC = b"LAIKV002"
HEADER_LEN = struct.Struct("<I")
MIN_TOKENS = 32  # shorter prefixes are cheaper to recompute than to manage


def fingerprint(parts: dict[str, Any]) -> str:
    """A stable hash of everything that must match for KV state to be reusable."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _checksum(tokens: bytes, payload: bytes) -> str:
    # CRC32 catches truncation and bit rot (the threats here) at several times blake2b's speed, and every
    # turn checksums tens of MB on the same cores that serve the next request.
    return f"crc32:{zlib.crc32(payload, zlib.crc32(tokens)):08x}"


@dataclass
class Entry:
    id: str
    tokens: list[int]
    size: int
    path: Path
    session: str | None = None
    last_used: float = field(default_factory=time.time)
    kind: str = "history"  # or "system": a shared system-prompt-and-tools prefix, evicted last


class CorruptEntry(Exception):
    """A cache file that is truncated, altered or foreign."""


class SessionCache:
    """The RAM and disk tiers for one model fingerprint. Thread-safe; writes happen on a background thread."""

    def __init__(self, root: Path, fingerprint_hex: str, *, max_bytes: int, ram_bytes: int = 256 << 20) -> None:
        self.dir = root / fingerprint_hex
        self.fingerprint = fingerprint_hex
        self.max_bytes = max_bytes
        self.ram_bytes = ram_bytes
        self.entries: dict[str, Entry] = {}
        self._ram: OrderedDict[str, bytes] = OrderedDict()
        self._ram_size = 0
        self._lock = threading.Lock()
        self._writes: list[tuple[Entry, bytes]] = []
        self._writing = False  # the writer holds an entry it has taken off the queue
        self._wake = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="cache-writer", daemon=True)
        self.stats = {"hits": 0, "misses": 0, "tokens_restored": 0, "bytes_read": 0, "bytes_written": 0,
                      "evictions": 0, "corrupt": 0}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer.start()

    # -- lookup and load -------------------------------------------------------------------------

    def best_prefix(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest token prefix with ``prompt``, and that prefix's length."""
        best: Entry | None = None
        best_common = 0
        with self._lock:
            candidates = list(self.entries.values())
        for entry in candidates:
            common = common_prefix(entry.tokens, prompt)
            if common > best_common or (common == best_common and best is not None and entry.size < best.size):
                best, best_common = entry, common
        return best, best_common

    def load(self, entry: Entry) -> bytes:
        """The entry's payload from RAM or disk (checksum verified); raises CorruptEntry and drops it."""
        with self._lock:
            payload = self._ram.get(entry.id)
            if payload is not None:
                self._ram.move_to_end(entry.id)
        if payload is None:
            try:
                tokens, payload = read_entry(entry.path, self.fingerprint)
            except (OSError, CorruptEntry) as exc:
                self.stats["corrupt"] += 1
                log.warning("dropping cache entry %s: %s", entry.path.name, exc)
                self.remove(entry.id)
                raise CorruptEntry(str(exc)) from exc
            if tokens != entry.tokens:
                self.remove(entry.id)
                raise CorruptEntry("tokens changed on disk")
            self.stats["bytes_read"] += len(payload)
            self._remember(entry.id, payload)
        entry.last_used = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # the file's mtime carries LRU order across restarts
        return payload

    # -- saving ----------------------------------------------------------------------------------

    def has(self, tokens: list[int]) -> bool:
        with self._lock:
            return any(entry.tokens == tokens for entry in self.entries.values())

    def save_async(self, tokens: list[int], payload: bytes, session: str | None, kind: str = "history") -> None:
        """Index an entry now (RAM tier) and queue it for the disk; the caller never waits for the disk."""
        if len(tokens) < MIN_TOKENS:
            return
        tokens = list(tokens)
        with self._lock:
            for entry in self.entries.values():
                if entry.tokens == tokens:
                    entry.last_used = time.time()
                    return  # already stored
        entry_id = uuid.uuid4().hex
        entry = Entry(id=entry_id, tokens=tokens, size=len(payload), path=self.dir / f"{entry_id}.kv",
                      session=session, kind=kind)
        superseded = []
        with self._lock:
            for other in self.entries.values():
                grown = len(other.tokens) < len(tokens) and tokens[: len(other.tokens)] == other.tokens
                if grown and other.session == session and other.kind == kind == "history":
                    superseded.append(other.id)  # the same conversation, grown: the old entry adds nothing
            self.entries[entry_id] = entry
        self._remember(entry_id, payload)
        for other_id in superseded:
            self.remove(other_id)
        with self._wake:
            self._writes.append((entry, payload))
            self._wake.notify()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (used at shutdown and by tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._writes and not self._writing:
                    return
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._writes:
                    self._wake.wait()
                entry, payload = self._writes.pop(0)
                self._writing = True
            try:
                self._write(entry, payload)
            except Exception:
                log.exception("cache write failed")
            finally:
                with self._lock:
                    self._writing = False

    def _write(self, entry: Entry, payload: bytes) -> None:
        with self._lock:
            if entry.id not in self.entries:
                return  # superseded or evicted before it reached the disk
        write_entry(entry.path, self.fingerprint, entry.tokens, payload, entry.session, entry.kind)
        entry.size = entry.path.stat().st_size
        with self._lock:
            still_wanted = entry.id in self.entries
        if not still_wanted:
            entry.path.unlink(missing_ok=True)
            return
        self.stats["bytes_written"] += entry.size
        self.enforce_quota()

    # -- retention -------------------------------------------------------------------------------

    def enforce_quota(self) -> None:
        """Evict until under quota: history before system prefixes, least recently used first, never pinned."""
        from localai.cache_admin import load_pins, pinned_until

        pins = load_pins(self.dir.parent)
        with self._lock:
            total = sum(entry.size for entry in self.entries.values())
            victims: list[str] = []
            order = sorted(self.entries.values(), key=lambda e: (e.kind == "system", e.last_used))
            for entry in order:
                if total <= self.max_bytes:
                    break
                if pinned_until(pins, entry.id, entry.session) is not None:
                    continue
                victims.append(entry.id)
                total -= entry.size
        for victim in victims:
            self.remove(victim)
            self.stats["evictions"] += 1

    def remove(self, entry_id: str) -> None:
        with self._lock:
            entry = self.entries.pop(entry_id, None)
            payload = self._ram.pop(entry_id, None)
            if payload is not None:
                self._ram_size -= len(payload)
        if entry is not None:
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()

    def _remember(self, entry_id: str, payload: bytes) -> None:
        with self._lock:
            if entry_id in self._ram:
                return
            self._ram[entry_id] = payload
            self._ram_size += len(payload)
            while self._ram_size > self.ram_bytes and self._ram:
                _, dropped = self._ram.popitem(last=False)
                self._ram_size -= len(dropped)

    def _scan(self) -> None:
        for temp in self.dir.glob(".tmp-*"):
            temp.unlink(missing_ok=True)  # a write that never finished
        for path in self.dir.glob("*.kv"):
            try:
                header, tokens = read_header(path, self.fingerprint)
            except (OSError, CorruptEntry) as exc:
                log.warning("dropping unreadable cache entry %s: %s", path.name, exc)
                self.stats["corrupt"] += 1
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            self.entries[path.stem] = Entry(id=path.stem, tokens=tokens, size=stat.st_size, path=path,
                                            session=header.get("session"), last_used=stat.st_mtime,
                                            kind=str(header.get("kind", "history")))


def common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    if limit and a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # binary search on equal prefixes: list slices compare in C
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def write_entry(path: Path, fingerprint_hex: str, tokens: list[int], payload: bytes, session: str | None,
                kind: str = "history") -> None:
    token_bytes = array.array("i", tokens).tobytes()
    header = json.dumps({
        "fingerprint": fingerprint_hex, "n_tokens": len(tokens), "payload_bytes": len(payload),
        "checksum": _checksum(token_bytes, payload), "session": session, "created": time.time(), "kind": kind,
    }).encode()
    temp = path.with_name(f".tmp-{path.name}")
    try:
        with open(temp, "wb") as handle:
            handle.write(MAGIC + HEADER_LEN.pack(len(header)) + header)
            handle.write(token_bytes)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def read_header(path: Path, fingerprint_hex: str) -> tuple[dict[str, Any], list[int]]:
    with open(path, "rb") as handle:
        header, tokens, _ = _read(handle, fingerprint_hex, with_payload=False)
    return header, tokens


def read_entry(path: Path, fingerprint_hex: str) -> tuple[list[int], bytes]:
    with open(path, "rb") as handle:
        _, tokens, payload = _read(handle, fingerprint_hex, with_payload=True)
    return tokens, payload


def _read(handle: Any, fingerprint_hex: str, *, with_payload: bool) -> tuple[dict[str, Any], list[int], bytes]:
    if handle.read(len(MAGIC)) != MAGIC:
        raise CorruptEntry("not a localai cache file")
    raw_length = handle.read(HEADER_LEN.size)
    if len(raw_length) != HEADER_LEN.size:
        raise CorruptEntry("truncated header")
    (length,) = HEADER_LEN.unpack(raw_length)
    try:
        header = json.loads(handle.read(length))
    except ValueError as exc:
        raise CorruptEntry(f"bad header: {exc}") from exc
    if header.get("fingerprint") != fingerprint_hex:
        raise CorruptEntry("made by another model or engine configuration")
    token_bytes = handle.read(4 * int(header["n_tokens"]))
    if len(token_bytes) != 4 * int(header["n_tokens"]):
        raise CorruptEntry("truncated tokens")
    tokens = array.array("i")
    tokens.frombytes(token_bytes)
    payload = b""
    if with_payload:
        payload = handle.read(int(header["payload_bytes"]) + 1)
        if len(payload) != int(header["payload_bytes"]):
            raise CorruptEntry("truncated or padded payload")
        if _checksum(token_bytes, payload) != header["checksum"]:
            raise CorruptEntry("checksum mismatch")
    return header, tokens.tolist(), payload
