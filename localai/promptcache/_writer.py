"""The prompt store's disk writes: a queue of blocks, snapshots and entry heads, written by a thread of its own so a
request never waits on the disk, and bounded in bytes (its oldest payloads go first when the disk falls behind).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from localai.promptcache.blocks import (
    STALE_TEMP_SECONDS,
    Folder,
    Head,
    Removal,
    block_file,
    snapshot_file,
    write_atomic,
)

log = logging.getLogger("localai.cache")


class Store(Protocol):
    """What the writer reaches of its ``PromptStore``."""

    dir: Path
    folder: Folder
    on_warning: Callable[[str], None] | None
    stats: dict[str, int]
    queue_bytes: int  # the most payload bytes queued

    def _remember(self, key: str, payload: bytes) -> None: ...

    def _notice_deletions(self) -> None: ...

    def enforce_quota(self, *, fresh: bool = True) -> None: ...


class Writer:
    """The store's write queue and the thread that drains it; shares the store's lock (and index)."""

    def __init__(self, store: Store, lock: threading.RLock) -> None:
        self.store = store
        self.pending: dict[str, bytes] = {}  # payloads queued for the disk
        # The writes in order, by a serial number: taken from the front, and dropped from anywhere by the queue
        # bound, in O(1) (a list's pop(0) and remove() were O(n) under the lock).
        self.queue: OrderedDict[int, tuple[str, Any]] = OrderedDict()
        self.weighty: OrderedDict[int, str] = OrderedDict()  # the queued writes with a payload: their pending key
        self.queued_blocks: Counter[str] = Counter()  # the keys of the blocks in the queue
        self.serial = 0
        self.queued_bytes = 0
        self.busy = False
        self.closing = False  # close(): the writer ends once the queue is empty
        self.failed_writes = 0  # write failures not logged yet (see abandon)
        # The first write failure was told (the store's ``on_warning``: the daemon's log, as the worker's own log
        # is most often on the disk that filled, and a full disk showed only in /metrics)
        self.failure_told = False
        self.tidy_due = False  # an entry was written: garbage and quota are due once the queue drains
        self.failed_logged_at = -math.inf
        self.tidy_failed_logged_at = -math.inf
        self.lock = lock
        self.wake = threading.Condition(lock)
        self.thread = threading.Thread(target=self.write_loop, name="cache-writer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def enqueue(self, kind: str, item: Any, payload: bytes | bytearray | memoryview) -> None:
        """Queue a write (caller holds the lock); a queue larger than the store's ``queue_bytes`` drops its oldest
        payloads, blocks and snapshots alike (a recurrent state's snapshot is tens of MB: on a slow disk they pile up
        too). A dropped write stays indexed without a file, as a failed one does (``abandon``): a restore that needs
        it finds it in RAM or missing."""
        payload = bytes(payload)  # a snapshot cut from the engine's (mutable) state buffer: kept as its own copy
        key = pending_key(kind, item)
        if key:
            self.queued_bytes -= len(self.pending.get(key, b""))  # queued again before written: counted once
            self.pending[key] = payload
            self.store._remember(key, payload)
        self.serial += 1
        self.queue[self.serial] = (kind, item)
        if payload:
            self.weighty[self.serial] = key
        if kind == "block":
            self.queued_blocks[item.key] += 1
        self.queued_bytes += len(payload)
        while self.queued_bytes > self.store.queue_bytes:
            victim = None
            while self.weighty:  # the oldest queued write whose payload is still pending
                serial, dropped_key = next(iter(self.weighty.items()))
                if self.pending.get(dropped_key):
                    victim = serial
                    break
                del self.weighty[serial]  # its payload went meanwhile (a checkpoint bounded away, a duplicate)
            if victim is None:
                break
            dropped_kind, _ = self.take(victim)
            self.queued_bytes -= len(self.pending.pop(dropped_key, b""))
            self.store.stats["dropped_writes"] += 1
            log.warning("cache writes are behind; not persisting %s %s", dropped_kind, dropped_key[2:])

    def take(self, serial: int | None = None) -> tuple[str, Any]:
        """Take a write off the queue: the oldest, or the one numbered ``serial`` (caller holds the lock)."""
        if serial is None:
            serial, entry = self.queue.popitem(last=False)
        else:
            entry = self.queue.pop(serial)
        self.weighty.pop(serial, None)
        kind, item = entry
        if kind == "block":
            self.queued_blocks[item.key] -= 1
            if not self.queued_blocks[item.key]:
                del self.queued_blocks[item.key]
        return entry

    def flush(self, timeout: float = 55.0) -> None:
        """Wait until queued writes are on disk (used at shutdown and by tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self.queue and not self.busy:
                    return
            time.sleep(0.01)
        log.warning("cache writes still queued after %.0f s at shutdown; they are lost", timeout)

    def close(self, timeout: float = 55.0) -> None:
        """Write what is queued and stop the writer thread."""
        self.flush(timeout)
        with self.wake:
            self.closing = True
            self.wake.notify()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def write_loop(self) -> None:
        while True:
            with self.wake:
                while not self.queue and not self.closing:
                    self.wake.wait()
                if not self.queue:
                    return  # closed, and everything queued was written
                kind, item = self.take()
                self.busy = True
            try:
                try:
                    self.write(kind, item)
                except Exception as exc:
                    self.abandon(kind, item, exc)
                else:
                    self.tidy()
            finally:
                with self.lock:
                    self.busy = False

    def tidy(self) -> None:
        """Garbage and quota, once the queue drains after an entry was written. A failure here is the cache's upkeep
        failing, not the write before it (which is on disk): logged as what it is, and not counted as dropped."""
        with self.lock:
            due = self.tidy_due and not self.queue
        if not due:
            return
        self.tidy_due = False
        store = self.store
        try:
            removal = Removal(store.folder)
            with self.lock:
                store.folder.collect_garbage(keep=self.queued_keys() | self.others_recent(), removal=removal)
            removal.apply()  # the unlinks without the lock: the engine thread's lookups and saves go on
            store.enforce_quota(fresh=False)
        except OSError as exc:  # a full or vanished disk: one line a minute, as for writes
            now = time.monotonic()
            if now - self.tidy_failed_logged_at >= 60.0:
                log.warning("cache garbage collection or quota enforcement failed (%s); the cache may hold more "
                            "than its quota until a later pass succeeds", exc)
                self.tidy_failed_logged_at = now
        except Exception as exc:
            log.error("cache garbage collection or quota enforcement failed", exc_info=exc)

    def write(self, kind: str, item: Any) -> None:
        store, folder = self.store, self.store.folder
        if kind == "block":
            with self.lock:
                payload = self.pending.get("b:" + item.key)
                if payload is not None and item.key not in folder.blocks:  # dropped while it waited
                    del self.pending["b:" + item.key]
                    self.queued_bytes -= len(payload)
                    return
            if payload is None:
                return
            written = write_atomic(folder.block_path(item.key),
                                   block_file(item.parent, item.tokens, payload, item.base))
            with self.lock:
                self.pending.pop("b:" + item.key, None)
                self.queued_bytes -= len(payload)
                item.size, item.on_disk = written, True
                if item.key not in folder.blocks:  # evicted or dropped while it was written
                    folder.block_path(item.key).unlink(missing_ok=True)
                    return
                store.stats["bytes_written"] += written
                store.stats["blocks_written"] += 1
        elif kind == "snapshot":
            with self.lock:
                payload = self.pending.get("s:" + item)
                if payload is not None and item not in folder.snapshots:  # dropped while it waited
                    del self.pending["s:" + item]
                    self.queued_bytes -= len(payload)
                    return
            if payload is None:
                return
            written = write_atomic(folder.snapshot_path(item), snapshot_file(payload))
            with self.lock:
                if self.pending.get("s:" + item) is payload:  # else dropped meanwhile: its bytes given back then
                    del self.pending["s:" + item]
                    self.queued_bytes -= len(payload)
                if item not in folder.snapshots:  # dropped while it was written: its file would be an orphan
                    folder.snapshot_path(item).unlink(missing_ok=True)
                    return
                folder.snapshots[item] = written
                store.stats["bytes_written"] += written
                store.stats["snapshots_written"] += 1
        elif kind == "drop_snapshot":
            with self.lock:
                if not any(h.key == item and h.snapshot for h in folder.heads.values()):
                    folder.drop_snapshot(item)
        elif kind == "head":
            head: Head = item
            with folder.locked(exclusive=False):  # no block of its chain is deleted until it is written
                store._notice_deletions()  # blocks deleted while it waited: never write a head over missing blocks
                with self.lock:
                    needed = folder.reached([head.key]) if folder.heads.get(head.id) is head else set()
                    # a block of the chain never written (the queue bound dropped it, or its write failed) would
                    # make the entry's file name a missing block: it stays unwritten (its old file, if any, stays)
                    if not needed or not all(folder.blocks[key].on_disk for key in needed):
                        return
                    data = json.dumps(head.as_json()).encode()
                    key = head.key
                write_atomic(folder.head_path(head.id), [data])
                with self.lock:
                    head.written, head.disk_key = True, key
            self.tidy_due = True  # garbage and quota once the queue drains, not after every entry

    def abandon(self, kind: str, item: Any, exc: Exception) -> None:
        """A write that failed (a full disk, a vanished folder): its payload is let go, so failed writes never pile
        up in memory; the block stays known without a file, and a restore that needs it finds it missing and stops
        before it (as for a block another worker evicted)."""
        key = pending_key(kind, item)
        with self.lock:
            payload = self.pending.pop(key, b"") if key else b""
            self.queued_bytes -= len(payload)
            self.store.stats["dropped_writes"] += 1
        if isinstance(exc, OSError):  # a full disk fails every write: one line a minute, with the count
            self.failed_writes += 1
            tell = self.store.on_warning
            if tell is not None and not self.failure_told:
                self.failure_told = True
                try:  # whatever the telling does, the writer thread goes on
                    tell(f"the prompt cache could not write a file in {self.store.dir} ({exc}); replies are "
                         "unaffected, the cache keeps less (later failures: the worker's log and /metrics' dropped "
                         "writes)")
                except Exception:
                    log.exception("could not pass on the cache's first failed write")
            now = time.monotonic()
            if now - self.failed_logged_at >= 60.0:
                log.warning("could not write %d cache file(s) (%s); replies are unaffected, the cache keeps less",
                            self.failed_writes, exc)
                self.failed_logged_at, self.failed_writes = now, 0
        else:
            log.error("cache %s write failed", kind, exc_info=exc)

    def others_recent(self) -> set[str]:
        """Blocks another worker wrote lately (its entry may not be on disk yet): not garbage."""
        limit = time.time() - STALE_TEMP_SECONDS
        return {b.key for b in self.store.folder.blocks.values() if not b.mine and b.last_used > limit}

    def queued_keys(self) -> set[str]:
        """The blocks queued or being written."""
        return set(self.queued_blocks) | {key[2:] for key in self.pending if key.startswith("b:")}

    def queued_heads(self) -> set[str]:
        return {item.id for kind, item in self.queue.values() if kind == "head"}


def pending_key(kind: str, item: Any) -> str:
    """A queued write's key in ``pending`` and the RAM tier ("" for writes without a payload)."""
    return "b:" + item.key if kind == "block" else "s:" + item if kind == "snapshot" else ""
