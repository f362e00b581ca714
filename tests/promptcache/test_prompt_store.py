"""The block store behind the prompt cache, with a byte codec (the engine's carving is tested in
tests/engines/test_llama_state.py against llama.cpp itself)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from localai.promptcache import admin, pins
from localai.promptcache.blocks import BLOCK_TOKENS, read_block
from localai.promptcache.store import MIN_TOKENS, PromptStore
from tests.cachecodec import BytesCodec, state_of

FP = "f" * 32


def store(root: Path, codec: BytesCodec | None = None, **options: int) -> PromptStore:
    return PromptStore(root, FP, codec or BytesCodec(), max_bytes=options.pop("max_bytes", 1 << 30), **options)


def restore(cache: PromptStore, prompt: list[int]) -> tuple[int, bytes] | None:
    match = cache.lookup(prompt)
    restored = cache.restore(match) if match else None
    return (restored.common, restored.state) if restored else None


def blocks_on_disk(root: Path) -> list[Path]:
    return sorted(root.glob("*/blocks/*.blk"))


def test_a_sequence_is_stored_as_blocks_and_its_longest_prefix_restored(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens = list(range(1000, 1200))  # 3 full blocks and a partial one
    cache.save(tokens, state_of(tokens), "a")
    cache.flush()
    assert len(blocks_on_disk(tmp_path)) == 4
    common, state = restore(cache, [*tokens[:150], 1, 2, 3]) or (0, b"")
    assert common == 150 and state == state_of(tokens[:192])  # whole blocks; the engine cuts back to 150
    assert restore(cache, list(range(5, 100))) is None
    again = store(tmp_path)  # a restart reads the index back from the headers
    assert (restore(again, tokens) or (0, b""))[1] == state_of(tokens)


def test_sessions_sharing_a_prefix_share_its_blocks_and_a_turn_writes_only_what_is_new(tmp_path: Path) -> None:
    cache = store(tmp_path)
    prefix = list(range(2000, 2000 + 4 * BLOCK_TOKENS))
    for session in range(6):  # sub-agents: one system prefix, different tails
        tail = [session] * 40
        cache.save(prefix + tail, state_of(prefix + tail), f"agent-{session}")
    cache.flush()
    assert len(blocks_on_disk(tmp_path)) == 4 + 6  # the prefix once, a tail each
    before = cache.stats_snapshot()["bytes_written"]
    grown = prefix + [0] * 40 + list(range(100))  # agent 0's next turn: 100 new tokens
    cache.save(grown, state_of(grown), "agent-0")
    cache.flush()
    written = cache.stats_snapshot()["bytes_written"] - before
    # The new tokens once, plus three files' headers: the block the old tail began is built on it (24 tokens)
    assert 8 * 100 < written <= 8 * 100 + 3 * 1024, written
    entries = [e for e in admin.list_entries(tmp_path) if e.session == "agent-0"]
    assert len(entries) == 1 and entries[0].tokens == len(grown)  # its entry moved forward
    assert len(blocks_on_disk(tmp_path)) == 4 + 6 + 3  # the old tail stays as the next block's base
    built = [read_block(path, with_payload=False)[0] for path in blocks_on_disk(tmp_path)]
    assert sorted(header["n_tokens"] - header["payload_bytes"] // 8 for header in built if "base" in header) == [40]
    for reader in (cache, store(tmp_path)):  # this worker, and after a restart
        assert restore(reader, grown) == (len(grown), state_of(grown))


def test_short_prefixes_are_not_stored(tmp_path: Path) -> None:
    cache = store(tmp_path)
    cache.save(list(range(MIN_TOKENS - 1)), state_of(list(range(MIN_TOKENS - 1))), None)
    cache.flush()
    assert not blocks_on_disk(tmp_path)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_block_mid_chain_is_never_served_and_restore_stops_before_it(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    tokens = list(range(3000, 3000 + 4 * BLOCK_TOKENS))
    cache = store(tmp_path)
    cache.save(tokens, state_of(tokens), "s")
    cache.flush()
    keys = cache._spans(tokens)
    path = cache.folder.block_path(keys[2][0])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[:-100]
    else:
        data = bytearray(b"not a block at all")
    path.write_bytes(bytes(data))
    fresh = store(tmp_path, ram_bytes=0)  # from disk, not RAM
    with caplog.at_level(logging.WARNING, "localai.cache"):
        result = restore(fresh, tokens)
    assert result is not None and result[0] == 2 * BLOCK_TOKENS  # the two good blocks before it
    assert result[1] == state_of(tokens[:2 * BLOCK_TOKENS])
    assert not path.exists() and not fresh.folder.block_path(keys[3][0]).exists()  # it, and what chains after it
    assert fresh.stats_snapshot()["corrupt"] == 1 or damage == "garbage"


def test_a_foreign_fingerprint_is_never_read(tmp_path: Path) -> None:
    """Another model's blocks inside this fingerprint's folder (a folder copied or renamed by hand): their chains
    start at the other fingerprint, so they are never served and are no entry here. (Reading
    another folder proved nothing: the files were never where the second store looks.)"""
    tokens = list(range(100))
    cache = store(tmp_path)
    cache.save(tokens, state_of(tokens), None)
    cache.close()
    foreign = tmp_path / ("0" * 32)
    shutil.copytree(tmp_path / FP, foreign)
    assert len(list(foreign.glob("blocks/*.blk"))) == 2 and list(foreign.glob("heads/*.json"))
    other = PromptStore(tmp_path, "0" * 32, BytesCodec(), max_bytes=1 << 30)
    assert other.lookup(tokens) is None
    assert not other.folder.complete_heads()  # no entry of theirs is an entry here
    assert store(tmp_path).lookup(tokens) is not None  # the model they belong to still has them


def test_an_interrupted_write_leaves_no_block_and_its_temp_file_is_cleaned(tmp_path: Path) -> None:
    folder = tmp_path / FP / "blocks"
    folder.mkdir(parents=True)
    (folder / ".tmp-999999-abc.blk").write_bytes(b"half a block")  # a writer that died
    (folder / ("0" * 32 + ".blk")).write_bytes(b"LAIBLK01")  # renamed but cut short by a disk fault
    cache = store(tmp_path)
    assert not list(folder.iterdir())
    assert cache.stats_snapshot()["corrupt"] == 1


def test_the_quota_evicts_least_recently_used_tails_first_and_never_a_pinned_chain(tmp_path: Path) -> None:
    prefix = list(range(4000, 4000 + 2 * BLOCK_TOKENS))
    cache = store(tmp_path)
    for used, session in enumerate(("old", "pinned", "new")):  # distinct tails, used in this order
        tokens = prefix + [used + 1] * (2 * BLOCK_TOKENS)
        cache.save(tokens, state_of(tokens), session)
        cache.flush()
        for key, start, _ in cache._spans(tokens):
            if start >= len(prefix):
                cache.folder.blocks[key].last_used = 1_000_000.0 + used  # the order, not the clock's resolution
    pins.add_pin(session="pinned", entry=None, ttl=600, root=tmp_path)
    block_bytes = read_size = blocks_on_disk(tmp_path)[0].stat().st_size
    cache.max_bytes = cache.folder.bytes_on_disk() - 2 * block_bytes + 1
    cache.enforce_quota()
    sessions = {e.session: e.tokens for e in admin.list_entries(tmp_path)}
    assert sessions["pinned"] == 4 * BLOCK_TOKENS and sessions["new"] == 4 * BLOCK_TOKENS
    assert sessions.get("old", 0) <= 2 * BLOCK_TOKENS  # lost its tail, oldest first; the shared prefix stays
    cache.max_bytes = 0
    cache.enforce_quota()
    left = {e.session: e.tokens for e in admin.list_entries(tmp_path)}
    assert left == {"pinned": 4 * BLOCK_TOKENS, "old": 2 * BLOCK_TOKENS, "new": 2 * BLOCK_TOKENS}
    assert len(blocks_on_disk(tmp_path)) == 4  # the shared prefix lives on under the pinned chain, and only it
    assert read_size > 0


def test_an_engine_with_a_window_restores_only_where_a_snapshot_was_taken(tmp_path: Path) -> None:
    codec = BytesCodec(rest=b"WINDOW")
    cache = store(tmp_path, codec)
    turn1 = list(range(5000, 5100))
    cache.save(turn1, state_of(turn1, b"WINDOW"), "s")
    cache.flush()
    common, state = restore(cache, [*turn1, 7, 8, 9]) or (0, b"")
    assert common == len(turn1) and state == state_of(turn1, b"WINDOW")
    assert restore(cache, [*turn1[:90], 1, 2]) is None  # it cannot be cut back inside the window


def test_a_window_engine_restores_a_shared_system_prefix_beside_a_longer_conversation(tmp_path: Path) -> None:
    """A system entry ends part way into a block that a conversation after it filled further: another session's
    prompt leaves that longer block part way, and must take the system entry's shorter tail, where the snapshot is
    (the longer block, cut back, would have no window to go with it)."""
    codec = BytesCodec(rest=b"WINDOW")
    cache = store(tmp_path, codec)
    system = list(range(7000, 7100))
    cache.save(system, state_of(system, b"WINDOW"), None, kind="system")
    first = [*system, *range(1, 40)]
    cache.save(first, state_of(first, b"WINDOW"), "a")
    cache.flush()
    other = [*system, *range(500, 540)]
    assert restore(cache, other) == (len(system), state_of(system, b"WINDOW"))
    # The next prompt even fills the same block as the conversation (the first user message starts alike) and
    # parts from it later, where no snapshot is: the system entry's tail is still the place to restore.
    alike = [*system, *range(1, 29), *range(900, 930)]
    assert restore(cache, alike) == (len(system), state_of(system, b"WINDOW"))


def test_an_engine_that_keeps_state_whole_still_caches(tmp_path: Path) -> None:
    cache = store(tmp_path, BytesCodec(whole=True))
    tokens = list(range(6000, 6100))
    cache.save(tokens, b"WHOLE-STATE", "s")
    cache.flush()
    assert restore(cache, [*tokens, 1]) == (len(tokens), b"WHOLE-STATE")
    assert restore(cache, [*tokens[:60], 1]) == (60, b"WHOLE-STATE")  # the engine cuts it back


def test_old_whole_sequence_entries_are_converted_into_blocks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tokens = list(range(7000, 7100))
    payload = state_of(tokens)
    token_bytes = struct.pack(f"<{len(tokens)}i", *tokens)
    header = json.dumps({"fingerprint": FP, "n_tokens": len(tokens), "payload_bytes": len(payload),
                         "checksum": f"crc32:{zlib.crc32(payload, zlib.crc32(token_bytes)):08x}",
                         "session": "old", "kind": "history"}).encode()
    (tmp_path / FP).mkdir()
    (tmp_path / FP / "legacy.kv").write_bytes(b"LAIKV002" + struct.pack("<I", len(header)) + header + token_bytes
                                             + payload)
    (tmp_path / FP / "broken.kv").write_bytes(b"LAIKV002junk")
    with caplog.at_level(logging.WARNING, "localai.cache"):
        cache = store(tmp_path)
        cache.flush()
    assert "converted old cache entry legacy.kv" in caplog.text and "dropping old cache entry broken.kv" in caplog.text
    assert not list((tmp_path / FP).glob("*.kv"))
    assert restore(cache, tokens) == (len(tokens), payload)


OTHER_WORKER = """
import sys, time
from pathlib import Path
from localai.promptcache.store import PromptStore
from tests.cachecodec import BytesCodec, state_of
cache = PromptStore(Path(sys.argv[1]), sys.argv[2], BytesCodec(), max_bytes=1 << 30)
tokens = list(range(9000, 9200))
cache.save(tokens, state_of(tokens), "theirs")
cache.flush()
print("saved", flush=True)
time.sleep(60)
"""


def test_two_workers_on_one_fingerprint_never_delete_each_others_blocks(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", OTHER_WORKER, str(tmp_path), FP], stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).parents[2])
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "saved"
        mine = store(tmp_path)
        tokens = list(range(8000, 8200))
        mine.save(tokens, state_of(tokens), "mine")
        mine.flush()
        theirs = {p.name for p in blocks_on_disk(tmp_path)} - {f"{k}.blk" for k, _, _ in mine._spans(tokens)}
        assert len(theirs) == 4
        mine.max_bytes = 0
        mine.enforce_quota()
        assert theirs <= {p.name for p in blocks_on_disk(tmp_path)}  # only my own blocks went
        assert not any(p.name in {f"{k}.blk" for k, _, _ in mine._spans(tokens)} for p in blocks_on_disk(tmp_path))
    finally:
        other.kill()
        other.wait()
        if other.stdout is not None:
            other.stdout.close()
    mine.enforce_quota()  # its worker is gone: now they are fair game
    assert not blocks_on_disk(tmp_path)


def test_the_write_queue_is_bounded(tmp_path: Path) -> None:
    cache = store(tmp_path, queue_bytes=0)
    cache._lock.acquire()  # the writer cannot take anything off the queue
    try:
        for session in range(3):
            tokens = [session + 1] * 200
            cache.save(tokens, state_of(tokens), str(session))
    finally:
        cache._lock.release()
    cache.flush()
    assert cache.stats_snapshot()["dropped_writes"] > 0


def test_block_files_carry_their_tokens_and_checksums(tmp_path: Path) -> None:
    tokens = list(range(100, 200))
    cache = store(tmp_path)
    cache.save(tokens, state_of(tokens), None)
    cache.flush()
    for path in blocks_on_disk(tmp_path):
        header, block_tokens, payload = read_block(path, with_payload=True)
        assert payload == state_of(block_tokens) and header["checksum"].startswith("crc32:")
    assert os.path.exists(tmp_path / FP / "layout.json")


@pytest.mark.parametrize(("state_bytes", "budget", "kept"), [
    (512, 1 << 20, 8),  # small states (the fixtures, Nemotron-3-Nano's 48 MiB against 512 MiB): the count bounds
    (1000, 4096, 4),  # the bytes bound (a snapshot: the state and a 24-byte header, 1,024 bytes each)
    (3000, 4096, 2),  # states larger than the budget allows (Qwen3.6-27B's ~150 MiB): the two newest stay anyway
])
def test_a_sessions_checkpoints_are_bounded_by_count_and_by_their_states_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state_bytes: int, budget: int, kept: int) -> None:
    """Ten checkpoints in one session: the newest stay, at most CHECKPOINTS_PER_SESSION, no more than the byte
    budget holds, never fewer than two; the others' entries and snapshots go, disk files included."""
    from localai.promptcache import _checkpoints

    monkeypatch.setattr(_checkpoints, "CHECKPOINT_BYTES_PER_SESSION", budget)
    cache = store(tmp_path, BytesCodec(rest=b"R" * 64))
    tokens = list(range(40_000, 40_000 + 12 * BLOCK_TOKENS))
    ends = [BLOCK_TOKENS * n + 10 for n in range(1, 11)]
    cache.save(tokens, state_of(tokens, b"R" * 64), "s",
               checkpoints=[(end, b"\0" * 8 + bytes([end % 251]) * state_bytes) for end in ends])
    cache.flush()
    held = sorted(head.n_tokens for head in cache.folder.heads.values() if head.kind == "checkpoint")
    assert held == ends[-kept:]  # the newest (the deepest of one save: the latest turns)
    sizes = [cache.folder.snapshots[h.key] for h in cache.folder.heads.values() if h.kind == "checkpoint"]
    assert len(sizes) == kept and all(size > state_bytes for size in sizes)
    assert sum(sizes) <= budget or kept == 2
    assert len(list(tmp_path.glob("*/snaps/*.snp"))) == kept + 1  # the kept checkpoints' and the entry's own
    cache.close()
