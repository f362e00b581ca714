"""The prompt store under concurrency: each race found by reading the code, injected deterministically (the
interleaving is forced with the store's own lock or a codec hook), so each test fails without its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localai.promptcache.blocks import BLOCK_TOKENS
from localai.promptcache.store import PromptStore, StateBytes
from tests.cachecodec import BytesCodec, state_of

FP = "f" * 32


class EvictingCodec(BytesCodec):
    """Cuts states like BytesCodec; the first cut also runs ``during`` (the writer thread's eviction, landing while
    the worker cuts its state outside the store's lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.during: list[Any] = []

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        while self.during:
            self.during.pop(0)()
        return super().state_split(state, n_tokens, ranges)


def store(root: Path, codec: BytesCodec | None = None) -> PromptStore:
    return PromptStore(root, FP, codec or BytesCodec(), max_bytes=1 << 30)


def test_a_block_evicted_while_the_state_is_cut_never_kills_the_save(tmp_path: Path) -> None:
    codec = EvictingCodec()
    cache = store(tmp_path, codec)
    first = list(range(500, 500 + 3 * BLOCK_TOKENS))
    cache.save(first, state_of(first), "s")
    cache.flush()
    grown = first + list(range(100))
    victim = cache._keys(first)[-1][0]  # stored, so the next save will not cut it again

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
        queued = cache._queued_bytes
        for key, _, _ in cache._keys(tokens):
            cache.folder.drop_block(key)
    assert queued > 0
    cache.flush()
    assert cache._queued_bytes == 0 and not cache._pending  # before the fix: leaked, until every block was dropped


def test_a_block_queued_twice_is_counted_once(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens = list(range(1300, 1300 + 2 * BLOCK_TOKENS))
    with cache._lock:
        cache.save(tokens, state_of(tokens), "s")
        for key, _, _ in cache._keys(tokens):
            cache.folder.drop_block(key)
        cache.save(tokens, state_of(tokens), "s")  # the same blocks again before the writer got to them
    cache.flush()
    assert cache._queued_bytes == 0 and not cache._pending
    assert store(tmp_path).lookup(tokens) is not None


def test_the_queue_budget_keeps_persisting_after_many_dropped_blocks(tmp_path: Path) -> None:
    """The leak's consequence: once leaked bytes passed the queue budget, every new block was dropped."""
    cache = PromptStore(tmp_path, FP, BytesCodec(), max_bytes=1 << 30, queue_bytes=8 * BLOCK_TOKENS * 8)
    for round_ in range(20):
        tokens = list(range(round_ * 1000, round_ * 1000 + 2 * BLOCK_TOKENS))
        with cache._lock:
            cache.save(tokens, state_of(tokens), f"s{round_}")
            for key, _, _ in cache._keys(tokens):
                cache.folder.drop_block(key)
        cache.flush()
    last = list(range(50_000, 50_000 + 2 * BLOCK_TOKENS))
    cache.save(last, state_of(last), "last")
    cache.flush()
    assert cache.stats_snapshot()["dropped_writes"] == 0
    assert store(tmp_path).lookup(last) is not None
