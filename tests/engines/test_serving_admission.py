"""The serving loop's admission and steps, driven op by op on the scripted engine (no worker process): a request
that fails while it starts gives its slot back, a warm prefill holds back only its own conversation's next turn,
and each step reaches the engine in sequence order."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from localai.engines import serving as serving_module
from localai.engines.engine import LoadOptions
from localai.engines.scripted import ScriptedEngine
from localai.engines.serving import FLUSH_INTERVAL, Serving


def serving(tmp_path: Path, n_parallel: int = 2) -> Serving:
    load = LoadOptions(model_path="scripted", num_ctx=4096, n_parallel=n_parallel, cache_dir=str(tmp_path / "cache"))
    return Serving(ScriptedEngine(load), load)


def generate(request_id: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "id": request_id, "prompt": prompt, "sampling": {"temperature": 0}, "max_tokens": 4,
            **extra}


def test_a_request_that_fails_while_starting_gives_its_slot_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    loop = serving(tmp_path)
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize",
                        lambda text: (_ for _ in ()).throw(RuntimeError("tokenizer broke")) if text == "SYS"
                        else real(text))
    events: list[dict[str, Any]] = []
    for n in range(3):  # more than the two slots: a leaked slot would keep the third waiting forever
        loop._handle(generate(f"r{n}", "SYS and the rest of the prompt", system_prefix="SYS"), events.append)
        loop._admit(events.append)
    assert [e["id"] for e in events if e["ev"] == "error"] == ["r0", "r1", "r2"]
    assert not any(slot.busy for slot in loop.slots) and not loop.requests and not loop.waiting


def test_a_warm_prefill_without_a_session_holds_back_only_its_own_next_turn(tmp_path: Path) -> None:
    loop = serving(tmp_path, n_parallel=3)
    events: list[dict[str, Any]] = []
    loop._handle(generate("warm", "conversation A so far", warm=True), events.append)
    loop._admit(events.append)
    assert "warm" in loop.requests  # prefilling (no decode step has run)
    loop._handle(generate("other", "an unrelated prompt from another client"), events.append)
    loop._handle(generate("next", "conversation A so far, and the next turn"), events.append)
    loop._handle(generate("again", "conversation A so far"), events.append)  # the same prompt sent again
    loop._handle(generate("mine", "session work", session="s1"), events.append)
    loop._admit(events.append)
    assert "other" in loop.requests  # before: held back by any warm prefill without a session
    assert [op["id"] for op in loop.waiting] == ["next", "again"]  # wait for the prefill they start from
    assert "mine" in loop.requests  # another session is never held back


def test_each_step_goes_to_the_engine_in_sequence_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp cuts a batch into ubatches of consecutive sequences (a KV stream each), so rows in arrival order
    (sequences 3, 2, 1, 0 here) would cost extra passes over the weights every step. The loop hands each step over
    grouped by sequence, in increasing order, a drafting request's rows together; every reply is still its own."""
    loop = serving(tmp_path, n_parallel=4)
    for rank, slot in enumerate(loop.slots):
        slot.last_used = 10.0 - rank  # least recently used first: the first request gets sequence 3
    steps: list[list[int]] = []
    real = loop.engine.decode
    monkeypatch.setattr(loop.engine, "decode", lambda batch: (steps.append([item.seq for item in batch]),
                                                              real(batch))[1])
    copy = "alpha beta gamma delta epsilon " * 3
    replies = {f"r{n}": f"reply {n} " * 3 for n in range(3)} | {"copy": copy}
    events: list[dict[str, Any]] = []
    for request_id, reply in replies.items():
        extra = {"speculative": True} if request_id == "copy" else {}
        loop._handle(generate(request_id, f"{copy}[[say:{reply}]]", max_tokens=200, **extra), events.append)
    loop._admit(events.append)
    assert sorted(request.slot.seq for request in loop.requests.values()) == [0, 1, 2, 3]
    assert [loop.requests[r].slot.seq for r in replies] == [3, 2, 1, 0]
    while loop.requests:
        loop._step(events.append)
    assert steps and all(seqs == sorted(seqs) for seqs in steps), steps
    assert any(len(seqs) > len(set(seqs)) == 4 for seqs in steps)  # a step with a draft beside three plain rows
    texts = {request_id: "".join(e["text"] for e in events if e["ev"] == "text" and e["id"] == request_id)
             for request_id in replies}
    assert texts == replies
    assert next(e for e in events if e["ev"] == "done" and e["id"] == "copy")["usage"]["accepted_tokens"] > 0


@pytest.mark.parametrize(("step", "one_frame_a_token"), [(0.030, True), (0.020, True), (0.004, False)])
def test_text_is_held_back_only_when_the_next_token_is_due_within_the_flush_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: float, one_frame_a_token: bool) -> None:
    """On a clock the test moves (each step takes ``step`` seconds): with steps about as long as the flush interval
    every token is sent when it is sampled (never two at once, the first a step late), with fast steps tokens are sent
    together, at most an interval apart."""
    clock = [1000.0]
    monkeypatch.setattr(serving_module, "time", SimpleNamespace(perf_counter=lambda: clock[0],
                                                                    monotonic=time.monotonic))
    loop = serving(tmp_path)
    real = loop.engine.decode

    def decode(batch: list[Any]) -> None:
        clock[0] += step
        real(batch)

    monkeypatch.setattr(loop.engine, "decode", decode)
    reply = "abcdefghijklmnopqrstuvwxyz" * 2
    events: list[dict[str, Any]] = []
    loop._handle(generate("r", f"[[say:{reply}]]", max_tokens=100, speculative=False), events.append)
    loop._admit(events.append)
    while loop.requests:
        loop._step(events.append)
    frames = [e["text"] for e in events if e["ev"] == "text"]
    assert "".join(frames) == reply
    if one_frame_a_token:
        assert frames == list(reply)
    else:
        assert len(frames) <= len(reply) // 4 and max(len(frame) for frame in frames) <= FLUSH_INTERVAL / step + 1


def prefill_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> tuple[Serving, list[dict[int, int]]]:
    """A loop whose engine prefills ``chunk`` tokens a request a step (a CPU's); returns it and every step's rows per
    sequence."""
    load = LoadOptions(model_path="scripted", num_ctx=16384, n_parallel=3, n_batch=512)
    engine = ScriptedEngine(load)
    engine.prefill_chunk = chunk
    loop = Serving(engine, load)
    steps: list[dict[int, int]] = []
    real = engine.decode

    def decode(batch: list[Any]) -> None:
        rows: dict[int, int] = {}
        for item in batch:
            rows[item.seq] = rows.get(item.seq, 0) + 1
        steps.append(rows)
        real(batch)

    monkeypatch.setattr(engine, "decode", decode)
    return loop, steps


def run_until_done(loop: Serving, events: list[dict[str, Any]], request_id: str) -> None:
    while not any(e["ev"] == "done" and e["id"] == request_id for e in events):
        loop._step(events.append)


def test_a_long_prefill_delays_a_new_request_by_one_chunk_not_by_the_whole_prompt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46, item 8: a long prompt took every step's room (num_batch, 512: 2 s a step on this CPU) until it was
    done: a 200-image request held a parallel chat for 19 s. Now each prefilling request evaluates one chunk of the
    engine's prefill_chunk a step, so a request that arrives during a long prefill gets its prompt into the next
    step and its tokens one chunk-sized step apart, while the long prompt goes on."""
    loop, steps = prefill_loop(tmp_path, monkeypatch, chunk=32)
    events: list[dict[str, Any]] = []
    long_prompt = "word " * 1200 + "[[say:the long answer]]"  # 6,000 tokens (the scripted engine's are bytes)
    loop._handle(generate("long", long_prompt, max_tokens=20), events.append)
    loop._admit(events.append)
    for _ in range(3):
        loop._step(events.append)
    long_seq = loop.requests["long"].slot.seq
    assert all(rows == {long_seq: 32} for rows in steps), steps  # alone: a chunk a step, not num_batch
    loop._handle(generate("short", "hello [[say:abcdefgh]]", max_tokens=8, speculative=False), events.append)
    loop._admit(events.append)
    arrived = len(steps)
    run_until_done(loop, events, "short")
    waited = steps[arrived:]
    assert "long" in loop.requests and loop.requests["long"].next_prompt < len(loop.requests["long"].prompt)
    # its prompt (one chunk, then its last token alone), then a step a token; none of them held more than a chunk
    # of the long prompt
    assert len(waited) <= 2 + 8, waited
    assert all(rows.get(long_seq, 0) <= 32 for rows in waited), waited
    assert "".join(e["text"] for e in events if e["ev"] == "text" and e["id"] == "short") == "abcdefgh"
    run_until_done(loop, events, "long")
    assert "".join(e["text"] for e in events if e["ev"] == "text" and e["id"] == "long") == "the long answer"


def test_a_prompts_chunks_do_not_depend_on_what_runs_beside_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's size changes the kernels' arithmetic (llama.cpp on a CPU), so chunks sized by what else is in the
    step made greedy replies depend on the daemon's other traffic (two sessions' first replies differed from run to
    run). Each request's chunks are the same alone and beside others, whatever the room."""

    def chunks(tmp: Path, others: int) -> list[int]:
        loop, steps = prefill_loop(tmp, monkeypatch, chunk=48)
        events: list[dict[str, Any]] = []
        for n in range(others):  # decoding and prefilling neighbours, started first
            loop._handle(generate(f"o{n}", "x" * (100 + 37 * n) + "[[say:" + "y" * 30 + "]]", max_tokens=30,
                                  speculative=False), events.append)
        loop._admit(events.append)
        loop._step(events.append)
        loop._handle(generate("me", "z" * 500 + "[[say:done]]", max_tokens=4), events.append)
        loop._admit(events.append)
        seq = loop.requests["me"].slot.seq
        arrived = len(steps)
        run_until_done(loop, events, "me")
        return [rows[seq] for rows in steps[arrived:] if seq in rows]

    alone = chunks(tmp_path / "a", 0)
    assert alone[:3] == [48, 48, 48]
    assert chunks(tmp_path / "b", 2) == alone


def test_prompts_arriving_together_finish_one_after_another_beside_a_decoding_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57: sub-agents' cold prompts sent while another session decoded each got a chunk a step, so all of them
    finished at the end (19-39 s under localai, 12-17 s under llama-server, same machine). Now a step's chunk goes to
    the prompt with the fewest tokens left: the first finishes before the second starts, and the decoding stream
    still gets a token every step beside at most one chunk."""
    loop, steps = prefill_loop(tmp_path, monkeypatch, chunk=32)
    events: list[dict[str, Any]] = []
    loop._handle(generate("decoder", "go [[say:" + "d" * 200 + "]]", max_tokens=200, speculative=False), events.append)
    loop._admit(events.append)
    while loop.requests["decoder"].pending_token is None:
        loop._step(events.append)
    decoder = loop.requests["decoder"].slot.seq
    arrived = len(steps)
    for name, size in (("a", 300), ("b", 290)):  # b is shorter: it goes first
        loop._handle(generate(name, "p" * size + "[[say:ok]]", max_tokens=2), events.append)
    loop._admit(events.append)
    first, second = loop.requests["b"].slot.seq, loop.requests["a"].slot.seq
    run_until_done(loop, events, "a")
    run_until_done(loop, events, "b")
    during = steps[arrived:]
    assert all(rows.get(decoder) == 1 for rows in during[:20]), during  # a token every step
    assert all(rows.get(first, 0) + rows.get(second, 0) <= 32 + 1 for rows in during), during
    first_done = max(i for i, rows in enumerate(during) if first in rows and rows[first] > 1)
    second_started = min(i for i, rows in enumerate(during) if second in rows)
    assert second_started >= first_done, during  # one after another, not side by side
    for name in "ab":
        assert "".join(e["text"] for e in events if e["ev"] == "text" and e["id"] == name) == "ok"


def test_a_long_prompt_is_never_starved_by_shorter_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorter prompts go first, but a prompt left without a chunk for STARVED_STEPS steps goes before them."""
    loop, steps = prefill_loop(tmp_path, monkeypatch, chunk=16)
    events: list[dict[str, Any]] = []
    loop._handle(generate("long", "L" * 600 + "[[say:done]]", max_tokens=4), events.append)
    loop._admit(events.append)
    loop._step(events.append)
    long_seq = loop.requests["long"].slot.seq
    arrived = len(steps)
    for n in range(40):  # a short prompt always waiting beside it
        if sum(1 for r in loop.requests.values() if r.id != "long") < 2:
            loop._handle(generate(f"s{n}", f"{n:02d}" + "s" * 60 + "[[say:x]]", max_tokens=1), events.append)
            loop._admit(events.append)
        loop._step(events.append)
    fed = [i for i, rows in enumerate(steps[arrived:]) if long_seq in rows]
    gaps = [b - a for a, b in zip([-1, *fed], fed, strict=False)]
    assert fed and max(gaps) <= serving_module.STARVED_STEPS + 1, (fed, gaps)
    assert len(fed) < 40  # the short ones did go first


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 M-character document (the most a request brings) took the loop about 1 s per fitting attempt to
    tokenize, steps the other sequences waited for; its first characters alone prove it is over the context."""
    loop = serving(tmp_path)
    lengths: list[int] = []
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize", lambda text: (lengths.append(len(text)), real(text))[1])
    events: list[dict[str, Any]] = []
    loop._handle(generate("huge", "page of a document " * 200_000), events.append)
    loop._admit(events.append)
    error = next(e for e in events if e["id"] == "huge")
    assert error["ev"] == "error" and error["kind"] == "context_length", error
    assert error["message"].startswith("the prompt is about ") and error["prompt_tokens"] > 4096 * 10
    assert max(lengths) <= 65_536, lengths
    assert not loop.requests and not any(slot.busy for slot in loop.slots)
    loop._handle(generate("fits", "page of a document " * 100), events.append)  # a long prompt that fits: whole
    loop._admit(events.append)
    assert "fits" in loop.requests


def test_a_cpu_prefill_chunk_follows_the_weights_size_and_a_gpu_takes_num_batch() -> None:
    """A CPU step's time is about its tokens times the weights read for each: SmolLM2's size gets 64 tokens, a
    random-weight fixture of a few MB num_batch, a 300 MB model 32 (never fewer); from 512 MiB of weights (where
    small chunks cost prefill speed: 0.78x at 32 tokens on a real-shaped Qwen3-1.7B) num_batch, as a GPU always."""
    from localai.engines.engine import CPU_PREFILL_CHUNK, FULL_BATCH_WEIGHTS, MIN_CPU_CHUNK, prefill_chunk

    assert prefill_chunk(512, on_gpu=False, weights_bytes=96 << 20) == CPU_PREFILL_CHUNK == 64
    assert prefill_chunk(512, on_gpu=False, weights_bytes=110_000_000) == 32  # a power of two under 58
    assert prefill_chunk(512, on_gpu=False, weights_bytes=3 << 20) == 512
    assert prefill_chunk(256, on_gpu=False, weights_bytes=1 << 20) == 256
    assert prefill_chunk(512, on_gpu=False, weights_bytes=(FULL_BATCH_WEIGHTS - 1)) == MIN_CPU_CHUNK == 32
    assert prefill_chunk(512, on_gpu=False, weights_bytes=FULL_BATCH_WEIGHTS) == 512  # agent-sized: as llama-server
    assert prefill_chunk(512, on_gpu=False, weights_bytes=4 << 30) == 512
    assert prefill_chunk(512, on_gpu=False) == 64  # the size not known
    assert prefill_chunk(16, on_gpu=False, weights_bytes=4 << 30) == 16  # never over num_batch
    assert prefill_chunk(512, on_gpu=True, weights_bytes=4 << 30) == 512


@pytest.mark.parametrize("forks", [True, False])
def test_a_request_starts_from_the_prefix_a_busy_sequence_shares_with_it(tmp_path: Path, forks: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's n choices, or sub-agents sent together: the second starts from the first's live state instead
    of computing the shared start again (without the fork, the control: nothing reused)."""
    loop = serving(tmp_path)
    monkeypatch.setattr(loop.engine, "can_trim", forks)
    events: list[dict[str, Any]] = []
    shared = "You are a careful assistant. " * 8  # 232 bytes: the scripted engine's tokens are bytes
    loop._handle(generate("first", shared + "[[say:one two three four five six]]", max_tokens=8), events.append)
    loop._admit(events.append)
    while loop.requests["first"].next_prompt < len(loop.requests["first"].prompt):
        loop._step(events.append)
    loop._step(events.append)  # the first has gone on past its prompt: its state is cut back for the copy
    loop._handle(generate("second", shared + "[[say:two]]", max_tokens=8), events.append)
    loop._admit(events.append)
    while loop.requests:
        loop._step(events.append)
    cached = next(e["cached_tokens"] for e in events if e["ev"] == "prompt" and e["id"] == "second")
    assert cached == (len(shared + "[[say:") if forks else 0)
    assert "".join(e["text"] for e in events if e["ev"] == "text" and e["id"] == "second") == "two"
    assert "".join(e["text"] for e in events if e["ev"] == "text" and e["id"] == "first") == "one two "


def test_a_prompt_chunk_never_cuts_a_run_the_engine_evaluates_in_one_pass(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An image attended non-causally (Gemma 3) goes to the engine whole: a chunk ends before it, or, starting at it,
    after it, however small the prefill chunk; a checkpoint that would fall inside it moves to its end."""
    loop, _ = prefill_loop(tmp_path, monkeypatch, chunk=6)
    image = (11, 24)  # prompt tokens [11, 24) are one image
    monkeypatch.setattr(loop.engine, "span_end", lambda tokens, index: image if image[0] < index < image[1] else None)
    batches: list[list[int]] = []
    decode = loop.engine.decode
    monkeypatch.setattr(loop.engine, "decode", lambda batch: (batches.append([item.pos for item in batch]),
                                                              decode(batch))[1])
    real_next = loop.slot_cache.next_checkpoint
    monkeypatch.setattr(loop.engine, "checkpoints", True)
    monkeypatch.setattr(loop.slot_cache, "next_checkpoint",
                        lambda request: 15 if request.next_prompt < 15 else real_next(request))
    monkeypatch.setattr(loop.engine, "seq_checkpoint", lambda seq: b"state")
    taken: list[int] = []
    take = loop.slot_cache.take_checkpoint
    monkeypatch.setattr(loop.slot_cache, "take_checkpoint",
                        lambda request: (taken.append(request.next_prompt), take(request))[1])
    events: list[dict[str, Any]] = []
    loop._handle(generate("r", "a prompt whose image sits in the middle of it, and text after"), events.append)
    loop._admit(events.append)
    run_until_done(loop, events, "r")
    prefill = [batch for batch in batches if batch and batch[0] < 50]
    assert [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23] in prefill  # whole, longer than a chunk
    assert all(not (image[0] < batch[0] < image[1]) for batch in prefill)  # no chunk starts inside it
    assert prefill[:3] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    assert taken and taken[0] == image[1]  # the checkpoint asked for at 15 was taken at the image's end
