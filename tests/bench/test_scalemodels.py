"""The real-shaped models' writer (tests/scalemodels.py), checked on small instances of every family but Gemma
(whose real 262k-token vocabulary makes even a small instance 150 MB): llama.cpp loads each file and replies its
known chain, and so does the daemon in every dialect. ``make fixtures-scale`` writes the full-size files, which
``localai bench`` times; none of them is part of ``make test``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import pytest

from tests import scalemodels
from tests.conftest import Daemon, start_daemon
from tests.parallel import threads

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
    model = llama_cpp.Llama(str(path), n_ctx=512, n_threads=threads(), verbose=False)
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


@pytest.mark.parametrize("name", ["qwen3.5-hybrid", "qwen3.5-moe"])
def test_an_mtp_block_drafts_the_chain_on_the_chosen_fraction(name: str, tmp_path: Path,
                                                              sources: dict[str, Path]) -> None:
    """The MTP variant: one nextn block after the model's (metadata and tensors as llama.cpp's qwen35 loader
    reads them), the model's own reply unchanged (llama.cpp does not run the block in the main pass), and the
    block's greedy draft, computed from the file's tensors as llama.cpp's MTP graph does with the block quiet
    (its token embedding, normed, through eh_proj's identity half, then the shared head), the chain's successor
    on the chosen fraction of tokens and the one after it on the rest."""
    scale = scalemodels.with_mtp(scalemodels.small(scalemodels.BY_NAME[name]), 0.75)
    assert scale.name == f"{name}-small-mtp75"
    path = scalemodels.write(scale, "q4_k", tmp_path / "mtp.gguf", sources)
    reader = gguf.GGUFReader(path)
    arch = scale.arch
    assert reader.get_field(f"{arch}.nextn_predict_layers").contents() == 1
    assert reader.get_field(f"{arch}.block_count").contents() == len(scale.layers) + 1
    tensors = {t.name: t for t in reader.tensors}
    nextn = f"blk.{len(scale.layers)}.nextn."
    assert {nextn + part for part in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "embed_tokens.weight")} \
        <= tensors.keys()

    model = llama_cpp.Llama(str(path), n_ctx=512, n_threads=threads(), verbose=False)
    assert llama_cpp.llama_model_n_layer_nextn(model.model) == 1
    vocab = scalemodels.vocabulary(scale, sources)
    prompt = model.tokenize(b"Read the log and find the first error", add_bos=False)
    reply = [token for token, _ in zip(model.generate(prompt, temp=0.0, top_k=1), range(N), strict=False)]
    assert reply == scalemodels.known_reply(vocab, prompt[-1], N)

    def matrix(tensor: Any) -> np.ndarray:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
            [int(d) for d in reversed(tensor.shape)])

    embed, head = matrix(tensors[nextn + "embed_tokens.weight"]), matrix(tensors["output.weight"])
    eh_proj = matrix(tensors[nextn + "eh_proj.weight"])
    order = scalemodels.chain(vocab)
    # a fixed sample of the chain's positions (the whole chain times the whole vocabulary is ~20 GB of logits)
    sample = np.random.default_rng(1).choice(len(order), size=min(len(order), 3000), replace=False)
    tokens = order[sample]
    normed = embed[tokens] / np.sqrt((embed[tokens] ** 2).mean(axis=1, keepdims=True))
    hidden = np.concatenate([normed, np.random.default_rng(0).standard_normal(normed.shape)], axis=1) @ eh_proj.T
    drafts = np.concatenate([(rows @ head.T).argmax(axis=1) for rows in np.array_split(hidden, 6)])
    successor, after = np.roll(order, -1)[sample], np.roll(order, -2)[sample]
    agreed = drafts == successor
    assert np.all(agreed | (drafts == after))
    assert abs(agreed.mean() - 0.75) < 0.05, agreed.mean()
    assert np.array_equal(~agreed, scalemodels.mtp_misses(scale, len(order))[sample])
    draft = scalemodels.mtp_drafter(vocab, scale)
    assert [draft(int(t)) for t in tokens[:50]] == list(drafts[:50])
    with pytest.raises(ValueError, match="no MTP block for qwen3"):
        scalemodels.with_mtp(scalemodels.BY_NAME["qwen3-1.7b"], 0.5)
    with pytest.raises(ValueError, match="give a fraction"):
        scalemodels.with_mtp(scalemodels.BY_NAME[name], 1.5)
