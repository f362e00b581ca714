"""The prompt store's checkpoints: for an engine whose state can only be restored where one was taken (recurrent or
sliding-window layers), entries of kind "checkpoint" with their snapshots, placed on the saved sequence's blocks (a
tail block beside the chain when one falls inside a block) and kept within a bound per session.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from localai.promptcache._writer import Writer
from localai.promptcache.blocks import Block, Folder, Head

# Checkpoints kept per session on disk (the states of engines with recurrent or sliding-window layers can only be
# restored where one was taken): the newest, up to 8 (the turns an agent edits or retries) and up to 512 MiB of
# states, but always 2 (a retry and a fork from the turn before). A recurrent state as llama.cpp keeps it is 48 MiB
# on Nemotron-3-Nano (8 kept), 75 MiB on Qwen3-Next-80B-A3B (6), ~150 MiB on Qwen3.6-27B (3): a count alone let one
# Qwen3.6 session hold 1.2 GiB of the 8 GiB default quota.
CHECKPOINTS_PER_SESSION = 8
MIN_CHECKPOINTS_PER_SESSION = 2
CHECKPOINT_BYTES_PER_SESSION = 512 << 20


@dataclass
class Tail:
    """Where a checkpoint is stored: the block ending at it, which may be a tail block beside the chain."""

    key: str
    parent: str
    start: int
    end: int
    tokens: list[int]
    snapshot: bytes


class Store(Protocol):
    """What the checkpoints reach of their ``PromptStore``."""

    folder: Folder
    _writer: Writer


class Checkpoints:
    """One store's checkpoint entries; every method runs under the store's lock (the caller's)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def index_tails(self, tails: list[Tail], payloads: dict[str, bytes], bases: dict[str, tuple[str, int]],
                    system: bool) -> None:
        """The checkpoints' tail blocks (a block of their own beside the chain)."""
        folder = self.store.folder
        for tail in tails:
            payload = payloads.get(tail.key)
            if tail.key in folder.blocks or payload is None:
                continue
            block = Block(tail.key, tail.parent, tail.tokens, len(payload), system=system, mine=True,
                          base=bases[tail.key][0] if tail.key in bases else None)
            folder.add_block(block)
            self.store._writer.enqueue("block", block, payload)

    def index(self, tails: list[Tail], session: str | None) -> None:
        """The checkpoints' snapshots and entries (their tail blocks are indexed: ``index_tails``); then the
        session's oldest checkpoints beyond its bound go (``bound``)."""
        for tail in tails:
            if tail.key in self.store.folder.blocks:
                self.add(tail.key, tail.end, tail.snapshot, session)
        self.bound(session)

    def add(self, key: str, n_tokens: int, snapshot: bytes | None, session: str | None) -> None:
        """An entry of kind "checkpoint" ending at block ``key`` with its snapshot (None: stored already)."""
        folder, writer = self.store.folder, self.store._writer
        if snapshot is not None and key not in folder.snapshots:
            folder.snapshots[key] = len(snapshot)
            writer.enqueue("snapshot", key, snapshot)
        if any(h.key == key and h.kind == "checkpoint" for h in folder.heads.values()):
            return
        head = Head(uuid.uuid4().hex, key, n_tokens, session, "checkpoint", time.time(), os.getpid(),
                    snapshot=True, written=False)
        folder.heads[head.id] = head
        writer.enqueue("head", head, b"")

    def bound(self, session: str | None) -> None:
        """The session's newest checkpoints stay: ``MIN_CHECKPOINTS_PER_SESSION`` always, then while they number
        under ``CHECKPOINTS_PER_SESSION`` and their states fit ``CHECKPOINT_BYTES_PER_SESSION``; the rest go."""
        folder, writer = self.store.folder, self.store._writer
        mine = sorted((h for h in folder.heads.values() if h.kind == "checkpoint" and h.session == session),
                      key=lambda h: (h.last_used, h.n_tokens), reverse=True)
        kept, used = 0, 0
        going = []
        for head in mine:
            size = folder.snapshots.get(head.key, 0)
            if kept < MIN_CHECKPOINTS_PER_SESSION or (
                    kept < CHECKPOINTS_PER_SESSION and used + size <= CHECKPOINT_BYTES_PER_SESSION):
                kept, used = kept + 1, used + size
            else:
                going.append(head)
        for head in going:
            del folder.heads[head.id]
            folder.head_path(head.id).unlink(missing_ok=True)
            if not any(h.key == head.key and h.snapshot for h in folder.heads.values()):
                writer.queued_bytes -= len(writer.pending.pop("s:" + head.key, b""))
                folder.drop_snapshot(head.key)
