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
STALE_TEMP_SECONDS = 3600.0


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
    on_disk: bool = False  # written (or found) on disk; until then only the RAM tier or the write queue holds it


class CorruptEntry(Exception):
    """A cache file that is truncated, altered or foreign."""


class SessionCache:
    """The RAM and disk tiers for one model fingerprint. Thread-safe; writes happen on a background thread.

    ``max_bytes`` is the quota of the whole cache folder (every fingerprint), as ``LOCALAI_CACHE_MAX_BYTES`` says.
    Several workers may share a fingerprint folder (two names for the same weights): a file another worker
    deleted is a miss here, never "corrupt".
    """

    def __init__(self, root: Path, fingerprint_hex: str, *, max_bytes: int, ram_bytes: int = 256 << 20,
                 queue_bytes: int | None = None) -> None:
        self.root = root
        self.dir = root / fingerprint_hex
        self.fingerprint = fingerprint_hex
        self.max_bytes = max_bytes
        self.ram_bytes = ram_bytes
        self.entries: dict[str, Entry] = {}
        self._ram: OrderedDict[str, bytes] = OrderedDict()
        self._ram_size = 0
        self._lock = threading.Lock()
        self._writes: list[tuple[Entry, bytes]] = []
        self._queued_bytes = 0
        self.queue_bytes = queue_bytes if queue_bytes is not None else max(4 * ram_bytes, 1 << 30)
        self._writing: tuple[Entry, bytes] | None = None  # what the writer took off the queue
        self._wake = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="cache-writer", daemon=True)
        self.stats = {"hits": 0, "misses": 0, "tokens_restored": 0, "bytes_read": 0, "bytes_written": 0,
                      "evictions": 0, "corrupt": 0, "dropped_writes": 0}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer.start()

    # -- lookup and load -------------------------------------------------------------------------

    def best_prefix(self, prompt: list[int], *, whole: bool = False) -> tuple[Entry | None, int]:
        """The entry sharing the longest token prefix with ``prompt``, and that prefix's length. With ``whole``,
        only entries that are entirely a prefix of the prompt (for engines that cannot cut a restored state)."""
        best: Entry | None = None
        best_common = 0
        with self._lock:
            candidates = list(self.entries.values())
        for entry in candidates:
            common = common_prefix(entry.tokens, prompt)
            if whole and common < len(entry.tokens):
                continue
            if common > best_common or (common == best_common and best is not None and entry.size < best.size):
                best, best_common = entry, common
        return best, best_common

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a statistic (the engine and the writer thread both count)."""
        with self._lock:
            self.stats[name] += amount

    def stats_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)

    def load(self, entry: Entry) -> bytes:
        """The entry's payload from RAM, the write queue or disk (checksum verified); raises CorruptEntry and
        drops it when the bytes are bad, or when they are simply gone (another worker deleted the file)."""
        with self._lock:
            payload = self._ram.get(entry.id)
            if payload is not None:
                self._ram.move_to_end(entry.id)
            else:
                payload = self._queued_payload(entry.id)
        if payload is None:
            try:
                tokens, payload = read_entry(entry.path, self.fingerprint)
            except FileNotFoundError as exc:
                self.remove(entry.id)  # evicted by another worker on this folder, or never written: a miss
                raise CorruptEntry("gone") from exc
            except (OSError, CorruptEntry) as exc:
                self.count("corrupt")
                log.warning("dropping cache entry %s: %s", entry.path.name, exc)
                self.remove(entry.id)
                raise CorruptEntry(str(exc)) from exc
            if tokens != entry.tokens:
                self.count("corrupt")
                self.remove(entry.id)
                raise CorruptEntry("tokens changed on disk")
            self.count("bytes_read", len(payload))
            self._remember(entry.id, payload)
        entry.last_used = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # the file's mtime carries LRU order across restarts
        return payload

    def _queued_payload(self, entry_id: str) -> bytes | None:
        """A payload still waiting for the disk (caller holds the lock)."""
        if self._writing is not None and self._writing[0].id == entry_id:
            return self._writing[1]
        return next((payload for queued, payload in self._writes if queued.id == entry_id), None)

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
            self._writes.append((entry, payload))  # queued before the RAM tier sees it: it is held somewhere
            self._queued_bytes += len(payload)
        self._remember(entry_id, payload)
        for other_id in superseded:
            self.remove(other_id)  # also takes its payload off the write queue
        with self._wake:
            self._bound_queue()
            self._wake.notify()

    def _bound_queue(self) -> None:
        """Drop the oldest queued history writes while the queue holds more than ``queue_bytes`` (caller holds
        the lock): a disk slower than the turns must not grow the worker's memory without limit."""
        while self._queued_bytes > self.queue_bytes and len(self._writes) > 1:
            victim = next((item for item in self._writes if item[0].kind == "history"), self._writes[0])
            self._writes.remove(victim)
            self._queued_bytes -= len(victim[1])
            self.stats["dropped_writes"] += 1
            if victim[0].id not in self._ram:
                self.entries.pop(victim[0].id, None)  # held nowhere now
            log.warning("cache writes are behind; not persisting entry %s", victim[0].id)

    def flush(self, timeout: float = 55.0) -> None:
        """Wait until queued writes are on disk (used at shutdown and by tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._writes and self._writing is None:
                    return
            time.sleep(0.01)
        log.warning("cache writes still queued after %.0f s at shutdown; they are lost", timeout)

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._writes:
                    self._wake.wait()
                entry, payload = self._writing = self._writes.pop(0)
                self._queued_bytes -= len(payload)
            try:
                self._write(entry, payload)
            except Exception:
                log.exception("cache write failed")
            finally:
                with self._lock:
                    self._writing = None

    def _write(self, entry: Entry, payload: bytes) -> None:
        with self._lock:
            if entry.id not in self.entries:
                return  # superseded or evicted before it reached the disk
        write_entry(entry.path, self.fingerprint, entry.tokens, payload, entry.session, entry.kind)
        entry.size = entry.path.stat().st_size
        with self._lock:
            still_wanted = entry.id in self.entries
            entry.on_disk = still_wanted
        if not still_wanted:
            entry.path.unlink(missing_ok=True)
            return
        self.count("bytes_written", entry.size)
        self.enforce_quota()

    # -- retention -------------------------------------------------------------------------------

    def enforce_quota(self) -> None:
        """Evict until the whole cache folder is under quota: history before system prefixes, least recently used
        first, never pinned. Other fingerprints' files (other models, or this model under another name) count
        and can be evicted too; their workers take a vanished file for a miss."""
        from localai.cache_admin import load_pins, pinned_until, read_kind_and_session

        pins = load_pins(self.root)
        with self._lock:
            own = {entry.id: entry for entry in self.entries.values() if entry.on_disk}
        candidates: list[tuple[bool, float, int, Path, Entry | None]] = []  # (system, last used, size, path, own)
        for path in self.root.glob("*/*.kv"):
            if path.name.startswith("."):
                continue
            mine = own.get(path.stem) if path.parent == self.dir else None
            try:
                stat = path.stat()
            except OSError:
                continue
            if mine is not None:
                candidates.append((mine.kind == "system", mine.last_used, stat.st_size, path, mine))
            else:
                candidates.append((False, stat.st_mtime, stat.st_size, path, None))
        total = sum(size for _, _, size, _, _ in candidates)
        for _, _, size, path, mine in sorted(candidates, key=lambda item: (item[0], item[1])):
            if total <= self.max_bytes:
                break
            if mine is not None:
                if pinned_until(pins, mine.id, mine.session) is not None:
                    continue
                self.remove(mine.id)
            else:
                kind, session = read_kind_and_session(path)
                if kind == "system" or pinned_until(pins, path.stem, session) is not None:
                    continue  # another worker's shared prefix or a pinned entry: theirs to evict
                path.unlink(missing_ok=True)
            total -= size
            self.count("evictions")

    def remove(self, entry_id: str) -> None:
        with self._lock:
            entry = self.entries.pop(entry_id, None)
            payload = self._ram.pop(entry_id, None)
            if payload is not None:
                self._ram_size -= len(payload)
            for queued in [item for item in self._writes if item[0].id == entry_id]:
                self._writes.remove(queued)  # superseded before it reached the disk: never write it
                self._queued_bytes -= len(queued[1])
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
                dropped_id, dropped = self._ram.popitem(last=False)
                self._ram_size -= len(dropped)
                entry = self.entries.get(dropped_id)
                if entry is not None and not entry.on_disk and self._queued_payload(dropped_id) is None:
                    del self.entries[dropped_id]  # in no tier any more: forget it rather than call it corrupt

    def _scan(self) -> None:
        for temp in self.dir.glob(".tmp-*"):
            with contextlib.suppress(OSError):
                if not _writer_alive(temp) or time.time() - temp.stat().st_mtime > STALE_TEMP_SECONDS:
                    temp.unlink()  # a write that never finished (a live writer's may be in flight: left alone)
        for path in self.dir.glob("*.kv"):
            if path.name.startswith("."):
                continue
            try:
                header, tokens = read_header(path, self.fingerprint)
            except (OSError, CorruptEntry) as exc:
                log.warning("dropping unreadable cache entry %s: %s", path.name, exc)
                self.count("corrupt")
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            self.entries[path.stem] = Entry(id=path.stem, tokens=tokens, size=stat.st_size, path=path,
                                            session=header.get("session"), last_used=stat.st_mtime,
                                            kind=str(header.get("kind", "history")), on_disk=True)


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
    temp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
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


def _writer_alive(temp: Path) -> bool:
    """Whether the process named in a temp file's name (``.tmp-<pid>-<id>.kv``) still runs."""
    pid = temp.name.split("-")[1] if temp.name.count("-") >= 2 else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
