"""Prefix reuse is confined to a partition (an API key's, a request's cache_salt): the store's chains start at a
root of the partition's own, a live sequence is reused only by its own partition, and the default partition keeps
the keys it always had (caches from before stay valid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localai.engines.engine import LoadOptions
from localai.engines.scripted import ScriptedEngine
from localai.engines.serving import Serving
from localai.promptcache import admin
from localai.promptcache.blocks import BLOCK_TOKENS, chain_key
from localai.promptcache.store import PromptStore
from tests.cachecodec import BytesCodec, state_of

FP = "f" * 32
TOKENS = list(range(3000, 3000 + 3 * BLOCK_TOKENS + 10))


def store(root: Path, whole: bool = False) -> PromptStore:
    return PromptStore(root, FP, BytesCodec(whole=whole), max_bytes=1 << 30)


def common(cache: PromptStore, prompt: list[int], partition: str = "") -> int:
    match = cache.lookup(prompt, partition=partition)
    return match.common if match else 0


def test_a_partition_restores_only_its_own_prefixes(tmp_path: Path) -> None:
    cache = store(tmp_path)
    cache.save(TOKENS, state_of(TOKENS), "s", partition="key-a")
    cache.flush()
    probe = [*TOKENS, 1, 2]
    assert common(cache, probe, "key-a") == len(TOKENS)
    assert common(cache, probe) == 0 and common(cache, probe, "key-b") == 0
    assert common(cache, probe, "key-a.salt") == 0  # a cache_salt partitions further
    assert cache.has(TOKENS, "key-a") and not cache.has(TOKENS) and not cache.has(TOKENS, "key-b")
    again = store(tmp_path)  # a restart: the partition's chains are read back, not dropped as broken
    assert common(again, probe, "key-a") == len(TOKENS) and common(again, probe) == 0
    [entry] = admin.list_entries(tmp_path)
    assert entry.partition == "key-a"


def test_the_default_partition_keeps_the_keys_caches_were_written_with(tmp_path: Path) -> None:
    cache = store(tmp_path)
    cache.save(TOKENS, state_of(TOKENS), "s")
    cache.flush()
    first = chain_key(FP, TOKENS[:BLOCK_TOKENS])  # what a cache from before this change holds
    assert (tmp_path / FP / "blocks" / f"{first}.blk").exists()
    assert common(cache, [*TOKENS, 1]) == len(TOKENS)
    assert admin.list_entries(tmp_path)[0].partition == ""


def test_an_engine_that_keeps_state_whole_restores_only_its_partitions_entries(tmp_path: Path) -> None:
    cache = store(tmp_path, whole=True)
    cache.save(TOKENS, b"A-STATE", "s", partition="key-a")
    cache.flush()
    assert common(cache, [*TOKENS, 1], "key-a") == len(TOKENS)
    assert common(cache, [*TOKENS, 1], "key-b") == 0


def test_a_session_name_used_by_two_partitions_keeps_two_entries(tmp_path: Path) -> None:
    cache = store(tmp_path)
    cache.save(TOKENS[:100], state_of(TOKENS[:100]), "shared-name", partition="key-a")
    cache.save(TOKENS, state_of(TOKENS), "shared-name", partition="key-b")  # would have moved key-a's entry
    cache.flush()
    entries = sorted((e.partition, e.tokens) for e in admin.list_entries(tmp_path))
    assert entries == [("key-a", 100), ("key-b", len(TOKENS))]


def serving(tmp_path: Path, n_parallel: int = 2) -> Serving:
    load = LoadOptions(model_path="scripted", num_ctx=4096, n_parallel=n_parallel, cache_dir=str(tmp_path / "cache"),
                       cache_max_bytes=1 << 30)
    return Serving(ScriptedEngine(load), load)


def run(loop: Serving, request_id: str, prompt: str, partition: str = "", **extra: Any) -> dict[str, Any]:
    """One request to its end; its ``prompt`` event (tokens reused and where from)."""
    events: list[dict[str, Any]] = []
    loop._handle({"op": "generate", "id": request_id, "prompt": prompt, "sampling": {"temperature": 0},
                  "max_tokens": 3, "cache_partition": partition, **extra}, events.append)
    while loop.waiting or loop.requests:
        loop._admit(events.append)
        if loop.requests:
            loop._step(events.append)
    assert loop.cache is not None
    loop.cache.flush()
    return next(e for e in events if e["ev"] == "prompt" and e["id"] == request_id)


PROMPT = "You are a careful assistant. " * 12 + "The secret PIN is 4812. "


def test_a_live_sequence_is_reused_only_by_its_own_partition(tmp_path: Path) -> None:
    loop = serving(tmp_path)
    assert run(loop, "a1", PROMPT, "key-a")["cached_tokens"] == 0
    guess = run(loop, "b1", PROMPT + "Is it 4812?", "key-b")
    assert guess["cached_tokens"] == 0 and guess["cache"]["source"] == "miss"
    mine = run(loop, "a2", PROMPT + "Is it 4812?", "key-a")
    assert mine["cached_tokens"] >= len(PROMPT) - 1  # the same key: reuse unchanged
    salted = run(loop, "a3", PROMPT + "Is it 4812?", "key-a.5f1e")
    assert salted["cached_tokens"] == 0


def test_a_saved_prefix_is_restored_only_for_its_own_partition(tmp_path: Path) -> None:
    run(serving(tmp_path), "a1", PROMPT, "key-a")
    restarted = serving(tmp_path)  # nothing live: only the disk tier could answer
    assert run(restarted, "b1", PROMPT + "Is it 4812?", "key-b")["cached_tokens"] == 0
    restored = run(serving(tmp_path), "a2", PROMPT + "Is it 4812?", "key-a")
    assert restored["cache"]["source"] in ("ram", "disk") and restored["cached_tokens"] > 0


def test_a_reply_being_prefilled_holds_back_only_its_own_partition(tmp_path: Path) -> None:
    loop = serving(tmp_path, n_parallel=3)
    events: list[dict[str, Any]] = []
    loop._handle({"op": "generate", "id": "warm", "prompt": PROMPT, "sampling": {}, "max_tokens": 0, "warm": True,
                  "session": "s", "cache_partition": "key-a"}, events.append)
    loop._admit(events.append)
    for request_id, partition in (("other", "key-b"), ("mine", "key-a")):
        loop._handle({"op": "generate", "id": request_id, "prompt": PROMPT + " next", "sampling": {},
                      "max_tokens": 1, "session": "s", "cache_partition": partition}, events.append)
    loop._admit(events.append)
    assert "other" in loop.requests and [op["id"] for op in loop.waiting] == ["mine"]
