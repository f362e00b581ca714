"""Images on the Qwen-VL family (Qwen3-VL, Qwen3.5/3.6): a tiny random projector of llama.cpp's ``qwen3vl_merger``
kind (tests/mmproj.py) beside the qwen35 and qwen35moe fixtures (Gated DeltaNet hybrids, M-RoPE). An image of
``rows x columns`` embeddings takes ``max(rows, columns)`` positions: the engine's positions and replies are
checked against llama.cpp's own helper (``mtmd_helper_eval_chunks``); through a daemon the image is encoded once
and its session resumes after it on a later turn, a retry, a fork and after a restart, answering as a cold daemon."""

from __future__ import annotations

import base64
import ctypes
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np
import pytest

from localai.engines.slot_cache import CHECKPOINT_MARGIN
from tests import media_files as files
from tests.conftest import Daemon, start_daemon
from tests.mmproj import write_mmproj, write_qwen_mmproj
from tests.parallel import threads

ARCHS = ["qwen35", "qwen35moe"]
IMAGE = files.png(40, 24, (200, 30, 30))  # 10x6 patches of 4: 5x3 embeddings after the 2x2 merge, 5 positions
OTHER = files.png(24, 24, (30, 30, 200))
REPLY = 12


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_mmproj(tmp_path_factory.mktemp("qwen-mmproj") / "mmproj-qwen.gguf")


# -- the engine against llama.cpp's own helper ------------------------------------------------------------------


def reference(model_path: Path, projector: Path, text: str, image: bytes) -> tuple[int, list[int]]:
    """llama.cpp's way: mtmd tokenizes the prompt, ``mtmd_helper_eval_chunks`` evaluates it (M-RoPE positions as
    llama-server sets them); then ``REPLY`` greedy tokens. Returns the positions the prompt took and the reply."""
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(model_path).encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 1024, 512, 512, 1
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, params)
    mparams = M.mtmd_context_params_default()
    mparams.use_gpu, mparams.warmup = False, False
    mctx = M.mtmd_init_from_file(str(projector).encode(), model, mparams)
    data = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
    bitmap = M.mtmd_helper_bitmap_init_from_buf(mctx, data, len(image), False)
    chunks = M.mtmd_input_chunks_init()
    try:
        spec = M.mtmd_input_text()
        prompt = text.encode()
        spec.text, spec.text_len, spec.add_special, spec.parse_special = prompt, len(prompt), True, True
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(spec), (ctypes.c_void_p * 1)(bitmap), 1) == 0
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        batch = L.llama_batch_init(1, 0, 1)
        reply, position = [], n_past.value
        for _ in range(REPLY):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            reply.append(int(logits.argmax()))
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = reply[-1], position, 1, 1
            batch.seq_id[0][0], batch.n_tokens = 0, 1
            assert L.llama_decode(ctx, batch) == 0
            position += 1
        L.llama_batch_free(batch)
        return n_past.value, reply
    finally:
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bitmap)
        M.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(model)


@pytest.mark.parametrize("arch", [*ARCHS, "qwen3vl-deepstack"])
def test_an_image_takes_the_positions_llama_cpp_gives_it_and_the_reply_is_llama_cpps(arch: str, tmp_path: Path,
                                                                                   arch_fixtures: Path) -> None:
    """On Qwen3-VL with a deepstack layer each embedding row is twice the model's width (the deepstack half added
    to its first layer's output); llama.cpp refuses a projector whose rows do not match."""
    from localai.engines.engine import BatchItem, LoadOptions
    from localai.engines.llama_cpp import LlamaCppEngine
    from localai.protocol import image_mark

    model_path = arch_fixtures / f"{arch}.gguf"  # the fixture fails, naming `make fixtures`, when one is missing
    projector = write_qwen_mmproj(tmp_path / "mmproj.gguf", deepstack=1 if "deepstack" in arch else 0)
    digest = hashlib.sha256(IMAGE).hexdigest()
    text = "describe {} please, and then some"
    n_pos, expected = reference(model_path, projector, text.format(M.mtmd_default_marker().decode()), IMAGE)
    engine = LlamaCppEngine(LoadOptions(model_path=str(model_path), num_ctx=1024, n_parallel=2, n_threads=threads(),
                                        projector_path=str(projector)))
    try:
        assert engine.vision is not None and engine.mrope
        engine.vision.remember({digest: base64.b64encode(IMAGE).decode()})
        tokens = engine.tokenize(text.format(image_mark(digest)))
        assert len(tokens) - n_pos == 15 - 5  # 15 embeddings (5x3) in 5 positions

        def run(seq: int, chunk: int) -> list[int]:
            start = 0
            while start < len(tokens) - 1:  # the prompt in chunks (the image cut in pieces when chunk < 15)
                stop = min(start + chunk, len(tokens) - 1)
                engine.decode([BatchItem(seq, t, start + k, False) for k, t in enumerate(tokens[start:stop])])
                start = stop
            engine.decode([BatchItem(seq, tokens[-1], len(tokens) - 1, True)])
            # llama.cpp's own count: the last prompt token sits at the position before its helper's n_past
            assert L.llama_memory_seq_pos_max(engine.memory, seq) == n_pos - 1
            sampler = engine.new_sampler({"temperature": 0}, None)
            reply = []
            for index in range(REPLY):
                reply.append(engine.sample(sampler, 0))
                engine.decode([BatchItem(seq, reply[-1], len(tokens) + index, True)])
            return reply

        assert run(0, 512) == expected
        assert run(1, 4) == expected
        # the state cut into blocks and joined again keeps every cell's position (an image's repeat)
        held = len(tokens) + REPLY
        state = bytes(engine.seq_state(0))
        ranges = [(0, 7), (7, 19), (19, held)]
        split = engine.state_split(state, held, ranges)
        assert split is not None
        layout, pieces, rest = split
        assert bytes(engine.state_join(layout, pieces, [b - a for a, b in ranges], rest)) == state
        # a restored state learns where its image lies from its tokens; a cut inside the image is refused (its
        # embeddings share one time position)
        first = next(index for index, token in enumerate(tokens) if token >= 1 << 30)
        engine.seq_clear(1)
        assert engine.seq_restore(1, state, tokens + [0] * REPLY)
        assert engine.vision.spans.by_seq[1] == [(first, 15, 5)]
        assert engine.vision.spans.inside(1, first + 3) and not engine.vision.spans.inside(1, first)
        assert not engine.seq_keep(1, first + 3)
        assert L.llama_memory_seq_pos_max(engine.memory, 1) == n_pos - 1 + REPLY  # the refused cut left it whole
        assert not engine.seq_restore(1, state, [t if t < 1 << 30 else (1 << 30) + 7 for t in tokens])
        assert L.llama_memory_seq_pos_max(engine.memory, 1) == -1  # refused: nothing half loaded stays
    finally:
        engine.close()


# -- through a daemon --------------------------------------------------------------------------------------------


def create(daemon: Daemon, name: str, modelfile: str) -> dict[str, Any]:
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": name, "modelfile": modelfile})
    return {**response.json(), "code": response.status_code}


def image_turn(image: bytes, text: str) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def ask(daemon: Daemon, messages: list[dict[str, Any]], session: str, salt: str | None = None) -> dict[str, Any]:
    body = {"model": "seer", "messages": messages, "max_tokens": 8, "temperature": 0, "prompt_cache_key": session}
    if salt is not None:
        body["cache_salt"] = salt  # a partition of its own: no live sequence is reused for it
    with daemon.http(timeout=300) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert "x-localai-omitted" not in response.headers  # the image reached the model
    data = response.json()
    message = data["choices"][0]["message"]
    usage = data["usage"]
    return {"text": (message.get("reasoning_content") or "") + (message["content"] or ""),
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def encoded(daemon: Daemon) -> float:
    with daemon.http() as http:
        text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("localai_prompt_cache_images_encoded_total{"))


def tool_round(image: bytes) -> dict[str, Any]:
    """Anthropic Messages: the model called a screenshot tool and its result is an image (Claude Code's Read of a
    PNG)."""
    return {"model": "seer", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": "What does the screen show?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "the screen:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}]}]}],
        "tools": [{"name": "screenshot", "description": "Take a screenshot", "input_schema": {"type": "object"}}]}


@pytest.fixture(scope="module", params=ARCHS)
def walk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, projector: Path,
         arch_fixtures: Path) -> Iterator[dict[str, Any]]:
    """One session with an image, through a daemon, then the same home restarted; every request's messages and
    answer, for a cold daemon to repeat."""
    model_path = arch_fixtures / f"{request.param}.gguf"
    home = tmp_path_factory.mktemp(f"mrope-{request.param}")
    modelfile = f"FROM {model_path}\nPROJECTOR {projector}\n"
    system = {"role": "system", "content": "You look at screenshots for a coding agent. " * 3}
    t1 = [system, image_turn(IMAGE, "What is on this screen?")]
    seen: dict[str, Any] = {"modelfile": modelfile, "arch": request.param}
    with start_daemon(home) as daemon:
        assert create(daemon, "seer", modelfile)["code"] == 200
        seen["t1"] = {**ask(daemon, t1, "s1"), "messages": t1}
        t2 = [*t1, {"role": "assistant", "content": seen["t1"]["text"]}, {"role": "user", "content": "And below?"}]
        seen["t2"] = {**ask(daemon, t2, "s1"), "messages": t2}
        seen["retry"] = {**ask(daemon, t2, "s1"), "messages": t2}
        fork = [*t2[:3], {"role": "user", "content": "Is there an error dialog?"}]
        seen["fork"] = {**ask(daemon, fork, "s2"), "messages": fork}
        seen["encoded"] = encoded(daemon)
        with daemon.http(timeout=300) as http:
            response = http.post("/v1/messages", json=tool_round(OTHER))
        assert response.status_code == 200, response.text
        seen["tool"] = response.json()
        seen["encoded with the tool's"] = encoded(daemon)
    with start_daemon(home) as daemon:  # a restart: only the disk remembers
        seen["retry after restart"] = {**ask(daemon, t2, "s1"), "messages": t2}
        t3 = [*t2, {"role": "assistant", "content": seen["t2"]["text"]}, {"role": "user", "content": "Thanks."}]
        seen["t3 after restart"] = {**ask(daemon, t3, "s1"), "messages": t3}
        seen["encoded after restart"] = encoded(daemon)
    yield seen


def test_the_image_is_encoded_once_and_every_branch_resumes_after_it(walk: dict[str, Any]) -> None:
    t1 = walk["t1"]
    assert t1["cached"] == 0
    for name in ("t2", "retry", "fork", "retry after restart", "t3 after restart"):
        # each resumes past the image, from a checkpoint after it: the first turn's prompt end or later
        assert walk[name]["cached"] >= t1["prompt"] - CHECKPOINT_MARGIN, (name, walk[name], t1)
    assert walk["encoded"] == 1  # IMAGE once for four requests
    assert walk["encoded after restart"] == 0  # its positions came back from the disk: not encoded again


def test_answers_with_the_image_cached_are_a_cold_daemons(walk: dict[str, Any], tmp_path: Path) -> None:
    with start_daemon(tmp_path / "cold", cache_max_bytes="0") as cold:
        assert create(cold, "seer", walk["modelfile"])["code"] == 200
        for name in ("t2", "retry", "fork", "retry after restart", "t3 after restart"):
            answer = ask(cold, walk[name]["messages"], f"cold-{name}", salt=name)
            assert answer["cached"] == 0
            assert answer["text"] == walk[name]["text"], name
            assert answer["prompt"] == walk[name]["prompt"], name
    assert all(walk[name]["text"] for name in ("t2", "fork", "t3 after restart"))  # answers to compare


def test_an_image_in_a_tool_result_reaches_the_model(walk: dict[str, Any]) -> None:
    usage = walk["tool"]["usage"]
    # OTHER (24x24: 6x6 patches, 3x3 embeddings) is 9 of the prompt's tokens; without the image there are none
    assert usage["input_tokens"] >= 9
    assert walk["encoded with the tool's"] == 2


def test_a_projector_of_the_wrong_kind_is_refused_at_create(tmp_path: Path, projector: Path, smollm2_path: Path,
                                                            arch_fixtures: Path) -> None:
    model_path = arch_fixtures / "qwen35.gguf"
    with start_daemon(tmp_path / "home") as daemon:
        # the Qwen-VL projector feeds 256-wide embeddings; smollm2's are 576 wide (llama.cpp would refuse at load)
        refused = create(daemon, "bad", f"FROM {smollm2_path}\nPROJECTOR {projector}\n")
        assert refused["code"] == 400
        assert "made for a model 256 wide" in refused["error"] and "576 wide" in refused["error"]
        gemma = write_mmproj(tmp_path / "mmproj-gemma3.gguf")  # 576 wide: the other way round
        refused = create(daemon, "bad2", f"FROM {model_path}\nPROJECTOR {gemma}\n")
        assert refused["code"] == 400 and "gemma3 projector made for a model 576 wide" in refused["error"]
