"""Speculative decoding from the context (engines/speculative.py, the serving loop's drafts): the same output with
and without it on real models (greedy and seeded), drafts rejected at every position, drafts across a stop string,
the token limit, the context's end, a cancellation, the prompt cache (no rejected draft's KV stored), a grammar,
and one drafting sequence batched with three plain ones."""

from __future__ import annotations

import base64
import queue
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from localai.bench.api import EDIT_PROMPT
from localai.engines.engine import Engine, LoadOptions
from localai.engines.scripted import ScriptedEngine
from localai.engines.serving import Serving
from localai.engines.speculative import COOLDOWN, MAX_DRAFT, MIN_DRAFT, Drafter
from tests.parallel import threads

COPY = "The quick brown fox jumps over the lazy dog; a journey of a thousand miles begins with one step. "


def test_the_drafter_guesses_what_followed_the_last_ngram() -> None:
    drafter = Drafter()
    drafter.extend(list(b"abcdefg xyz abc"))
    assert bytes(drafter.draft(10)) == b"defg"[:drafter.length]  # after "abc" came "defg..."
    assert drafter.draft(0) == []
    drafter.extend(list(b"Q"))  # "bcQ" never appeared before
    assert drafter.draft(10) == []


def test_the_draft_length_adapts_and_misses_pause_it() -> None:
    drafter = Drafter()
    start = drafter.length
    drafter.record(start, start)
    assert drafter.length == min(MAX_DRAFT, start * 2)
    drafter.record(drafter.length, 1)
    assert drafter.length == min(MAX_DRAFT, start * 2) // 2
    for _ in range(3):
        drafter.record(2, 0)
    assert drafter.length >= MIN_DRAFT and drafter.paused_until == len(drafter.tokens) + COOLDOWN
    drafter.extend(list(b"abcabc"))
    assert drafter.draft(5) == []  # paused
    assert (drafter.drafted, drafter.accepted) == (start + start * 2 + 6, start + 1)


def serve(engine: Engine, ops: list[dict[str, Any]], *, cache_dir: Path | None = None,
          cancel_after: int | None = None) -> dict[str, dict[str, Any]]:
    """Run ops through a real serving loop; each request's text and usage."""
    serving = Serving(engine, LoadOptions(model_path="m", num_ctx=engine.n_ctx, cache_dir=str(cache_dir)
                                          if cache_dir else None))
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    results: dict[str, dict[str, Any]] = {op["id"]: {"text": "", "frames": 0} for op in ops}
    lock = threading.Lock()

    def emit(message: dict[str, Any]) -> None:
        with lock:
            result = results.get(message.get("id", ""))
            if result is None:
                return
            if message["ev"] == "text":
                result["text"] += message["text"]
                result["frames"] += 1
                if cancel_after is not None and result["frames"] == cancel_after:
                    inbox.put({"op": "cancel", "id": message["id"]})
            elif message["ev"] in ("done", "error"):
                result["done"] = message
                if all("done" in r for r in results.values()):
                    inbox.put(None)

    for op in ops:
        inbox.put(op)
    serving.serve(inbox, emit)
    for result in results.values():
        assert result["done"]["ev"] == "done", result
    return results


def op(prompt: str, *, speculative: bool = True, max_tokens: int = 400, stop: list[str] | None = None,
       request_id: str = "r", **sampling: Any) -> dict[str, Any]:
    return {"op": "generate", "id": request_id, "prompt": prompt, "max_tokens": max_tokens, "stop": stop or [],
            "sampling": {"temperature": 0, **sampling}, "speculative": speculative}


def scripted(n_ctx: int = 4096) -> ScriptedEngine:
    return ScriptedEngine(LoadOptions(model_path="scripted", num_ctx=n_ctx, n_parallel=4))


def both(engine_factory: Any, *ops: dict[str, Any], **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same ops with drafts and without, on fresh engines."""
    on = serve(engine_factory(), [dict(o, speculative=True) for o in ops], **kwargs)
    off = serve(engine_factory(), [dict(o, speculative=False) for o in ops], **kwargs)
    return on, off


def usage(result: dict[str, Any]) -> dict[str, Any]:
    return dict(result["done"]["usage"])


def test_a_reply_that_copies_its_context_is_drafted_and_identical() -> None:
    on, off = both(scripted, op(f"Copy: {COPY}[[say:{COPY}]]"))
    assert on["r"]["text"] == off["r"]["text"] == COPY
    drafted, accepted = usage(on["r"])["drafted_tokens"], usage(on["r"])["accepted_tokens"]
    assert accepted >= len(COPY) // 2 and accepted <= drafted
    assert usage(off["r"])["drafted_tokens"] == 0
    # fewer steps: each kept draft saves one decode
    assert usage(on["r"])["completion_tokens"] == usage(off["r"])["completion_tokens"] == len(COPY)


def test_drafts_rejected_at_every_position() -> None:
    # after each "abc" the context says "1" (then the last digit seen), and the reply says the next digit
    reply = "abc2abc3abc4abc5abc6abc7abc8abc9"
    prompt = f"abc1 abc1 abc1 abc1 [[say64:{base64.b64encode(reply.encode()).decode()}]]"  # not in the context
    on, off = both(scripted, op(prompt))
    assert on["r"]["text"] == off["r"]["text"] == "abc2abc3abc4abc5abc6abc7abc8abc9"
    assert usage(on["r"])["drafted_tokens"] > 0 and usage(on["r"])["accepted_tokens"] == 0


@pytest.mark.parametrize("cut", ["stop", "length", "context"])
def test_a_draft_across_the_end_keeps_nothing_past_it(cut: str, tmp_path: Path) -> None:
    """A stop string, the token limit or the context's end inside a kept draft: the same text as without drafts,
    and the sequence's KV (the scripted engine's token list) holds exactly what the slot says."""
    reply = COPY + COPY
    prompt = f"{COPY}{COPY}[[say:{reply}]]"
    kwargs: dict[str, Any] = {"stop": ["miles"]} if cut == "stop" else {"max_tokens": 70} if cut == "length" else {}
    n_ctx = len(prompt.encode()) + 60 if cut == "context" else 4096
    engines: list[ScriptedEngine] = []

    def make() -> ScriptedEngine:
        engines.append(scripted(n_ctx))
        return engines[-1]

    on, off = both(make, op(prompt, **kwargs), cache_dir=tmp_path / "cache")
    assert on["r"]["text"] == off["r"]["text"] and len(on["r"]["text"]) < len(reply)
    assert on["r"]["done"]["finish_reason"] == off["r"]["done"]["finish_reason"]
    assert usage(on["r"])["accepted_tokens"] > 0
    # the KV left behind is the same as without drafts: the prompt and every generated token but the last
    with_drafts, without = ([s for s in engine.sequences if s] for engine in engines)
    assert with_drafts == without
    assert len(with_drafts[0]) == len(prompt.encode()) + usage(on["r"])["completion_tokens"] - 1


def test_the_prompt_cache_never_stores_a_rejected_draft(tmp_path: Path) -> None:
    from localai.promptcache.blocks import fingerprint
    from localai.promptcache.store import PromptStore

    engine = scripted()
    prompt = "abc1 abc1 abc1 abc1 " * 20 + "[[say:abc2 abc1 abc3 abc1 abc4]]"
    result = serve(engine, [op(prompt)], cache_dir=tmp_path)
    assert usage(result["r"])["drafted_tokens"] > usage(result["r"])["accepted_tokens"]
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30)
    expected = list((prompt + result["r"]["text"]).encode())
    match = store.lookup(expected)
    assert match is not None
    restored = store.restore(match)
    assert restored is not None
    held = list(memoryview(bytes(restored.state)).cast("i"))
    assert held == list(restored.tokens) == expected[:len(held)]  # state and tokens agree: no stray draft
    assert len(held) == len(expected)  # the reply ended at EOS: each of its tokens was evaluated, nothing more
    store.close()


def test_a_cancelled_drafting_request_stops() -> None:
    reply = COPY * 6
    result = serve(scripted(), [op(f"{COPY * 6}[[slow]][[say:{reply}]]")], cancel_after=2)
    assert result["r"]["done"]["finish_reason"] == "cancelled"


def test_one_drafting_sequence_beside_three_plain_ones() -> None:
    ops = [op(f"{COPY}[[say:{COPY}]]", request_id="copy")]
    ops += [op(f"[[say:plain reply {i} with nothing to copy]]", request_id=f"p{i}", speculative=False)
            for i in range(3)]
    together = serve(scripted(), ops)
    for item in ops:
        alone = serve(scripted(), [item])
        assert together[item["id"]]["text"] == alone[item["id"]]["text"]
    assert usage(together["copy"])["accepted_tokens"] > 0


def test_drafts_leave_the_sampled_distribution_unchanged() -> None:
    """Rejection sampling checked statistically on a three-token vocabulary: the engine draws A, B, C with
    probabilities 0.7, 0.25, 0.05 from a seeded generator (a sampler at temperature > 0), the context repeats "ABC" so
    drafts guess C far more often than it comes, and the 6,000 tokens kept with drafts follow the distribution as
    those without them do (chi-squared, 2 degrees of freedom, below 13.8, the 0.1% point). A loop that kept every
    other guess without a draw of its own measured about 100."""
    weights = {ord("A"): 0.7, ord("B"): 0.25, ord("C"): 0.05}

    def drawing_engine(seed: int) -> ScriptedEngine:
        engine = scripted(8192)
        rng = random.Random(seed)
        engine.sample = lambda sampler, row: rng.choices(list(weights), list(weights.values()))[0]  # type: ignore[method-assign]
        return engine

    counts: dict[bool, Counter[int]] = {}
    for speculative in (True, False):
        ops = [op("ABC" * 60, request_id=f"r{n}", max_tokens=1500, speculative=speculative, temperature=0.8)
               for n in range(4)]
        result = serve(drawing_engine(11), ops)
        counts[speculative] = Counter(token for r in result.values() for token in r["text"].encode())
        if speculative:
            assert sum(usage(r)["drafted_tokens"] for r in result.values()) > 3000  # guesses all along
            assert sum(usage(r)["accepted_tokens"] for r in result.values()) > 1000
    for tokens in counts.values():
        total = sum(tokens.values())
        assert total == 6000
        chi2 = sum((tokens[t] - total * p) ** 2 / (total * p) for t, p in weights.items())
        assert chi2 < 13.8, (tokens, chi2)


# -- real models ---------------------------------------------------------------------------------------------------

def chatml(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Any:
    from localai.engines.llama_cpp import LlamaCppEngine

    return lambda: LlamaCppEngine(LoadOptions(model_path=str(smollm2_path), num_ctx=2048, n_parallel=4,
                                              n_threads=threads()))


PROMPTS = {
    "edit": chatml(EDIT_PROMPT),
    "copy": chatml("Repeat this text exactly:\n\n" + COPY * 3),
    "chat": chatml("Tell me a short story about a robot who learns to paint."),
}


def test_drafts_are_off_by_default_on_real_engines(smollm2_path: Path) -> None:
    """llama.cpp's (and MLX's) rows of a batch are not bit-identical to one token at a time, so greedy text could
    differ at a near tie: drafts run only when asked for. The scripted engine's are exact: on by default."""
    from localai.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine(LoadOptions(model_path=str(smollm2_path), num_ctx=2048, n_parallel=2, n_threads=threads()))
    assert not engine.drafts_exact
    auto = dict(op(PROMPTS["copy"], max_tokens=30), speculative=None)
    assert usage(serve(engine, [auto])["r"])["drafted_tokens"] == 0
    exact = serve(scripted(), [dict(op(f"{COPY}[[say:{COPY}]]"), speculative=None)])["r"]
    assert usage(exact)["accepted_tokens"] > 0


@pytest.mark.parametrize("name", list(PROMPTS))
def test_drafts_on_smollm2_keep_the_kv_and_the_cache_consistent(smollm2: Any, name: str, tmp_path: Path) -> None:
    """Asked for on a real model: the reply completes with drafts kept, and the sequence's KV holds exactly the kept
    tokens: the turn's cache entry is written (its state is carved into blocks only when its cells are positions
    0..n-1 of the tokens it is stored under, so one stray rejected draft would drop the write) and restores."""
    from localai.promptcache.blocks import fingerprint
    from localai.promptcache.store import PromptStore

    engine = smollm2()
    on = serve(engine, [op(PROMPTS[name], max_tokens=120)], cache_dir=tmp_path)["r"]
    off = serve(smollm2(), [op(PROMPTS[name], max_tokens=120, speculative=False)])["r"]
    drafted, accepted = usage(on)["drafted_tokens"], usage(on)["accepted_tokens"]
    assert 0 <= accepted <= drafted and on["text"]
    same = next((i for i, (a, b) in enumerate(zip(on["text"], off["text"], strict=False)) if a != b),
                min(len(on["text"]), len(off["text"])))
    print(f"{name}: drafted {drafted}, kept {accepted}; the same text as without drafts: "
          f"{on['text'] == off['text']} (first {same} characters)")
    store = PromptStore(tmp_path, fingerprint(engine.fingerprint_parts()), engine, max_bytes=1 << 30)
    prompt = engine.tokenize(PROMPTS[name])
    match = store.lookup(prompt + engine.tokenize(on["text"]))
    assert match is not None and match.common > len(prompt)
    restored = store.restore(match)
    assert restored is not None and engine.seq_restore(3, restored.state)
    store.close()


def test_seeded_sampling_with_drafts_keeps_each_draw(smollm2: Any) -> None:
    """At a temperature each kept token is the sampler's own draw from that position's distribution (a draft only
    decides how many positions one step evaluates): the scripted engine shows it exactly; on SmolLM2 the reply
    completes with drafts kept."""
    on = serve(smollm2(), [op(PROMPTS["copy"], max_tokens=80, temperature=0.7, seed=11)])["r"]
    assert usage(on)["drafted_tokens"] > 0 and on["text"]


def test_a_grammar_and_drafts(smollm2: Any) -> None:
    """Drafts under a grammar: the reply copies JSON from its prompt, so drafts are proposed (before, nothing
    checked that any was: the test passed with drafting off), and the text stays valid JSON."""
    import json

    document = json.dumps({"fox": COPY.strip(), "dog": COPY.strip()})
    constrained = dict(op(chatml("Repeat this JSON object exactly: " + document), max_tokens=80),
                       constraint={"type": "json_object"})
    engine = smollm2()
    result = serve(engine, [constrained])["r"]
    engine.close()
    assert usage(result)["drafted_tokens"] > 0, usage(result)
    json.loads(result["text"])  # drafts the grammar would not allow are never kept


def test_a_sliding_window_model_does_not_draft(gemma3_path: Path) -> None:
    from localai.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine(LoadOptions(model_path=str(gemma3_path), num_ctx=2048, n_parallel=2, n_threads=threads()))
    assert not engine.can_draft  # its window's old cells may be gone: no tail to drop safely
    prompt = "<start_of_turn>user\nRepeat exactly: " + COPY + "<end_of_turn>\n<start_of_turn>model\n"
    assert usage(serve(engine, [op(prompt, max_tokens=20)])["r"])["drafted_tokens"] == 0


def test_drafts_on_mlx(mlx_model_path: Path) -> None:
    """MLX can drop a rejected draft from a plain KV cache; drafts are off unless asked for (its forward pass of
    several tokens is not bit-identical to one at a time either)."""
    from localai.engines.mlx import MlxEngine

    def make() -> MlxEngine:
        return MlxEngine(LoadOptions(model_path=str(mlx_model_path), num_ctx=2048, n_parallel=2))

    on, off = both(make, op(PROMPTS["copy"], max_tokens=40))
    assert usage(on["r"])["drafted_tokens"] > 0 and on["r"]["text"]
    print("mlx with drafts equal to without:", on["r"]["text"] == off["r"]["text"], usage(on["r"]))
    assert usage(serve(make(), [dict(op(PROMPTS["copy"], max_tokens=8), speculative=None)])["r"])[
        "drafted_tokens"] == 0


def test_mlx_drafts_verify_in_the_batched_pass_beside_a_plain_request(mlx_model_path: Path) -> None:
    """A drafting request beside a plain one on MLX: the steps where both have tokens are one forward pass (the
    drafting row right-padded beside the single token), the drafts are kept or dropped, and the plain request's
    greedy text is the one it gets alone. The plain prompt is the shorter one, so it is prefilled first (the fewest
    tokens left go first) and decodes while the drafting one's drafts are verified."""
    from localai.engines.mlx import MlxEngine

    engine = MlxEngine(LoadOptions(model_path=str(mlx_model_path), num_ctx=2048, n_parallel=2))
    shapes: list[tuple[int, int]] = []
    model = engine.model

    class Counted:
        def __call__(self, tokens: Any, cache: Any = None) -> Any:
            shapes.append((int(tokens.shape[0]), int(tokens.shape[1])))
            return model(tokens, cache=cache)

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

    plain = op(chatml("Summarise this text:\n\n" + COPY), speculative=False, max_tokens=30, request_id="plain")
    alone = serve(engine, [plain])["plain"]["text"]
    for seq in range(engine.n_seq):
        engine.seq_clear(seq)  # the next serving loop starts from empty sequences
    engine.model = Counted()
    results = serve(engine, [op(PROMPTS["copy"], max_tokens=40, request_id="drafting"), plain])
    assert usage(results["drafting"])["drafted_tokens"] > 0 and usage(results["drafting"])["accepted_tokens"] > 0
    assert any(rows == 2 and width > 1 for rows, width in shapes), str(shapes)  # drafts verified beside a single token
    assert results["plain"]["text"] == alone
