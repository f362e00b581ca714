"""The MLX engine's batched decode (on a tiny random-weight llama folder): sequences that decode together run in
one forward pass a step, and give the same greedy tokens as each sequence alone, whoever joins or leaves the
batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localai.engines.engine import BatchItem, LoadOptions

PROMPTS = ["Write a poem about the sea and its waves.", "What is the capital of France? Answer in detail.",
           "Explain recursion to a child. " * 5, "Count: one two three"]
STEPS = 12


@pytest.fixture(scope="module")
def engine(mlx_arch_fixtures: dict[str, Path]) -> Any:
    """The tiny random-weight llama folder (tests/mlxarch.py): the batch's arithmetic, not the answers, is tested
    here, and it runs in a fraction of SmolLM2's time."""
    from localai.engines.mlx import MlxEngine

    return MlxEngine(LoadOptions(model_path=str(mlx_arch_fixtures["llama"]), num_ctx=1024, n_parallel=4,
                                 n_batch=32))


class Passes:
    """The model, counting its forward passes and the rows each had."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        self.model = engine.model
        monkeypatch.setattr(engine, "model", self)

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        self.rows.append(int(tokens.shape[0]))
        return self.model(tokens, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def prefill(engine: Any, seq: int, tokens: list[int]) -> None:
    engine.seq_clear(seq)
    for start in range(0, len(tokens) - 1, engine.n_batch):
        chunk = tokens[start:min(start + engine.n_batch, len(tokens) - 1)]
        engine.decode([BatchItem(seq, token, start + i, False) for i, token in enumerate(chunk)])
    engine.decode([BatchItem(seq, tokens[-1], len(tokens) - 1, True)])


def alone(engine: Any, tokens: list[int], constraint: Any = None) -> list[int]:
    prefill(engine, 0, tokens)
    sampler = engine.new_sampler({"temperature": 0}, constraint)
    out = [engine.sample(sampler, 0)]
    for index in range(STEPS - 1):
        engine.decode([BatchItem(0, out[-1], len(tokens) + index, True)])
        out.append(engine.sample(sampler, 0))
    return out


def test_sequences_decode_in_one_pass_and_match_each_alone(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequence 3 leaves after 5 tokens, sequence 2 joins after 4 steps (its prompt chunks beside the others'
    decode), sequence 1 is cancelled after 7 (its state cleared mid-batch): every token each produced is the one it
    produces alone, and every step with several decoding sequences was one forward pass."""
    prompts = [engine.tokenize(text) for text in PROMPTS]
    expected = [alone(engine, tokens) for tokens in prompts]
    passes = Passes(engine, monkeypatch)
    samplers = [engine.new_sampler({"temperature": 0}, None) for _ in prompts]
    outs: list[list[int]] = [[], [], [], []]
    stop_at = {1: 7, 3: 5}
    for seq in (0, 1, 3):
        prefill(engine, seq, prompts[seq])
        outs[seq].append(engine.sample(samplers[seq], 0))
    steps_with_many = 0
    for step in range(STEPS + 8):
        batch = [BatchItem(seq, outs[seq][-1], len(prompts[seq]) + len(outs[seq]) - 1, True) for seq in range(4)
                 if outs[seq] and len(outs[seq]) < stop_at.get(seq, STEPS)]
        if step == 4:  # its prompt but the last token as a chunk in this step, beside the decoding sequences
            batch += [BatchItem(2, token, i, False) for i, token in enumerate(prompts[2][:-1])]
        elif step == 5:  # its last prompt token beside the others' next tokens, as the serving loop sends it
            batch.append(BatchItem(2, prompts[2][-1], len(prompts[2]) - 1, True))
        if not batch:
            break
        before = len(passes.rows)
        engine.decode(batch)
        decoding = {item.seq for item in batch if item.seq != 2 or step != 4}
        if len(decoding) >= 2:
            steps_with_many += 1
            assert max(passes.rows[before:]) == len(decoding), passes.rows[before:]
        for row, item in enumerate(batch):
            if item.logits:
                outs[item.seq].append(engine.sample(samplers[item.seq], row))
        if len(outs[1]) == stop_at[1]:
            engine.seq_clear(1)  # cancelled: its row leaves the batch
            stop_at[1] = 0
    assert steps_with_many >= 8
    for seq in range(4):
        limit = {1: 7, 3: 5}.get(seq, STEPS)
        assert outs[seq][:limit] == expected[seq][:limit], seq


def test_a_grammar_constrained_sequence_decodes_beside_a_free_one(engine: Any) -> None:
    schema = {"type": "json_schema", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                "required": ["n"]}}
    prompts = [engine.tokenize(PROMPTS[1]), engine.tokenize(PROMPTS[0])]
    expected = [alone(engine, prompts[0], schema), alone(engine, prompts[1])]
    samplers = [engine.new_sampler({"temperature": 0}, schema), engine.new_sampler({"temperature": 0}, None)]
    outs: list[list[int]] = [[], []]
    for seq in (0, 1):
        prefill(engine, seq, prompts[seq])
        outs[seq].append(engine.sample(samplers[seq], 0))
    for _ in range(STEPS - 1):
        batch = [BatchItem(seq, outs[seq][-1], len(prompts[seq]) + len(outs[seq]) - 1, True) for seq in (0, 1)]
        engine.decode(batch)
        for row, item in enumerate(batch):
            outs[item.seq].append(engine.sample(samplers[item.seq], row))
    assert outs == expected
    text = b"".join(engine.token_bytes(token) for token in outs[0] if not engine.is_end(token)).decode()
    assert text.startswith("{")


def test_a_state_saved_from_the_batch_restores_and_continues_exactly(engine: Any) -> None:
    """seq_state of a sequence in the decoding group is its own row: restored elsewhere, it continues the same."""
    prompts = [engine.tokenize(PROMPTS[2]), engine.tokenize(PROMPTS[3])]
    for seq in (0, 1):
        prefill(engine, seq, prompts[seq])
    engine.decode([BatchItem(0, 11, len(prompts[0]), True), BatchItem(1, 12, len(prompts[1]), True)])
    state = engine.seq_state(1)
    assert engine.seq_restore(2, state)
    engine.decode([BatchItem(1, 13, len(prompts[1]) + 1, True), BatchItem(2, 13, len(prompts[1]) + 1, True),
                   BatchItem(0, 14, len(prompts[0]) + 1, True)])
    sampler = engine.new_sampler({"temperature": 0}, None)
    assert engine.sample(sampler, 0) == engine.sample(sampler, 1)
    with pytest.raises(Exception, match="does not follow"):
        engine.decode([BatchItem(2, 13, 5, True), BatchItem(0, 14, len(prompts[0]) + 2, True)])


def test_a_token_and_its_drafts_verify_in_the_batched_pass(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequence 1 drafts (its pending token and up to 4 guesses, some wrong) beside sequence 0's single tokens and
    sequence 2's: each step is one forward pass of right-padded rows, the rejected guesses and the padding are
    dropped from the end of their rows without the row leaving the batch, and every sequence's greedy tokens are the
    ones it produces alone."""
    monkeypatch.setattr(engine, "padding_allowed", 1 << 30)  # as on a GPU: any padding (a CPU's rule: below)
    prompts = [engine.tokenize(text) for text in PROMPTS[:3]]
    expected = [alone(engine, tokens) for tokens in prompts]
    samplers = [engine.new_sampler({"temperature": 0}, None) for _ in prompts]
    outs: list[list[int]] = [[], [], []]
    for seq in range(3):
        prefill(engine, seq, prompts[seq])
        outs[seq].append(engine.sample(samplers[seq], 0))
    passes = Passes(engine, monkeypatch)
    rejected = 0
    for step in range(STEPS):
        batch: list[BatchItem] = []
        for seq in range(3):
            if len(outs[seq]) >= STEPS:
                continue
            at = len(prompts[seq]) + len(outs[seq]) - 1
            batch.append(BatchItem(seq, outs[seq][-1], at, True))
            if seq == 1:  # the right continuation, its guesses wrong from the first or the second every other step
                guess = expected[1][len(outs[1]):len(outs[1]) + 1 + step % 4]
                if step % 2 and guess:
                    guess[step % 4 == 3] = (guess[step % 4 == 3] + 1) % engine.n_vocab
                batch += [BatchItem(1, token, at + offset, True) for offset, token in enumerate(guess, start=1)]
        if len({item.seq for item in batch}) < 2:
            break
        before = len(passes.rows)
        engine.decode(batch)
        assert passes.rows[before:] == [len({item.seq for item in batch})], passes.rows[before:]
        for seq in range(3):
            mine = [row for row, item in enumerate(batch) if item.seq == seq]
            for position, row in enumerate(mine):
                token = engine.sample(samplers[seq], row)
                outs[seq].append(token)
                if position + 1 == len(mine) or batch[mine[position + 1]].token != token:
                    break
            kept = len(outs[seq]) - 1 + len(prompts[seq])  # the last sampled token is pending, not in the KV
            if kept < engine.lengths[seq]:
                rejected += engine.lengths[seq] - kept
                assert engine.seq_keep(seq, kept)
        assert engine.group.seqs == [seq for seq in range(3) if any(item.seq == seq for item in batch)]
    assert rejected >= 4
    for seq in range(3):
        assert outs[seq][:STEPS] == expected[seq][:STEPS], seq


def test_on_a_cpu_drafts_share_the_pass_only_while_their_padding_is_cheap(engine: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU computes every padded position: a token and 2 drafts beside 2 single tokens (4 padded positions) share
    the pass; a token and 4 drafts (8) run in a pass of their own beside the batched single tokens."""
    from localai.engines.mlx import CPU_PADDING_ALLOWED

    assert engine.padding_allowed == CPU_PADDING_ALLOWED  # this machine has no GPU
    prompts = [engine.tokenize(text) for text in PROMPTS[:3]]
    for seq in range(3):
        prefill(engine, seq, prompts[seq])
    passes = Passes(engine, monkeypatch)
    shapes: list[tuple[int, int]] = []
    real = passes.model
    passes.model = lambda tokens, cache=None: (shapes.append(tuple(tokens.shape)), real(tokens, cache=cache))[1]
    for drafts, expected in ((2, [(3, 3)]), (4, [(2, 1), (1, 5)])):
        shapes.clear()
        batch = [BatchItem(seq, 5, engine.lengths[seq], True) for seq in (0, 2)]
        batch += [BatchItem(1, 5 + offset, engine.lengths[1] + offset, True) for offset in range(1 + drafts)]
        engine.decode(sorted(batch, key=lambda item: item.seq))
        assert shapes == expected, (drafts, shapes)
        assert engine.seq_keep(1, engine.lengths[1] - drafts)  # every guess rejected
