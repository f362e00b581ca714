"""Carving llama.cpp's sequence state into token blocks and assembling it back, against the real engine: bit for
bit with flash attention on and off, f16 and q8_0 KV, and a sliding-window model (Gemma 3) restored from blocks and
its window snapshot after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from localai.engines import llama_state
from localai.engines.engine import BatchItem, LoadOptions
from localai.engines.llama_cpp import LlamaCppEngine
from localai.promptcache.blocks import BLOCK_TOKENS, fingerprint
from localai.promptcache.store import PromptStore
from tests.parallel import threads

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 100


def prefill(engine: LlamaCppEngine, seq: int, tokens: list[int], start: int = 0) -> None:
    for at in range(start, len(tokens), engine.n_batch):
        chunk = tokens[at:at + engine.n_batch]
        last = at + len(chunk) == len(tokens)
        engine.decode([BatchItem(seq, t, at + i, last and i == len(chunk) - 1) for i, t in enumerate(chunk)])


def greedy(engine: LlamaCppEngine, seq: int, n_past: int, count: int = 8) -> list[int]:
    sampler = engine.new_sampler({"temperature": 0}, None)
    out = [engine.sample(sampler, -1)]  # the last logits of the prefill
    for step in range(count - 1):
        engine.decode([BatchItem(seq, out[-1], n_past + step, True)])
        out.append(engine.sample(sampler, 0))
    engine.free_sampler(sampler)
    return out


@pytest.mark.parametrize(("flash", "kv"), [(False, "f16"), (True, "f16"), (True, "q8_0")])
def test_blocks_round_trip_bit_for_bit_and_a_restored_prefix_continues_like_a_fresh_one(
        smollm2_path: Path, flash: bool, kv: str) -> None:
    engine = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=2048, n_parallel=3,
                                        flash_attention=flash, kv_type=kv))
    tokens = engine.tokenize(TEXT)[:700]
    prefill(engine, 1, tokens)
    state = engine.seq_state(1)
    ranges = [(a, min(a + BLOCK_TOKENS, len(tokens))) for a in range(0, len(tokens), BLOCK_TOKENS)]
    layout, pieces, rest = engine.state_split(state, len(tokens), ranges) or ({}, [], b"")
    assert rest == b"" and len(pieces) == len(ranges)
    assert engine.state_join(layout, pieces, [b - a for a, b in ranges], rest) == state  # bit for bit

    # Five blocks (320 tokens) into another sequence, then the rest of a prompt: the same greedy tokens as a
    # sequence that computed everything itself.
    prefix = engine.state_join(layout, pieces[:5], [BLOCK_TOKENS] * 5, b"")
    engine.seq_clear(0)
    assert engine.seq_restore(0, prefix)
    prompt = tokens[:400]
    prefill(engine, 0, prompt, start=5 * BLOCK_TOKENS)
    restored = greedy(engine, 0, len(prompt))
    engine.seq_clear(2)
    prefill(engine, 2, prompt)
    assert restored == greedy(engine, 2, len(prompt))


def test_a_state_it_does_not_understand_is_refused_not_cut(smollm2_path: Path) -> None:
    with pytest.raises(llama_state.StateFormatError):
        llama_state.split(b"\x00" * 64, 4, [(0, 4)])
    with pytest.raises(llama_state.StateFormatError):
        llama_state.split(llama_state.MAGIC.to_bytes(4, "little") + b"\x00\x00\x00\x00\x01\x00\x00\x00", 4, [(0, 4)])


def test_a_sliding_window_model_restores_from_blocks_and_its_window_snapshot_after_a_restart(
        gemma3_path: Path, tmp_path: Path) -> None:
    options = LoadOptions(n_threads=threads(), model_path=str(gemma3_path), num_ctx=2048, n_parallel=2,
                          flash_attention=True)
    engine = LlamaCppEngine(options)
    assert engine.n_swa > 0
    tokens = engine.tokenize(TEXT)[:1500]  # well past the 512-token window: older cells are dropped
    prefill(engine, 0, tokens)
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    store.save(tokens, engine.seq_state(0), "gemma")
    store.close()
    cut_back = engine.seq_keep(0, 200)  # the window no longer reaches that far back: refused, never wrong
    assert cut_back is False
    prompt = tokens + engine.tokenize(" And then the dog woke up.")[1:]
    engine.seq_clear(1)
    prefill(engine, 1, prompt)
    expected = greedy(engine, 1, len(prompt))
    engine.close()

    engine = LlamaCppEngine(options)  # a restart
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    assert store.lookup([*tokens[:1400], 1, 2, 3]) is None  # inside the window: no snapshot there
    match = store.lookup(prompt)
    assert match is not None and match.common == len(tokens) and match.snapshot is not None
    restored = store.restore(match)
    assert restored is not None and restored.tier == "disk"
    assert engine.seq_restore(0, restored.state)
    assert engine.seq_keep(0, len(tokens) - 1)  # replaying the last token stays inside the window
    prefill(engine, 0, prompt, start=len(tokens) - 1)
    assert greedy(engine, 0, len(prompt)) == expected
    store.close()
    engine.close()


def test_saves_back_to_back_keep_each_state_though_the_engine_reuses_its_buffer(smollm2_path: Path,
                                                                                   tmp_path: Path) -> None:
    """``seq_state`` writes every save into one buffer kept between saves: what the store keeps of a save (its
    blocks, in RAM and on disk) must be its own copy, not a view the next save overwrites."""
    engine = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=1024, n_parallel=1))
    first, second = engine.tokenize(TEXT)[:300], engine.tokenize(TEXT[::-1])[:300]
    prefill(engine, 0, first)
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    state = engine.seq_state(0)
    expected = bytes(state)
    store.save(first, state, "first")
    engine.seq_clear(0)
    prefill(engine, 0, second)
    store.save(second, engine.seq_state(0), "second")  # the same buffer, overwritten
    assert bytes(state) != expected  # (what the reuse means: the first view now shows the second state)
    store.flush()
    for ram in (True, False):
        if not ram:
            store.close()
            store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30)
        match = store.lookup(first)
        restored = store.restore(match) if match else None
        assert restored is not None and restored.common == len(first)
        assert bytes(restored.state) == expected
    store.close()
    engine.close()


def test_close_frees_the_model_context_and_batch_once(smollm2_path: Path) -> None:
    """A worker's process frees its engine as it exits; benches and tests build many in one process. Before,
    the engine had no close(): each one kept its weights, context and batch until the process ended."""
    engine = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=512, n_parallel=1))
    engine.embed([engine.tokenize("an embedding context too")], truncate=True)
    assert engine.model and engine.ctx and engine.embedder is not None
    engine.close()
    assert (engine.model, engine.ctx, engine.batch, engine.embedder) == (None, None, None, None)
    engine.close()  # twice: nothing freed twice


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantized_kv_type_loads_with_flash_attention_on(smollm2_path: Path, kv: str) -> None:
    """llama.cpp refuses a quantized V cache without flash attention (the context was not created: "out of
    memory?"); PARAMETER kv_type, or a window fitted with q8_0, turns it on for that model."""
    engine = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=512, n_parallel=1,
                                        kv_type=kv))
    assert engine.info()["kv_type"] == kv and engine.info()["flash_attention"]
    prefill(engine, 0, list(range(100, 140)))
    assert len(greedy(engine, 0, 40, 4)) == 4
    engine.close()
