"""LoRA adapters through a real daemon on the llama fixture and its two random LoRAs (tests/archfixtures.py):
``ADAPTER path [scale]`` applies them as llama-server's ``--lora``/``--lora-scaled`` do, checked against
llama-cpp-python's own ``Llama(lora_path=...)``; the adapters are part of the model's load key and of its prompt
cache's fingerprint; files that are not a LoRA of this model are refused naming the line."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from localai.errors import ModelfileError
from localai.models.modelfile import anchored_adapters, split_adapter
from tests.archfixtures import write_lora
from tests.conftest import Daemon
from tests.engines.daemon.test_architectures import ask
from tests.parallel import threads

PROMPT = "Hello there, how are"


def complete(http: httpx.Client, model: str, prompt: str = PROMPT) -> tuple[str, dict[str, float]]:
    """A greedy completion's text and its first token's top-5 logprobs."""
    response = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "logprobs": 5})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"][0]


def llama_cpp_python(model: Path, lora: Path | None, prompt: str = PROMPT) -> tuple[str, dict[str, float]]:
    """The same completion from llama-cpp-python's own Llama (its lora_path applies one adapter at scale 1)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), lora_path=str(lora) if lora else None, n_ctx=2048, n_threads=threads(),
                          logits_all=True, verbose=False)
    try:
        out: Any = llm.create_completion(prompt, max_tokens=12, temperature=0, logprobs=5)
        choice = out["choices"][0]
        return choice["text"], choice["logprobs"]["top_logprobs"][0]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def adapted(daemon: Daemon, arch_fixtures: Path) -> Path:
    fixtures = arch_fixtures.resolve()
    modelfiles = {
        "lora-plain": "",
        "lora-a": f"ADAPTER {fixtures}/llama-lora-a.gguf\n",
        "lora-ab": f"ADAPTER {fixtures}/llama-lora-a.gguf 0.5\nADAPTER {fixtures}/llama-lora-b.gguf -0.25\n",
    }
    with daemon.http() as http:
        for name, extra in modelfiles.items():
            created = http.post("/api/create", json={"model": name,
                                                     "modelfile": f"FROM {fixtures}/llama.gguf\n{extra}"})
            assert created.status_code == 200, created.text
    return fixtures


def test_an_adapter_answers_as_llama_cpp_python_applies_it(daemon: Daemon, adapted: Path) -> None:
    with daemon.http(timeout=300) as http:
        plain, with_a, with_both = (complete(http, name) for name in ("lora-plain", "lora-a", "lora-ab"))
    for (text, top), (their_text, their_top) in ((plain, llama_cpp_python(adapted / "llama.gguf", None)),
                                                  (with_a, llama_cpp_python(adapted / "llama.gguf",
                                                                            adapted / "llama-lora-a.gguf"))):
        assert text == their_text
        assert top.keys() == their_top.keys()
        for token, value in their_top.items():
            assert top[token] == pytest.approx(value, abs=1e-4)
    assert with_a[0] != plain[0]  # the adapter changes the answer
    assert with_both[1] != with_a[1] and with_both[1] != plain[1]  # two scaled adapters: another model again


def test_the_modelfile_shows_the_adapters_with_their_scales(daemon: Daemon, adapted: Path) -> None:
    with daemon.http() as http:
        shown = http.post("/api/show", json={"model": "lora-ab"}).json()["modelfile"]
    assert f"ADAPTER {adapted}/llama-lora-a.gguf 0.5\n" in shown
    assert f"ADAPTER {adapted}/llama-lora-b.gguf -0.25\n" in shown


def test_sessions_with_and_without_an_adapter_keep_their_own_caches(daemon: Daemon, adapted: Path) -> None:
    """The same conversation and session key on the model with and without the adapter: each reuses only its own
    cache (another fingerprint), from the live sequence and from the disk after an unload, and answers as cold."""
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Say a word."}]
    cold_plain = ask(daemon, "lora-plain", messages, "lora-session")
    cold_a = ask(daemon, "lora-a", messages, "lora-session")
    assert cold_a["cached"] == 0  # nothing of the plain model's cache is served with the adapter
    assert cold_a["text"] != cold_plain["text"]
    with daemon.http() as http:
        for name in ("lora-plain", "lora-a"):
            http.post("/api/generate", json={"model": name, "keep_alive": 0})
    again_a = ask(daemon, "lora-a", messages, "lora-session")
    again_plain = ask(daemon, "lora-plain", messages, "lora-session")
    assert (again_a["text"], again_plain["text"]) == (cold_a["text"], cold_plain["text"])
    assert again_a["cached"] > 0 and again_plain["cached"] > 0
    assert again_a["source"] == again_plain["source"] == "disk"


@pytest.mark.parametrize(("line", "says"), [
    ("ADAPTER {fx}/nope.gguf", "no such file"),
    ("ADAPTER {fx}/llama.gguf", "not a LoRA adapter"),
    ("ADAPTER {fx}/reranker.gguf", "not a LoRA adapter"),
    ("ADAPTER {fx}", "a folder"),
    ("ADAPTER {fx}/llama-lora-a.gguf 1e9", "the scale must be a number"),
    ("ADAPTER {fx}/llama-lora-a.gguf nan", "the scale must be a number"),
])
def test_an_adapter_that_is_not_a_lora_of_this_model_is_refused_naming_the_line(
        daemon: Daemon, adapted: Path, line: str, says: str) -> None:
    line = line.format(fx=adapted)
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": "lora-bad", "modelfile": f"FROM {adapted}/llama.gguf\n"
                                                                                   f"{line}\n"})
    assert response.status_code == 400
    assert line in response.json()["error"] and says in response.json()["error"]


def test_a_lora_of_another_architecture_is_refused(daemon: Daemon, adapted: Path) -> None:
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": "lora-bad", "modelfile": f"FROM {adapted}/qwen3moe.gguf\n"
                                                  f"ADAPTER {adapted}/llama-lora-a.gguf\n"})
    assert response.status_code == 400 and "a LoRA for llama models" in response.json()["error"]


def test_per_request_scales_are_a_400_saying_why(daemon: Daemon, adapted: Path) -> None:
    with daemon.http() as http:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            response = http.post(path, json={"model": "lora-a", "lora": [{"id": 0, "scale": 0.5}], **body})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "lora" and "ADAPTER ./lora.gguf 0.5" in error["message"]


def test_an_adapter_gone_after_create_fails_the_load_clearly_and_others_are_served(
        daemon: Daemon, adapted: Path, tmp_path: Path) -> None:
    copy = tmp_path / "moved-lora.gguf"
    shutil.copy(adapted / "llama-lora-a.gguf", copy)
    with daemon.http(timeout=300) as http:
        created = http.post("/api/create", json={"model": "lora-moved",
                                                 "modelfile": f"FROM {adapted}/llama.gguf\nADAPTER {copy}\n"})
        assert created.status_code == 200, created.text
        copy.unlink()
        failed = http.post("/v1/completions", json={"model": "lora-moved", "prompt": PROMPT, "max_tokens": 2})
        assert failed.status_code >= 400
        assert "LoRA adapter" in failed.json()["error"]["message"] and str(copy) in failed.json()["error"]["message"]
        assert complete(http, "lora-a")[0]  # the daemon and the other models go on


def test_adapter_lines_split_and_anchor(tmp_path: Path) -> None:
    assert split_adapter("./a.gguf") == ("./a.gguf", 1.0)
    assert split_adapter("./a.gguf 0.5") == ("./a.gguf", 0.5)
    assert split_adapter("/x/my lora.gguf") == ("/x/my lora.gguf", 1.0)  # a space in a name, no number after it
    spaced = tmp_path / "lora 2"
    spaced.write_bytes(b"")
    assert split_adapter(str(spaced)) == (str(spaced), 1.0)  # a file whose name ends in a number stays whole
    with pytest.raises(ModelfileError, match="the scale must be"):
        split_adapter("./a.gguf inf")
    assert anchored_adapters(["./a.gguf", "./b.gguf -0.25", "/abs.gguf 2"], tmp_path) == [
        str(tmp_path / "a.gguf"), f"{tmp_path / 'b.gguf'} -0.25", "/abs.gguf 2"]


def test_an_adapter_on_an_mlx_model_is_refused_saying_so(daemon: Daemon, adapted: Path, mlx_model_path: Path) -> None:
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": "lora-mlx", "modelfile": f"FROM {mlx_model_path}\n"
                                                  f"ADAPTER {adapted}/llama-lora-a.gguf\n"})
    assert response.status_code == 400 and "MLX adapters are not supported yet" in response.json()["error"]


def test_a_lora_whose_tensors_do_not_fit_the_weights_is_refused_at_create(daemon: Daemon, adapted: Path,
                                                                         tmp_path: Path) -> None:
    """llama.cpp checks a LoRA's shapes only when the model loads (a 500 on the first request): localai checks them
    as it creates the model, naming the line and the tensor; the daemon's other models go on."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(adapted / "llama.gguf", "r")
    q = next(t for t in reader.tensors if t.name.endswith(".attn_q.weight"))
    rows, cols = q.data.shape  # numpy order: [out, in]
    zeros = np.zeros
    cases = {
        "rank": ({f"{q.name}.lora_a": zeros((4, cols), np.float32), f"{q.name}.lora_b": zeros((rows, 8), np.float32)},
                 f"its tensor {q.name} (A [{cols}, 4], B [8, {rows}]) does not fit"),
        "width": ({f"{q.name}.lora_a": zeros((4, cols + 64), np.float32),
                   f"{q.name}.lora_b": zeros((rows, 4), np.float32)}, "a LoRA made for another size"),
        "absent": ({"blk.99.attn_q.weight.lora_a": zeros((4, cols), np.float32),
                    "blk.99.attn_q.weight.lora_b": zeros((rows, 4), np.float32)},
                   "its tensor blk.99.attn_q.weight is not in the base model"),
        "half": ({f"{q.name}.lora_a": zeros((4, cols), np.float32)}, f"{q.name}.lora_a has no lora_b"),
    }
    with daemon.http() as http:
        for case, (tensors, says) in cases.items():
            lora = write_lora(tmp_path / f"{case}.gguf", "llama", tensors)
            response = http.post("/api/create", json={"model": f"lora-{case}",
                                                      "modelfile": f"FROM {adapted}/llama.gguf\nADAPTER {lora}\n"})
            assert response.status_code == 400, (case, response.text)
            assert f"ADAPTER {lora}" in response.json()["error"] and says in response.json()["error"], case
        fits = write_lora(tmp_path / "fits.gguf", "llama", {f"{q.name}.lora_a": zeros((4, cols), np.float32),
                                                   f"{q.name}.lora_b": zeros((rows, 4), np.float32)})
        created = http.post("/api/create", json={"model": "lora-fits",
                                                 "modelfile": f"FROM {adapted}/llama.gguf\nADAPTER {fits}\n"})
        assert created.status_code == 200, created.text
        assert complete(http, "lora-fits")[0] == complete(http, "lora-plain")[0]  # a zero delta changes nothing
