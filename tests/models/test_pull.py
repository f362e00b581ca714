"""``localai pull`` and ``POST /api/pull`` end to end: a real daemon pulling from a hub-compatible server."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from localai import paths
from localai.errors import HubUnreachable
from localai.models import hub, library
from localai.models import pull as pulling
from localai.models.loading import mlx_importable
from localai.models.modelfile import parse_file
from localai.settings import Settings
from tests.conftest import Daemon, start_daemon
from tests.hubserver import HubServer, split_gguf
from tests.media_files import png
from tests.mmproj import write_mmproj
from tests.observe import wait_for

MiB = 1 << 20
SMOL_REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_NAME = f"hf.co/{SMOL_REPO}:Q4_1"
SMOL_REGISTERED = SMOL_NAME.lower()


@pytest.fixture
def hub_server(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add(SMOL_REPO, {SMOL_FILE: smollm2_path, "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF not used",
                               "README.md": b"# SmolLM2 135M"})
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


@pytest.fixture
def puller(hub_server: HubServer, isolated_home: Path) -> Iterator[Daemon]:
    with start_daemon(isolated_home) as daemon:
        yield daemon


def blob_of(path: Path) -> Path:
    return paths.hf_hub_cache() / f"models--{SMOL_REPO.replace('/', '--')}" / "blobs" / _sha256(path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(MiB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def installed(daemon: Daemon) -> set[str]:
    with daemon.http() as http:
        return {model["name"] for model in http.get("/api/tags").json()["models"]}


def answer(daemon: Daemon, model: str) -> str:
    with daemon.http() as http:
        response = http.post("/api/generate", json={"model": model, "prompt": "Say hello.", "stream": False,
                                                    "options": {"num_predict": 8, "temperature": 0}})
    assert response.status_code == 200, response.text
    return str(response.json()["response"])


def pull_error(daemon: Daemon, name: str) -> tuple[int, str]:
    with daemon.http() as http:
        response = http.post("/api/pull", json={"model": name})
    return response.status_code, response.json()["error"]


def test_pull_by_quantization_then_answer(puller: Daemon, hub_server: HubServer, smollm2_path: Path) -> None:
    result = puller.cli("pull", f"hf.co/{SMOL_REPO.upper()}:q4_1")  # names and quantizations ignore case
    assert result.returncode == 0, result.stderr
    assert "pulling manifest" in result.stderr and "success" in result.stderr
    listed = puller.cli("list").stdout
    line = next(line for line in listed.splitlines() if line.startswith(SMOL_REGISTERED))
    assert "Q4_1" in line and "llama" in line and "8192" in line and "98.4 MB" in line
    with puller.http() as http:
        path = Path(http.post("/api/show", json={"model": SMOL_REGISTERED}).json()["path"])
    assert path.is_symlink() and path.resolve() == blob_of(smollm2_path)  # in the hub cache, never copied
    assert answer(puller, SMOL_REGISTERED).strip()
    (download,) = hub_server.downloads(SMOL_FILE)
    assert download.sent == smollm2_path.stat().st_size and download.range_start is None


def test_progress_events_through_the_ollama_client(puller: Daemon, hub_server: HubServer,
                                                   smollm2_path: Path) -> None:
    with ollama.Client(host=puller.base_url) as client:
        events = list(client.pull(f"{SMOL_REPO}:Q4_1", stream=True))
        statuses = [event.status for event in events]
        assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest",
                                                                       "success"]
        sha = _sha256(smollm2_path)
        progress = [event for event in events if event.total]
        assert {event.digest for event in progress} == {f"sha256:{sha}"}
        assert {event.status for event in progress} == {f"pulling {sha[:12]}"}
        completed = [event.completed for event in progress]
        assert completed == sorted(completed) and len(completed) > 2 and completed[-1] == progress[0].total
        assert progress[0].total == smollm2_path.stat().st_size
        assert f"{SMOL_REPO.lower()}:q4_1" in installed(puller)
        again = [event.status for event in client.pull(f"{SMOL_REPO}:Q4_1", stream=True)]
        assert again[-1] == "success" and "verifying sha256 digest" not in again  # already in the cache
        assert len(hub_server.downloads(SMOL_FILE)) == 1
        assert client.pull(SMOL_NAME, stream=False).status == "success"


def test_pull_a_library_model(puller: Daemon, hub_server: HubServer, smollm2_path: Path) -> None:
    # The hub stand-in serves smollm2's bytes as the library's qwen2.5-coder:1.5b file.
    hub_server.add("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", {
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": smollm2_path, "qwen2.5-coder-1.5b-instruct-q8_0.gguf": b"x",
    })
    result = puller.cli("pull", "qwen2.5-coder:1.5b")
    assert result.returncode == 0, result.stderr
    with puller.http() as http:
        shown = http.post("/api/show", json={"model": "qwen2.5-coder:1.5b"}).json()
    assert "num_ctx" not in shown["parameters"] and "repeat_penalty       1.05" in shown["parameters"]
    assert '"<|im_end|>"' in shown["parameters"]
    assert "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" in shown["path"]
    library = puller.cli("list", "--library").stdout
    row = next(line for line in library.splitlines() if line.startswith("qwen2.5-coder:1.5b "))
    assert "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M" in row and " yes " in row
    assert "qwen3:4b" in library and "llama3.2:1b" in library

    status, message = pull_error(puller, "qwen2.5-coder")
    assert status == 400 and "1.5b, 3b, 7b" in message and "localai pull qwen2.5-coder:1.5b" in message
    status, message = pull_error(puller, "qwen2.5-coder:99b")
    assert status == 404 and "1.5b, 3b, 7b" in message
    status, message = pull_error(puller, "gpt-9")
    assert status == 404 and "not in the library" in message and "llama3.2" in message and "hf.co/OWNER" in message

    before = len(hub_server.log)
    assert puller.cli("rm", "smollm2:135m").returncode == 0 and "smollm2:135m" not in installed(puller)
    result = puller.cli("pull", "smollm2:135m")  # the embedded model ships with localai: no request
    assert result.returncode == 0, result.stderr
    assert "smollm2:135m" in installed(puller) and len(hub_server.log) == before


def test_a_pull_fetches_the_repositorys_vision_projector(puller: Daemon, hub_server: HubServer, smollm2_path: Path,
                                                         tmp_path: Path) -> None:
    """A repository with an mmproj GGUF beside its model (as Gemma 3's, Qwen3.5's and Mistral Small's ship): the pull
    fetches the F16 projector with the weights, the model sees images, and /api/show says vision."""
    projector = write_mmproj(tmp_path / "mmproj.gguf")
    hub_server.add("test-org/Seer-GGUF", {"Seer.Q4_1.gguf": smollm2_path, "mmproj-Seer-F16.gguf": projector,
                                          "mmproj-Seer-Q8_0.gguf": b"not the one"})
    result = puller.cli("pull", "hf.co/test-org/Seer-GGUF:Q4_1")
    assert result.returncode == 0, result.stderr
    with puller.http() as http:
        shown = http.post("/api/show", json={"model": "hf.co/test-org/seer-gguf:q4_1"}).json()
        image = "data:image/png;base64," + base64.b64encode(png(8, 8)).decode()
        reply = http.post("/v1/chat/completions", json={
            "model": "hf.co/test-org/seer-gguf:q4_1", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": image}}]}]})
    assert "vision" in shown["capabilities"] and paths.hf_hub_cache() in Path(shown["projector"]).parents
    assert Path(shown["projector"]).read_bytes() == projector.read_bytes()
    assert len(hub_server.downloads("mmproj-Seer-F16.gguf")) == 1
    assert reply.status_code == 200 and "x-localai-omitted" not in reply.headers, reply.text
    assert hub_server.downloads("mmproj-Seer-Q8_0.gguf") == []


def test_pull_an_mlx_repository(puller: Daemon, hub_server: HubServer) -> None:
    config = {"model_type": "qwen2", "max_position_embeddings": 4096, "quantization": {"bits": 4, "group_size": 64}}
    hub_server.add("mlx-community/Tiny-Chat-4bit", {
        "config.json": json.dumps(config).encode(), "model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
        "tokenizer.json": b"{}", "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "README.md": b"# tiny", "modeling_tiny.py": b"print('never fetched')",
    }, tags=["mlx"])
    result = puller.cli("pull", "mlx-community/Tiny-Chat-4bit")
    assert result.returncode == 0, result.stderr
    row = next(line for line in puller.cli("list").stdout.splitlines() if line.startswith("mlx-community/"))
    assert "4bit" in row and "qwen2" in row and "4096" in row
    assert not hub_server.downloads("README.md") and not hub_server.downloads("modeling_tiny.py")
    with puller.http() as http:
        response = http.post("/api/chat", json={"model": "mlx-community/tiny-chat-4bit", "stream": False,
                                                "messages": [{"role": "user", "content": "hi"}]})
    if not mlx_importable():  # the engine is missing: a 400 naming the extra to install
        assert response.status_code == 400
        assert "MLX" in response.json()["error"] and "localai[mlx]" in response.json()["error"]
    else:  # the MLX engine runs, and these stand-in weights (an empty safetensors) are no model
        assert response.status_code == 500 and "could not load" in response.json()["error"], response.text
    with puller.http() as http:
        snapshot = Path(http.post("/api/show", json={"model": "mlx-community/tiny-chat-4bit"}).json()["path"])
    assert sorted(item.name for item in snapshot.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    (snapshot / "notes.txt").write_text("put here by another tool")
    assert puller.cli("rm", "mlx-community/tiny-chat-4bit").returncode == 0
    assert sorted(item.name for item in snapshot.iterdir()) == ["notes.txt"]


def test_split_gguf_is_pulled_whole_and_loads(puller: Daemon, hub_server: HubServer, smollm2_path: Path,
                                               tmp_path: Path) -> None:
    (tmp_path / "split").mkdir()
    parts = split_gguf(smollm2_path, tmp_path / "split" / "SmolLM2-135M-Instruct-Q4_1.gguf")
    assert len(parts) == 2
    hub_server.add("test-org/SmolLM2-Split-GGUF", {part.name: part for part in parts})
    with ollama.Client(host=puller.base_url) as client:
        events = list(client.pull("hf.co/test-org/SmolLM2-Split-GGUF:Q4_1", stream=True))
    assert len({event.digest for event in events if event.total}) == 2
    name = "hf.co/test-org/smollm2-split-gguf:q4_1"
    row = next(line for line in puller.cli("list").stdout.splitlines() if line.startswith(name))
    assert f"{sum(part.stat().st_size for part in parts) / 1e6:.1f} MB" in row
    assert answer(puller, name).strip()


def _partial(smollm2_path: Path) -> Path:
    blob = blob_of(smollm2_path)
    return blob.with_name(blob.name + ".incomplete")


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def test_a_killed_pull_resumes_without_fetching_the_finished_bytes(
    hub_server: HubServer, isolated_home: Path, smollm2_path: Path
) -> None:
    hub_server.file(SMOL_REPO, SMOL_FILE).stall_after = 30 * MiB
    first = start_daemon(isolated_home)
    with first:
        puller = subprocess.Popen([sys.executable, "-m", "localai", "pull", SMOL_NAME], env=first.env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _size(_partial(smollm2_path)) >= 30 * MiB, "30 MiB on disk")
        first.process.kill()  # the daemon dies mid-download
        first.process.wait()
        puller.wait(timeout=60)
    kept = _size(_partial(smollm2_path))
    hub_server.file(SMOL_REPO, SMOL_FILE).release.set()
    with start_daemon(isolated_home) as second:
        result = second.cli("pull", SMOL_NAME)
        assert result.returncode == 0, result.stderr
        assert SMOL_REGISTERED in installed(second)
    resumed = hub_server.downloads(SMOL_FILE)[-1]
    assert kept >= 30 * MiB and resumed.range_start == kept
    assert resumed.sent == smollm2_path.stat().st_size - kept
    assert blob_of(smollm2_path).is_file() and not _partial(smollm2_path).exists()


def test_ctrl_c_stops_the_pull_and_the_next_one_resumes(puller: Daemon, hub_server: HubServer,
                                                        smollm2_path: Path) -> None:
    served = hub_server.file(SMOL_REPO, SMOL_FILE)
    served.stall_after = 30 * MiB
    cli = subprocess.Popen([sys.executable, "-m", "localai", "pull", SMOL_NAME], env=puller.env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           # as from a terminal, even when this test runs where SIGINT is ignored (`make test &`)
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(lambda: _size(_partial(smollm2_path)) >= 30 * MiB, "30 MiB on disk")
    cli.send_signal(signal.SIGINT)
    _, stderr = cli.communicate(timeout=60)
    assert cli.returncode == 130 and "run `localai pull" in stderr and "again to resume" in stderr
    wait_for(lambda: "the client stopped pulling" in puller.log(), "the daemon to stop the download")
    served.release.set()
    assert SMOL_REGISTERED not in installed(puller)
    result = puller.cli("pull", SMOL_NAME)
    assert result.returncode == 0, result.stderr
    resumed = hub_server.downloads(SMOL_FILE)[-1]
    assert resumed.range_start is not None and resumed.range_start >= 30 * MiB
    assert resumed.sent == smollm2_path.stat().st_size - resumed.range_start
    assert SMOL_REGISTERED in installed(puller)


def test_a_corrupt_download_is_rejected(puller: Daemon, hub_server: HubServer, smollm2_path: Path) -> None:
    hub_server.file(SMOL_REPO, SMOL_FILE).served = b"\0" * smollm2_path.stat().st_size
    result = puller.cli("pull", SMOL_NAME)
    assert result.returncode == 1
    assert "corrupt" in result.stderr and "sha256" in result.stderr and "deleted" in result.stderr
    assert SMOL_REGISTERED not in installed(puller)
    assert not blob_of(smollm2_path).exists() and not _partial(smollm2_path).exists()


def test_missing_repositories_quantizations_and_bad_names(puller: Daemon, hub_server: HubServer) -> None:
    status, message = pull_error(puller, f"hf.co/{SMOL_REPO}:Q5_K_M")
    assert status == 404 and "no Q5_K_M" in message and "available: Q4_1, Q8_0" in message
    status, message = pull_error(puller, "hf.co/test-org/SmolLM2-GGUF:Q4_K_M")
    assert status == 404 and "not found" in message and SMOL_REPO in message  # a similar name is suggested
    status, message = pull_error(puller, "test-org/README-only")
    assert status == 404
    hub_server.add("test-org/Weights-Elsewhere", {"README.md": b"see elsewhere", "model.bin": b"x"})
    status, message = pull_error(puller, "test-org/Weights-Elsewhere")
    assert status == 404 and "neither GGUF files nor an MLX model" in message and "model.bin" in message
    for bad in ("a/b/c", "hf.co/x", "x/y:Q4 K", "   "):
        status, message = pull_error(puller, bad)
        assert status == 400, (bad, message)
    with puller.http() as http:
        assert http.post("/api/pull", json={}).status_code == 400
        assert http.post("/api/pull", content=b"{not json").status_code == 400
    result = puller.cli("pull", f"{SMOL_REPO}:Q5_K_M")
    assert result.returncode == 1 and "available: Q4_1, Q8_0" in result.stderr
    assert not hub_server.downloads(SMOL_FILE)


def test_not_enough_disk_space_fails_before_downloading(hub_server: HubServer, isolated_home: Path) -> None:
    with start_daemon(isolated_home, min_free_space=str(10**18)) as daemon:
        result = daemon.cli("pull", SMOL_NAME)
    assert result.returncode == 1 and "not enough disk space" in result.stderr
    assert "LOCALAI_MIN_FREE_SPACE" in result.stderr
    assert not [entry for entry in hub_server.log if "/resolve/" in entry.path]


def test_offline_pulls_register_from_the_cache_without_a_request(
    hub_server: HubServer, isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start_daemon(isolated_home) as online:
        assert online.cli("pull", SMOL_NAME).returncode == 0
    requests = len(hub_server.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with start_daemon(tmp_path / "second-home") as offline:
        result = offline.cli("pull", SMOL_NAME)
        assert result.returncode == 0, result.stderr
        assert SMOL_REGISTERED in installed(offline)
        status, message = pull_error(offline, "hf.co/test-org/Not-Cached-GGUF:Q4_K_M")
        assert status == 503 and "offline" in message and "not in the Hugging Face cache" in message
    assert len(hub_server.log) == requests


def test_without_network_a_cached_model_is_planned_from_the_cache(hub_server: HubServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    listing = hub.list_repo(SMOL_REPO)
    hub.fetch(listing, listing.files[SMOL_FILE])
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing answers: the lookup fails, the cache answers
    plan = pulling.plan(SMOL_NAME, Settings())
    assert plan.listing is None and not plan.files and plan.name == SMOL_REGISTERED
    with pytest.raises(HubUnreachable, match="not in the Hugging Face cache"):
        pulling.plan("hf.co/test-org/Other-GGUF", Settings())


def test_gated_repository_uses_the_clients_hf_token(puller: Daemon, hub_server: HubServer,
                                                    smollm2_path: Path) -> None:
    hub_server.add("test-org/Gated-GGUF", {"gated-Q4_K_M.gguf": smollm2_path}, gated=True)
    refused = puller.cli("pull", "hf.co/test-org/Gated-GGUF")
    assert refused.returncode == 1 and "gated" in refused.stderr and "HF_TOKEN" in refused.stderr
    env = {**puller.env, "HF_TOKEN": hub_server.token}  # the daemon was started without it
    allowed = subprocess.run([sys.executable, "-m", "localai", "pull", "hf.co/test-org/Gated-GGUF"], env=env,
                             capture_output=True, text=True, timeout=180)
    assert allowed.returncode == 0, allowed.stderr
    assert "hf.co/test-org/gated-gguf:latest" in installed(puller)


def test_rm_deletes_pulled_weights_once_no_model_uses_them(puller: Daemon, hub_server: HubServer,
                                                          smollm2_path: Path) -> None:
    assert puller.cli("pull", SMOL_NAME).returncode == 0
    assert puller.cli("cp", SMOL_REGISTERED, "twin").returncode == 0
    blob = blob_of(smollm2_path)
    assert puller.cli("rm", SMOL_REGISTERED).returncode == 0
    assert blob.is_file() and "twin:latest" in installed(puller)  # twin still uses them
    assert puller.cli("rm", "twin").returncode == 0
    assert not blob.exists() and not blob.parent.parent.exists()
    assert puller.cli("rm", "smollm2").returncode == 0 and smollm2_path.is_file()  # not ours to delete
    result = puller.cli("rm", "never-pulled")
    assert result.returncode == 1 and "not installed" in result.stderr


def test_concurrent_pulls_of_one_model_share_the_download(puller: Daemon, hub_server: HubServer) -> None:
    clis = [subprocess.Popen([sys.executable, "-m", "localai", "pull", SMOL_NAME], env=puller.env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for cli in clis:
        _, stderr = cli.communicate(timeout=180)
        assert cli.returncode == 0, stderr
    downloads = hub_server.downloads(SMOL_FILE)
    assert sum(download.sent for download in downloads) == os.path.getsize(
        Path(hub_server.file(SMOL_REPO, SMOL_FILE).content))  # type: ignore[arg-type]


def test_a_library_pull_takes_the_mlx_source_where_mlx_is_preferred(hub_server: HubServer, isolated_home: Path) -> None:
    """LOCALAI_ENGINE=mlx here stands for Apple Silicon (where it is the default): the library's TAG-mlx source
    is pulled and registered under the name asked for; the GGUF repository is never asked."""
    config = {"model_type": "qwen2", "max_position_embeddings": 32768, "quantization": {"bits": 4, "group_size": 64}}
    repo = library.resolve("qwen2.5-coder:1.5b-mlx")
    hub_server.add(parse_file(repo.path).from_.removeprefix("hf.co/"), {
        "config.json": json.dumps(config).encode(), "model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
        "tokenizer.json": b"{}", "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}'}, tags=["mlx"])
    with start_daemon(isolated_home, engine="mlx") as daemon:
        result = daemon.cli("pull", "qwen2.5-coder:1.5b")
        assert result.returncode == 0, result.stderr
        with daemon.http() as http:
            shown = http.post("/api/show", json={"model": "qwen2.5-coder:1.5b"}).json()
    assert shown["engine"] == "mlx" and shown["details"]["format"] == "mlx"
    assert not [entry for entry in hub_server.log if "GGUF" in entry.path]
