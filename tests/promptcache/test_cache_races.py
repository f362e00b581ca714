"""The prompt store under concurrency: each race found by reading the code, injected deterministically (the
interleaving is forced with the store's own lock or a codec hook), so each test fails without its fix."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from localai.promptcache import _quota, _writer, admin
from localai.promptcache.blocks import BLOCK_TOKENS, Folder
from localai.promptcache.store import PromptStore
from tests.cachecodec import BytesCodec, EvictingCodec, state_of

FP = "f" * 32


def store(root: Path, codec: BytesCodec | None = None) -> PromptStore:
    return PromptStore(root, FP, codec or BytesCodec(), max_bytes=1 << 30)


def test_a_block_evicted_while_the_state_is_cut_never_kills_the_save(tmp_path: Path) -> None:
    codec = EvictingCodec()
    cache = store(tmp_path, codec)
    first = list(range(500, 500 + 3 * BLOCK_TOKENS))
    cache.save(first, state_of(first), "s")
    cache.flush()
    grown = first + list(range(100))
    victim = cache._spans(first)[-1][0]  # stored, so the next save will not cut it again

    def evict() -> None:
        with cache._lock:
            for head in cache.folder.drop_block(victim):
                cache.folder.write_head(head)

    codec.during.append(evict)
    head = cache.save(grown, state_of(grown), "s")  # KeyError before the fix (the worker exited 70)
    cache.flush()
    assert head is not None and cache.stats_snapshot()["save_races"] == 1
    again = store(tmp_path)
    match = again.lookup(grown)
    restored = again.restore(match) if match else None
    assert restored is not None and restored.common == len(grown) and restored.state == state_of(grown)


def test_a_block_dropped_while_queued_gives_back_its_queue_bytes(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens = list(range(900, 900 + 2 * BLOCK_TOKENS))
    with cache._lock:  # the writer cannot take anything from the queue meanwhile
        cache.save(tokens, state_of(tokens), "s")
        queued = cache._writer.queued_bytes
        for key, _, _ in cache._spans(tokens):
            cache.folder.drop_block(key)
    assert queued > 0
    cache.flush()
    writer = cache._writer
    assert writer.queued_bytes == 0 and not writer.pending  # before the fix: leaked, until every block was dropped


def test_a_block_queued_twice_is_counted_once(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens = list(range(1300, 1300 + 2 * BLOCK_TOKENS))
    with cache._lock:
        cache.save(tokens, state_of(tokens), "s")
        for key, _, _ in cache._spans(tokens):
            cache.folder.drop_block(key)
        cache.save(tokens, state_of(tokens), "s")  # the same blocks again before the writer got to them
    cache.flush()
    assert cache._writer.queued_bytes == 0 and not cache._writer.pending
    assert store(tmp_path).lookup(tokens) is not None


def test_the_queue_budget_keeps_persisting_after_many_dropped_blocks(tmp_path: Path) -> None:
    """The leak's consequence: once leaked bytes passed the queue budget, every new block was dropped."""
    cache = PromptStore(tmp_path, FP, BytesCodec(), max_bytes=1 << 30, queue_bytes=8 * BLOCK_TOKENS * 8)
    for round_ in range(20):
        tokens = list(range(round_ * 1000, round_ * 1000 + 2 * BLOCK_TOKENS))
        with cache._lock:
            cache.save(tokens, state_of(tokens), f"s{round_}")
            for key, _, _ in cache._spans(tokens):
                cache.folder.drop_block(key)
        cache.flush()
    last = list(range(50_000, 50_000 + 2 * BLOCK_TOKENS))
    cache.save(last, state_of(last), "last")
    cache.flush()
    assert cache.stats_snapshot()["dropped_writes"] == 0
    assert store(tmp_path).lookup(last) is not None


def test_listing_the_cache_while_a_worker_saves_never_deletes_its_entry(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's save (blocks, then the head) lands between the listing's read of the blocks and of the heads:
    the listing saw a head whose blocks it had not seen. Before: it deleted that head (the session's entry)."""
    cache = store(tmp_path)
    tokens = list(range(2000, 2000 + 3 * BLOCK_TOKENS))
    real = Folder._scan_blocks

    def blocks_then_a_save(folder: Folder, complaints: list[str], **options: Any) -> None:
        real(folder, complaints, **options)
        if folder is not cache.folder:  # the listing's folder, not the worker's own
            cache.save(tokens, state_of(tokens), "live")
            cache.flush()

    monkeypatch.setattr(Folder, "_scan_blocks", blocks_then_a_save)
    listed = admin.list_entries(tmp_path)
    monkeypatch.setattr(Folder, "_scan_blocks", real)
    assert [e.session for e in listed] == []  # not complete when the listing looked: left out, not deleted
    assert [e.session for e in admin.list_entries(tmp_path)] == ["live"]
    assert admin.stats(tmp_path)["entries"] == 1
    again = store(tmp_path)
    match = again.lookup(tokens)
    assert match is not None and match.common == len(tokens)


def test_a_second_workers_startup_repair_spares_a_live_workers_head(tmp_path: Path) -> None:
    """A head whose blocks are not all there yet, owned by a live process other than this one, is another worker's
    save in progress: a starting worker's repair leaves it."""
    tokens = list(range(3000, 3000 + 2 * BLOCK_TOKENS))
    cache = store(tmp_path)
    cache.save(tokens, state_of(tokens), "s")
    cache.flush()
    head = next((tmp_path / FP / "heads").glob("*.json"))
    data = json.loads(head.read_text())
    first_block = cache.folder.block_path(cache._spans(tokens)[0][0])
    first_block.rename(first_block.with_name(".tmp-1-" + first_block.name))  # "not written yet"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        head.write_text(json.dumps({**data, "owner": live.pid}))
        store(tmp_path)
        assert head.exists()
        head.write_text(json.dumps({**data, "owner": 999_999}))  # a dead owner: its chain can never complete
        store(tmp_path)
        assert not head.exists()
    finally:
        live.kill()
        live.wait()


def test_cache_rm_under_a_running_worker_is_noticed_and_the_session_saved_whole_again(tmp_path: Path) -> None:
    """4 sessions x 6 turns; ``localai cache rm --session`` of one after turn 3 while its worker lives on. Before:
    the worker trusted its index, rewrote the head but not the deleted blocks, and after a restart that session
    restored only its newest blocks' worth; ``bytes_on_disk`` over-counted, so eviction removed too much."""
    cache = store(tmp_path)
    prompts: dict[str, list[int]] = {f"s{n}": list(range(n * 10_000, n * 10_000 + 300)) for n in range(4)}
    for turn in range(6):
        for session, tokens in prompts.items():
            tokens += [turn] * 50
            cache.save(tokens, state_of(tokens), session)
        cache.flush()
        if turn == 2:
            assert admin.remove_entries(session="s1", root=tmp_path) == 1
    on_disk = sum(p.stat().st_size for p in (tmp_path / FP).glob("blocks/*.blk")) + \
        sum(p.stat().st_size for p in (tmp_path / FP).glob("snaps/*.snp"))
    assert cache.folder.bytes_on_disk() - 256 * len(cache.folder.heads) == on_disk
    restarted = store(tmp_path)
    for session, tokens in prompts.items():
        match = restarted.lookup(tokens)
        assert match is not None and match.common == len(tokens), session


def test_quota_enforcement_never_holds_the_lock_across_its_disk_work(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """enforce_quota read the pins (and rescanned the folder, and deleted other folders' files) holding the store's
    lock, so the engine thread's lookups and saves waited on the disk. Held inside load_pins, a lookup must go on."""
    cache = store(tmp_path)
    tokens = list(range(7000, 7000 + 4 * BLOCK_TOKENS))
    cache.save(tokens, state_of(tokens), "s")
    cache.flush()
    cache.max_bytes = 1  # over quota: the next enforcement evicts
    inside, release = threading.Event(), threading.Event()
    real = _quota.load_pins

    def slow_pins(root: Path | None = None, *, now: float | None = None) -> list[Any]:
        inside.set()
        release.wait(10)
        return real(root, now=now)

    monkeypatch.setattr(_quota, "load_pins", slow_pins)
    enforcing = threading.Thread(target=cache.enforce_quota)
    enforcing.start()
    try:
        assert inside.wait(10)
        looked: list[Any] = []
        lookup = threading.Thread(target=lambda: looked.append(cache.lookup(tokens)))
        lookup.start()
        lookup.join(5)
        assert looked, "a lookup waited for the quota's disk work"
    finally:
        release.set()
        enforcing.join(10)


def test_eviction_deletes_its_files_without_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction dropped each victim (its file, its snapshot, a moved entry's rewrite and fsync) holding the store's
    lock, so the engine thread's lookups and saves waited on the disk. Held inside the eviction's first unlink of a
    block, a lookup and a save on another thread complete."""
    cache = store(tmp_path)
    old = list(range(50_000, 50_000 + 4 * BLOCK_TOKENS))
    kept = list(range(60_000, 60_000 + 4 * BLOCK_TOKENS))
    for session, tokens in (("old", old), ("kept", kept)):
        cache.save(tokens, state_of(tokens), session)
        cache.flush()
    blocks = cache.folder.path / "blocks"
    evicting = threading.get_ident()
    during: list[bool] = []  # whether the other thread had finished
    found: list[Any] = []  # its lookup's match and its save's head
    threads: list[threading.Thread] = []
    real_unlink = Path.unlink

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if threading.get_ident() == evicting and not during and path.parent == blocks and path.suffix == ".blk":
            fresh = list(range(70_000, 70_000 + 2 * BLOCK_TOKENS))
            other = threading.Thread(target=lambda: found.extend(
                [cache.lookup(kept), cache.save(fresh, state_of(fresh), "new")]))
            threads.append(other)
            other.start()
            other.join(10)  # bounded: before the fix it waits for the lock this thread holds
            during.append(not other.is_alive())
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    cache.max_bytes = cache.folder.bytes_on_disk() - 1  # one block over: the old session's tail goes
    cache.enforce_quota()
    monkeypatch.undo()
    for thread in threads:
        thread.join()
    assert during == [True], "a lookup and a save waited for the eviction's file deletions"
    match, head = found
    assert match is not None and match.common == len(kept) and head is not None
    assert cache.stats_snapshot()["evictions"] == 1
    cache.flush()
    assert entries_on_disk_are_whole(tmp_path)


@pytest.mark.parametrize("failing", ["garbage", "quota"])
def test_a_tidy_failure_after_a_write_is_not_counted_as_a_dropped_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: str) -> None:
    """The writer's garbage collection and quota pass ran in the write's own try: their failure after the entry was
    written was counted as a dropped write and logged as "could not write". The write counts as written; the
    failure is logged as the upkeep's."""
    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    if failing == "garbage":
        monkeypatch.setattr(Folder, "collect_garbage", fail)
    cache = store(tmp_path)
    if failing == "quota":
        monkeypatch.setattr(cache._quota, "enforce", fail)
    tokens = list(range(80_000, 80_000 + 3 * BLOCK_TOKENS))
    with caplog.at_level(logging.WARNING, "localai.cache"):
        cache.save(tokens, state_of(tokens), "s")
        cache.flush()
    stats = cache.stats_snapshot()
    assert (stats["dropped_writes"], stats["blocks_written"]) == (0, 3)
    assert "garbage collection or quota enforcement failed" in caplog.text
    assert "could not write" not in caplog.text
    cache.close()
    match = store(tmp_path).lookup(tokens)  # the entry is on disk
    assert match is not None and match.common == len(tokens)


def test_a_workers_own_eviction_never_hides_a_cache_rm_it_has_not_noticed(tmp_path: Path) -> None:
    """cache rm marks the folder changed; if the worker's quota eviction marks it again before the worker looked,
    the worker must still notice the rm (else it trusts blocks that are gone and never writes them again)."""
    cache = store(tmp_path)
    kept = list(range(8000, 8000 + 3 * BLOCK_TOKENS))
    gone = list(range(9000, 9000 + 3 * BLOCK_TOKENS))
    filler = list(range(11_000, 11_000 + 2 * BLOCK_TOKENS))
    for session, tokens in (("gone", gone), ("kept", kept), ("filler", filler)):
        cache.save(tokens, state_of(tokens), session)
        cache.flush()
    assert admin.remove_entries(session="gone", root=tmp_path) == 1  # the worker has not looked since
    cache.max_bytes = cache.folder.bytes_on_disk() - 1  # its own eviction runs next, and marks the folder too
    cache.enforce_quota()
    cache.max_bytes = 1 << 30
    cache.save(gone, state_of(gone), "gone")  # the session comes back: its blocks must be written again
    cache.flush()
    match = store(tmp_path).lookup(gone)
    assert match is not None and match.common == len(gone)


def test_a_moved_entrys_file_never_names_a_deleted_block_while_its_new_version_waits(tmp_path: Path) -> None:
    """A session grows past a partial last block: its entry moves to a chain without that block, but its file on
    disk still names it until the new version is written. The writer's garbage collection (after another entry's
    write) and quota eviction ran before it and deleted the block; then ``prune`` took the new chain's fresh tail
    (no file named it yet), the new version could not be written, and the entry on disk named a deleted block (the
    10-minute soak's one finding, seed 322)."""
    cache = store(tmp_path)
    first = list(range(700, 700 + 2 * BLOCK_TOKENS + 20))  # a partial last block
    head = cache.save(first, state_of(first), "grows")
    cache.flush()
    assert head is not None
    old_tail = head.key
    grown = first + list(range(9000, 9030))  # the last block is now a different (longer) one
    new_tail = cache._spans(grown)[-1][0]
    with cache._lock:  # the writer waits: the moved entry's new version is queued, its old file is on disk
        assert cache.save(grown, state_of(grown), "grows") is head and head.key != old_tail
        writer = cache._writer
        for serial in [serial for serial, (kind, _) in writer.queue.items() if kind == "block"]:
            writer.write(*writer.take(serial))  # the writer got as far as the new blocks, not the entry
        cache.folder.collect_garbage(keep=cache._writer.queued_keys())  # what it runs after another entry's write
        assert old_tail in cache.folder.blocks  # kept: the file on disk names it
        pruned = Folder(tmp_path / FP)  # `localai cache prune` takes the new tail: no file names it yet
        with pruned.locked(exclusive=True):
            pruned.scan()
            for moved in pruned.drop_block(new_tail):
                pruned.write_head(moved)
            pruned.mark_changed()
    cache.flush()  # the new version's chain is broken now: it is not written, the old file stays
    cache.close()
    check = Folder(tmp_path / FP)
    check.scan()
    assert all(check.chain(entry.key) for entry in check.heads.values())  # every entry's blocks are there
    again = store(tmp_path)
    match = again.lookup(grown)
    assert match is not None and match.common >= 2 * BLOCK_TOKENS  # the session still restores


class WriteGate:
    """Holds the writer thread inside ``write_atomic`` for one path (the interleaving is forced, not slept into);
    records, at the writer's next write, whether that path's file and index entry were still there."""

    def __init__(self, cache: PromptStore, path: Path) -> None:
        self.cache, self.path = cache, path
        self.inside, self.release = threading.Event(), threading.Event()
        self.after: tuple[bool, bool] | None = None  # (file exists, indexed) when the writer moved on
        self.real = _writer.write_atomic

    def __call__(self, path: Path, parts: list[bytes]) -> int:
        if self.after is None and self.inside.is_set() and path != self.path:
            with self.cache._lock:
                self.after = (self.path.exists(), self.path.stem in self.cache.folder.snapshots)
        if path == self.path and not self.inside.is_set():
            self.inside.set()  # before the rename: a drop now finds no file to delete
            assert self.release.wait(30)
        return self.real(path, parts)


def checkpoints(tokens: list[int], ends: list[int]) -> list[tuple[int, bytes]]:
    """``seq_checkpoint``-shaped bytes (an 8-byte header, then the state's uncut part) at each of ``ends``."""
    return [(end, b"\0" * 8 + bytes([end % 251]) * 512) for end in ends]


def test_a_snapshot_dropped_while_it_is_written_is_counted_once_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's checkpoints pass CHECKPOINTS_PER_SESSION while the writer is inside ``write_atomic`` for the
    oldest one's snapshot: ``_bound_checkpoints`` gives its bytes back and drops it. Before: the writer gave the
    bytes back a second time (``_queued_bytes`` negative: the queue bound loosened by a recurrent state's size) and
    indexed the snapshot again, its file an orphan until the next tidy."""
    rest = b"W" * 64
    cache = PromptStore(tmp_path, FP, BytesCodec(rest=rest), max_bytes=1 << 30)
    tokens = list(range(20_000, 20_000 + 12 * BLOCK_TOKENS))
    oldest = cache._checkpoint_tails(tokens, checkpoints(tokens, [40]))[0].key
    gate = WriteGate(cache, cache.folder.snapshot_path(oldest))
    monkeypatch.setattr(_writer, "write_atomic", gate)
    first = tokens[:2 * BLOCK_TOKENS]
    cache.save(first, state_of(first, rest), "s", checkpoints=checkpoints(first, [40]))
    assert gate.inside.wait(30)  # the writer is writing the oldest checkpoint's snapshot
    ends = [BLOCK_TOKENS * n + 10 for n in range(2, 11)]  # nine more: the oldest goes
    cache.save(tokens, state_of(tokens, rest), "s", checkpoints=checkpoints(tokens, ends))
    assert oldest not in cache.folder.snapshots
    gate.release.set()
    cache.flush()
    # ((file there, indexed) when the writer moved on, bytes queued once all is written)
    assert (gate.after, cache._writer.queued_bytes) == ((False, False), 0)
    assert not cache._writer.pending
    cache.close()
    assert not cache.folder.snapshot_path(oldest).exists()


def test_the_queue_bound_drops_queued_snapshots_too(tmp_path: Path) -> None:
    """An engine whose states cannot be cut (whole snapshots, blocks without payloads), on a disk that cannot keep
    up (the writer held): before, only blocks were dropped, so the queued snapshots grew past ``queue_bytes``."""
    size = 4096
    cache = PromptStore(tmp_path, FP, BytesCodec(whole=True), max_bytes=1 << 30, queue_bytes=3 * size)
    with cache._lock:  # the writer takes nothing from the queue meanwhile
        for n in range(8):
            tokens = list(range(n * 1000, n * 1000 + size // 8))
            cache.save(tokens, state_of(tokens), f"s{n}")
            queued = cache._writer.queued_bytes
            assert 0 <= queued <= cache.queue_bytes, f"save {n}: {queued} bytes queued"
        assert sum(len(p) for p in cache._writer.pending.values()) == cache._writer.queued_bytes
    cache.flush()
    assert cache.stats_snapshot()["dropped_writes"] == 5 and cache._writer.queued_bytes == 0
    last = list(range(7000, 7000 + size // 8))
    match = store(tmp_path, BytesCodec(whole=True)).lookup(last)  # the newest were kept
    assert match is not None and match.common == len(last)


def test_eviction_of_a_folder_nobody_used_spares_a_worker_that_started_on_it_after_the_scan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker A's quota pass scans the other folders, finds B unused, and deletes B's files; a worker started on B
    between the scan and the deletion. Before: its entries were deleted under it (from a scan up to 30 s old, without
    B's lock). Now B is locked and read again before anything of it is deleted: A evicts its own instead."""
    other = "e" * 32
    old = PromptStore(tmp_path, other, BytesCodec(), max_bytes=1 << 30)
    kept = list(range(30_000, 30_000 + 4 * BLOCK_TOKENS))
    old.save(kept, state_of(kept), "b")
    old.close()  # B is nobody's now
    a = store(tmp_path)
    mine = list(range(40_000, 40_000 + 4 * BLOCK_TOKENS))
    a.save(mine, state_of(mine), "a")
    a.flush()
    started: list[PromptStore] = []
    real = a._quota.scan_others

    def scan_then_a_worker_starts_on_b(fresh: bool) -> tuple[int, list[tuple[float, int, Path]]]:
        found = real(fresh)
        if not started:
            started.append(PromptStore(tmp_path, other, BytesCodec(), max_bytes=1 << 30))
        return found

    monkeypatch.setattr(a._quota, "scan_others", scan_then_a_worker_starts_on_b)
    b_bytes = sum(p.stat().st_size for p in (tmp_path / other).glob("blocks/*.blk"))
    a.max_bytes = a.folder.bytes_on_disk() + b_bytes - 1  # one byte over: A's oldest file would do
    a.enforce_quota()
    b = started[0]
    match = b.lookup(kept)
    restored = b.restore(match) if match else None
    assert restored is not None and restored.common == len(kept), "the new worker lost entries it had indexed"
    assert a.stats_snapshot()["evictions"] >= 1  # A evicted from its own folder instead
    b.close()
    a.close()


def test_close_stops_the_writer_thread(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens = list(range(50_000, 50_000 + 2 * BLOCK_TOKENS))
    cache.save(tokens, state_of(tokens), "s")
    cache.close()
    assert not cache._writer.thread.is_alive(), "the writer thread outlived close()"
    assert store(tmp_path).lookup(tokens) is not None  # what was queued was written first


def entries_on_disk_are_whole(root: Path) -> bool:
    check = Folder(root / FP)
    check.scan()
    return all(check.chain(head.key) for head in check.heads.values())


def test_no_entry_file_names_a_block_whose_write_the_queue_bound_dropped(tmp_path: Path) -> None:
    """The stress soak's finding (two workers, a small queue): a session grows by two blocks on a disk that cannot
    keep up, and the bound drops the first. Before: the entry's new version was written anyway, naming the block that
    was never written; and when quota then evicted the last block, the entry moved back onto the dropped one and
    was rewritten naming it. Either way a restart found an entry whose chain is broken."""
    cache = store(tmp_path)
    first = list(range(60_000, 60_000 + 2 * BLOCK_TOKENS))
    cache.save(first, state_of(first), "s")
    cache.flush()
    cache.queue_bytes = 8 * BLOCK_TOKENS  # one block's payload
    grown = first + list(range(61_000, 61_000 + 2 * BLOCK_TOKENS))
    with cache._lock:  # the writer takes nothing meanwhile: the second new block pushes the first out
        cache.save(grown, state_of(grown), "s")
    cache.flush()
    assert cache.stats_snapshot()["dropped_writes"] == 1
    assert entries_on_disk_are_whole(tmp_path), "the entry's new version names the dropped block"
    cache.max_bytes = cache.folder.bytes_on_disk() - 1  # the last block goes: the entry moves back a block
    cache.enforce_quota()
    assert cache.stats_snapshot()["evictions"] == 1
    assert entries_on_disk_are_whole(tmp_path), "the moved entry was rewritten over the dropped block"
    assert [(e.session, e.tokens) for e in admin.list_entries(tmp_path)] == [("s", len(first))]  # its file as was
    match = store(tmp_path).lookup(grown)  # after a restart: what is on disk restores
    assert match is not None and match.common == len(first)


def test_the_first_failed_write_is_told_once_from_the_writer_thread(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk fails every write: the first is told to ``on_warning`` (the serving loop sends it to the daemon's
    log, the worker's own log being on that disk), once, outside the store's lock; later ones only count."""
    def full(*args: Any, **kwargs: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_writer, "write_atomic", full)
    cache = store(tmp_path)
    told: list[tuple[str, bool, str]] = []

    def tell(message: str) -> None:
        free = not cache._lock._is_owned()  # type: ignore[attr-defined]  # RLock's own: held by this thread
        told.append((message, free, threading.current_thread().name))

    cache.on_warning = tell
    for session in range(3):
        tokens = list(range(90_000 + session * 1000, 90_000 + session * 1000 + 2 * BLOCK_TOKENS))
        cache.save(tokens, state_of(tokens), str(session))
        cache.flush()
    assert cache.stats_snapshot()["dropped_writes"] >= 3
    assert len(told) == 1, told
    message, free, thread = told[0]
    assert "could not write a file" in message and "No space left on device" in message and str(cache.dir) in message
    assert free and thread == "cache-writer"


def test_a_failing_warning_never_stops_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_warning`` runs on the writer thread: had it raised out of the writer's loop, every later write would
    have queued for nothing."""
    real = _writer.write_atomic
    full = [True]

    def maybe_full(*args: Any, **kwargs: Any) -> int:
        if full[0]:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    def broken(message: str) -> None:
        raise RuntimeError("the daemon is gone")

    monkeypatch.setattr(_writer, "write_atomic", maybe_full)
    cache = store(tmp_path)
    cache.on_warning = broken
    tokens = list(range(95_000, 95_000 + 2 * BLOCK_TOKENS))
    cache.save(tokens, state_of(tokens), "a")
    cache.flush()
    full[0] = False  # the disk has room again
    later = list(range(96_000, 96_000 + 2 * BLOCK_TOKENS))
    cache.save(later, state_of(later), "b")
    cache.flush(timeout=10)
    assert cache._writer.thread.is_alive() and cache.stats_snapshot()["blocks_written"] == 2

