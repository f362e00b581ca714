"""The prompt store's quota: the whole cache folder (every fingerprint) kept under ``max_bytes``, by evicting the
files of folders no live worker uses first, then the store's own least recently used leaf blocks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Protocol

from localai.paths import process_alive
from localai.promptcache._writer import Writer
from localai.promptcache.blocks import Folder
from localai.promptcache.pins import Pin, load_pins, pinned_until

OTHERS_SECONDS = 30.0  # how old the writer's view of the other folders' bytes may be (enforce)


class Store(Protocol):
    """What a quota pass reaches of its ``PromptStore``."""

    root: Path
    dir: Path
    max_bytes: int
    folder: Folder
    stats: dict[str, int]
    _lock: threading.RLock
    _writer: Writer
    _seen_change: int

    def count(self, name: str, amount: int = 1) -> None: ...

    def _notice_deletions(self) -> None: ...

    def _forget_ram_of_dropped(self) -> None: ...


class Quota:
    """One store's quota passes; shares the store's lock and index."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.others_scan: tuple[float, int, list[tuple[float, int, Path]]] | None = None

    def enforce(self, *, fresh: bool = True) -> None:
        """Evict until the whole cache folder is under quota: folders no live worker uses first (least recently
        used files), then this one's least recently used leaf blocks; never a pinned chain, never another live
        worker's entries. Not ``fresh`` (the writer, after each burst of writes): the other folders' bytes may
        be up to ``OTHERS_SECONDS`` old unless they would put the cache over quota; reading every other model's
        files after each turn cost a turn tens of milliseconds of the engine thread's time (the GIL) once the cache
        held ~10,000 files."""
        store = self.store
        with store._lock:
            total = store.folder.bytes_on_disk()
        others_total, others = self.scan_others(fresh)
        if not fresh and total + others_total > store.max_bytes:
            others_total, others = self.scan_others(True)
        total += others_total
        if total <= store.max_bytes:
            return
        # The disk work (other folders' files, a rescan of this one, the pins) happens outside the lock: lookups and
        # saves on the engine thread never wait for it. Only the index changes and this folder's eviction take it.
        if others:
            total = self.evict_others(total, others)
            if total <= store.max_bytes:
                return
        self.others_scan = None
        pins = load_pins(store.root)
        with store.folder.locked(exclusive=True):
            self.evict(total, pins)

    def evict_others(self, total: int, others: list[tuple[float, int, Path]]) -> int:
        """Delete the least recently used files of the folders no live worker uses, until ``total`` is under quota;
        returns the total left. Each of those folders is locked (exclusively, as its own workers' eviction does)
        and read again under its lock: the scan may be ``OTHERS_SECONDS`` old, and a worker that started on the
        folder since has indexed its files (it registers and scans under the lock shared: ``PromptStore``)."""
        store = self.store
        stale: dict[Path, int] = {}
        for _, size, path in others:
            where = store.root / path.relative_to(store.root).parts[0]
            stale[where] = stale.get(where, 0) + size
        with contextlib.ExitStack() as locks:
            files: list[tuple[float, int, Path, Folder]] = []
            for path in sorted(stale):  # in one order: two workers' quota passes never wait on each other in a cycle
                if not path.is_dir():
                    continue
                folder = Folder(path)
                locks.enter_context(folder.locked(exclusive=True))
                if used(path):
                    continue  # a worker started on it since the scan: its files are its own to evict
                found = cache_files(path)
                total += sum(size for _, size, _ in found) - stale[path]
                files += [(mtime, size, file, folder) for mtime, size, file in found]
            changed: dict[Path, Folder] = {}
            for _, size, file, folder in sorted(files, key=lambda entry: entry[:3]):
                if total <= store.max_bytes:
                    break
                with contextlib.suppress(OSError):
                    file.unlink()
                    total -= size
                    store.count("evictions")
                    changed[folder.path] = folder
            for folder in changed.values():
                folder.mark_changed()  # a worker that starts on it later reads it afresh anyway; `localai cache` too
        self.others_scan = None
        return total

    def scan_others(self, fresh: bool) -> tuple[int, list[tuple[float, int, Path]]]:
        """The other fingerprint folders' bytes, and the files of those no live worker uses (mtime, size, path)."""
        store = self.store
        cached = self.others_scan
        if not fresh and cached is not None and time.monotonic() - cached[0] < OTHERS_SECONDS:
            return cached[1], cached[2]
        others: list[tuple[float, int, Path]] = []
        total = 0
        for folder in store.root.iterdir() if store.root.exists() else []:
            if not folder.is_dir() or folder == store.dir:
                continue
            live = used(folder)
            for mtime, size, path in cache_files(folder):
                total += size
                if not live:
                    others.append((mtime, size, path))
        self.others_scan = (time.monotonic(), total, others)
        return total, others

    def evict(self, total: int, pins: list[Pin]) -> None:
        """This folder's eviction, under its exclusive lock (the caller's): nobody else deletes meanwhile."""
        store = self.store
        store._notice_deletions()  # others' deletions first: the mark this eviction leaves would hide them
        with store._lock:
            known = set(store.folder.blocks)
        fresh = Folder(store.dir)
        fresh.scan(known=known)  # blocks and entries another worker on this fingerprint added since (read-only)
        with store._lock:
            folder = store.folder
            for key, block in fresh.blocks.items():
                if key not in folder.blocks:
                    folder.add_block(block)
            for head_id, head in fresh.heads.items():
                folder.heads.setdefault(head_id, head)
            for key, size in fresh.snapshots.items():
                folder.snapshots.setdefault(key, size)
            heads = list(folder.heads.values())
            protected: set[str] = store._writer.queued_keys() | folder.reached(
                [h.key for h in heads if pinned_until(pins, h.id, h.session) is not None]
                + [h.disk_key for h in heads  # a moved head's file names them until it is rewritten
                   if h.disk_key is not None and h.disk_key != h.key])
            others_live = {h.owner for h in folder.heads.values()
                           if h.owner != os.getpid() and process_alive(h.owner)}
            removal = folder.plan_eviction(total - store.max_bytes, protected=protected, skip_owner=others_live)
            store.stats["evictions"] += removal.evicted
            store._forget_ram_of_dropped()
        # The victims are out of the index: their files go (and the moved entries' files are rewritten, fsynced)
        # without the lock, so the engine thread's lookups and saves go on meanwhile. Nobody else deletes here
        # until the folder's lock (the caller's) is let go.
        removal.apply()
        with store._lock:
            store._seen_change = folder.changed_stamp()  # its own mark, and nothing else's is unseen (above)


def used(folder: Path) -> bool:
    """Whether a live worker uses a fingerprint folder (its ``owners/<pid>`` file)."""
    return any(path.name.isdigit() and process_alive(int(path.name)) for path in (folder / "owners").glob("*"))


def cache_files(folder: Path) -> list[tuple[float, int, Path]]:
    """A fingerprint folder's blocks, snapshots and old entries: (mtime, size, path), writes in progress left out."""
    found = []
    for path in [*folder.glob("blocks/*.blk"), *folder.glob("snaps/*.snp"), *folder.glob("*.kv")]:
        if path.name.startswith("."):
            continue  # another process's write in progress
        with contextlib.suppress(OSError):
            stat = path.stat()
            found.append((stat.st_mtime, stat.st_size, path))
    return found
