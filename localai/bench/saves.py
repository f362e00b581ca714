"""``localai bench saves``: what a turn-end save costs the engine as the context grows.

A save holds the engine thread (every sequence's decoding waits) while it takes the sequence's state out of the
engine and carves the new blocks from it; the disk writes happen later, on the store's writer thread. This loads
the model in-process on one sequence, grows one context to each size asked for, and times the saves that follow
``new`` fresh tokens there (the blocks before them are already stored, as after the previous turn).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SaveCost:
    context: int  # tokens in the sequence when saved
    state_ms: list[float] = field(default_factory=list)  # taking the state out of the engine
    carve_ms: list[float] = field(default_factory=list)  # cutting and indexing the new blocks (store lock)
    state_bytes: int = 0

    def hold_ms(self) -> float:
        return statistics.median(s + c for s, c in zip(self.state_ms, self.carve_ms, strict=True))


def measure(model_path: str, contexts: list[int], *, new: int = 100, samples: int = 3, threads: int = 2,
            flash_attention: bool = False, kv_type: str = "f16", seed: int = 0) -> list[SaveCost]:
    """Save costs at each context size (ascending), ``samples`` saves each, ``new`` new tokens before each."""
    from localai.engines.engine import BatchItem, LoadOptions
    from localai.engines.llama_cpp import LlamaCppEngine
    from localai.promptcache.blocks import fingerprint
    from localai.promptcache.store import PromptStore

    contexts = sorted(contexts)
    top = contexts[-1] + (samples + 1) * new + 64
    engine = LlamaCppEngine(LoadOptions(model_path=model_path, num_ctx=top, n_parallel=1, n_threads=threads,
                                        flash_attention=flash_attention, kv_type=kv_type))
    room = engine.n_ctx - (samples + 1) * new  # the engine stops at the model's trained context
    skipped = [size for size in contexts if size > room]
    contexts = [size for size in contexts if size <= room]
    if skipped:
        print(f"{Path(model_path).name}: {', '.join(map(str, skipped))} tokens are past what its context holds "
              f"({engine.n_ctx} trained); measuring {', '.join(map(str, contexts))}")
    rng = random.Random(seed)
    n_vocab = int(engine.info()["n_vocab"])
    tokens: list[int] = []

    def grow(to: int) -> None:
        while len(tokens) < to:
            chunk = [rng.randrange(100, n_vocab - 100) for _ in range(min(engine.n_batch, to - len(tokens)))]
            engine.decode([BatchItem(0, token, len(tokens) + index, index == len(chunk) - 1)
                           for index, token in enumerate(chunk)])
            tokens.extend(chunk)

    results = []
    with tempfile.TemporaryDirectory(prefix="localai-bench-saves-") as folder:
        store = PromptStore(Path(folder), fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 40,
                            ram_bytes=0, trims=engine.can_trim)
        try:
            for context in contexts:
                grow(context - new)
                store.save(list(tokens), engine.seq_state(0), "bench")  # the turn before: its blocks are stored
                store.flush()
                cost = SaveCost(context)
                for _ in range(samples):
                    grow(len(tokens) + new)
                    started = time.perf_counter()
                    state = engine.seq_state(0)
                    taken = time.perf_counter()
                    store.save(list(tokens), state, "bench")
                    done = time.perf_counter()
                    cost.state_ms.append((taken - started) * 1000)
                    cost.carve_ms.append((done - taken) * 1000)
                    cost.state_bytes = len(state)
                    del state
                    store.flush()
                results.append(cost)
        finally:
            store.close()
    return results


def table(name: str, costs: list[SaveCost]) -> str:
    first = costs[0].hold_ms()
    lines = [f"{name}: the engine held per save, {len(costs[0].state_ms)} saves per size (median)",
             f"{'context':>8} {'state out':>10} {'carve':>8} {'held':>8} {'vs first':>9} {'state MB':>9}"]
    for cost in costs:
        lines.append(f"{cost.context:>8} {statistics.median(cost.state_ms):>8.1f}ms "
                     f"{statistics.median(cost.carve_ms):>6.1f}ms {cost.hold_ms():>6.1f}ms "
                     f"{cost.hold_ms() / first:>8.2f}x {cost.state_bytes / 1e6:>9.1f}")
    return "\n".join(lines)
