"""The client tier: real client libraries against a real daemon, as their users run them
(tests/api/daemon/clients/drive.py, drive.mjs). Each client runs in its own process from its own install (``make
install-clients``: .clients/python, .clients/llama-index, tests/api/daemon/clients/node/node_modules), so none of
them shares localai's test dependencies; each cell of the matrix (client x check) is one test, and the whole matrix
is written to ``$LOCALAI_HOME``'s parent as ``client-matrix.md`` (and printed with ``-s``).

A missing install fails these tests (``make test`` installs the clients); ``LOCALAI_SKIP_CLIENTS=1`` skips them on
purpose.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMOLLM2, Daemon, start_daemon

HERE = Path(__file__).parent
ROOT = HERE.parents[3]
CHECKS = ("models", "plain", "stream", "tools", "structured", "embed", "image", "logprobs", "rerank")
PYTHON = ROOT / ".clients" / "python" / "bin" / "python"
LLAMA_INDEX = ROOT / ".clients" / "llama-index" / "bin" / "python"
CLIENTS: dict[str, list[str]] = {
    "langchain-openai": [str(PYTHON), str(HERE / "drive.py")],
    "langchain-ollama": [str(PYTHON), str(HERE / "drive.py")],
    "langchain-anthropic": [str(PYTHON), str(HERE / "drive.py")],
    "openai-agents-http": [str(PYTHON), str(HERE / "drive.py")],
    "openai-agents-websocket": [str(PYTHON), str(HERE / "drive.py")],
    "pydantic-ai": [str(PYTHON), str(HERE / "drive.py")],
    "litellm": [str(PYTHON), str(HERE / "drive.py")],
    "langchain-cohere": [str(PYTHON), str(HERE / "drive.py")],
    "llama-index": [str(LLAMA_INDEX), str(HERE / "drive.py")],
    "llm-cli": [str(PYTHON), str(HERE / "drive.py")],
    "npm-openai": ["node", str(HERE / "node" / "drive.mjs")],
    "npm-ollama": ["node", str(HERE / "node" / "drive.mjs")],
}
# What a client has no way to do (no model listing in the SDK, no embeddings API): null in the matrix, by design
NOT_OFFERED = {("openai-agents-http", "models"), ("openai-agents-websocket", "models"), ("pydantic-ai", "models"),
               ("litellm", "models"), ("llama-index", "models"), ("langchain-anthropic", "embed"),
               ("openai-agents-http", "embed"), ("openai-agents-websocket", "embed")}
# Rerank: LangChain's CohereRerank (langchain-cohere) and litellm's rerank speak it; the others have no rerank API.
# langchain-cohere is in the matrix for its reranker only (Cohere's own chat and embed APIs are not served).
NOT_OFFERED |= {(client, "rerank") for client in CLIENTS if client not in ("langchain-cohere", "litellm")}
NOT_OFFERED |= {("langchain-cohere", check) for check in CHECKS if check != "rerank"}

# Driven by no check yet: each may have a way (pydantic-ai's and llama-index's OpenAI settings, the openai-agents
# ModelSettings' top_logprobs), not tried; LangChain's Anthropic, Ollama (its Python client), and the llm CLI show none
NOT_DRIVEN = {(client, "logprobs") for client in ("langchain-ollama", "langchain-anthropic", "openai-agents-http",
                                                   "openai-agents-websocket", "pydantic-ai", "llama-index", "llm-cli")}

pytestmark = pytest.mark.skipif(os.environ.get("LOCALAI_SKIP_CLIENTS") == "1", reason="LOCALAI_SKIP_CLIENTS=1")


@pytest.fixture(scope="module")
def client_daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path,
                  arch_fixtures: Path) -> Iterator[Daemon]:
    """A daemon serving smollm2, ``agent`` (the scripted engine on smollm2's weights and template, so every
    client's tool round trip is the same call and answer), smollm2 under ``text-embedding-3-small`` (the
    ``llm`` CLI embeds with OpenAI's model names), and the reranker fixture as ``reranker``."""
    daemon = start_daemon(tmp_path_factory.mktemp("clients"), keep_alive="-1")
    try:
        with daemon.http() as http:
            created = http.post("/api/create", json={"model": "agent",
                                                     "modelfile": f"FROM {SMOLLM2}\nPARAMETER engine scripted\n"})
            assert created.status_code == 200, created.text
            copied = http.post("/api/copy", json={"source": "smollm2", "destination": "text-embedding-3-small"})
            assert copied.status_code == 200, copied.text
            reranker = http.post("/api/create", json={"model": "reranker", "modelfile":
                                                      f"FROM {(arch_fixtures / 'reranker.gguf').resolve()}\n"})
            assert reranker.status_code == 200, reranker.text
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def matrix(client_daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every client's outcomes, run lazily (a client runs once, when its first cell is asked for)."""
    found: dict[str, Any] = {}
    yield found
    if found:
        table = render(found)
        path = tmp_path_factory.getbasetemp() / "client-matrix.md"
        path.write_text(table)
        print(f"\nclient matrix ({path}):\n{table}")


def outcomes(client: str, matrix: dict[str, Any], daemon: Daemon) -> dict[str, Any]:
    if client not in matrix:
        command = CLIENTS[client]
        if command[0] != "node" and not Path(command[0]).exists():
            pytest.fail(f"{client} is not installed at {command[0]}: run `make install-clients`")
        if command[0] == "node" and not (HERE / "node" / "node_modules").exists():
            pytest.fail(f"{client} is not installed in tests/api/daemon/clients/node/node_modules: "
                        "run `make install-clients`")
        done = subprocess.run([*command, client, daemon.base_url], capture_output=True, text=True, timeout=900,
                              cwd=ROOT, env={k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")})
        if done.returncode != 0:
            matrix[client] = {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
        else:
            matrix[client] = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(matrix[client])


def render(matrix: dict[str, Any]) -> str:
    """The matrix as a Markdown table: pass, FAIL, or a dash where the client offers no way to do the check."""
    lines = ["| client | " + " | ".join(CHECKS) + " |", "|---" * (len(CHECKS) + 1) + "|"]
    for client, found in matrix.items():
        cells = []
        for check in CHECKS:
            cell = found.get(check) if "error" not in found else {"ok": False}
            cells.append("-" if cell is None else "pass" if cell["ok"] else "FAIL")
        lines.append(f"| {client} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("client", list(CLIENTS))
def test_client(client: str, check: str, client_daemon: Daemon, matrix: dict[str, Any]) -> None:
    found = outcomes(client, matrix, client_daemon)
    assert "error" not in found, found.get("error")
    cell = found[check]
    if (client, check) in NOT_DRIVEN:
        assert cell is None, f"{client} now drives {check}: take it out of NOT_DRIVEN"
        pytest.skip(f"{client} {check}: not driven yet")
    if (client, check) in NOT_OFFERED:
        assert cell is None, f"{client} now offers {check}: drive it"
        return
    assert cell is not None, f"{client} does not drive {check}"
    assert cell["ok"], f"{client} {check}: {cell['detail']}\n{cell.get('trace', '')}"
