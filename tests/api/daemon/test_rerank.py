"""Rerank through the real daemon on the reranker fixture (llama.cpp's qwen3 model with Qwen3-Reranker's head and
prompt, random weights: tests/archfixtures.py). Each score is checked against the same math done apart: the last
token's hidden state from llama-cpp-python's own ``Llama`` (last-token pooling), times the head's weights read with
the ``gguf`` package, softmax over "yes"/"no"."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.archfixtures import RERANK_PROMPT
from tests.conftest import Daemon
from tests.parallel import threads

QUERY = "how do I bake bread in an oven?"
DOCUMENTS = ["Knead the dough, let it rise, then bake at 220 C for 30 minutes.", "Quarks are bound by gluons.",
             "The river bank was muddy after the rain.", "Preheat the oven; a loaf needs steam for its crust.",
             "def main(): print('hello')"]


def bert_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """A BERT cross-encoder's score for each pair, computed apart from localai: the pair as llama-server forms it
    for this vocabulary (``[CLS] query [SEP] [SEP] document [SEP]``), its first token's hidden state from a llama.cpp
    context of CLS pooling (llama-cpp-python's bindings), then the head read with ``gguf``: tanh(W h + b), w . + b."""
    import gguf
    import llama_cpp as L
    import numpy as np

    weights = {t.name: t.data.astype(np.float64) for t in gguf.GGUFReader(path).tensors if t.name.startswith("cls")}
    words = L.Llama(str(path), vocab_only=True, verbose=False)
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 512
    params.embeddings, params.pooling_type = True, L.LLAMA_POOLING_TYPE_CLS
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(512, 0, 1)
    n_embd = L.llama_model_n_embd(model)
    try:
        scores = []
        for document in documents:
            tokens = [2, *words.tokenize(query.encode(), add_bos=False), 3, 3,
                      *words.tokenize(document.encode(), add_bos=False), 3]
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            batch.n_tokens = len(tokens)
            for position, token in enumerate(tokens):
                batch.token[position], batch.pos[position], batch.n_seq_id[position] = token, position, 1
                batch.seq_id[position][0], batch.logits[position] = 0, True
            assert L.llama_decode(ctx, batch) == 0
            pointer = L.llama_get_embeddings_seq(ctx, 0)
            hidden = np.array([pointer[i] for i in range(n_embd)], dtype=np.float64)
            pooled = np.tanh(weights["cls.weight"] @ hidden + weights["cls.bias"])
            scores.append(float((weights["cls.output.weight"] @ pooled + weights["cls.output.bias"])[0]))
        return scores
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
        words.close()


@pytest.fixture(scope="module")
def reranker(daemon: Daemon, arch_fixtures: Path) -> str:
    path = (arch_fixtures / "reranker.gguf").resolve()
    with daemon.http() as http:
        response = http.post("/api/create", json={"model": "test-reranker", "modelfile": f"FROM {path}\n"})
    assert response.status_code == 200, response.text
    return "test-reranker"


def expected_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """P(yes) for each document, computed apart from localai: llama-cpp-python's Llama reads the last token's
    hidden state (last-token pooling) of Qwen3-Reranker's prompt; the head's two rows come from the file."""
    import gguf
    import llama_cpp
    import numpy as np

    head = next(t for t in gguf.GGUFReader(path).tensors if t.name == "cls.output.weight").data.astype(np.float64)
    model = llama_cpp.Llama(str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST, n_ctx=2048,
                            n_threads=threads(), verbose=False)
    try:
        scores = []
        for document in documents:
            hidden = np.array(model.embed(RERANK_PROMPT.replace("{query}", query).replace("{document}", document)),
                              dtype=np.float64)
            logits = head @ hidden
            scores.append(float(1 / (1 + math.exp(logits[1] - logits[0]))))  # softmax over two: P(yes)
        return scores
    finally:
        model.close()


def rerank(http: httpx.Client, path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    return http.post(path, json={"model": "test-reranker", "query": QUERY, "documents": DOCUMENTS, **body})


def test_scores_are_the_rerankers_head_on_each_pair_sorted_best_first(daemon: Daemon, reranker: str,
                                                                       arch_fixtures: Path) -> None:
    with daemon.http() as http:
        response = rerank(http)
        assert response.status_code == 200, response.text
        body = response.json()
        show = http.post("/api/show", json={"model": reranker}).json()
    assert show["capabilities"] == ["rerank"]
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    expected = expected_scores(arch_fixtures / "reranker.gguf", QUERY, DOCUMENTS)
    assert len(set(round(score, 3) for score in expected)) == len(DOCUMENTS)  # the fixture's scores differ
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4), result
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(DOCUMENTS) * 20
    assert body["model"] == "test-reranker" and body["object"] == "list"


def test_a_bert_cross_encoder_scores_its_pairs_as_llama_server_forms_them(daemon: Daemon,
                                                                           arch_fixtures: Path) -> None:
    """The bge-reranker/jina kind: no rerank prompt, a non-causal encoder read at its first token. Nine documents
    (more than one batch's worth for a causal model: a non-causal one scores each pair alone)."""
    path = (arch_fixtures / "reranker-bert.gguf").resolve()
    documents = DOCUMENTS + [d.upper() for d in DOCUMENTS[:4]]
    with daemon.http() as http:
        assert http.post("/api/create", json={"model": "test-bert-reranker",
                                              "modelfile": f"FROM {path}\n"}).status_code == 200
        response = http.post("/v1/rerank", json={"model": "test-bert-reranker", "query": QUERY,
                                                 "documents": documents})
    assert response.status_code == 200, response.text
    expected = bert_scores(path, QUERY, documents)
    assert len(set(round(score, 2) for score in expected)) > 3  # the fixture's scores differ
    results = response.json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(documents)), key=lambda i: -expected[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4), result


def test_cohere_jina_and_tei_shapes_and_the_aliases_agree(daemon: Daemon, reranker: str) -> None:
    with daemon.http() as http:
        plain = rerank(http).json()["results"]
        objects = http.post("/v2/rerank", json={"model": reranker, "query": QUERY, "top_n": 2,
                                                "return_documents": True,
                                                "documents": [{"text": d, "title": "x"} for d in DOCUMENTS]})
        assert objects.status_code == 200, objects.text
        assert objects.json()["results"] == [{**r, "document": {"text": DOCUMENTS[r["index"]]}} for r in plain[:2]]
        for alias in ("/rerank", "/v1/reranking", "/reranking"):
            assert rerank(http, alias).json()["results"] == plain, alias
        tei = http.post("/rerank", json={"model": reranker, "query": QUERY, "texts": DOCUMENTS, "return_text": True})
        assert tei.status_code == 200, tei.text
        assert tei.json() == [{"index": r["index"], "score": r["relevance_score"], "text": DOCUMENTS[r["index"]]}
                              for r in plain]


def test_a_hundred_documents_in_one_request_score_as_each_alone(daemon: Daemon, reranker: str) -> None:
    """100 documents go through the rerank context in batches of several pairs; each scores as when sent alone."""
    documents = [" ".join(DOCUMENTS[(i + j) % len(DOCUMENTS)] for j in range(i % 4 + 1)) + f" ({i})"
                 for i in range(100)]
    with daemon.http(timeout=300) as http:
        response = http.post("/v1/rerank", json={"model": reranker, "query": QUERY, "documents": documents})
        assert response.status_code == 200, response.text
        together = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
        assert len(together) == 100
        for index in (0, 37, 99):
            alone = http.post("/v1/rerank", json={"model": reranker, "query": QUERY, "documents": [documents[index]]})
            assert alone.json()["results"][0]["relevance_score"] == pytest.approx(together[index], abs=1e-5)


def test_a_long_document_is_cut_to_fit_or_refused(daemon: Daemon, reranker: str) -> None:
    long = "bread " * 6000  # over the rerank context
    with daemon.http() as http:
        cut = http.post("/v1/rerank", json={"model": reranker, "query": QUERY, "documents": [long, "short"]})
        assert cut.status_code == 200, cut.text
        refused = http.post("/v1/rerank", json={"model": reranker, "query": QUERY, "documents": ["short", long],
                                                "truncate": False})
    assert refused.status_code == 400
    assert "document 1" in refused.json()["error"]["message"] and refused.json()["error"]["param"] == "documents"


@pytest.mark.parametrize(("body", "param"), [
    ({"documents": []}, "documents"),
    ({"documents": None}, "documents"),
    ({"texts": []}, "texts"),
    ({"top_n": 0}, "top_n"),
    ({"top_n": "two"}, "top_n"),
    ({"query": ""}, "query"),
    ({"query": None}, "query"),
    ({"documents": [3]}, "documents.0"),
    ({"documents": [{"title": "no text"}]}, "documents.0"),
    ({"documents": ["x"] * 1001}, "documents"),
])
def test_malformed_requests_are_400s_naming_the_field(daemon: Daemon, reranker: str, body: dict[str, Any],
                                                      param: str) -> None:
    request = {"model": reranker, "query": QUERY, "documents": DOCUMENTS, **body}
    request = {key: value for key, value in request.items() if value is not None}
    with daemon.http() as http:
        response = http.post("/v1/rerank", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_a_chat_model_asked_to_rerank_names_a_reranker_and_a_reranker_asked_to_chat_says_so(
        daemon: Daemon, reranker: str) -> None:
    with daemon.http() as http:
        refused = http.post("/v1/rerank", json={"model": "smollm2", "query": QUERY, "documents": DOCUMENTS})
        assert refused.status_code == 400
        assert "not a reranker" in refused.json()["error"]["message"]
        assert "localai pull bge-reranker-v2-m3:568m" in refused.json()["error"]["message"]
        chat = http.post("/v1/chat/completions", json={"model": reranker,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "is a reranker" in chat.json()["error"]["message"]
        ollama = http.post("/api/chat", json={"model": reranker, "messages": [{"role": "user", "content": "hi"}]})
        assert ollama.status_code == 400
        assert http.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}).status_code == 404


def test_localai_show_says_rerank(daemon: Daemon, reranker: str) -> None:
    shown = daemon.cli("show", reranker)
    assert shown.returncode == 0, shown.stderr
    assert "capabilities    rerank" in shown.stdout and "tool calls" not in shown.stdout


def test_a_worker_that_dies_is_reloaded_and_scores_the_same(daemon: Daemon, reranker: str) -> None:
    with daemon.http() as http:
        before = rerank(http).json()["results"]
        pid = next(m["pid"] for m in http.get("/api/ps").json()["models"] if m["name"].startswith(reranker))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(m.get("pid") == pid for m in http.get("/api/ps").json()["models"]) and time.monotonic() < deadline:
            time.sleep(0.1)  # the daemon notices the worker gone (bounded), not an ordering assumption
        after = rerank(http)
    assert after.status_code == 200, after.text
    assert after.json()["results"] == before
