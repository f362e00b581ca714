"""A worker's prompt cache: find the longest stored prefix of a prompt, restore it, save sequences as blocks.

Saving cuts a sequence's state into blocks (the engine's codec knows the layout) and writes only the blocks not
stored yet, plus at most one partial tail block, a boundary snapshot when the engine has state that cannot be
cut by token (sliding-window layers), and the entry's head. A new block that begins with a stored shorter one
(the partial last block an earlier turn saved) is built on it and holds only the tokens after it. Restoring walks
the prompt block by block along the chain of keys, then asks the engine to assemble the blocks (and snapshot) into
one state. The RAM tier holds recently used blocks within a byte budget; a background thread writes to disk, so a
request never waits on it.

``PromptStore`` is the one face: what it does beside lookup, restore and save lives in private modules behind it,
the writer (``_writer.py``), the quota and eviction (``_quota.py``) and checkpoint retention (``_checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from localai.paths import process_alive
from localai.promptcache import legacy
from localai.promptcache._checkpoints import Checkpoints, Tail
from localai.promptcache._quota import Quota
from localai.promptcache._writer import Writer
from localai.promptcache.blocks import (
    BLOCK_TOKENS,
    Block,
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
MIN_TOKENS = 32  # shorter prefixes are cheaper to recompute than to manage
# A block is read from at most this many files, its bases' and its own: a block built on a chain this long is
# written whole. Saves every ~10 tokens reach it within a 64-token block; an agent's turns (100+ tokens) never do.
MAX_PIECES = 8


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
        self._writer = Writer(self, self._lock)
        self._quota = Quota(self)
        self._checkpoints = Checkpoints(self)
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

    def save(self, tokens: list[int], state: StateBytes, session: str | None, kind: str = "history",
             checkpoints: list[tuple[int, bytes]] | None = None, *, state_tokens: int | None = None,
             end: bytes | None = None, partition: str = "") -> Head | None:
        """Store a sequence: its new blocks, its snapshot and its head, queued for the disk (never waited on).

        ``checkpoints``: (tokens held, ``seq_checkpoint``'s bytes) taken earlier on the way to ``state``, for an
        engine whose state can only be restored where one was taken; each becomes an entry of kind "checkpoint"
        (with a tail block when it falls inside a block), bounded a session (``Checkpoints.bound``).
        ``state_tokens``: the tokens ``state`` holds when it holds more than ``tokens`` (the entry then ends before the
        state does, and ``end``, the checkpoint taken at its last token, is its snapshot)."""
        state_tokens = len(tokens) if state_tokens is None else state_tokens
        if len(tokens) < MIN_TOKENS or not state or state_tokens < len(tokens):
            return None
        self._notice_deletions()
        tokens = list(tokens)
        spans = self._spans(tokens, partition)
        tails = self._checkpoint_tails(tokens, checkpoints or [], partition)
        for _ in range(3):
            with self._lock:
                missing = [(index, key) for index, (key, _, _) in enumerate(spans) if key not in self.folder.blocks]
                cut = [tail for tail in tails if tail.key not in self.folder.blocks]
                bases = self._plan_bases(
                    [(key, spans[index - 1][0] if index else root_key(self.fingerprint, partition),
                      tokens[spans[index][1]:spans[index][2]]) for index, key in missing]
                    + [(t.key, t.parent, t.tokens) for t in cut])
            ranges = [(spans[index][1] + bases.get(key, ("", 0))[1], spans[index][2]) for index, key in missing] \
                + [(t.start + bases.get(t.key, ("", 0))[1], t.end) for t in cut]
            split = self._split(state, state_tokens, ranges)
            with self._lock:
                # The state is cut outside the lock, so the writer's eviction may have dropped a block counted as
                # stored meanwhile (its payload was not cut): cut again for the new set; after three tries, give up.
                new = {index for index, _ in missing}
                made = {key for _, key in missing} | {t.key for t in cut}
                if all(key in self.folder.blocks for index, (key, _, _) in enumerate(spans) if index not in new) \
                        and all(t.key in self.folder.blocks for t in tails if t not in cut) \
                        and all(base in made or base in self.folder.blocks for base, _ in bases.values()):
                    if state_tokens != len(tokens):  # the state's tail is past the entry's end: ``end`` is its snapshot
                        if split is None:
                            return None
                        split = (split[0], split[1], end[8:] if end and split[2] else b"")
                    tail_pieces = split[1][len(missing):] if split is not None else []
                    if split is not None:
                        split = (split[0], split[1][:len(missing)], split[2])
                    checkpointed = split is not None and bool(split[2])
                    if split is None:
                        bases = {}  # nothing was cut: no block holds a part of another's KV
                    built_on = {base for base, _ in bases.values()}
                    # Tails first: a block of the chain may be built on one (they are written in this order too)
                    self._checkpoints.index_tails([t for t in cut if checkpointed or t.key in built_on],
                                      dict(zip([t.key for t in cut], tail_pieces, strict=True)), bases,
                                      kind == "system")
                    head = self._index_entry(tokens, spans, missing, split, state, session, kind, partition, bases)
                    if head is not None and checkpointed:
                        self._checkpoints.index(tails, session)
                    return head
                self.stats["save_races"] += 1
        log.info("not saving %d tokens: their blocks kept being evicted while the state was cut", len(tokens))
        return None

    def _checkpoint_tails(self, tokens: list[int], checkpoints: list[tuple[int, bytes]],
                          partition: str = "") -> list[Tail]:
        """Where each checkpoint goes: the block ending at it (a tail block of its own beside the chain when it
        falls inside a block) and its snapshot."""
        tails = []
        for n_tokens, data in checkpoints:
            if not MIN_TOKENS <= n_tokens < len(tokens) or len(data) <= 8:
                continue
            start = n_tokens - (n_tokens % BLOCK_TOKENS or BLOCK_TOKENS)
            parent = self._spans(tokens[:start], partition)[-1][0] if start else root_key(self.fingerprint, partition)
            piece = tokens[start:n_tokens]
            tails.append(Tail(chain_key(parent, piece), parent, start, n_tokens, piece, data[8:]))
        return tails

    def _plan_bases(self, new: list[tuple[str, str, list[int]]]) -> dict[str, tuple[str, int]]:
        """For the blocks a save writes, (key, parent, tokens): the block each is built on and its length in
        tokens, where one exists: the longest stored block with the same parent whose tokens begin it (written or
        queued: one whose write was dropped holds no payload), or a shorter one of these new blocks; never past
        ``MAX_PIECES`` files. Caller holds the lock."""
        if self.uncuttable:
            return {}
        plan: dict[str, tuple[str, int]] = {}
        depth: dict[str, int] = {}  # a new block -> the files it is read from
        made: dict[str, list[tuple[str, list[int]]]] = {}  # parent -> the new blocks planned so far
        for key, parent, tokens in sorted(new, key=lambda item: len(item[2])):
            best: tuple[str, int, int] | None = None
            candidates = [(child, self.folder.blocks[child].tokens) for child in self.folder.children.get(parent, ())
                          if child in self.folder.blocks and (self.folder.blocks[child].on_disk
                                                              or "b:" + child in self._writer.pending)]
            for child, child_tokens in candidates + made.get(parent, []):
                n_tokens = len(child_tokens)
                if child == key or n_tokens >= len(tokens) or (best is not None and n_tokens <= best[1]) \
                        or tokens[:n_tokens] != child_tokens:
                    continue
                files = depth.get(child) or len(self.folder.pieces(child) or ())
                if 0 < files < MAX_PIECES:
                    best = (child, n_tokens, files)
            if best is not None:
                plan[key] = (best[0], best[1])
            depth[key] = best[2] + 1 if best is not None else 1
            made.setdefault(parent, []).append((key, tokens))
        return plan

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

    def _split(self, state: StateBytes, n_tokens: int,
               ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        if self.uncuttable:
            return None
        try:
            return self.codec.state_split(state, n_tokens, ranges)
        except ValueError as exc:
            log.warning("cannot cut this state into blocks (%s); keeping it whole", exc)
            return None

    def _index_entry(self, tokens: list[int], spans: list[tuple[str, int, int]], missing: list[tuple[int, str]],
                     split: tuple[Any, list[bytes], bytes] | None, state: StateBytes, session: str | None,
                     kind: str, partition: str, bases: dict[str, tuple[str, int]]) -> Head | None:
        """``save``'s second half, under the lock: the entry (its new blocks, its snapshot, its head) into the index
        and the write queue."""
        if split is None:
            layout, pieces, rest = None, [b""] * len(missing), state
        else:
            layout, pieces, rest = split
        if split is None and not self.uncuttable:
            if self.layout is not None or self.folder.blocks:
                return None  # blocks with payloads exist: do not mix layouts
            self.uncuttable = True
            self._save_layout({"whole": True})
        elif split is not None and json.loads(json.dumps(layout)) != (self.layout or {}).get("layout"):
            tail = bool(rest) or bool(isinstance(layout, dict) and layout.get("tail"))
            self._save_layout({"layout": json.loads(json.dumps(layout)), "rest": tail})
        system = kind == "system"
        parent = root_key(self.fingerprint, partition)
        new_pieces = {index: piece for (index, _), piece in zip(missing, pieces, strict=True)}
        for index, (key, start, end) in enumerate(spans):
            payload = new_pieces.get(index)
            if payload is not None and key not in self.folder.blocks:  # (a checkpoint's tail may be this block)
                block = Block(key, parent, tokens[start:end], len(payload), system=system, mine=True,
                              base=bases[key][0] if key in bases else None)
                self.folder.add_block(block)
                self._writer.enqueue("block", block, payload)
            else:
                block = self.folder.blocks[key]
                block.last_used = time.time()
                block.system = block.system or system
            parent = key
        last = spans[-1][0]
        head = self._head_for(tokens, session, kind, last, partition)
        if rest:
            if head.snapshot and head.key != last:
                if self.uncuttable or head.kind != "history":
                    self._writer.enqueue("drop_snapshot", head.key, b"")
                else:  # the turn before stays restorable: an agent that edits or retries a turn returns there
                    self._checkpoints.add(head.key, head.n_tokens, None, head.session)
                    self._checkpoints.bound(head.session)
            head.snapshot = True
            self.folder.snapshots[last] = len(rest)
            self._writer.enqueue("snapshot", last, rest)
        head.key, head.n_tokens, head.last_used, head.owner = last, len(tokens), time.time(), os.getpid()
        self.folder.heads[head.id] = head
        self._writer.enqueue("head", head, b"")
        self._writer.wake.notify()
        return head

    def _head_for(self, tokens: list[int], session: str | None, kind: str, last: str, partition: str) -> Head:
        """The entry a sequence updates: the same one, or the same session's entry it grew from (never one a
        live worker beside this one owns); else a new one (a fork keeps its parent's entry)."""
        mine = {os.getpid()}
        for head in self.folder.heads.values():
            if head.key == last and head.kind == kind:
                return head
        if kind == "history":
            for head in self.folder.heads.values():
                if head.kind == "history" and head.session == session and head.n_tokens < len(tokens) \
                        and (head.owner in mine or not process_alive(head.owner)) \
                        and _chain_is_prefix(self.folder, head, tokens) \
                        and self.folder.partition_of(head.key) == partition:
                    return head  # the same conversation, grown: its entry moves forward
        return Head(uuid.uuid4().hex, last, len(tokens), session, kind, time.time(), os.getpid(), written=False)

    def _spans(self, tokens: list[int], partition: str = "") -> list[tuple[str, int, int]]:
        """The blocks a sequence is cut into: (key, start, end) for each, the last one partial when it is short."""
        spans = []
        parent = root_key(self.fingerprint, partition)
        for start in range(0, len(tokens), BLOCK_TOKENS):
            end = min(start + BLOCK_TOKENS, len(tokens))
            parent = chain_key(parent, tokens[start:end])
            spans.append((parent, start, end))
        return spans

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


def _chain_is_prefix(folder: Folder, head: Head, tokens: list[int]) -> bool:
    position = 0
    for key in folder.chain(head.key):
        block = folder.blocks[key]
        if tokens[position:position + len(block.tokens)] != block.tokens:
            return False
        position += len(block.tokens)
    return position == head.n_tokens

