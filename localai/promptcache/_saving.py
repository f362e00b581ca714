"""The prompt store's saves: a sequence cut into the blocks it is stored as (``spans``), the new blocks built on
stored ones where they can be (``Saver._plan_bases``), the state cut outside the lock and indexed under it, and the
entry (head) the sequence updates. ``PromptStore.save`` is its face.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Protocol

from localai.paths import process_alive
from localai.promptcache._checkpoints import Checkpoints, Tail
from localai.promptcache._writer import Writer
from localai.promptcache.blocks import BLOCK_TOKENS, Block, Folder, Head, chain_key, root_key

log = logging.getLogger("localai.cache")

MIN_TOKENS = 32  # shorter prefixes are cheaper to recompute than to manage
# A block is read from at most this many files, its bases' and its own: a block built on a chain this long is
# written whole. Saves every ~10 tokens reach it within a 64-token block; an agent's turns (100+ tokens) never do.
MAX_PIECES = 8


class Store(Protocol):
    """What a save reaches of its ``PromptStore``."""

    fingerprint: str
    folder: Folder
    codec: Any
    layout: Any
    uncuttable: bool
    stats: dict[str, int]
    _lock: threading.RLock
    _writer: Writer
    _checkpoints: Checkpoints

    def _notice_deletions(self) -> None: ...

    def _save_layout(self, layout: dict[str, Any]) -> None: ...


def spans(fingerprint: str, tokens: list[int], partition: str = "") -> list[tuple[str, int, int]]:
    """The blocks a sequence is cut into: (key, start, end) for each, the last one partial when it is short."""
    found = []
    parent = root_key(fingerprint, partition)
    for start in range(0, len(tokens), BLOCK_TOKENS):
        end = min(start + BLOCK_TOKENS, len(tokens))
        parent = chain_key(parent, tokens[start:end])
        found.append((parent, start, end))
    return found


def checkpoint_tails(fingerprint: str, tokens: list[int], checkpoints: list[tuple[int, bytes]],
                     partition: str = "") -> list[Tail]:
    """Where each checkpoint goes: the block ending at it (a tail block of its own beside the chain when it
    falls inside a block) and its snapshot."""
    tails = []
    for n_tokens, data in checkpoints:
        if not MIN_TOKENS <= n_tokens < len(tokens) or len(data) <= 8:
            continue
        start = n_tokens - (n_tokens % BLOCK_TOKENS or BLOCK_TOKENS)
        parent = spans(fingerprint, tokens[:start], partition)[-1][0] if start else root_key(fingerprint, partition)
        piece = tokens[start:n_tokens]
        tails.append(Tail(chain_key(parent, piece), parent, start, n_tokens, piece, data[8:]))
    return tails


class Saver:
    """One store's saves; shares the store's lock and index."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def save(self, tokens: list[int], state: Any, session: str | None, kind: str,
             checkpoints: list[tuple[int, bytes]] | None, state_tokens: int | None, end: bytes | None,
             partition: str) -> Head | None:
        """``PromptStore.save``: its new blocks, its snapshot and its head indexed and queued for the disk."""
        store = self.store
        state_tokens = len(tokens) if state_tokens is None else state_tokens
        if len(tokens) < MIN_TOKENS or not state or state_tokens < len(tokens):
            return None
        store._notice_deletions()
        tokens = list(tokens)
        chain = spans(store.fingerprint, tokens, partition)
        tails = checkpoint_tails(store.fingerprint, tokens, checkpoints or [], partition)
        for _ in range(3):
            with store._lock:
                missing = [(index, key) for index, (key, _, _) in enumerate(chain) if key not in store.folder.blocks]
                cut = [tail for tail in tails if tail.key not in store.folder.blocks]
                bases = self._plan_bases(
                    [(key, chain[index - 1][0] if index else root_key(store.fingerprint, partition),
                      tokens[chain[index][1]:chain[index][2]]) for index, key in missing]
                    + [(t.key, t.parent, t.tokens) for t in cut])
            ranges = [(chain[index][1] + bases.get(key, ("", 0))[1], chain[index][2]) for index, key in missing] \
                + [(t.start + bases.get(t.key, ("", 0))[1], t.end) for t in cut]
            split = self._split(state, state_tokens, ranges)
            with store._lock:
                # The state is cut outside the lock, so the writer's eviction may have dropped a block counted as
                # stored meanwhile (its payload was not cut): cut again for the new set; after three tries, give up.
                new = {index for index, _ in missing}
                made = {key for _, key in missing} | {t.key for t in cut}
                if all(key in store.folder.blocks for index, (key, _, _) in enumerate(chain) if index not in new) \
                        and all(t.key in store.folder.blocks for t in tails if t not in cut) \
                        and all(base in made or base in store.folder.blocks for base, _ in bases.values()):
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
                    store._checkpoints.index_tails([t for t in cut if checkpointed or t.key in built_on],
                                                   dict(zip([t.key for t in cut], tail_pieces, strict=True)), bases,
                                                   kind == "system")
                    head = self._index_entry(tokens, chain, missing, split, state, session, kind, partition, bases)
                    if head is not None and checkpointed:
                        store._checkpoints.index(tails, session)
                    return head
                store.stats["save_races"] += 1
        log.info("not saving %d tokens: their blocks kept being evicted while the state was cut", len(tokens))
        return None

    def _plan_bases(self, new: list[tuple[str, str, list[int]]]) -> dict[str, tuple[str, int]]:
        """For the blocks a save writes, (key, parent, tokens): the block each is built on and its length in
        tokens, where one exists: the longest stored block with the same parent whose tokens begin it (written or
        queued: one whose write was dropped holds no payload), or a shorter one of these new blocks; never past
        ``MAX_PIECES`` files. Caller holds the lock."""
        store = self.store
        if store.uncuttable:
            return {}
        plan: dict[str, tuple[str, int]] = {}
        depth: dict[str, int] = {}  # a new block -> the files it is read from
        made: dict[str, list[tuple[str, list[int]]]] = {}  # parent -> the new blocks planned so far
        for key, parent, tokens in sorted(new, key=lambda item: len(item[2])):
            best: tuple[str, int, int] | None = None
            candidates = [(child, store.folder.blocks[child].tokens) for child in store.folder.children.get(parent, ())
                          if child in store.folder.blocks and (store.folder.blocks[child].on_disk
                                                               or "b:" + child in store._writer.pending)]
            for child, child_tokens in candidates + made.get(parent, []):
                n_tokens = len(child_tokens)
                if child == key or n_tokens >= len(tokens) or (best is not None and n_tokens <= best[1]) \
                        or tokens[:n_tokens] != child_tokens:
                    continue
                files = depth.get(child) or len(store.folder.pieces(child) or ())
                if 0 < files < MAX_PIECES:
                    best = (child, n_tokens, files)
            if best is not None:
                plan[key] = (best[0], best[1])
            depth[key] = best[2] + 1 if best is not None else 1
            made.setdefault(parent, []).append((key, tokens))
        return plan

    def _split(self, state: Any, n_tokens: int,
               ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        if self.store.uncuttable:
            return None
        try:
            split: tuple[Any, list[bytes], bytes] | None = self.store.codec.state_split(state, n_tokens, ranges)
        except ValueError as exc:
            log.warning("cannot cut this state into blocks (%s); keeping it whole", exc)
            return None
        return split

    def _index_entry(self, tokens: list[int], chain: list[tuple[str, int, int]], missing: list[tuple[int, str]],
                     split: tuple[Any, list[bytes], bytes] | None, state: Any, session: str | None,
                     kind: str, partition: str, bases: dict[str, tuple[str, int]]) -> Head | None:
        """``save``'s second half, under the lock: the entry (its new blocks, its snapshot, its head) into the index
        and the write queue."""
        store = self.store
        folder, writer = store.folder, store._writer
        if split is None:
            layout, pieces, rest = None, [b""] * len(missing), state
        else:
            layout, pieces, rest = split
        if split is None and not store.uncuttable:
            if store.layout is not None or folder.blocks:
                return None  # blocks with payloads exist: do not mix layouts
            store.uncuttable = True
            store._save_layout({"whole": True})
        elif split is not None and json.loads(json.dumps(layout)) != (store.layout or {}).get("layout"):
            tail = bool(rest) or bool(isinstance(layout, dict) and layout.get("tail"))
            store._save_layout({"layout": json.loads(json.dumps(layout)), "rest": tail})
        system = kind == "system"
        parent = root_key(store.fingerprint, partition)
        new_pieces = {index: piece for (index, _), piece in zip(missing, pieces, strict=True)}
        for index, (key, start, end) in enumerate(chain):
            payload = new_pieces.get(index)
            if payload is not None and key not in folder.blocks:  # (a checkpoint's tail may be this block)
                block = Block(key, parent, tokens[start:end], len(payload), system=system, mine=True,
                              base=bases[key][0] if key in bases else None)
                folder.add_block(block)
                writer.enqueue("block", block, payload)
            else:
                block = folder.blocks[key]
                block.last_used = time.time()
                block.system = block.system or system
            parent = key
        last = chain[-1][0]
        head = self._head_for(tokens, session, kind, last, partition)
        if rest:
            if head.snapshot and head.key != last:
                if store.uncuttable or head.kind != "history":
                    writer.enqueue("drop_snapshot", head.key, b"")
                else:  # the turn before stays restorable: an agent that edits or retries a turn returns there
                    store._checkpoints.add(head.key, head.n_tokens, None, head.session)
                    store._checkpoints.bound(head.session)
            head.snapshot = True
            folder.snapshots[last] = len(rest)
            writer.enqueue("snapshot", last, rest)
        head.key, head.n_tokens, head.last_used, head.owner = last, len(tokens), time.time(), os.getpid()
        folder.heads[head.id] = head
        writer.enqueue("head", head, b"")
        writer.wake.notify()
        return head

    def _head_for(self, tokens: list[int], session: str | None, kind: str, last: str, partition: str) -> Head:
        """The entry a sequence updates: the same one, or the same session's entry it grew from (never one a
        live worker beside this one owns); else a new one (a fork keeps its parent's entry)."""
        folder = self.store.folder
        mine = {os.getpid()}
        for head in folder.heads.values():
            if head.key == last and head.kind == kind:
                return head
        if kind == "history":
            for head in folder.heads.values():
                if head.kind == "history" and head.session == session and head.n_tokens < len(tokens) \
                        and (head.owner in mine or not process_alive(head.owner)) \
                        and _chain_is_prefix(folder, head, tokens) \
                        and folder.partition_of(head.key) == partition:
                    return head  # the same conversation, grown: its entry moves forward
        return Head(uuid.uuid4().hex, last, len(tokens), session, kind, time.time(), os.getpid(), written=False)


def _chain_is_prefix(folder: Folder, head: Head, tokens: list[int]) -> bool:
    position = 0
    for key in folder.chain(head.key):
        block = folder.blocks[key]
        if tokens[position:position + len(block.tokens)] != block.tokens:
            return False
        position += len(block.tokens)
    return position == head.n_tokens
