import os
import time
from pathlib import Path

import pytest

from localai.session_cache import MIN_TOKENS, CorruptEntry, SessionCache, common_prefix, read_entry

TOKENS = list(range(100, 100 + MIN_TOKENS + 20))


def make(root: Path, **kwargs: int) -> SessionCache:
    return SessionCache(root, "f" * 32, max_bytes=kwargs.get("max_bytes", 1 << 30), ram_bytes=0)


def test_round_trip_and_longest_prefix(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.save_async(TOKENS, b"state-a" * 100, "s1")
    cache.save_async([*TOKENS[:40], 7, 7, 7], b"state-b" * 100, "s2")
    cache.flush()
    entry, common = cache.best_prefix([*TOKENS, 1, 2, 3])
    assert entry is not None and common == len(TOKENS)
    assert cache.load(entry) == b"state-a" * 100
    # a new process sees the same entries
    again = make(tmp_path)
    entry, common = again.best_prefix([*TOKENS[:40], 7, 7, 9])
    assert entry is not None and common == 42 and again.load(entry) == b"state-b" * 100


def test_short_prefixes_are_not_stored(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.save_async(TOKENS[: MIN_TOKENS - 1], b"x", None)
    cache.flush()
    assert cache.entries == {}


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_files_are_dropped_never_served(tmp_path: Path, damage: str) -> None:
    cache = make(tmp_path)
    cache.save_async(TOKENS, b"payload" * 1000, None)
    cache.flush()
    (entry,) = cache.entries.values()
    data = bytearray(entry.path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"definitely not a cache file")
    entry.path.write_bytes(bytes(data))
    reopened = make(tmp_path)
    found, _ = reopened.best_prefix(TOKENS)
    if found is not None:  # header still readable: the payload check catches it
        with pytest.raises(CorruptEntry):
            reopened.load(found)
    assert not list((tmp_path / ("f" * 32)).glob("*.kv"))
    assert reopened.stats["corrupt"] == 1


def test_foreign_fingerprint_is_never_read(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.save_async(TOKENS, b"x" * 64, None)
    cache.flush()
    (entry,) = cache.entries.values()
    with pytest.raises(CorruptEntry, match="another model"):
        read_entry(entry.path, "0" * 32)
    other = SessionCache(tmp_path, "0" * 32, max_bytes=1 << 30)
    assert other.best_prefix(TOKENS) == (None, 0)


def test_interrupted_write_leaves_no_entry(tmp_path: Path) -> None:
    directory = tmp_path / ("f" * 32)
    directory.mkdir(parents=True)
    crashed = directory / ".tmp-999999999-abc.kv"  # its writer is gone
    crashed.write_bytes(b"LAIKV002 half written")
    stale = directory / f".tmp-{os.getpid()}-old.kv"  # a live pid, but far too old to be in flight
    stale.write_bytes(b"LAIKV002 half written")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    in_flight = directory / f".tmp-{os.getpid()}-def.kv"  # another worker on this folder, writing right now
    in_flight.write_bytes(b"LAIKV002 being written")
    cache = make(tmp_path)
    assert cache.entries == {} and list(directory.iterdir()) == [in_flight]


def test_quota_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = make(tmp_path, max_bytes=25_000)
    for index in range(3):
        cache.save_async([index, *TOKENS], bytes(10_000), f"s{index}")
        cache.flush()
    assert len(cache.entries) == 2 and cache.stats["evictions"] == 1
    assert {e.tokens[0] for e in cache.entries.values()} == {1, 2}


def test_a_grown_conversation_supersedes_its_older_entry(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.save_async(TOKENS, b"a" * 100, "s")
    cache.flush()
    cache.save_async([*TOKENS, 5, 6], b"b" * 100, "s")
    cache.flush()
    cache.save_async([*TOKENS, 9], b"c" * 100, "other")
    cache.flush()
    assert sorted(len(e.tokens) for e in cache.entries.values()) == [len(TOKENS) + 1, len(TOKENS) + 2]


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5] * 1000 + [1], [5] * 1000 + [2]) == 1000


def test_quota_keeps_pinned_entries_and_an_expired_pin_is_evictable(tmp_path: Path) -> None:
    import time

    from localai import cache_admin

    cache = make(tmp_path, max_bytes=25_000)
    cache.save_async([0, *TOKENS], bytes(10_000), "keep")
    cache.flush()
    cache_admin.add_pin(session="keep", entry=None, ttl=3600, root=tmp_path)
    for index in (1, 2):
        cache.save_async([index, *TOKENS], bytes(10_000), f"s{index}")
        cache.flush()
    assert {e.session for e in cache.entries.values()} == {"keep", "s2"}  # s1 went, the pinned one stayed
    cache_admin.save_pins([cache_admin.Pin(session="keep", entry=None, expires_at=time.time() - 1)], tmp_path)
    cache.save_async([3, *TOKENS], bytes(10_000), "s3")
    cache.flush()
    assert "keep" not in {e.session for e in cache.entries.values()}


def test_system_prefixes_outrank_history_in_eviction(tmp_path: Path) -> None:
    cache = make(tmp_path, max_bytes=25_000)
    cache.save_async([9, *TOKENS], bytes(10_000), None, kind="system")
    cache.flush()
    for index in (1, 2):
        cache.save_async([index, *TOKENS], bytes(10_000), f"s{index}")
        cache.flush()
    assert sorted(e.kind for e in cache.entries.values()) == ["history", "system"]


class StalledDisk:
    """Holds the writer thread inside its first write until released, so the queue can be inspected."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        from localai import session_cache

        self.release = threading.Event()
        self.entered = threading.Event()
        real = session_cache.write_entry

        def slow_write(*args: object, **kwargs: object) -> None:
            self.entered.set()
            self.release.wait(10)
            real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(session_cache, "write_entry", slow_write)


def test_a_superseded_entry_leaves_the_write_queue_and_is_never_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = StalledDisk(monkeypatch)
    cache = make(tmp_path)
    cache.save_async([1, *TOKENS], b"x" * 100, "other")  # the writer takes this one and stalls
    assert disk.entered.wait(5)
    cache.save_async(TOKENS, b"a" * 1000, "s")
    cache.save_async([*TOKENS, 5], b"b" * 1000, "s")  # the same conversation, grown
    assert [len(payload) for _, payload in cache._writes] == [1000]  # the superseded payload is gone
    disk.release.set()
    cache.flush()
    assert sorted(len(e.tokens) for e in cache.entries.values()) == [len(TOKENS) + 1, len(TOKENS) + 1]
    assert len(list(cache.dir.glob("*.kv"))) == 2


def test_an_entry_too_large_for_ram_is_served_from_the_write_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = StalledDisk(monkeypatch)
    cache = make(tmp_path)  # ram_bytes=0: nothing stays in the RAM tier
    cache.save_async([1, *TOKENS], b"x" * 100, "first")
    assert disk.entered.wait(5)
    cache.save_async(TOKENS, b"big" * 1000, "s")
    entry, common = cache.best_prefix([*TOKENS, 1])
    assert entry is not None and common == len(TOKENS)
    assert cache.load(entry) == b"big" * 1000
    disk.release.set()
    cache.flush()
    assert cache.stats["corrupt"] == 0


def test_the_write_queue_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = StalledDisk(monkeypatch)
    cache = SessionCache(tmp_path, "f" * 32, max_bytes=1 << 30, ram_bytes=0, queue_bytes=2500)
    cache.save_async([0, *TOKENS], b"x" * 100, "first")
    assert disk.entered.wait(5)
    for index in range(1, 6):
        cache.save_async([index, *TOKENS], bytes(1000), f"s{index}")
    assert cache._queued_bytes <= 2500 and cache.stats["dropped_writes"] == 3
    disk.release.set()
    cache.flush()
    assert {e.tokens[0] for e in cache.entries.values()} == {0, 4, 5}  # dropped ones are not indexed as corrupt
    assert cache.stats["corrupt"] == 0


def test_a_file_another_worker_deleted_is_a_miss_not_corruption(tmp_path: Path) -> None:
    first, second = make(tmp_path), make(tmp_path)  # two model names on the same weights share a folder
    first.save_async(TOKENS, b"a" * 100, "s")
    first.flush()
    again = make(tmp_path)
    (entry,) = again.entries.values()
    first.save_async([*TOKENS, 1], b"b" * 100, "s")  # supersedes: deletes the file `again` indexed
    first.flush()
    with pytest.raises(CorruptEntry):
        again.load(entry)
    assert again.stats["corrupt"] == 0 and entry.id not in again.entries
    assert second.stats["corrupt"] == 0


def test_the_quota_covers_every_fingerprint_folder(tmp_path: Path) -> None:
    other = SessionCache(tmp_path, "0" * 32, max_bytes=25_000, ram_bytes=0)
    other.save_async([7, *TOKENS], bytes(10_000), "old")
    other.flush()
    past = time.time() - 100
    for path in other.dir.glob("*.kv"):
        os.utime(path, (past, past))
    cache = make(tmp_path, max_bytes=25_000)
    for index in (1, 2):
        cache.save_async([index, *TOKENS], bytes(10_000), f"s{index}")
        cache.flush()
    # 3 x 10 kB over a 25 kB quota for the whole folder: the oldest file, another fingerprint's, went
    assert not list(other.dir.glob("*.kv")) and len(cache.entries) == 2
