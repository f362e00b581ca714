"""llama.cpp sampling: the greedy path (the argmax read in place) picks what llama.cpp's own greedy sampler picks,
on the real model, one row and four at once; anything beyond plain greedy goes through llama.cpp's sampler chain."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp as L
import pytest

from localai.engines.engine import BatchItem, LoadOptions
from localai.engines.llama_cpp import GREEDY, LlamaCppEngine
from tests.parallel import threads


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[LlamaCppEngine]:
    loaded = LlamaCppEngine(LoadOptions(model_path=str(smollm2_path), num_ctx=1024, n_parallel=4, n_threads=threads()))
    yield loaded
    loaded.close()


def test_plain_greedy_takes_the_fast_path_and_nothing_else_does(engine: LlamaCppEngine) -> None:
    assert engine.new_sampler({"temperature": 0}, None) is GREEDY
    chains = [engine.new_sampler({"temperature": 0, "repeat_penalty": 1.1}, None),
              engine.new_sampler({"temperature": 0, "presence_penalty": 0.5}, None),
              engine.new_sampler({"temperature": 0}, {"type": "json_object"}),
              engine.new_sampler({"temperature": 0.7, "seed": 1}, None)]
    assert all(chain is not GREEDY for chain in chains)
    for chain in [GREEDY, *chains]:
        engine.free_sampler(chain)  # GREEDY is nobody's to free; the chains are


def test_the_greedy_path_agrees_with_llama_cpps_greedy_sampler(engine: LlamaCppEngine) -> None:
    """Four sequences decoded together for 48 steps: every row's fast argmax equals llama.cpp's greedy choice,
    and the text they generate is real text (the path reads the right row)."""
    reference = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(reference, L.llama_sampler_init_greedy())
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
    tokens = [engine.tokenize(prompt) for prompt in prompts]
    for seq in range(4):
        engine.seq_clear(seq)
    engine.decode([BatchItem(seq, token, pos, pos == len(tokens[seq]) - 1)
                   for seq in range(4) for pos, token in enumerate(tokens[seq])])
    rows = [sum(len(t) for t in tokens[:seq + 1]) - 1 for seq in range(4)]  # each prompt's last row
    picked: list[list[int]] = [[] for _ in range(4)]
    for _ in range(48):
        step = []
        for seq, row in enumerate(rows):
            fast = engine.sample(GREEDY, row)
            assert fast == int(L.llama_sampler_sample(reference, engine.ctx, row))
            picked[seq].append(fast)
            step.append(BatchItem(seq, fast, len(tokens[seq]) + len(picked[seq]) - 1, True))
        engine.decode(step)
        rows = [0, 1, 2, 3]
    L.llama_sampler_free(reference)
    assert b"Paris" in b"".join(engine.token_bytes(token) for token in picked[0])
    assert b"5" in b"".join(engine.token_bytes(token) for token in picked[2])
    assert len({tuple(p) for p in picked}) == 4
