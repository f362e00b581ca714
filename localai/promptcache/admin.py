"""Managing the persisted prompt cache from outside a worker: list, stats, pins, remove, prune.

Used by ``localai cache ...`` (directly on ``$LOCALAI_HOME/cache``, no daemon needed) and by the
``/api/cache`` endpoints (pins are ``pins.py``'s). Listings only read; removals hold the folder's lock and mark it
changed, so a worker forgets what was removed before its next save or lookup; pins are re-read at eviction time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localai import paths
from localai.errors import InvalidRequest
from localai.promptcache import legacy
from localai.promptcache.blocks import CorruptEntry, Folder
from localai.promptcache.pins import Pin, drop_expired, load_pins, pinned_until


@dataclass
class EntryInfo:
    id: str
    fingerprint: str
    tokens: int
    bytes: int  # its blocks (shared ones counted in every entry that uses them) and snapshot
    blocks: int
    session: str | None
    kind: str
    last_used: float
    pinned_until: float | None
    partition: str = ""  # whose prefix cache it is: an API key's id and a cache_salt's hash ("" the default)


def folders(root: Path | None = None, *, hold: contextlib.ExitStack | None = None) -> list[Folder]:
    """Every fingerprint folder, scanned (headers only, read-only: workers may be writing). With ``hold``, each
    folder is locked exclusively before it is read, until ``hold`` closes: for removing what the scan found (a
    worker's head cannot land over blocks deleted under it)."""
    base = root or paths.cache_dir()
    found = []
    for path in sorted(base.glob("*/")) if base.exists() else []:
        if path.is_dir() and not path.name.startswith("."):
            folder = Folder(path)
            if hold is not None:
                hold.enter_context(folder.locked(exclusive=True))
            folder.scan()
            found.append(folder)
    return found


Visible = Callable[[str], bool]  # which partitions a caller may see (None: all, the machine's owner)


def list_entries(root: Path | None = None, *, scanned: list[Folder] | None = None,
                 visible: Visible | None = None) -> list[EntryInfo]:
    base = root or paths.cache_dir()
    pins = load_pins(base)
    entries = []
    for folder in folders(base) if scanned is None else scanned:
        for head in folder.complete_heads():
            keys = folder.chain(head.key)
            needed = folder.reached([head.key])  # the chain's blocks and their bases
            size = sum(folder.blocks[key].size for key in needed) + folder.snapshots.get(head.key, 0)
            partition = folder.partition_of(head.key)
            entries.append(EntryInfo(
                id=head.id, fingerprint=folder.fingerprint, tokens=head.n_tokens, bytes=size, blocks=len(keys),
                session=head.session, kind=head.kind, last_used=head.last_used,
                pinned_until=pinned_until(pins, head.id, head.session, partition), partition=partition,
            ))
        for path in folder.path.glob("*.kv"):  # whole-sequence entries from before blocks
            if path.name.startswith("."):
                continue
            try:
                header, tokens = legacy.read_header(path, folder.fingerprint)
                stat = path.stat()
            except (OSError, CorruptEntry):
                continue
            entries.append(EntryInfo(
                id=path.stem, fingerprint=folder.fingerprint, tokens=len(tokens), bytes=stat.st_size, blocks=0,
                session=header.get("session"), kind="legacy", last_used=stat.st_mtime,
                pinned_until=pinned_until(pins, path.stem, header.get("session")),
            ))
    entries.sort(key=lambda e: e.last_used, reverse=True)
    return entries if visible is None else [entry for entry in entries if visible(entry.partition)]


def stats(root: Path | None = None) -> dict[str, Any]:
    """Totals: entries, the blocks they share, bytes on disk (each block once), tokens, pins."""
    return overview(root)[0]


def overview(root: Path | None = None, *, visible: Visible | None = None) -> tuple[dict[str, Any], list[EntryInfo]]:
    """The totals and the entries, from one scan of the folders (``/api/cache``, which the TUI polls). With
    ``visible``, only those entries, and totals of them alone (blocks and bytes counted per entry)."""
    base = root or paths.cache_dir()
    scanned = folders(base)
    entries = list_entries(base, scanned=scanned, visible=visible)
    if visible is not None:
        return {
            "entries": len(entries), "blocks": sum(e.blocks for e in entries), "bytes": sum(e.bytes for e in entries),
            "tokens": sum(e.tokens for e in entries), "block_tokens": sum(e.tokens for e in entries),
            "pinned": sum(1 for e in entries if e.pinned_until),
            "sessions": len({e.session for e in entries if e.session}),
            "fingerprints": len({e.fingerprint for e in entries}), "pins": sum(1 for e in entries if e.pinned_until),
        }, entries
    legacy_bytes = sum(e.bytes for e in entries if e.kind == "legacy")
    return {
        "entries": len(entries), "blocks": sum(len(f.blocks) for f in scanned),
        "bytes": sum(f.bytes_on_disk() for f in scanned) + legacy_bytes,
        "tokens": sum(e.tokens for e in entries),
        "block_tokens": sum(len(b.tokens) for f in scanned for b in f.blocks.values()),
        "pinned": sum(1 for e in entries if e.pinned_until),
        "sessions": len({e.session for e in entries if e.session}),
        "fingerprints": len(scanned), "pins": len(load_pins(base)),
    }, entries


def _drop_heads(folder: Folder, head_ids: list[str]) -> None:
    """Remove entries, and the blocks no remaining entry reaches."""
    chains = {key for head_id in head_ids if head_id in folder.heads
              for key in folder.reached([folder.heads[head_id].key])}
    for head_id in head_ids:
        folder.drop_head(head_id)
    for key in chains - folder.referenced():
        folder.drop_block(key)
    if head_ids:
        folder.mark_changed()


def remove_entries(*, entry: str | None = None, session: str | None = None, partition: str | None = None,
                   root: Path | None = None, visible: Visible | None = None) -> int:
    """Delete one entry, all of a session's, or all of a partition's (a principal's: its salted partitions too);
    with ``visible``, only among those a caller may see. Returns how many."""
    if not entry and not session and partition is None:
        raise InvalidRequest("name an entry, a session or a partition to remove", param="entry")
    base = root or paths.cache_dir()

    def doomed(folder: Folder, head_id: str, head_session: str | None) -> bool:
        mine = folder.partition_of(folder.heads[head_id].key)
        named = head_id == entry or bool(session and head_session == session) or (
            partition is not None and (mine == partition or mine.startswith(partition + ".")))
        return named and (visible is None or visible(mine))

    with contextlib.ExitStack() as hold:
        return _remove_entries(folders(base, hold=hold), entry if visible is None else None, doomed)


def _remove_entries(scanned: list[Folder], entry: str | None,
                    doomed: Callable[[Folder, str, str | None], bool]) -> int:
    removed = 0
    for folder in scanned:
        doomed_ids = [h.id for h in folder.heads.values() if doomed(folder, h.id, h.session)]
        _drop_heads(folder, doomed_ids)
        removed += len(doomed_ids)
        for path in folder.path.glob("*.kv"):  # old whole-sequence entries: the default partition's
            if entry and path.stem == entry:
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def prune(*, max_bytes: int, older_than: float | None = None, root: Path | None = None) -> int:
    """Delete unpinned entries unused for ``older_than`` seconds (and old-format entries), then least recently
    used blocks, tails before the prefixes they extend, until under ``max_bytes``; returns the blocks and entries
    removed."""
    base = root or paths.cache_dir()
    pins = load_pins(base)
    with contextlib.ExitStack() as hold:
        removed = _prune(folders(base, hold=hold), pins, max_bytes, older_than)
    drop_expired(base)
    return removed


def _prune(scanned: list[Folder], pins: list[Pin], max_bytes: int, older_than: float | None) -> int:
    now = time.time()
    removed = 0
    for folder in scanned:
        for path in folder.path.glob("*.kv"):
            path.unlink(missing_ok=True)
            removed += 1
        if older_than is not None:
            stale = [h.id for h in folder.heads.values()
                     if pinned_until(pins, h.id, h.session, folder.partition_of(h.key)) is None
                     and now - h.last_used > older_than]
            _drop_heads(folder, stale)
            removed += len(stale)
    total = sum(folder.bytes_on_disk() for folder in scanned)
    protected = {folder.fingerprint: folder.reached([
        h.key for h in folder.heads.values() if pinned_until(pins, h.id, h.session, folder.partition_of(h.key))
        is not None]) for folder in scanned}
    while total > max_bytes:
        candidates = [(b.system, b.last_used, folder, b) for folder in scanned for b in folder.blocks.values()
                      if folder.is_leaf(b.key) and b.key not in protected[folder.fingerprint]]
        if not candidates:
            break
        _, _, folder, block = min(candidates, key=lambda item: (item[0], item[1]))
        total -= block.size + folder.snapshots.get(block.key, 0)
        for head in folder.drop_block(block.key):
            folder.write_head(head)
        folder.mark_changed()
        removed += 1
    return removed
