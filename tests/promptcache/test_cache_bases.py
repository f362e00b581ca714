"""Blocks built on a shorter block (its ``base``): a conversation's saves write each token's KV once, not the partial
last block again every turn. Every checkpoint and entry still restores exactly, in this worker and after a restart;
a damaged or missing base is never served; eviction, ``cache rm`` and ``prune`` never leave a block without its base;
a base evicted while the state is cut never kills the save."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from localai.promptcache import admin
from localai.promptcache.blocks import BLOCK_TOKENS, read_block
from localai.promptcache.store import MAX_PIECES, PromptStore
from tests.cachecodec import BytesCodec, EvictingCodec, state_of

FP = "f" * 32
REPLY = 8  # tokens an answer adds after each prompt's end (where the engine took its checkpoint)


def store(root: Path, codec: BytesCodec | None = None, **options: int) -> PromptStore:
    return PromptStore(root, FP, codec or BytesCodec(rest=b"R" * 64), max_bytes=options.pop("max_bytes", 1 << 30),
                       **options)


def rest_at(n_tokens: int) -> bytes:
    """The recurrent state after ``n_tokens`` tokens (the part of a state that cannot be cut by token)."""
    return bytes([n_tokens % 251]) * 64


def checkpoint(n_tokens: int) -> bytes:
    return b"\0" * 8 + rest_at(n_tokens)  # seq_checkpoint's bytes: a header, then the state's rest


def converse(cache: PromptStore, turns: int, step: int = 23, start: int = 100) -> tuple[list[int], list[int]]:
    """A session whose prompt grows by ``step`` tokens a turn: each save holds the prompt and its answer, with a
    checkpoint at the prompt's end. Returns the tokens and the checkpoints' positions."""
    tokens = list(range(10_000, 10_000 + start))
    ends = []
    for turn in range(turns):
        tokens += [20_000 + turn * 100 + i for i in range(step - REPLY)]
        ends.append(len(tokens))
        tokens += [30_000 + turn * 100 + i for i in range(REPLY)]
        cache.save(tokens, state_of(tokens, rest_at(len(tokens))), "s", checkpoints=[(ends[-1], checkpoint(ends[-1]))])
    return tokens, ends


def payload_bytes(root: Path) -> dict[str, int]:
    return {path.stem: read_block(path, with_payload=False)[0]["payload_bytes"] for path in root.glob("*/blocks/*.blk")}


def restores_exactly(cache: PromptStore, tokens: list[int], at: int) -> bool:
    match = cache.lookup([*tokens[:at], 1], limit=at)
    restored = cache.restore(match) if match else None
    return restored is not None and restored.common == at and restored.state == state_of(tokens[:at], rest_at(at))


def test_short_turns_write_each_tokens_kv_once_and_every_checkpoint_restores_after_a_restart(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens, ends = converse(cache, 3, start=113)  # the first checkpoint at 128 tokens: on a block's end
    cache.flush()
    seen = payload_bytes(tmp_path)
    total_new = 0
    for turn in range(3, 40):  # one turn at a time: what each save writes
        before = len(tokens)
        tokens += [20_000 + turn * 100 + i for i in range(23 - REPLY)]  # as converse() does
        ends.append(len(tokens))
        tokens += [30_000 + turn * 100 + i for i in range(REPLY)]
        cache.save(tokens, state_of(tokens, rest_at(len(tokens))), "s", checkpoints=[(ends[-1], checkpoint(ends[-1]))])
        cache.flush()
        now = payload_bytes(tmp_path)
        written = sum(size for key, size in now.items() if key not in seen)
        new_kv = 8 * (len(tokens) - before)
        # Each new token's KV once; at most once in a while a block whose bases reach MAX_PIECES is written whole
        assert new_kv <= written <= new_kv + 8 * BLOCK_TOKENS, (turn, written, new_kv)
        total_new += new_kv
        seen = now
    assert ends[-1] % BLOCK_TOKENS and any(end % BLOCK_TOKENS == 0 for end in ends)  # a checkpoint on a boundary too
    assert all(len(cache.folder.pieces(key) or []) <= MAX_PIECES for key in cache.folder.blocks)
    for reader in (cache, store(tmp_path, ram_bytes=0)):  # this worker, and a restart reading every file from disk
        kept = sorted(h.n_tokens for h in reader.folder.heads.values() if h.kind == "checkpoint")
        # the prompts' ends, and the turn before's end (kept when the entry moved on)
        assert len(kept) >= 2 and set(kept) <= set(ends) | {end + REPLY for end in ends}
        for at in [*kept, len(tokens)]:
            assert restores_exactly(reader, tokens, at), at
    assert sum(size for size in payload_bytes(tmp_path).values()) < 2 * 8 * len(tokens)


def test_a_damaged_base_is_never_served_and_the_blocks_built_on_it_go_with_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = store(tmp_path)
    tokens, _ = converse(cache, 12)
    cache.flush()
    head = next(h for h in cache.folder.heads.values() if h.kind == "history")
    built = next(key for key in cache.folder.chain(head.key) if cache.folder.blocks[key].base is not None)
    base = cache.folder.blocks[built].base
    assert base is not None
    path = cache.folder.block_path(base)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = store(tmp_path, ram_bytes=0)
    with caplog.at_level(logging.WARNING, "localai.cache"):
        match = fresh.lookup([*tokens, 1], limit=len(tokens))
        restored = fresh.restore(match) if match else None
    assert restored is None or restored.state == state_of(tokens[:restored.common], rest_at(restored.common))
    assert fresh.stats_snapshot()["corrupt"] == 1 and "damaged" in caplog.text
    assert base not in fresh.folder.blocks and built not in fresh.folder.blocks
    assert not fresh.folder.block_path(built).exists()
    # The same conversation saved again writes what was lost and restores whole
    fresh.save(tokens, state_of(tokens, rest_at(len(tokens))), "s")
    fresh.flush()
    assert restores_exactly(store(tmp_path, ram_bytes=0), tokens, len(tokens))


def test_a_base_missing_at_startup_takes_the_blocks_built_on_it_and_keeps_what_is_before(
        tmp_path: Path) -> None:
    """A crash between writing a block and its base cannot happen (the base is queued first), but a base deleted by
    hand or lost to the disk must be: the blocks built on it, and everything after them, go at startup."""
    cache = store(tmp_path)
    tokens, ends = converse(cache, 12)
    cache.flush()
    cache.close()
    head = next(h for h in cache.folder.heads.values() if h.kind == "history")
    chain = cache.folder.chain(head.key)
    # The last block built on a base: checkpoints kept before it (the first such block, at 64 tokens, left none)
    at = max(index for index, key in enumerate(chain) if cache.folder.blocks[key].base is not None)
    base = cache.folder.blocks[chain[at]].base
    assert base is not None
    cache.folder.block_path(base).unlink()
    fresh = store(tmp_path)
    assert chain[at] not in fresh.folder.blocks and not fresh.folder.block_path(chain[at]).exists()
    assert all(key in fresh.folder.blocks for key in chain[:at])
    before = [end for end in ends if end <= at * BLOCK_TOKENS]
    assert before and any(h.n_tokens == before[-1] for h in fresh.folder.heads.values())  # kept, and restores
    assert restores_exactly(fresh, tokens, before[-1])
    assert fresh.folder.heads
    for current in fresh.folder.heads.values():
        assert fresh.folder.reached([current.key]), current  # no entry names a chain it cannot restore


def test_eviction_and_prune_never_take_a_base_from_under_the_block_built_on_it(tmp_path: Path) -> None:
    cache = store(tmp_path)
    tokens, _ = converse(cache, 20)
    cache.flush()
    bases = {block.base for block in cache.folder.blocks.values() if block.base is not None}
    assert bases
    for _ in range(6):  # the least recently used leaf, one at a time
        assert cache.folder.evict(1, protected=set(), skip_owner=set())[1] == 1
        for key in cache.folder.blocks:
            assert cache.folder.pieces(key) is not None, key  # every block left still has its bases
        restorable = [head for head in cache.folder.heads.values() if head.snapshot]  # (a head moved back: none)
        assert restorable
        for head in restorable:
            assert restores_exactly(cache, tokens, head.n_tokens), head
    cache.close()
    admin.prune(max_bytes=cache.folder.bytes_on_disk() // 2, root=tmp_path)
    fresh = store(tmp_path)
    assert fresh.stats_snapshot()["corrupt"] == 0
    for head in fresh.folder.heads.values():
        assert fresh.folder.reached([head.key]), head
        assert restores_exactly(fresh, tokens, head.n_tokens) or not head.snapshot, head


def test_cache_rm_keeps_the_bases_another_entry_is_built_on_and_leaves_no_garbage(tmp_path: Path) -> None:
    cache = store(tmp_path, BytesCodec())
    first = list(range(50_000, 50_000 + BLOCK_TOKENS + 20))
    cache.save(first, state_of(first), "a")
    cache.flush()
    fork = [*first, *range(60_000, 60_030)]  # another session goes on from the first's tokens (a sub-agent, a fork)
    cache.save(fork, state_of(fork), "b")
    cache.flush()
    fork_head = next(h for h in cache.folder.heads.values() if h.session == "b")
    assert cache.folder.blocks[fork_head.key].base == cache._spans(first)[-1][0]
    assert sum(payload_bytes(tmp_path).values()) == 8 * len(fork)  # the shared tokens' KV once
    cache.close()
    admin.remove_entries(session="a", root=tmp_path)
    reader = store(tmp_path, BytesCodec(), ram_bytes=0)
    match = reader.lookup(fork)
    restored = reader.restore(match) if match else None
    assert restored is not None and (restored.common, restored.state) == (len(fork), state_of(fork))
    reader.close()
    admin.remove_entries(session="b", root=tmp_path)
    assert not list(tmp_path.glob("*/blocks/*.blk"))


def test_a_base_evicted_while_the_state_is_cut_never_kills_the_save(tmp_path: Path) -> None:
    codec = EvictingCodec()
    cache = store(tmp_path, codec)
    first = list(range(70_000, 70_000 + BLOCK_TOKENS + 20))
    cache.save(first, state_of(first), "s")
    cache.flush()
    grown = [*first, *range(80_000, 80_030)]
    victim = cache._spans(first)[-1][0]  # the partial block the grown one will be built on

    def evict() -> None:
        with cache._lock:
            for head in cache.folder.drop_block(victim):
                cache.folder.write_head(head)

    codec.during.append(evict)
    head = cache.save(grown, state_of(grown), "s")
    cache.flush()
    assert head is not None and cache.stats_snapshot()["save_races"] == 1
    assert cache.folder.blocks[head.key].base is None  # cut again: written whole, its base gone
    match = store(tmp_path, codec, ram_bytes=0).lookup(grown)
    assert match is not None and match.common == len(grown)
