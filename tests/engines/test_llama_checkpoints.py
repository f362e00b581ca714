"""The prompt cache's state handling on the architectures agents run on, against llama.cpp itself: the random-weight
fixtures (tests/archfixtures.py: real kernels, KV and recurrent buffers, state layouts) of dense, MoE, latent
attention, sliding-window and hybrid recurrent models. A state is cut into blocks and rebuilt bit for bit; a
sequence returns to a checkpoint exactly; a prefix restored from the cache answers as llama.cpp does when it
evaluates the same prompt in two parts, and within what that differs from evaluating it whole."""

from __future__ import annotations

import json
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest

from localai.engines import llama_state
from localai.engines.engine import LoadOptions
from localai.engines.llama_cpp import LlamaCppEngine
from localai.promptcache.blocks import BLOCK_TOKENS, fingerprint
from localai.promptcache.store import PromptStore
from tests.archfixtures import BY_NAME, FIXTURES
from tests.engines.test_llama_state import prefill
from tests.parallel import threads

NAMES = [fixture.name for fixture in FIXTURES]
TEXT = ("<|im_start|>system\nYou are a coding agent. Read the files, run the tests, keep the diff small.<|im_end|>\n"
        "<|im_start|>user\nThe parser drops the last argument when a flag follows it; find out why and fix it."
        "<|im_end|>\n<|im_start|>assistant\nLooking at parse_args in cli.py: the loop stops one early. ") * 8


def load(folder: Path, name: str, **options: object) -> LlamaCppEngine:
    return LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(folder / f"{name}.gguf"), **{  # type: ignore[arg-type]
        "num_ctx": 2048, "n_parallel": 2, **options}))


def logits(engine: LlamaCppEngine) -> np.ndarray:
    return np.ctypeslib.as_array(L.llama_get_logits_ith(engine.ctx, -1), shape=(engine.n_vocab,)).copy()


def answer(engine: LlamaCppEngine, seq: int, tokens: list[int], parts: list[int]) -> np.ndarray:
    """The first answer token's logits after evaluating ``tokens`` from a clear sequence, cut at ``parts``, the
    last token alone (as the serving loop does)."""
    engine.seq_clear(seq)
    start = 0
    for end in [*parts, len(tokens) - 1, len(tokens)]:
        prefill(engine, seq, tokens[:end], start)
        start = end
    return logits(engine)


@pytest.mark.parametrize("name", NAMES)
def test_a_state_is_rebuilt_from_blocks_bit_for_bit_and_a_checkpoint_returns_exactly(arch_fixtures: Path,
                                                                                      name: str) -> None:
    fixture = BY_NAME[name]
    engine = load(arch_fixtures, name)
    assert engine.checkpoints == (fixture.kind != "dense")  # a window or recurrent layers: checkpoints only
    assert engine.can_draft == (fixture.kind == "dense")  # speculative decoding only where a draft can be dropped
    tokens = engine.tokenize(TEXT)[:300]
    prefill(engine, 1, tokens)
    state = bytes(engine.seq_state(1))
    ranges = [(a, min(a + BLOCK_TOKENS, len(tokens))) for a in range(0, len(tokens), BLOCK_TOKENS)]
    split = engine.state_split(state, len(tokens), ranges)
    assert split is not None
    layout, pieces, rest = split
    assert bool(rest) == engine.checkpoints  # the uncut part travels whole, as a checkpoint
    assert bytes(engine.state_join(layout, pieces, [b - a for a, b in ranges], rest)) == state

    # A checkpoint at 200 tokens, the sequence on to 260, back to the checkpoint, on to 300: bit for bit the
    # logits of a sequence that went 200 -> 300 directly.
    prefill(engine, 0, tokens[:200])
    checkpoint = engine.seq_checkpoint(0)
    prefill(engine, 0, tokens[:260], start=200)
    assert engine.seq_rollback(0, checkpoint, 200)
    prefill(engine, 0, tokens, start=200)
    returned = logits(engine)
    engine.seq_clear(1)
    prefill(engine, 1, tokens[:200])
    prefill(engine, 1, tokens, start=200)
    assert np.array_equal(returned, logits(engine))
    if engine.checkpoints:  # without the checkpoint, such a state cannot be cut back at all: refused, never wrong
        assert not engine.seq_keep(1, 150)


@pytest.mark.parametrize("name", NAMES)
def test_a_restored_prefix_answers_as_llama_cpp_does_in_two_parts(arch_fixtures: Path, name: str,
                                                                  tmp_path: Path) -> None:
    """The cache's way back (blocks and a checkpoint saved, read back by a new store as after a restart, restored,
    the rest evaluated) gives bit for bit the logits llama.cpp gives for the prompt evaluated in two parts at the
    same token; and those differ from evaluating it whole by at most what llama.cpp alone differs by (measured
    here, printed), with the same argmax wherever the top two are further apart than that."""
    engine = load(arch_fixtures, name)
    tokens = engine.tokenize(TEXT)[:420]
    cut = 250  # inside a block: a checkpoint there gets a tail block of its own
    engine.seq_clear(1)
    prefill(engine, 1, tokens[:cut])
    checkpoint = engine.seq_checkpoint(1) if engine.checkpoints else b""
    prefill(engine, 1, tokens, start=cut)
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    store.save(tokens, engine.seq_state(1), "s", checkpoints=[(cut, checkpoint)] if checkpoint else None)
    store.close()

    prompt = [*tokens[:cut], *engine.tokenize("Something else entirely, asked instead. " * 6)[1:]]
    whole = answer(engine, 1, prompt, [])
    two_parts = answer(engine, 1, prompt, [cut])
    bound = float(np.abs(whole - two_parts).max())
    print(f"{name}: llama.cpp alone, whole vs two parts at {cut}: max |logit difference| {bound:.3g}")

    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    match = store.lookup(prompt, len(prompt) - 1)
    assert match is not None and match.common == cut
    restored = store.restore(match)
    assert restored is not None and restored.tier == "disk"
    engine.seq_clear(0)
    assert engine.seq_restore(0, restored.state)
    assert engine.seq_keep(0, cut)
    prefill(engine, 0, prompt[:-1], start=cut)
    prefill(engine, 0, prompt, start=len(prompt) - 1)
    reused = logits(engine)
    assert np.array_equal(reused, two_parts)
    assert float(np.abs(reused - whole).max()) <= bound
    top = np.sort(whole)[-2:]
    if top[1] - top[0] > bound:
        assert int(reused.argmax()) == int(whole.argmax())
    store.close()


@pytest.mark.parametrize("name", ["qwen35", "gpt-oss"])
def test_a_damaged_checkpoint_is_recomputed_never_served(arch_fixtures: Path, name: str, tmp_path: Path) -> None:
    engine = load(arch_fixtures, name)
    tokens = engine.tokenize(TEXT)[:300]
    prefill(engine, 0, tokens[:150])
    checkpoint = engine.seq_checkpoint(0)
    prefill(engine, 0, tokens, start=150)
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    store.save(tokens, engine.seq_state(0), "s", checkpoints=[(150, checkpoint)])
    store.close()
    snapshots = list(tmp_path.rglob("*.snp"))
    assert len(snapshots) == 2  # the checkpoint's and the entry's own end
    for path in snapshots:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    prompt = [*tokens, 7]
    offered = []
    while (match := store.lookup(prompt, len(prompt) - 1)) is not None:  # the index names it: reading shows damage
        offered.append(match.common)
        assert store.restore(match) is None  # never served; dropped, so the next lookup offers what is left
    assert offered == [300, 150]  # the entry's end, then the checkpoint
    assert store.stats_snapshot()["corrupt"] == 2
    store.close()


def test_a_checkpoint_is_found_by_any_session_of_its_partition_and_by_no_other_partition(arch_fixtures: Path,
                                                                                         tmp_path: Path) -> None:
    """A fork from an earlier turn (another session, its prompt leaving the saved one after 200 tokens) returns to
    the checkpoint at 150 in the partition that saved it; another API key's or cache_salt's partition, and the
    default one, see nothing."""
    engine = load(arch_fixtures, "qwen35")
    tokens = engine.tokenize(TEXT)[:300]
    prefill(engine, 0, tokens[:150])
    checkpoint = engine.seq_checkpoint(0)
    prefill(engine, 0, tokens, start=150)
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    store.save(tokens, engine.seq_state(0), "first-session", checkpoints=[(150, checkpoint)], partition="team-a")
    store.flush()
    fork = [*tokens[:200], 7, 8, 9]
    match = store.lookup(fork, len(fork) - 1, "team-a")
    assert match is not None and match.common == 150
    restored = store.restore(match)
    assert restored is not None and restored.n_tokens == 150 and engine.seq_restore(1, restored.state)
    assert store.lookup(fork, len(fork) - 1, "team-b") is None
    assert store.lookup(fork, len(fork) - 1) is None  # the default partition
    store.close()


def test_quota_eviction_takes_a_checkpoint_with_its_blocks(arch_fixtures: Path, tmp_path: Path) -> None:
    """A checkpoint is an entry: its tail block and snapshot count in the quota and go together, never leaving a
    snapshot without its blocks or an entry without its snapshot."""
    engine = load(arch_fixtures, "qwen35moe")
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    for session, text in enumerate(("First session. ", "Second session. ")):
        tokens = engine.tokenize(text * 3 + TEXT)[:300]
        engine.seq_clear(0)
        prefill(engine, 0, tokens[:170])
        checkpoint = engine.seq_checkpoint(0)
        prefill(engine, 0, tokens, start=170)
        store.save(tokens, engine.seq_state(0), f"s{session}", checkpoints=[(170, checkpoint)])
    store.flush()
    kinds = sorted(head.kind for head in store.folder.heads.values())
    assert kinds == ["checkpoint", "checkpoint", "history", "history"]
    assert store.stats_snapshot()["snapshots_written"] == len(store.folder.snapshots) == 4  # end + checkpoint x 2
    store.max_bytes = store.folder.bytes_on_disk() // 2
    store.enforce_quota()
    folder = store.folder
    assert folder.bytes_on_disk() <= store.max_bytes
    for key in folder.snapshots:
        assert key in folder.blocks and folder.snapshot_path(key).exists()
    for head in folder.heads.values():
        assert folder.chain(head.key), head
        if head.kind == "checkpoint":
            assert head.key in folder.snapshots
    on_disk = {path.stem for path in (store.dir / "snaps").glob("*.snp")}
    assert on_disk == set(folder.snapshots)
    store.close()


def test_a_cache_from_another_llama_cpp_python_is_refused_and_left_intact(arch_fixtures: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Another llama-cpp-python may lay its states out otherwise: its cache is another fingerprint's folder, never
    read here and left as it is; and blocks whose layout does not match the engine's are refused, not served."""
    engine = load(arch_fixtures, "qwen35")
    tokens = engine.tokenize(TEXT)[:300]
    prefill(engine, 0, tokens)
    monkeypatch.setattr(L, "__version__", "0.0.1")
    old = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    old.save(tokens, engine.seq_state(0), "s")
    old.close()
    files = sorted(p.relative_to(tmp_path) for p in old.dir.rglob("*") if p.is_file() and p.parent.name != "owners")
    monkeypatch.undo()
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    assert store.dir != old.dir
    assert store.lookup([*tokens, 5], len(tokens)) is None
    store.save(tokens, engine.seq_state(0), "s")
    store.close()
    assert sorted(p.relative_to(tmp_path) for p in old.dir.rglob("*")
                  if p.is_file() and p.parent.name != "owners") == files

    # The same folder, its layout altered as another build would write it: the restore is refused
    layout = json.loads((store.dir / "layout.json").read_text())
    layout["layout"]["modules"][0]["layers"][0]["k_row"] += 2
    (store.dir / "layout.json").write_text(json.dumps(layout))
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30, trims=True)
    match = store.lookup([*tokens, 5], len(tokens))
    assert match is not None
    assert store.restore(match) is None
    store.close()


def test_a_state_with_an_unexpected_tail_is_refused_not_cut(arch_fixtures: Path) -> None:
    engine = load(arch_fixtures, "qwen35")
    tokens = engine.tokenize(TEXT)[:100]
    prefill(engine, 0, tokens)
    state = bytes(engine.seq_state(0))
    with pytest.raises(llama_state.StateFormatError):
        llama_state.split(state, len(tokens), [(0, 64)])  # the recurrent part read as attention: refused
    with pytest.raises(llama_state.StateFormatError):
        llama_state.split(state, len(tokens), [(0, 64)], tail=len(state))
    layout, pieces, _ = llama_state.split(state, len(tokens), [(0, 64), (64, 100)],
                                          tail=len(engine.seq_checkpoint(0)) - 8)
    with pytest.raises(llama_state.StateFormatError):
        llama_state.join(layout, pieces, [64, 36], b"")  # a checkpoint's state without its checkpoint


@pytest.mark.parametrize("name", NAMES)
def test_the_memory_estimate_is_what_llama_cpp_allocates(arch_fixtures: Path, name: str) -> None:
    """The window rule's and the placement's estimate from the GGUF header (attention layers' KV per token, a
    sliding window's cells, latent attention's K alone, recurrent layers' state per sequence) against the KV and
    recurrent-state buffers llama.cpp reports as it loads the model: within 5%."""
    from localai.models.gguf_meta import read_metadata
    from localai.models.loading import kv_bytes

    shape = read_metadata(arch_fixtures / f"{name}.gguf").attention
    engine = load(arch_fixtures, name, num_ctx=4096, n_parallel=2)
    reported = sum(size for key, size in engine.load_report.buffers.items() if key.split()[1] in ("KV", "RS"))
    estimate = kv_bytes(shape, 4096, 2, "f16")
    print(f"{name}: estimate {estimate / 2**20:.3f} MiB, llama.cpp {reported / 2**20:.3f} MiB")
    assert reported > 0 and abs(estimate - reported) <= 0.05 * reported
    if BY_NAME[name].kind == "recurrent":
        assert shape is not None and shape.recurrent_bytes > 0
