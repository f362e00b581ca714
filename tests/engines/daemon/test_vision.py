"""Vision through a projector: smollm2 (576 wide) with a tiny random-weight Gemma 3 projector (tests/mmproj.py),
through llama.cpp's mtmd: the Modelfile lines, /api/show's capability, images as the positions llama.cpp reports,
keyed in the prompt cache by their bytes, and answers the same with the cache and without."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import media_files as files
from tests.conftest import SMOLLM2, Daemon, start_daemon
from tests.metagguf import metadata_gguf
from tests.mmproj import POSITIONS, write_mmproj
from tests.parallel import threads

RED = files.png(16, 16, (220, 20, 20))
BLUE = files.png(16, 16, (20, 20, 220))


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj-tiny.gguf")


def create(daemon: Daemon, name: str, modelfile: str) -> dict[str, Any]:
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": name, "modelfile": modelfile})
    return {**response.json(), "code": response.status_code}


@pytest.fixture(scope="module")
def seer(tmp_path_factory: pytest.TempPathFactory, projector: Path, smollm2_path: Path) -> Iterator[Daemon]:
    daemon = start_daemon(tmp_path_factory.mktemp("vision"), keep_alive="-1")
    try:
        assert create(daemon, "seer", f"FROM {smollm2_path}\nPROJECTOR {projector}\n")["code"] == 200
        yield daemon
    finally:
        daemon.stop()


def ask(daemon: Daemon, messages: list[dict[str, Any]], session: str, **extra: Any) -> dict[str, Any]:
    with daemon.http() as http:
        response = http.post("/v1/chat/completions", headers={"X-Session-Id": session}, json={
            "model": "seer", "messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    assert "x-localai-omitted" not in response.headers  # the image reached the model
    result: dict[str, Any] = response.json()
    return result


def image_turn(image: bytes, text: str = "What colour is this?") -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def test_the_projector_is_a_modelfile_line_and_show_says_vision(seer: Daemon, projector: Path,
                                                                smollm2_path: Path, tmp_path: Path) -> None:
    with seer.http() as http:
        shown = http.post("/api/show", json={"model": "seer"}).json()
        plain = http.post("/api/show", json={"model": "smollm2"}).json()
    assert "vision" in shown["capabilities"] and "vision" not in plain["capabilities"]
    assert f"PROJECTOR {projector}" in shown["modelfile"] and shown["projector"] == str(projector)
    # Ollama's way: a second FROM names the projector
    assert create(seer, "seer-ollama", f"FROM {smollm2_path}\nFROM {projector}\n")["code"] == 200
    with seer.http() as http:
        assert "vision" in http.post("/api/show", json={"model": "seer-ollama"}).json()["capabilities"]
    # a model built FROM a vision model keeps its projector
    assert create(seer, "seer-terse", "FROM seer\nSYSTEM Be terse.\n")["code"] == 200
    with seer.http() as http:
        assert "vision" in http.post("/api/show", json={"model": "seer-terse"}).json()["capabilities"]


@pytest.mark.parametrize(("line", "needle"), [
    ("PROJECTOR /nonexistent/mmproj.gguf", "no such file"),
    ("PROJECTOR {text_model}", "not a vision projector"),
    ("PROJECTOR {projector}\nPROJECTOR {projector}", "a second projector"),
])
def test_a_bad_projector_line_is_refused_naming_it(seer: Daemon, projector: Path, smollm2_path: Path,
                                                   tmp_path: Path, line: str, needle: str) -> None:
    text_model = metadata_gguf(tmp_path / "text.gguf", arch="llama", context_length=4096)
    created = create(seer, "broken", f"FROM {smollm2_path}\n" + line.format(projector=projector,
                                                                           text_model=text_model) + "\n")
    assert created["code"] == 400 and needle in created["error"], created


def test_an_image_adds_the_positions_llama_cpp_reports(seer: Daemon) -> None:
    """The image is ``POSITIONS`` pseudo-tokens plus the begin/end text mtmd puts around it for this projector
    type (Gemma 3's ``<start_of_image>``/``<end_of_image>``, plain text to smollm2)."""
    with_image = ask(seer, [image_turn(RED)], "count-1")["usage"]["prompt_tokens"]
    without = ask(seer, [{"role": "user", "content": "What colour is this?\n"}], "count-2")["usage"]["prompt_tokens"]
    from llama_cpp import Llama

    from localai.models.registry import resolve_weights
    vocab = Llama(model_path=str(resolve_weights(SMOLLM2)), vocab_only=True, verbose=False)
    around = len(vocab.tokenize(b"<start_of_image>", add_bos=False)) + len(vocab.tokenize(b"<end_of_image>",
                                                                                         add_bos=False))
    assert with_image - without == POSITIONS + around


def test_the_cache_keys_an_image_by_its_bytes(seer: Daemon) -> None:
    first = ask(seer, [image_turn(RED)], "keys")
    reply = first["choices"][0]["message"]["content"]
    follow = [image_turn(RED), {"role": "assistant", "content": reply}, {"role": "user", "content": "And now?"}]
    second = ask(seer, follow, "keys")
    # the second turn reuses the whole first turn, the image's positions included
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    # a different image at the same place is not reused: the prefix stops before it
    other = [image_turn(BLUE), {"role": "assistant", "content": reply}, {"role": "user", "content": "And now?"}]
    third = ask(seer, other, "keys")
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"] - POSITIONS


def test_answers_are_the_same_with_the_cache_and_without(seer: Daemon, tmp_path: Path, projector: Path,
                                                          smollm2_path: Path) -> None:
    turn = [image_turn(BLUE, "Describe it."), {"role": "assistant", "content": "A square."},
            {"role": "user", "content": "What else?"}]
    ask(seer, turn[:1], "same", max_tokens=1)  # the image's prefix is cached
    warm = ask(seer, turn, "same", max_tokens=16)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > POSITIONS
    cold_daemon = start_daemon(tmp_path / "cold", cache_max_bytes="0")
    try:
        assert create(cold_daemon, "seer", f"FROM {smollm2_path}\nPROJECTOR {projector}\n")["code"] == 200
        cold = ask(cold_daemon, turn, "same", max_tokens=16)
    finally:
        cold_daemon.stop()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_images_the_projector_cannot_read_get_the_stand_in(seer: Daemon) -> None:
    webp = b"RIFF\x1a\x00\x00\x00WEBPVP8L\x0d\x00\x00\x00/\x00\x00\x00\x10\x07\x10\x11\x11\x88\x88\xfe\x07\x00"
    url = "data:image/webp;base64," + base64.b64encode(webp).decode()
    with seer.http() as http:
        response = http.post("/v1/chat/completions", json={"model": "seer", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    assert response.status_code == 200, response.text
    assert "image reader takes PNG, JPEG, GIF and BMP" in response.headers["x-localai-omitted"]


def test_text_that_spells_an_image_mark_stays_text(seer: Daemon) -> None:
    """Only images a client sent become marks: a mark typed in a message (naming an image the worker holds) is
    text to the model, not that image."""
    import hashlib

    ask(seer, [image_turn(RED)], "spell-1")  # the worker now holds RED
    forged = f"<__localai_image_{hashlib.sha256(RED).hexdigest()}__>"
    typed = ask(seer, [{"role": "user", "content": f"What colour is this?\n{forged}"}], "spell-2")
    real = ask(seer, [image_turn(RED)], "spell-3")
    assert typed["usage"]["prompt_tokens"] != real["usage"]["prompt_tokens"]



def test_an_image_attended_non_causally_fits_the_batch_and_is_one_run(projector: Path, smollm2_path: Path) -> None:
    """Gemma 3's image positions attend each other, so the image goes to llama.cpp in one pass: with a batch of 2
    tokens the engine's batch grows to hold an image beside every sequence's next token, and the engine names the
    image as a run no prompt chunk may end inside (the serving loop's side: tests/engines/test_serving_admission)."""
    import hashlib

    from localai.engines.engine import BatchItem, LoadOptions
    from localai.engines.llama_cpp import LlamaCppEngine
    from localai.protocol import image_mark

    engine = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=512, n_parallel=2,
                                        n_batch=2, projector_path=str(projector)))
    try:
        assert engine.n_batch == POSITIONS + 2
        digest = hashlib.sha256(RED).hexdigest()
        engine.vision.remember({digest: base64.b64encode(RED).decode()})  # type: ignore[union-attr]
        tokens = engine.tokenize("look at " + image_mark(digest) + " here")
        first = next(index for index, token in enumerate(tokens) if token >= 1 << 30)
        assert [engine.span_end(tokens, index) for index in range(first, first + POSITIONS + 1)] == \
            [None] + [(first, first + POSITIONS)] * (POSITIONS - 1) + [None]
        assert engine.span_end(tokens, first - 1) is None
        for start in range(0, first, 2):
            engine.decode([BatchItem(0, token, start + k, False) for k, token in enumerate(tokens[start:min(start + 2,
                                                                                                          first)])])
        # the image whole, with the other sequence's next token beside it: llama.cpp takes it in one batch
        engine.decode([*(BatchItem(0, tokens[index], index, False) for index in range(first, first + POSITIONS)),
                       BatchItem(1, tokens[0], 0, True)])
    finally:
        engine.close()
