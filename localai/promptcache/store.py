"""A worker's prompt cache: find the longest stored prefix of a prompt, restore it, save sequences as blocks.

Saving cuts a sequence's state into blocks (the engine's codec knows the layout) and writes only the blocks not
stored yet, plus at most one partial tail block, a boundary snapshot when the engine has state that cannot be
cut by token (sliding-window layers), and the entry's head. A new block that begins with a stored shorter one
(the partial last block an earlier turn saved) is built on it and holds only the tokens after it. Restoring walks
the prompt block by block along the chain of keys, then asks the engine to assemble the blocks (and snapshot) into
one state. The RAM tier holds recently used blocks within a byte budget; a background thread writes to disk, so a
request never waits on it.

``PromptStore`` is the one face, and this module's concern is finding and restoring (lookup, restore, the RAM
tier); the rest lives in private modules behind it: save planning and indexing (``_saving.py``), the writer
(``_writer.py``), the quota and eviction (``_quota.py``) and checkpoint retention (``_checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from localai.promptcache import legacy
from localai.promptcache._checkpoints import Checkpoints, Tail
from localai.promptcache._quota import Quota
from localai.promptcache._saving import MAX_PIECES as MAX_PIECES  # the bound on a block's files, for callers
from localai.promptcache._saving import MIN_TOKENS as MIN_TOKENS  # the shortest prefix kept, for callers
from localai.promptcache._saving import Saver, checkpoint_tails, spans
from localai.promptcache._writer import Writer
from localai.promptcache.blocks import (
    BLOCK_TOKENS,
    CorruptEntry,
    Folder,
    Head,
    chain_key,
    read_block,
    read_snapshot,
    root_key,
    write_atomic,
)
from localai.promptcache.pins import extend_pin
from localai.text import common_prefix_length

log = logging.getLogger("localai.cache")

# A sequence's serialized KV state: llama.cpp's is a bytearray when assembled (loaded in place) and a view of the
# engine's reused buffer when saved (valid until the engine's next save: the store copies what it keeps).
StateBytes = bytes | bytearray | memoryview


class Codec(Protocol):
    """How an engine cuts its serialized sequence state by token range and puts it back together."""

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        """(layout as JSON-able data, one payload per range, the part that cannot be cut), or None when this
        engine's state cannot be cut at all (then the whole state is the snapshot)."""
        ...

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes: ...


@dataclass
class Match:
    """What a prompt can restore: consecutive blocks from the first, and the snapshot to put with them."""

    keys: list[str]
    lengths: list[int]
    common: int  # prompt tokens the restored state shares (the last block may be cut back to it)
    snapshot: str | None = None


@dataclass
class Restored:
    state: StateBytes
    tokens: list[int]
    common: int
    tier: str  # "ram" when every part came from memory, else "disk"
    seconds: float

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class PromptStore:
    """The RAM and disk tiers of one model fingerprint. Thread-safe; disk writes happen on a background thread.

    ``max_bytes`` is the quota of the whole cache folder (every fingerprint), as ``LOCALAI_CACHE_MAX_BYTES`` says.
    """

    def __init__(self, root: Path, fingerprint_hex: str, codec: Codec, *, max_bytes: int,
                 ram_bytes: int = 256 << 20, queue_bytes: int | None = None, trims: bool = True) -> None:
        self.root = root
        self.dir = root / fingerprint_hex
        self.fingerprint = fingerprint_hex
        self.codec = codec
        self.max_bytes = max_bytes
        self.ram_bytes = ram_bytes
        self.trims = trims  # the engine can cut a restored state back to any shorter prefix
        self.queue_bytes = queue_bytes if queue_bytes is not None else max(4 * ram_bytes, 1 << 30)
        self.folder = Folder(self.dir)
        self.layout: Any = None
        # The engine's state cannot be cut (layout.json's "whole"): blocks carry tokens only, snapshots the state. Not
        # to be confused with a block "written whole", one built on no base.
        self.uncuttable = False
        self._ram: OrderedDict[str, bytes] = OrderedDict()  # "b:<key>" / "s:<key>" -> payload
        self._ram_size = 0
        self._lock = threading.RLock()
        # told the first write that failed (a full disk), on the writer thread and never under the lock: the
        # serving loop sends it to the daemon's log
        self.on_warning: Callable[[str], None] | None = None
        self._writer = Writer(self, self._lock)
        self._quota = Quota(self)
        self._checkpoints = Checkpoints(self)
        self._saver = Saver(self)
        self.stats = {"hits": 0, "misses": 0, "tokens_restored": 0, "bytes_read": 0, "bytes_written": 0,
                      "evictions": 0, "corrupt": 0, "dropped_writes": 0, "blocks_written": 0, "snapshots_written": 0,
                      "save_races": 0}
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "owners").mkdir(exist_ok=True)
        self._owner_file = self.dir / "owners" / str(os.getpid())
        # Registered and read under the folder's lock: another worker's quota pass, which deletes the files of
        # folders nobody uses under the same lock, either ends before this scan or sees the owner file and stays out
        with self.folder.locked(exclusive=False):
            self._owner_file.touch()
            self._seen_change = self.folder.changed_stamp()
            for complaint in self.folder.scan(repair=True):
                log.warning("dropping damaged cache file %s", complaint)
                self.stats["corrupt"] += 1
        self._load_layout()
        self._writer.start()
        self._upgrade_legacy()

    # -- statistics ------------------------------------------------------------------------------

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.stats[name] += amount

    def stats_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)

    # -- lookup and restore ----------------------------------------------------------------------

    def lookup(self, prompt: list[int], limit: int | None = None, partition: str = "") -> Match | None:
        """The longest stored prefix of ``prompt`` that can be restored (within ``partition``). ``limit``: the most
        tokens the restored state may hold, for states that can only be restored where a snapshot was taken (a
        request that needs fresh logits evaluates at least its last token: ``len(prompt) - 1``)."""
        self._notice_deletions()
        limit = len(prompt) if limit is None else min(limit, len(prompt))
        with self._lock:
            if self.uncuttable:
                return self._lookup_uncuttable(prompt, limit, partition)
            if self._needs_snapshot():
                return self._lookup_checkpoint(prompt, limit, partition)
            folder = self.folder
            keys: list[str] = []
            lengths: list[int] = []
            parent = root_key(self.fingerprint, partition)
            position = 0
            while position < len(prompt):
                chunk = prompt[position:position + BLOCK_TOKENS]
                key = chain_key(parent, chunk) if len(chunk) == BLOCK_TOKENS else None
                if key is not None and key in folder.blocks:
                    keys.append(key)
                    lengths.append(len(chunk))
                    position += len(chunk)
                    parent = key
                    continue
                best, best_common = None, 0  # a partial tail, or a block the prompt leaves part way
                for child in folder.children.get(parent, ()):
                    block = folder.blocks.get(child)
                    if block is None:
                        continue
                    common = common_prefix_length(block.tokens, prompt[position:])
                    if common > best_common and (common == len(block.tokens) or self.trims):
                        best, best_common = block, common
                if best is not None:
                    keys.append(best.key)
                    lengths.append(len(best.tokens))
                    position += best_common
                break
        if not keys or position < MIN_TOKENS:
            return None
        return Match(keys, lengths, position)

    def _lookup_checkpoint(self, prompt: list[int], limit: int, partition: str) -> Match | None:
        """For states with a part that cannot be cut (sliding window, recurrent layers): the deepest snapshot on
        the prompt's path within ``limit`` tokens, at the end of a full block or of a shorter tail block (a
        checkpoint taken inside a block). Caller holds the lock."""
        folder = self.folder
        keys: list[str] = []
        parent = root_key(self.fingerprint, partition)
        position = 0
        best: tuple[list[str], list[int]] | None = None
        while True:
            for child in folder.children.get(parent, ()):
                block = folder.blocks.get(child)
                if block is None or child not in folder.snapshots:
                    continue
                end = position + len(block.tokens)
                if end > limit or (best is not None and end <= sum(best[1])):
                    continue
                if prompt[position:end] == block.tokens:
                    best = ([*keys, child], [BLOCK_TOKENS] * len(keys) + [len(block.tokens)])
            chunk = prompt[position:position + BLOCK_TOKENS]
            if len(chunk) < BLOCK_TOKENS:
                break
            key = chain_key(parent, chunk)
            if key not in folder.blocks:
                break
            keys.append(key)
            position += BLOCK_TOKENS
            parent = key
        if best is None or sum(best[1]) < MIN_TOKENS:
            return None
        return Match(best[0], best[1], sum(best[1]), best[0][-1])

    def _lookup_uncuttable(self, prompt: list[int], limit: int, partition: str) -> Match | None:
        """For engines whose state cannot be cut: the entry sharing the longest prefix (caller holds the lock)."""
        best: Match | None = None
        matched: dict[str, int] = {}  # a block whose whole chain matches the prompt -> the tokens matched through it
        for head in self.folder.heads.values():
            if not head.snapshot or head.key not in self.folder.snapshots:
                continue
            keys = self.folder.chain(head.key)
            if not keys or self.folder.blocks[keys[0]].parent != root_key(self.fingerprint, partition):
                continue
            common, whole = self._common_with(keys, prompt, matched)
            if not self.trims and (not whole or common > limit):
                continue
            if common >= MIN_TOKENS and (best is None or common > best.common):
                best = Match(keys, [len(self.folder.blocks[key].tokens) for key in keys], common, head.key)
        return best

    def _common_with(self, keys: list[str], prompt: list[int], matched: dict[str, int]) -> tuple[int, bool]:
        """How many of the prompt's tokens the chain ``keys`` holds, and whether it holds them all: block by
        block, stopping at the first that differs (entries share their first blocks: ``matched`` remembers those
        already compared in this lookup), so a lookup costs the shared prefixes, not every entry's length."""
        common = 0
        for key in keys:
            if key in matched:
                common = matched[key]
                continue
            block = self.folder.blocks[key].tokens
            if prompt[common:common + len(block)] == block:
                common += len(block)
                matched[key] = common
                continue
            return common + common_prefix_length(block, prompt[common:common + len(block)]), False
        return common, True

    def restore(self, match: Match) -> Restored | None:
        """The state for a match, or None when a part is gone or damaged (what follows it is dropped)."""
        started = time.perf_counter()
        tier = "ram"
        pieces: list[bytes] = []
        lengths: list[int] = []
        kept = 0  # the match's blocks restored
        read: list[str] = []  # the blocks whose payloads were read: the match's and their bases
        for key, length in zip(match.keys, match.lengths, strict=True):
            if self.uncuttable:
                pieces.append(b"")
                lengths.append(length)
                kept += 1
                continue
            parts = self._parts(key)
            if parts is None:
                break
            for piece, payload, n_tokens, from_disk in parts:
                tier = "disk" if from_disk else tier
                read.append(piece)
                pieces.append(payload)
                lengths.append(n_tokens)
            kept += 1
        if kept < len(match.keys):
            if match.snapshot is not None:
                return None  # a snapshot is only valid with every block before it
            match = Match(match.keys[:kept], match.lengths[:kept], min(match.common, sum(lengths)))
            if match.common < MIN_TOKENS:
                return None
        rest = b""
        if match.snapshot is not None:
            rest_payload, from_disk = self._snapshot_payload(match.snapshot)
            if rest_payload is None:
                return None
            rest = rest_payload
            tier = "disk" if from_disk else tier
        state: StateBytes = rest
        if not self.uncuttable:
            try:
                state = self.codec.state_join((self.layout or {}).get("layout"), pieces, lengths, rest)
            except ValueError as exc:
                log.warning("cache blocks do not fit the engine's layout (%s); dropping them", exc)
                with self._lock:
                    self.folder.drop_subtree(match.keys[0])
                return None
        now = time.time()
        tokens: list[int] = []
        with self._lock:
            for key in match.keys:
                block = self.folder.blocks.get(key)
                if block is None:
                    return None  # dropped meanwhile
                block.last_used = now
                tokens += block.tokens
            for piece in read:  # the bases too (a base is only evicted after its blocks anyway)
                if piece in self.folder.blocks:
                    self.folder.blocks[piece].last_used = now
        return Restored(state, tokens, match.common, tier, time.perf_counter() - started)

    def _parts(self, key: str) -> list[tuple[str, bytes, int, bool]] | None:
        """A block's KV as (block, payload, tokens, read from disk) per file: its bases' first, then its own; None
        when a part is gone or damaged (the block and what is chained after it are dropped)."""
        with self._lock:
            pieces = self.folder.pieces(key)
            if pieces is None:
                log.warning("cache block %s lost the block it is built on; dropping it", key)
                self.folder.drop_subtree(key)
                return None
            spans, before = [], 0
            for piece in pieces:
                n_tokens = len(self.folder.blocks[piece].tokens)
                spans.append((piece, n_tokens - before))
                before = n_tokens
        parts = []
        for piece, n_tokens in spans:
            payload, from_disk = self._block_payload(piece)
            if payload is None:
                return None
            parts.append((piece, payload, n_tokens, from_disk))
        return parts

    def _block_payload(self, key: str) -> tuple[bytes | None, bool]:
        with self._lock:
            cached = self._ram.get("b:" + key)
            if cached is not None:
                self._ram.move_to_end("b:" + key)
                return cached, False
            pending = self._writer.pending.get("b:" + key)
            if pending is not None:
                return pending, False
            if key not in self.folder.blocks:
                return None, False
        path = self.folder.block_path(key)
        payload = self._from_disk(f"block {key} and the blocks after it", path,
                                  lambda at: read_block(at, with_payload=True)[2],
                                  lambda: self.folder.drop_subtree(key))
        if payload is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # the file's mtime carries LRU order across restarts
            self._remember("b:" + key, payload)
        return payload, True

    def _snapshot_payload(self, key: str) -> tuple[bytes | None, bool]:
        with self._lock:
            cached = self._ram.get("s:" + key) or self._writer.pending.get("s:" + key)
            if cached is not None:
                return cached, False
        payload = self._from_disk(f"snapshot {key}", self.folder.snapshot_path(key), read_snapshot,
                                  lambda: self.folder.drop_snapshot(key))
        if payload is not None:
            self._remember("s:" + key, payload)
        return payload, True

    def _from_disk(self, what: str, path: Path, read: Callable[[Path], bytes],
                   forget: Callable[[], None]) -> bytes | None:
        """A file's verified payload; a missing file (evicted by another worker, removed by `localai cache rm`) or a
        damaged one (counted and logged) is forgotten with what depends on it, and is None."""
        try:
            payload = read(path)
        except FileNotFoundError:
            with self._lock:
                forget()
            return None
        except (OSError, CorruptEntry) as exc:
            self.count("corrupt")
            log.warning("dropping damaged cache %s: %s", what, exc)
            with self._lock:
                forget()
            return None
        self.count("bytes_read", len(payload))
        return payload

    # -- saving ----------------------------------------------------------------------------------

    def has(self, tokens: list[int], partition: str = "") -> bool:
        """Whether this exact sequence is stored (its last block, and a snapshot where one is needed)."""
        key = self._spans(tokens, partition)[-1][0] if tokens else None
        with self._lock:
            if key is None or key not in self.folder.blocks:
                return False
            return not self._needs_snapshot() or key in self.folder.snapshots

    def pin(self, head_id: str, ttl: float) -> None:
        """Keep an entry (its chain of blocks) from eviction for ``ttl`` seconds (a longer pin stays)."""
        try:
            extend_pin(head_id, ttl, self.root)
        except OSError as exc:
            log.warning("could not pin cache entry %s: %s", head_id, exc)

    def pin_prefix(self, tokens: list[int], ttl: float, partition: str = "") -> None:
        """Pin the entry that ends exactly at ``tokens``, when one is stored."""
        if len(tokens) < MIN_TOKENS:
            return
        key = self._spans(tokens, partition)[-1][0]
        with self._lock:
            found = [head.id for head in self.folder.heads.values() if head.key == key and head.n_tokens == len(tokens)]
        for head_id in found:
            self.pin(head_id, ttl)

    # -- saving (_saving.py) -----------------------------------------------------------------------

    def save(self, tokens: list[int], state: StateBytes, session: str | None, kind: str = "history",
             checkpoints: list[tuple[int, bytes]] | None = None, *, state_tokens: int | None = None,
             end: bytes | None = None, partition: str = "") -> Head | None:
        """Store a sequence: its new blocks, its snapshot and its head, queued for the disk (never waited on).

        ``checkpoints``: (tokens held, ``seq_checkpoint``'s bytes) taken earlier on the way to ``state``, for an
        engine whose state can only be restored where one was taken; each becomes an entry of kind "checkpoint"
        (with a tail block when it falls inside a block), bounded a session (``Checkpoints.bound``).
        ``state_tokens``: the tokens ``state`` holds when it holds more than ``tokens`` (the entry then ends before the
        state does, and ``end``, the checkpoint taken at its last token, is its snapshot)."""
        return self._saver.save(tokens, state, session, kind, checkpoints, state_tokens, end, partition)

    def _spans(self, tokens: list[int], partition: str = "") -> list[tuple[str, int, int]]:
        """The blocks a sequence is cut into (``_saving.spans``)."""
        return spans(self.fingerprint, tokens, partition)

    def _checkpoint_tails(self, tokens: list[int], checkpoints: list[tuple[int, bytes]],
                          partition: str = "") -> list[Tail]:
        """Where each checkpoint goes (``_saving.checkpoint_tails``)."""
        return checkpoint_tails(self.fingerprint, tokens, checkpoints, partition)

    def _notice_deletions(self) -> None:
        """Another process (``localai cache rm``/``prune``, a second worker's eviction) deleted files here: forget
        them, so a save writes those blocks again instead of trusting an index that no longer matches the disk."""
        stamp = self.folder.changed_stamp()
        if stamp == self._seen_change:
            return
        with self._lock:
            self._seen_change = stamp
            queued = self._writer.queued_heads()
            snapshots = {key[2:] for key in self._writer.pending if key.startswith("s:")}  # queued or being written
            forgotten = self.folder.forget_missing(keep_heads=queued, keep_snapshots=snapshots)
        if forgotten:
            log.info("forgot %d cache files another process deleted", forgotten)

    def _needs_snapshot(self) -> bool:
        return self.uncuttable or bool((self.layout or {}).get("rest"))

    # -- the writer (_writer.py) --------------------------------------------------------------------

    def flush(self, timeout: float = 55.0) -> None:
        """Wait until queued writes are on disk (used at shutdown and by tests)."""
        self._writer.flush(timeout)

    def close(self, timeout: float = 55.0) -> None:
        """Write what is queued, stop the writer thread and leave the folder (its owner file)."""
        self._writer.close(timeout)
        self._owner_file.unlink(missing_ok=True)

    # -- the quota (_quota.py) ----------------------------------------------------------------------

    def enforce_quota(self, *, fresh: bool = True) -> None:
        """Evict until the whole cache folder is under quota (``Quota.enforce``)."""
        self._quota.enforce(fresh=fresh)

    def _forget_ram_of_dropped(self) -> None:
        """RAM copies of blocks and snapshots the index no longer has (caller holds the lock)."""
        for key in [k for k in self._ram if k[2:] not in self.folder.blocks and k[2:] not in
                    self.folder.snapshots]:
            self._ram_size -= len(self._ram.pop(key))

    def _remember(self, key: str, payload: bytes) -> None:
        with self._lock:
            if key in self._ram:
                self._ram.move_to_end(key)
                return
            self._ram[key] = payload
            self._ram_size += len(payload)
            while self._ram_size > self.ram_bytes and self._ram:
                _, dropped = self._ram.popitem(last=False)
                self._ram_size -= len(dropped)

    # -- layout and upgrade ----------------------------------------------------------------------

    def _load_layout(self) -> None:
        try:
            raw = json.loads((self.dir / "layout.json").read_text())
        except (OSError, ValueError):
            return
        if isinstance(raw, dict):
            self.layout = raw
            self.uncuttable = bool(raw.get("whole"))

    def _save_layout(self, layout: dict[str, Any]) -> None:
        self.layout = layout
        write_atomic(self.dir / "layout.json", [json.dumps(layout).encode()])

    def _upgrade_legacy(self) -> None:
        """Whole-sequence entries from before blocks (``*.kv``): converted into blocks, or dropped; logged."""
        for path in sorted(self.dir.glob("*.kv")):
            try:
                header, tokens, payload = legacy.read_entry(path, self.fingerprint)
            except (OSError, CorruptEntry) as exc:
                log.warning("dropping old cache entry %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            head = self.save(tokens, payload, header.get("session"), str(header.get("kind", "history")))
            log.warning("converted old cache entry %s (%d tokens) into blocks%s", path.name, len(tokens),
                        "" if head else " failed: dropped")
            path.unlink(missing_ok=True)
