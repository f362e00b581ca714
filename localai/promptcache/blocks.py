"""The prompt cache's files: chained token blocks, boundary snapshots and entry heads, and their index.

One folder per compatibility fingerprint (``<cache>/<fingerprint>/``), so a different model, engine build, context
size, KV type or attention layout never sees another's state:

- ``blocks/<key>.blk``: the KV of up to ``BLOCK_TOKENS`` tokens. ``key`` chains the fingerprint, the parent block's
  key and the block's tokens, so one key names one exact token prefix, and sequences sharing a prefix share its
  blocks. File: magic, u32 header length, JSON header (parent, token count, payload size, CRC32, and ``base`` where
  it has one), tokens, payload. A block written after a shorter one with the same parent and the first of its tokens
  (the partial last block of an earlier save, a checkpoint's tail) names it as its ``base`` and holds only the KV
  of the tokens after it: a conversation's saves write each token once, not the partial block again each turn.
- ``snaps/<key>.snp``: a boundary snapshot, the state an engine cannot cut by token (sliding-window layers, or a
  whole state from an engine without a block layout), taken where the sequence ending in block ``key`` ended.
- ``heads/<id>.json``: an entry: where one saved sequence ends (its last block), its session, kind and owner.
- ``layout.json``: how the engine rebuilds a state from blocks (written by the worker, read back after restarts).
- ``changed``: touched by whoever deletes files another process may have indexed (``localai cache rm`` and
  ``prune``, a worker's eviction); a worker that sees it move forgets what is gone before it saves or looks up.
- ``lock``: taken shared while a worker writes a head, exclusively while blocks are deleted, so no head is ever
  written over blocks deleted under it.
- ``owners/<pid>``: the workers using the folder now. Nothing a live worker on this folder owns is deleted by
  another (two names for the same weights, or two daemons on one home).

Every file is written to a temp name, fsynced and renamed, so a crash mid-write leaves no file; checksums are
verified on every load, and a block that fails is deleted with everything chained after it, never served.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import hashlib
import heapq
import json
import logging
import os
import struct
import time
import zlib
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localai.paths import process_alive

log = logging.getLogger("localai.cache")

# 64 tokens per block: a turn rewrites at most one partial block (<= 63 tokens) on top of what it added, which keeps
# bytes written per turn near the tokens added even for agents' short tool turns (~100 tokens), and a block is
# still 1.5 MB (135M model) to 8 MB (8B model, f16): large sequential writes, and a 30k-token session is ~470 files.
BLOCK_TOKENS = 64
MAGIC = b"LAIBLK01"
HEADER_LEN = struct.Struct("<I")
STALE_TEMP_SECONDS = 3600.0
CHANGED_FILE = "changed"
TEMP_PREFIX = ".tmp-"  # write_atomic's temp files: ``.tmp-<pid>-<hex>-<name>`` beside the file they become
LOCK_FILE = "lock"


def fingerprint(parts: dict[str, Any]) -> str:
    """A stable hash of everything that must match for KV state to be reusable."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def root_key(fingerprint: str, partition: str = "") -> str:
    """Where a chain starts: the fingerprint, or a root of a partition's own (a principal, a ``cache_salt``), so no
    block is shared across partitions. The default partition keeps the fingerprint: caches from before stay valid."""
    return f"{fingerprint}:{partition}" if partition else fingerprint


def chain_key(parent: str, tokens: list[int]) -> str:
    """The key of a block: its parent's key (the fingerprint for the first block) and its tokens."""
    digest = hashlib.blake2b(parent.encode(), digest_size=16)
    digest.update(array.array("i", tokens).tobytes())
    return digest.hexdigest()


def checksum(tokens: bytes, payload: bytes) -> str:
    # CRC32 catches truncation and bit rot (the threats here) at several times blake2b's speed.
    return f"crc32:{zlib.crc32(payload, zlib.crc32(tokens)):08x}"


class CorruptEntry(Exception):
    """A cache file that is truncated, altered or foreign."""


@dataclass
class Block:
    key: str
    parent: str  # the fingerprint for a first block
    tokens: list[int]
    size: int  # file bytes on disk (payload bytes until written)
    last_used: float = field(default_factory=time.time)
    on_disk: bool = False
    system: bool = False  # part of a shared system-and-tools prefix: evicted last
    mine: bool = False  # written by this process (others' may still wait for their entry to be written)
    base: str | None = None  # a shorter block with the same parent and the first tokens: the payload is the rest's


@dataclass
class Head:
    """An entry: the end of one saved sequence."""

    id: str
    key: str  # its last block
    n_tokens: int
    session: str | None
    kind: str  # "history", "system", or "checkpoint" (a snapshot where a state that cannot be cut returns)
    last_used: float
    owner: int  # the pid of the worker that saved it
    snapshot: bool = False  # a boundary snapshot exists at ``key``
    written: bool = True  # its file is on disk (False while a worker's save of it is queued)
    # The key its file on disk names, while a moved head's new version waits to be written (None: no file yet).
    # That older chain's blocks are kept until then: the file must never name a deleted block.
    disk_key: str | None = None

    def __post_init__(self) -> None:
        if self.written and self.disk_key is None:
            self.disk_key = self.key

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "key": self.key, "n_tokens": self.n_tokens, "session": self.session,
                "kind": self.kind, "last_used": self.last_used, "owner": self.owner, "snapshot": self.snapshot}


def parse_head(text: str) -> Head:
    """A head file's entry; raises ValueError, KeyError or TypeError when it is damaged."""
    raw = json.loads(text)
    return Head(id=str(raw["id"]), key=str(raw["key"]), n_tokens=int(raw["n_tokens"]), session=raw.get("session"),
                kind=str(raw.get("kind", "history")), last_used=float(raw.get("last_used", 0)),
                owner=int(raw.get("owner", 0)), snapshot=bool(raw.get("snapshot")))


def write_atomic(path: Path, parts: list[bytes]) -> int:
    """Write ``parts`` to ``path`` through a temp file, fsynced and renamed; returns the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}-{path.name}")  # unique: threads too
    try:
        with open(temp, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return sum(len(part) for part in parts)


@contextlib.contextmanager
def file_lock(path: Path, *, exclusive: bool = True) -> Iterator[None]:
    """An flock on ``path`` (created if missing). Each call opens the file anew, so threads of one process exclude
    each other as separate processes do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def block_file(parent: str, tokens: list[int], payload: bytes, base: str | None = None) -> list[bytes]:
    token_bytes = array.array("i", tokens).tobytes()
    fields = {"parent": parent, "n_tokens": len(tokens), "payload_bytes": len(payload),
              "checksum": checksum(token_bytes, payload)}
    if base is not None:
        fields["base"] = base
    header = json.dumps(fields).encode()
    return [MAGIC, HEADER_LEN.pack(len(header)), header, token_bytes, payload]


def read_framed(handle: Any, magic: bytes, *, with_payload: bool) -> tuple[dict[str, Any], list[int], bytes]:
    """Magic, u32 header length, JSON header (``n_tokens``, ``payload_bytes``, ``checksum``), tokens, payload: the
    layout of block files and of the old whole-sequence entries. The payload is checksum-verified when read."""
    if handle.read(len(magic)) != magic:
        raise CorruptEntry("not a localai cache file")
    raw_length = handle.read(HEADER_LEN.size)
    if len(raw_length) != HEADER_LEN.size:
        raise CorruptEntry("truncated header")
    (length,) = HEADER_LEN.unpack(raw_length)
    try:
        header = json.loads(handle.read(length))
        n_tokens, payload_bytes = int(header["n_tokens"]), int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"bad header: {exc}") from exc
    token_bytes = handle.read(4 * n_tokens)
    if len(token_bytes) != 4 * n_tokens:
        raise CorruptEntry("truncated tokens")
    tokens = array.array("i")
    tokens.frombytes(token_bytes)
    payload = b""
    if with_payload:
        payload = handle.read(payload_bytes + 1)
        if len(payload) != payload_bytes:
            raise CorruptEntry("truncated or padded payload")
        if checksum(token_bytes, payload) != header.get("checksum"):
            raise CorruptEntry("checksum mismatch")
    return header, tokens.tolist(), payload


def read_block(path: Path, *, with_payload: bool) -> tuple[dict[str, Any], list[int], bytes]:
    """A block file's header, tokens and (verified) payload; raises ``CorruptEntry``/``OSError``."""
    with open(path, "rb") as handle:
        header, tokens, payload = read_framed(handle, MAGIC, with_payload=with_payload)
    if chain_key(str(header.get("parent")), tokens) != path.stem:
        raise CorruptEntry("tokens do not match the block's key")
    return header, tokens, payload


def snapshot_file(payload: bytes) -> list[bytes]:
    return [MAGIC, struct.pack("<Q", len(payload)), f"{zlib.crc32(payload):08x}".encode(), payload]


def read_snapshot(path: Path) -> bytes:
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 16 or not data.startswith(MAGIC):
        raise CorruptEntry("not a localai snapshot")
    (length,) = struct.unpack_from("<Q", data, len(MAGIC))
    crc = data[len(MAGIC) + 8:len(MAGIC) + 16].decode(errors="replace")
    payload = data[len(MAGIC) + 16:]
    if len(payload) != length or f"{zlib.crc32(payload):08x}" != crc:
        raise CorruptEntry("truncated or damaged snapshot")
    return payload


class Folder:
    """The files of one fingerprint: an index of blocks (headers only), heads and snapshots, and eviction.

    Used by the worker's store (which keeps it current as it saves) and by ``localai cache`` (which scans it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fingerprint = path.name
        self.blocks: dict[str, Block] = {}
        self.children: dict[str, set[str]] = {}
        self.dependents: dict[str, set[str]] = {}  # a block -> the blocks naming it as their base
        self.heads: dict[str, Head] = {}
        self.snapshots: dict[str, int] = {}  # block key -> snapshot file bytes

    # -- paths -----------------------------------------------------------------------------------

    def block_path(self, key: str) -> Path:
        return self.path / "blocks" / f"{key}.blk"

    def snapshot_path(self, key: str) -> Path:
        return self.path / "snaps" / f"{key}.snp"

    def head_path(self, head_id: str) -> Path:
        return self.path / "heads" / f"{head_id}.json"

    # -- the index -------------------------------------------------------------------------------

    def add_block(self, block: Block) -> None:
        self.blocks[block.key] = block
        self.children.setdefault(block.parent, set()).add(block.key)
        if block.base is not None:
            self.dependents.setdefault(block.base, set()).add(block.key)

    def _unlink(self, block: Block) -> None:
        """Take a block out of its parent's children and its base's dependents (the index only)."""
        self.children.get(block.parent, set()).discard(block.key)
        if block.base is not None:
            self.dependents.get(block.base, set()).discard(block.key)

    def pieces(self, key: str) -> list[str] | None:
        """The blocks whose payloads make up block ``key``'s KV, oldest first: its bases, then itself; None when a
        base is missing or is not a shorter block with the same parent (that its tokens begin the block's is
        checked once, when a scan reads the block: ``_scan_blocks``; the store builds only such bases)."""
        keys = [key]
        block = self.blocks.get(key)
        while block is not None and block.base is not None:
            base = self.blocks.get(block.base)
            if base is None or base.parent != block.parent or len(base.tokens) >= len(block.tokens) \
                    or len(keys) > BLOCK_TOKENS:
                return None
            keys.append(base.key)
            block = base
        return keys[::-1] if block is not None else None

    def is_leaf(self, key: str) -> bool:
        """No block chains from it or names it as its base: evicting it breaks nothing else."""
        return not self.children.get(key) and not self.dependents.get(key)

    def chain(self, key: str) -> list[str]:
        """The keys from the first block to ``key`` (shorter when a block in between is missing)."""
        keys = []
        while key in self.blocks:
            keys.append(key)
            key = self.blocks[key].parent
        keys.reverse()
        return keys if self.is_root(key) else []

    def is_root(self, key: str) -> bool:
        """Whether ``key`` starts chains: the fingerprint, or a partition's root (``root_key``)."""
        return key == self.fingerprint or key.startswith(self.fingerprint + ":")

    def partition_of(self, key: str) -> str:
        """The partition of the chain that ends at ``key`` ("" for the default one)."""
        keys = self.chain(key)
        return self.blocks[keys[0]].parent.partition(":")[2] if keys else ""

    def scan(self, *, repair: bool = False, known: Collection[str] = ()) -> list[str]:
        """Read the folder into the index (headers only); returns complaints about unreadable files.

        Other processes write here while it runs (a worker writes blocks, then the entry's head), so what looks
        incomplete may only be newer than the listing. Without ``repair`` (listings, ``localai cache``, a worker's
        rescan) nothing is deleted. With it (a worker starting on the folder), damaged files and temp files of dead
        writers go, and so do blocks and heads whose chain is still broken after the blocks are listed again, unless
        a live process other than this one owns them. ``known``: block keys already indexed elsewhere, whose headers
        are not read again."""
        complaints: list[str] = []
        if repair:
            self._remove_dead_temps()
        self._scan_blocks(complaints, repair=repair, known=known)
        self._scan_snapshots()
        self._scan_heads(complaints, repair=repair)
        if repair and any(self._broken()):
            self._scan_blocks(complaints, repair=repair)  # blocks written while the folder was read
            broken_blocks, _ = self._broken()
            for key in broken_blocks:
                block = self.blocks.get(key)
                if block is not None and (not self.block_path(block.parent).exists()
                                          or (block.base is not None and not self.block_path(block.base).exists())):
                    complaints.append(f"{key}.blk: an earlier block of its chain is gone")
                    self.drop_block(key)  # can never be restored
            for head_id in self._broken()[1]:
                owner = self.heads[head_id].owner
                if owner == os.getpid() or not process_alive(owner):
                    self.drop_head(head_id)
        for head in self.heads.values():
            if head.kind == "system":
                for key in self.chain(head.key):
                    self.blocks[key].system = True
        return complaints

    def reached(self, starts: Iterable[str]) -> set[str]:
        """The blocks on the chains from ``starts`` back to the fingerprint, with their bases, leaving out chains
        that break on the way (a missing block or base): every block's parents are followed once for all starts,
        where following each start's chain alone was quadratic in the chains' length."""
        intact: set[str] = set()
        broken: set[str] = set()
        for key in starts:
            path: list[str] = []
            on_path: set[str] = set()
            bases: list[str] = []
            while key in self.blocks and key not in intact and key not in broken and key not in on_path:
                pieces = self.pieces(key)
                if pieces is None:
                    break  # a base is gone: this block, and what chains from it, cannot be restored
                path.append(key)
                on_path.add(key)
                bases += pieces[:-1]
                key = self.blocks[key].parent
            if key in intact or self.is_root(key):
                intact.update(path)
                intact.update(bases)
            else:
                broken.update(path)
        return intact

    def _broken(self) -> tuple[list[str], list[str]]:
        """The blocks and the heads whose chain does not reach the fingerprint."""
        intact = self.reached(self.blocks)
        return ([key for key in self.blocks if key not in intact],
                [head.id for head in self.heads.values() if head.key not in intact])

    def _remove_dead_temps(self) -> None:
        for folder in ("blocks", "snaps", "heads"):
            for temp in (self.path / folder).glob(TEMP_PREFIX + "*"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    pid = int(temp.name.split("-")[1])
                    if not process_alive(pid) or time.time() - temp.stat().st_mtime > STALE_TEMP_SECONDS:
                        temp.unlink()  # a write that never finished

    def _scan_blocks(self, complaints: list[str], *, repair: bool, known: Collection[str] = ()) -> None:
        read: list[Block] = []
        for path in (self.path / "blocks").glob("*.blk"):
            if path.stem in self.blocks or path.stem in known or path.name.startswith("."):
                continue  # known, or a write in progress (.tmp-*)
            try:
                header, tokens, _ = read_block(path, with_payload=False)
                stat = path.stat()
            except FileNotFoundError:
                continue
            except (OSError, CorruptEntry) as exc:
                complaints.append(f"{path.name}: {exc}")
                if repair:
                    path.unlink(missing_ok=True)
                continue
            base = header.get("base")
            read.append(Block(path.stem, str(header["parent"]), tokens, stat.st_size, stat.st_mtime, True,
                              base=str(base) if base is not None else None))
            self.add_block(read[-1])
        for block in read:  # a base named by a damaged header (the checksum covers the tokens and the KV only)
            base = self.blocks.get(block.base) if block.base is not None else None
            if base is not None and block.tokens[:len(base.tokens)] != base.tokens:
                complaints.append(f"{block.key}.blk: its base {base.key} does not begin it")
                if repair:
                    self.drop_block(block.key)
                else:
                    self._unlink(self.blocks.pop(block.key))

    def _scan_snapshots(self) -> None:
        for path in (self.path / "snaps").glob("*.snp"):
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                self.snapshots[path.stem] = path.stat().st_size

    def _scan_heads(self, complaints: list[str], *, repair: bool) -> None:
        for path in (self.path / "heads").glob("*.json"):
            if path.name.startswith("."):
                continue
            try:
                head = parse_head(path.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                complaints.append(f"{path.name}: {exc}")
                if repair:
                    path.unlink(missing_ok=True)
                continue
            self.heads.setdefault(head.id, head)

    def complete_heads(self) -> list[Head]:
        """The entries whose whole chain of blocks is known (a listing's entries: a head seen before the blocks
        its worker wrote just before it is left out, not deleted)."""
        return [head for head in self.heads.values() if self.reached([head.key])]

    def locked(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """The folder's lock, across processes: shared while a worker writes an entry's head (its blocks must still
        be there), exclusive while blocks are deleted (``cache rm``/``prune``, eviction)."""
        return file_lock(self.path / LOCK_FILE, exclusive=exclusive)

    def mark_changed(self) -> None:
        """Tell the other processes on this folder that files they may have indexed were deleted."""
        with contextlib.suppress(OSError):
            (self.path / CHANGED_FILE).write_bytes(str(time.time_ns()).encode())

    def changed_stamp(self) -> int:
        try:
            return (self.path / CHANGED_FILE).stat().st_mtime_ns
        except OSError:
            return 0

    def forget_missing(self, *, keep_heads: set[str], keep_snapshots: Collection[str] = ()) -> int:
        """Drop from the index the blocks, snapshots and heads whose files another process deleted (nothing is
        deleted here); a head in ``keep_heads`` or a snapshot in ``keep_snapshots`` (queued for writing: no file
        yet) stays. Returns how many were forgotten."""
        gone = [key for key, block in self.blocks.items() if block.on_disk and not self.block_path(key).exists()]
        for key in gone:
            self._unlink(self.blocks.pop(key))
        snaps = [key for key in self.snapshots if key not in keep_snapshots and not self.snapshot_path(key).exists()]
        for key in snaps:
            del self.snapshots[key]
        heads = 0
        for head_id in [h for h in self.heads if h not in keep_heads]:
            head = self.heads[head_id]
            complete = bool(self.chain(head.key))
            if complete and (not head.written or self.head_path(head_id).exists()):
                continue
            heads += 1
            on_disk = self._read_head(self.head_path(head_id)) if not complete else None
            if on_disk is not None and self.chain(on_disk.key):
                self.heads[head_id] = on_disk  # moved back to a shorter prefix by whoever evicted its tail
                continue
            del self.heads[head_id]  # removed (cache rm, prune), or its blocks are gone
            if on_disk is not None and on_disk.owner == os.getpid():
                self.head_path(head_id).unlink(missing_ok=True)  # this worker's entry, no longer restorable
        return len(gone) + len(snaps) + heads

    @staticmethod
    def _read_head(path: Path) -> Head | None:
        try:
            return parse_head(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def bytes_on_disk(self) -> int:
        heads = 256 * len(self.heads)
        return sum(b.size for b in self.blocks.values() if b.on_disk) + sum(self.snapshots.values()) + heads

    # -- removal ---------------------------------------------------------------------------------

    def drop_block(self, key: str, *, removal: Removal | None = None,
                   heads_at: dict[str, list[Head]] | None = None) -> list[Head]:
        """Forget a block and delete its file (and its snapshot); heads ending at it move to its parent (or go
        when it was the first). Returns the heads that changed, for the caller to rewrite or delete. ``removal``:
        the files are left for it to delete (after the store's lock is let go); ``heads_at``: the heads by the block
        they end at (``heads_by_key``), for a pass that drops many blocks, kept current here."""
        block = self.blocks.pop(key, None)
        if block is None:
            return []
        now = removal is None  # no pass to leave the files to: they go before this returns
        removal = Removal(self) if removal is None else removal
        self._unlink(block)
        removal.files.append(self.block_path(key))
        self.drop_snapshot(key, removal=removal)
        changed = []
        ending = heads_at.pop(key, []) if heads_at is not None else [h for h in self.heads.values() if h.key == key]
        for head in ending:
            if head.key != key or self.heads.get(head.id) is not head:
                continue
            changed.append(head)
            if self.is_root(block.parent) or head.kind == "checkpoint":  # a checkpoint is only its snapshot
                del self.heads[head.id]
                removal.heads[self.head_path(head.id)] = None
            else:
                head.key, head.n_tokens, head.snapshot = block.parent, head.n_tokens - len(block.tokens), False
                if heads_at is not None:
                    heads_at.setdefault(head.key, []).append(head)
        if now:
            removal.apply()
        return changed

    def heads_by_key(self) -> dict[str, list[Head]]:
        """The heads by the block they end at (one pass over them, for ``drop_block`` in a loop)."""
        found: dict[str, list[Head]] = {}
        for head in self.heads.values():
            found.setdefault(head.key, []).append(head)
        return found

    def drop_subtree(self, key: str) -> None:
        """A block and everything chained after it or built on it (a corrupt block: what follows can never be
        restored)."""
        for child in [*self.children.get(key, ()), *self.dependents.get(key, ())]:
            self.drop_subtree(child)
        for head in self.drop_block(key):
            self.write_head(head)

    def drop_snapshot(self, key: str, *, removal: Removal | None = None) -> None:
        if self.snapshots.pop(key, None) is not None:
            if removal is None:
                self.snapshot_path(key).unlink(missing_ok=True)
            else:
                removal.files.append(self.snapshot_path(key))  # deleted when the pass applies it

    def drop_head(self, head_id: str) -> None:
        head = self.heads.pop(head_id, None)
        if head is not None:
            self.head_path(head_id).unlink(missing_ok=True)
            if head.snapshot and not any(h.key == head.key and h.snapshot for h in self.heads.values()):
                self.drop_snapshot(head.key)

    def write_head(self, head: Head, *, removal: Removal | None = None) -> None:
        """Rewrite a moved entry's file. Where its chain now holds a block never written (a worker's write the queue
        bound dropped, or that failed), the file it has stays if that one's chain is whole (eviction keeps it:
        ``disk_key``), else it goes: no entry on disk names a missing block. ``removal``: the file is written (or
        deleted) by it, later."""
        if head.id not in self.heads:
            return
        path, data = self.head_path(head.id), None
        if self._on_disk(head.key):
            data = json.dumps(head.as_json()).encode()
            head.disk_key = head.key
        elif head.disk_key is None or head.disk_key == head.key or not self._on_disk(head.disk_key):
            head.disk_key = None
        else:
            return
        if removal is not None:
            removal.heads[path] = data
        elif data is not None:
            write_atomic(path, [data])
        else:
            path.unlink(missing_ok=True)

    def _on_disk(self, key: str) -> bool:
        """Whether the chain ending at ``key`` is whole and every block of it (and of their bases) written."""
        needed = self.reached([key])
        return bool(needed) and all(self.blocks[block].on_disk for block in needed)

    def referenced(self) -> set[str]:
        """Blocks on some head's chain."""
        starts = [head.key for head in self.heads.values()]
        starts += [head.disk_key for head in self.heads.values()  # what its file on disk still names
                   if head.disk_key is not None and head.disk_key != head.key]
        return self.reached(starts)

    def collect_garbage(self, *, keep: set[str] | None = None, removal: Removal | None = None) -> int:
        """Delete blocks no head reaches (left by moved heads or removed entries); returns bytes freed.
        ``removal``: the files are left for it to delete."""
        reached = self.referenced() | {piece for key in keep or () for piece in self.pieces(key) or [key]}
        freed = 0
        heads_at = self.heads_by_key()
        for key in [k for k in self.blocks if k not in reached]:
            freed += self.blocks[key].size if self.blocks[key].on_disk else 0
            self.drop_block(key, removal=removal, heads_at=heads_at)
        snapshotted = {head.key for head in self.heads.values() if head.snapshot}  # once, not per snapshot
        for key in [k for k in self.snapshots if k not in snapshotted]:
            freed += self.snapshots.get(key, 0)
            self.drop_snapshot(key, removal=removal)
        return freed

    def evict(self, excess: int, *, protected: set[str], skip_owner: set[int]) -> tuple[int, int]:
        """Free at least ``excess`` bytes, least recently used leaf blocks first, history before system prefixes:
        a chain loses its tail before its prefix, and a block others chain from is never evicted under them.
        ``protected``: blocks on pinned chains; ``skip_owner``: live workers whose heads' chains are theirs to
        evict. Returns (bytes freed, blocks evicted)."""
        removal = self.plan_eviction(excess, protected=protected, skip_owner=skip_owner)
        removal.apply()
        return removal.freed, removal.evicted

    def plan_eviction(self, excess: int, *, protected: set[str], skip_owner: set[int]) -> Removal:
        """``evict``'s choice and its index changes: the files go when the caller applies the returned ``Removal``
        (the store: after its lock is let go, under this folder's exclusive lock still). The leaves are kept in a
        heap: a block becomes one when its last child or dependent goes, so no victim rescans every block."""
        guarded = set(protected) | self.reached([head.key for head in self.heads.values() if head.owner in skip_owner])
        order = {key: position for position, key in enumerate(self.blocks)}  # ties go as min() over the dict would

        def evictable(block: Block) -> bool:
            return block.on_disk and self.is_leaf(block.key) and block.key not in guarded

        leaves = [(block.system, block.last_used, order[block.key], block.key)
                  for block in self.blocks.values() if evictable(block)]
        heapq.heapify(leaves)
        heads_at = self.heads_by_key()
        removal = Removal(self)
        while removal.freed < excess and leaves:
            *_, key = heapq.heappop(leaves)
            victim = self.blocks.get(key)
            if victim is None or not evictable(victim):
                continue
            removal.freed += victim.size + self.snapshots.get(victim.key, 0)
            removal.evicted += 1
            for head in self.drop_block(victim.key, removal=removal, heads_at=heads_at):
                self.write_head(head, removal=removal)
            for freed in (victim.parent, victim.base):  # its parent and its base may be leaves now
                block = self.blocks.get(freed) if freed is not None else None
                if block is not None and evictable(block):
                    heapq.heappush(leaves, (block.system, block.last_used, order[block.key], block.key))
        return removal


@dataclass
class Removal:
    """Files whose blocks, snapshots and heads are gone from the index already, still to delete (and moved heads'
    files to rewrite): a pass over many blocks picks them under the store's lock and ``apply`` does the disk work
    after it, so the engine thread's lookups and saves never wait on unlinks and fsyncs."""

    folder: Folder
    files: list[Path] = field(default_factory=list)  # blocks and snapshots
    heads: dict[Path, bytes | None] = field(default_factory=dict)  # a head's file: its new content, or None to delete
    freed: int = 0
    evicted: int = 0

    def apply(self) -> None:
        """The moved heads first (they name blocks that stay), then the deletions; then the mark that tells the
        other processes on the folder (only once the files are gone: one that looks must not find them)."""
        for path, data in self.heads.items():
            if data is not None:
                write_atomic(path, [data])
        for path in [path for path, data in self.heads.items() if data is None] + self.files:
            path.unlink(missing_ok=True)
        if self.evicted:
            self.folder.mark_changed()
