"""Issue 48's comparisons with llama.cpp's own server on the same files (not a test: run by hand, figures for notes).

``make llama-server fixtures``, then ``python -m tests.bench.anchors logprobs|rerank|lora``:
- logprobs: a greedy smollm2 chat reply's tokens and top-5 logprobs, localai (flash attention off, its default)
  beside llama-server with ``-fa off`` and ``-fa on``; localai streamed beside not streamed.
- rerank: 100 documents in one request to the reranker fixture, beside llama-server ``--reranking`` with 1 and 4
  slots (its own two runs differ: see the output).
- lora: the llama fixture plain, with one LoRA and with two scaled ones, beside llama-server ``--lora`` /
  ``--lora-scaled``: greedy text and the first token's top-5 logprobs.
Each starts a localai daemon of its own (a temporary home) and llama-server on a free port.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from localai.models.registry import resolve_weights
from tests.archfixtures import fixtures_dir
from tests.conftest import SMOLLM2, free_port, start_daemon

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / ".bench" / "llama.cpp" / "build" / "bin" / "llama-server"


@contextmanager
def llama_server(*args: str) -> Iterator[str]:
    """llama-server on a free port with ``args``; its base URL once healthy."""
    if not SERVER.exists():
        raise SystemExit(f"no {SERVER}: run `make llama-server`")
    port = free_port()
    process = subprocess.Popen([str(SERVER), "--port", str(port), "-t", "2", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait()


@contextmanager
def localai() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as home:
        daemon = start_daemon(Path(home) / "home")
        try:
            yield daemon.base_url
        finally:
            daemon.stop()


def create(base: str, name: str, modelfile: str) -> None:
    response = httpx.post(f"{base}/api/create", json={"model": name, "modelfile": modelfile}, timeout=300)
    response.raise_for_status()


def top(entry: dict[str, Any]) -> dict[str, float]:
    return {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Tokens in common from the start, top-5 order equal, the largest logprob difference over the common tokens."""
    common = 0
    while common < min(len(ours), len(theirs)) and ours[common]["token"] == theirs[common]["token"]:
        common += 1
    pairs = list(zip(ours[:common], theirs[:common], strict=True))
    order = sum([alt["token"] for alt in a["top_logprobs"]] == [alt["token"] for alt in b["top_logprobs"]]
                for a, b in pairs)
    diff = max((abs(value - top(b)[token]) for a, b in pairs for token, value in top(a).items() if token in top(b)),
               default=float("nan"))
    return (f"same greedy tokens {common}/{len(ours)}, top-5 order equal {order}/{common}, "
            f"max |logprob diff| {diff:.2e}")


# -- logprobs --------------------------------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Name three colours and say why the sky is blue."}],
        "max_tokens": 48, "temperature": 0, "repeat_penalty": 1.0, "logprobs": True, "top_logprobs": 5}


def chat_entries(base: str, model: str, *, stream: bool = False) -> list[dict[str, Any]]:
    body = {**CHAT, "model": model}
    if not stream:
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).json()
        return list(reply["choices"][0]["logprobs"]["content"])
    entries: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    entries += (choice.get("logprobs") or {}).get("content") or []
    return entries


def logprobs() -> None:
    theirs = {}
    for fa in ("off", "on"):
        with llama_server("-m", str(resolve_weights(SMOLLM2)), "-c", "4096", "-np", "1", "-fa", fa, "--jinja") as base:
            theirs[fa] = chat_entries(base, "x")
    with localai() as base:
        ours, streamed = chat_entries(base, "smollm2"), chat_entries(base, "smollm2", stream=True)
    for fa, entries in theirs.items():
        print(f"localai vs llama-server -fa {fa}: {compare(ours, entries)}")
    print(f"localai streamed vs not: {compare(streamed, ours)}")
    print(f"llama-server -fa off vs on: {compare(theirs['off'], theirs['on'])}")


# -- rerank ----------------------------------------------------------------------------------------------------------

def documents() -> list[str]:
    rng = random.Random(7)
    words = ["cat", "mat", "sat", "bread", "flour", "oven", "quantum", "gluon", "quark", "river", "bank", "money",
             "loan", "tree", "leaf", "code", "python", "rust"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) for _ in range(100)]


def ranked(base: str, model: str, docs: list[str]) -> tuple[dict[int, float], list[int], int, float]:
    body = {"model": model, "query": "how do I bake bread in an oven?", "documents": docs}
    httpx.post(f"{base}/v1/rerank", json={**body, "documents": ["warm up"]}, timeout=600)
    started = time.perf_counter()
    reply = httpx.post(f"{base}/v1/rerank", json=body, timeout=600).json()
    elapsed = time.perf_counter() - started
    scores = {r["index"]: r["relevance_score"] for r in reply["results"]}
    return scores, [r["index"] for r in reply["results"]], reply["usage"]["prompt_tokens"], elapsed


def rerank() -> None:
    docs = documents()
    for name in ("reranker", "reranker-bert"):  # Qwen3-Reranker's prompt form; a BERT cross-encoder's pair form
        model = fixtures_dir().resolve() / f"{name}.gguf"
        with localai() as base:
            create(base, name, f"FROM {model}\n")
            ours, order, tokens, elapsed = ranked(base, name, docs)
        print(f"{name}: localai: {len(ours)} results, {tokens} tokens, {elapsed:.2f} s; scores "
              f"{min(ours.values()):.3f}-{max(ours.values()):.3f}")
        runs = {}
        for slots in (1, 4):
            with llama_server("-m", str(model), "--reranking", "-c", str(2048 * slots), "-np", str(slots)) as base:
                runs[slots] = ranked(base, "x", docs)
            theirs, their_order, their_tokens, their_elapsed = runs[slots]
            diff = max(abs(theirs[i] - ours[i]) for i in ours)
            print(f"{name}: llama-server -np {slots}: {len(theirs)} results, {their_tokens} tokens, "
                  f"{their_elapsed:.2f} s; max |score diff| vs localai {diff:.2e}; same order {their_order == order}")
        print(f"{name}: llama-server -np 1 vs -np 4: max |score diff| "
              f"{max(abs(runs[1][0][i] - runs[4][0][i]) for i in ours):.2e}")


# -- lora ------------------------------------------------------------------------------------------------------------

PROMPTS = ["Hello there, how are", "def fib(n):", "The capital of France is"]


def first_tokens(base: str, model: str) -> list[tuple[str, dict[str, float]]]:
    answers = []
    for prompt in PROMPTS:
        reply = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                           "temperature": 0, "logprobs": 5}, timeout=300).json()
        choice = reply["choices"][0]
        logprobs = choice["logprobs"]
        if "content" in logprobs:  # llama-server: OpenAI chat's shape in completions too
            answers.append((choice["text"], top(logprobs["content"][0])))
        else:
            answers.append((choice["text"], dict(logprobs["top_logprobs"][0])))
    return answers


def lora() -> None:
    fixtures = fixtures_dir().resolve()
    a, b = fixtures / "llama-lora-a.gguf", fixtures / "llama-lora-b.gguf"
    cases = {"plain": ([], ""), "a": (["--lora", str(a)], f"ADAPTER {a}\n"),
             "a 0.5 + b -0.25": (["--lora-scaled", f"{a}:0.5", "--lora-scaled", f"{b}:-0.25"],
                                 f"ADAPTER {a} 0.5\nADAPTER {b} -0.25\n")}
    ours = {}
    with localai() as base:
        for index, (case, (_, extra)) in enumerate(cases.items()):
            create(base, f"lora-{index}", f"FROM {fixtures / 'llama.gguf'}\n{extra}")
            ours[case] = first_tokens(base, f"lora-{index}")
    for case, (flags, _) in cases.items():
        theirs = {}
        for fa in ("off", "on"):
            with llama_server("-m", str(fixtures / "llama.gguf"), "-c", "4096", "-np", "1", "-fa", fa,
                              *flags) as base:
                theirs[fa] = first_tokens(base, "x")
            same = sum(t[0] == o[0] for t, o in zip(theirs[fa], ours[case], strict=True))
            diff = max(abs(value - o[1].get(token, float("nan"))) for t, o in zip(theirs[fa], ours[case], strict=True)
                       for token, value in t[1].items())
            print(f"{case:16} vs llama-server -fa {fa:3}: greedy text equal {same}/{len(PROMPTS)}; first token "
                  f"top-5 max |logprob diff| {diff:.2e}")
        fa_diff = max(abs(value - o[1].get(token, float("nan")))
                      for t, o in zip(theirs["on"], theirs["off"], strict=True) for token, value in t[1].items())
        print(f"{case:16} llama-server -fa on vs off: first token max |diff| {fa_diff:.2e}")
    changed = sum(x[0] != y[0] for x, y in zip(ours["a"], ours["plain"], strict=True))
    print(f"localai with vs without the adapter: greedy text differs on {changed} of {len(PROMPTS)}")


if __name__ == "__main__":
    {"logprobs": logprobs, "rerank": rerank, "lora": lora}[sys.argv[1]]()
