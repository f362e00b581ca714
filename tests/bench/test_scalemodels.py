"""The real-shaped models' writer (tests/scalemodels.py), checked on small instances of every family but Gemma
(whose real 262k-token vocabulary makes even a small instance 150 MB): llama.cpp loads each file and replies its
known chain, and so does the daemon in every dialect. ``make fixtures-scale`` writes the full-size files, which
``localai bench`` times; none of them is part of ``make test``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import pytest

from tests import scalemodels
from tests.conftest import Daemon, start_daemon

FAMILIES = [s.name for s in scalemodels.SCALES if s.tokenizer == "smollm2"]
N = 6  # reply tokens asked for


@pytest.fixture(scope="session")
def sources(smollm2_path: Path) -> dict[str, Path]:
    return {"smollm2": smollm2_path}


@pytest.fixture(scope="session")
def small_files(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> dict[str, Path]:
    """Each family's small instance, quantized as the Q4_K_M-like mix (Q4_K, Q6_K, Q5_0, Q8_0 and MXFP4 meet)."""
    out = tmp_path_factory.mktemp("scale")
    return {name: scalemodels.write(scalemodels.small(scalemodels.BY_NAME[name]), "q4_k", out / f"{name}.gguf",
                                    sources) for name in FAMILIES}


# The last token of each template's generation prompt: ChatML's newline (off the chain: the reply starts it),
# Harmony's "assistant" (a word on it: the reply goes on from there).
PROMPT_ENDS = {"gpt-oss": b"assistant"}


def expected_text(path: Path, sources: dict[str, Path], name: str) -> str:
    vocab = scalemodels.vocabulary(scalemodels.small(scalemodels.BY_NAME[name]), sources)
    model = llama_cpp.Llama(str(path), n_ctx=256, verbose=False, vocab_only=True)
    last = model.tokenize(PROMPT_ENDS.get(name, b"\n"), add_bos=False, special=True)[-1]
    return model.detokenize(scalemodels.known_reply(vocab, last, N)).decode()


@pytest.mark.parametrize("name", FAMILIES)
def test_llama_cpp_loads_each_family_and_replies_its_known_chain(name: str, small_files: dict[str, Path],
                                                                 sources: dict[str, Path]) -> None:
    path = small_files[name]
    scale = scalemodels.small(scalemodels.BY_NAME[name])
    reader = gguf.GGUFReader(path)
    assert reader.get_field(gguf.Keys.General.ARCHITECTURE).contents() == scale.arch
    assert reader.get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE).contents().strip()
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes == {name: shape for name, shape, _ in scalemodels.tensors(
        scalemodels.replace(scale, vocab=shapes["token_embd.weight"][1]))}
    model = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, verbose=False)
    vocab = scalemodels.vocabulary(scale, sources)
    for text in (b"Read the log and find the first error", b"def main():\n    return 0\n"):
        prompt = model.tokenize(text, add_bos=False)
        reply = []
        for token in model.generate(prompt, temp=0.0, top_k=1):
            reply.append(token)
            if len(reply) == N:
                break
        assert reply == scalemodels.known_reply(vocab, prompt[-1], N), (name, text)


def replies(daemon: Daemon, model: str) -> dict[str, str]:
    """The reply's text (reasoning and answer together, as the template splits them) in each dialect."""
    messages = [{"role": "user", "content": "Read the log and find the first error."}]
    found: dict[str, str] = {}
    with daemon.http(timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": N,
                                                       "temperature": 0}).json()
        message = chat["choices"][0]["message"]
        found["openai"] = (message.get("reasoning_content") or "") + (message.get("content") or "")
        anthropic = http.post("/v1/messages", json={"model": model, "messages": messages, "max_tokens": N,
                                                    "temperature": 0}).json()
        found["anthropic"] = "".join(block.get("thinking") or block.get("text") or ""
                                     for block in anthropic["content"])
        responses = http.post("/v1/responses", json={"model": model, "input": messages, "max_output_tokens": N,
                                                     "temperature": 0}).json()
        found["responses"] = "".join(part.get("text", "") for item in responses["output"]
                                     for part in item.get("content", []) + item.get("summary", []))
        ollama = http.post("/api/chat", json={"model": model, "messages": messages, "stream": False,
                                              "options": {"num_predict": N, "temperature": 0}}).json()
        found["ollama"] = (ollama["message"].get("thinking") or "") + ollama["message"]["content"]
    return found


def test_the_daemon_replies_each_familys_known_chain_in_every_dialect(tmp_path: Path, small_files: dict[str, Path],
                                                                       sources: dict[str, Path]) -> None:
    with start_daemon(tmp_path / "home") as daemon, daemon.http() as http:
        for name, path in small_files.items():
            created = http.post("/api/create", json={"model": name, "modelfile": f"FROM {path}\n"})
            assert created.status_code == 200, created.text
            expected = expected_text(path, sources, name)
            assert len(expected) > N
            assert replies(daemon, name) == dict.fromkeys(("openai", "anthropic", "responses", "ollama"),
                                                          expected), name


def test_a_vocabulary_larger_than_the_family_is_refused(sources: dict[str, Path]) -> None:
    too_small = scalemodels.replace(scalemodels.BY_NAME["qwen3-1.7b"], vocab=1000)
    with pytest.raises(ValueError, match="49158 tokens, more than 1000"):
        scalemodels.vocabulary(too_small, sources)


def test_a_write_that_fails_leaves_no_file(tmp_path: Path, sources: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed halfway (here: the third matrix's blocks raise), the writer leaves neither the file nor its
    temporary; an unknown quantization and an architecture with no layout are refused by name."""
    scale = scalemodels.small(scalemodels.BY_NAME["qwen3.5-hybrid"])
    calls = {"n": 0}
    real = scalemodels._blocks

    def failing(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("No space left on device")
        return real(*args)

    monkeypatch.setattr(scalemodels, "_blocks", failing)
    with pytest.raises(OSError, match="No space left"):
        scalemodels.write(scale, "q8_0", tmp_path / "cut.gguf", sources)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no quantization 'q2'"):
        scalemodels.write(scale, "q2", tmp_path / "q2.gguf", sources)
    with pytest.raises(ValueError, match="no layout for llama"):
        scalemodels.write(scalemodels.replace(scale, arch="llama"), "q8_0", tmp_path / "llama.gguf", sources)
    assert list(tmp_path.iterdir()) == []
