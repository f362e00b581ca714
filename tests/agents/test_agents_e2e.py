"""Real agents from npm and PyPI, run headless through ``localai launch`` against the real daemon and smollm2.

smollm2 is far too small for coding; the point is the whole wire path: launch configures the agent, the agent
speaks its own protocol to the daemon, and the model's reply comes back out of the agent. ``make
install-agents`` (a dependency of ``make test``) installs the pinned agents into ``.agents/``; a missing agent
fails these tests. ``LOCALAI_SKIP_AGENT_E2E=1`` skips them on purpose (e.g. on a machine without npm).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from localai.agents import get
from localai.bench.servers import LlamaCppPythonServer
from localai.engines.scripted import DEFAULT_REPLY
from tests.conftest import Daemon, start_daemon
from tests.metagguf import metadata_gguf
from tests.observe import reported_divergences
from tests.runtime.formats.test_formats_roundtrip import qwen3_coder

# `make agents-latest` runs these tests on the newest releases, installed beside the pinned ones
AGENTS_DIR = Path(__file__).resolve().parents[2] / (".agents-latest" if os.environ.get("LOCALAI_AGENTS_LATEST") == "1"
                                                   else ".agents")
PROMPT = "Reply with a short friendly greeting."

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # agents' first prompts are thousands of tokens, prefilled on a small CPU
    pytest.mark.skipif(os.environ.get("LOCALAI_SKIP_AGENT_E2E") == "1", reason="LOCALAI_SKIP_AGENT_E2E=1"),
]


@pytest.fixture(autouse=True)
def pinned_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALAI_AGENTS_DIR", str(AGENTS_DIR))


MODEL = "smollm2-agent"
# What every agent's model runs with (see agent_daemon): replies end at their first line.
ONE_LINE = {"stop": ["\n", "<|im_end|>", "<|im_start|>"], "temperature": 0, "repeat_penalty": 1.2}


@pytest.fixture(scope="module")
def agent_daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    """A daemon with the access log on (debug), so a test can see which endpoint served the agent.

    The agents get smollm2 with its replies ending at the end of their first line, and a repeat penalty: a 135M
    model can ramble until its output limit, and an agent takes a reply cut there as an error (Claude Code) or as
    a reason to go on (OpenCode loops). A blank line was not enough: on Claude Code's prompt, with its date
    varied over 30 days, greedy smollm2 wrote past 400 tokens in single-newline paragraphs on 15 of them, and CI
    once saw Claude Code give up after four replies cut at its 2048-token limit. With these settings the same 30
    prompts all ended by themselves, in 22 to 95 tokens. One line keeps every agent's run short whatever the
    model says."""
    instance = start_daemon(tmp_path_factory.mktemp("agent-daemon"), keep_alive="-1", debug="true",
                            context_length="8192")
    with instance.http() as http:
        created = http.post("/api/create", json={"model": MODEL, "from": "smollm2", "parameters": ONE_LINE})
        assert created.status_code == 200, created.text
    yield instance
    instance.stop()


def run_agent(daemon: Daemon, tmp_path: Path, agent: str, *args: str,
              model: str = MODEL) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``localai launch <agent> --model smollm2 --yes -- <args>`` in a fresh git repository and home;
    returns the result and what the daemon logged meanwhile."""
    integration = get(agent)
    program = integration.managed_path()
    if not program.exists():
        pytest.fail(f"{integration.title} is not installed at {program}: run `make install-agents`")
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    user = tmp_path / "user"
    user.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    # No LOCALAI_HOST: launch finds the daemon (on its random port) through LOCALAI_HOME, as a user's shell would.
    env.update({"HOME": str(user), "LOCALAI_HOME": str(daemon.home), "LOCALAI_AGENTS_DIR": str(AGENTS_DIR),
                "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
                "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"})
    logged = len(daemon.log())
    result = subprocess.run(
        [sys.executable, "-m", "localai", "launch", agent, "--model", model, "--yes", "--", *args],
        cwd=work, env=env, capture_output=True, text=True, timeout=840, stdin=subprocess.DEVNULL,
    )
    return result, daemon.log()[logged:]


def served(log: str, method_and_path: str) -> list[str]:
    """Access-log lines for requests the daemon answered with 200 on that route."""
    return [line for line in log.splitlines() if f'"{method_and_path}' in line and '" 200' in line]


def test_claude_code(agent_daemon: Daemon, tmp_path: Path) -> None:
    result, log = run_agent(agent_daemon, tmp_path, "claude", "-p", PROMPT, "--output-format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["is_error"] is False and reply["result"].strip()
    assert served(log, "POST /v1/messages"), log[-3000:]


def test_codex(agent_daemon: Daemon, tmp_path: Path) -> None:
    last_message = tmp_path / "last-message.txt"
    result, log = run_agent(agent_daemon, tmp_path, "codex", "exec", "--skip-git-repo-check", "--ephemeral",
                            "-o", str(last_message), PROMPT)
    assert result.returncode == 0, result.stdout + result.stderr
    reply = last_message.read_text().strip()
    assert reply and reply in result.stdout
    # Codex talks WebSocket mode (localai launch sets supports_websockets): no fallback to HTTPS was needed
    assert [line for line in log.splitlines() if '"WebSocket /v1/responses" [accepted]' in line], log[-3000:]
    assert not served(log, "POST /v1/responses"), log[-3000:]


def test_opencode(agent_daemon: Daemon, tmp_path: Path) -> None:
    result, log = run_agent(agent_daemon, tmp_path, "opencode", "run", "--format", "json", PROMPT)
    assert result.returncode == 0, result.stdout + result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    texts = [event["part"]["text"] for event in events if event.get("type") == "text"]
    assert "".join(texts).strip(), result.stdout
    assert served(log, "POST /v1/chat/completions"), log[-3000:]


AIDER_ARGS = ("--message", PROMPT, "--yes-always", "--no-auto-commits", "--no-pretty", "--no-gitignore",
              "--no-show-release-notes")


def check_aider(result: subprocess.CompletedProcess[str], log: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    tokens = re.search(r"Tokens: [\d.,k]+ sent, (\d+) received", result.stdout)
    assert tokens and int(tokens.group(1)) > 0, result.stdout
    last_line = result.stdout[:tokens.start()].rstrip().splitlines()[-1]  # the end of the model's reply
    assert last_line.strip() and not last_line.startswith(("Repo-map", "Git repo", "Model:")), result.stdout
    assert served(log, "POST /v1/chat/completions"), log[-3000:]


def test_aider(agent_daemon: Daemon, tmp_path: Path) -> None:
    check_aider(*run_agent(agent_daemon, tmp_path, "aider", *AIDER_ARGS))


def test_aider_on_the_mlx_engine(agent_daemon: Daemon, tmp_path: Path, mlx_model_path: Path) -> None:
    """The same launch on an MLX model (SmolLM2's weights converted; MLX's CPU backend): Aider's prompt is the
    shortest of the agents' (~600 tokens), which MLX on this CPU prefills in about half a minute. The model ends
    its reply at the first line, as the agents' smollm2 does (Aider's prompt carries the date too)."""
    with agent_daemon.http() as http:
        created = http.post("/api/create", json={"model": "smol-mlx-agent", "from": str(mlx_model_path),
                                                 "parameters": ONE_LINE})
        assert created.status_code == 200, created.text
        assert http.post("/api/show", json={"model": "smol-mlx-agent"}).json()["engine"] == "mlx"
    check_aider(*run_agent(agent_daemon, tmp_path, "aider", *AIDER_ARGS, model="smol-mlx-agent"))


def test_aider_through_a_remote_model(agent_daemon: Daemon, tmp_path: Path,
                                      llama_servers: list[LlamaCppPythonServer]) -> None:
    """``localai launch`` with a model that lives on two replicas of llama-cpp-python's own server: the agent
    neither knows nor cares; the daemon relays its requests to the replica that holds the session."""
    modelfile = (f"FROM {llama_servers[0].base_url}\nPARAMETER replica {llama_servers[1].base_url}\n"
                 "PARAMETER num_ctx 2048\nPARAMETER temperature 0\nPARAMETER stop \"<|im_end|>\"\n")
    with agent_daemon.http() as http:
        created = http.post("/api/create", json={"model": "smol-remote", "modelfile": modelfile})
        assert created.status_code == 200, created.text
    check_aider(*run_agent(agent_daemon, tmp_path, "aider", *AIDER_ARGS, model="smol-remote"))
    metrics = agent_daemon.get("/metrics").text
    assert re.search(r'localai_upstream_requests_total\{model="smol-remote:latest",outcome="ok",[^}]*\} [1-9]',
                     metrics), metrics[-2000:]


def test_claude_code_on_a_remote_model(agent_daemon: Daemon, tmp_path: Path) -> None:
    """``localai launch claude --model big`` where ``big`` is served by another localai over chat completions (here
    the daemon's own TCP port, so no second model is loaded): Claude Code speaks Anthropic Messages, which localai
    translates for the upstream, and it gets the upstream's context window."""
    with agent_daemon.http() as http:
        created = http.post("/api/create", json={"model": "big", "modelfile": (
            f"FROM {agent_daemon.base_url}/v1\nPARAMETER upstream_model {MODEL}\n")})
        assert created.status_code == 200, created.text
        shown = http.post("/api/show", json={"model": "big"}).json()
        assert shown["engine"] == "remote" and shown["num_ctx"] == 8192  # what the upstream says it serves
    result, log = run_agent(agent_daemon, tmp_path, "claude", "-p", PROMPT, "--output-format", "json", model="big")
    assert result.returncode == 0, result.stdout + result.stderr
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["is_error"] is False and reply["result"].strip()
    assert served(log, "POST /v1/messages") and served(log, "POST /v1/chat/completions"), log[-3000:]


# -- today's formats, with real agents: a scripted model speaks the family's format, the agent writes the file ------

GREET = 'def greet(name: str) -> str:\n    return f"<b>{name}</b> & \'co\'"  # <tool_call> in a string\n'


def scripted_model(daemon: Daemon, tmp_path: Path, name: str, parser: str, num_ctx: int = 131072) -> str:
    """A model whose replies come from the prompt's ``[[turns:...]]`` (the scripted engine), with a 262k-token
    trained context (a metadata-only GGUF: agents' prompts are long), the family's PARSER and a 128k window."""
    weights = metadata_gguf(tmp_path / f"{name}.gguf", arch="qwen3moe", context_length=262144)
    with daemon.http() as http:
        created = http.post("/api/create", json={"model": name, "modelfile": (
            f"FROM {weights}\nPARAMETER engine scripted\nPARSER {parser}\nPARAMETER num_ctx {num_ctx}\n")})
        assert created.status_code == 200, created.text
    return name


def test_claude_code_writes_a_file_a_qwen3_coder_model_called_for(agent_daemon: Daemon, tmp_path: Path) -> None:
    """The model answers with Claude Code's Write tool in Qwen3-Coder's XML; Claude Code gets a tool_use block,
    writes the file, sends the result back, and the model's second turn ends the run."""
    model = scripted_model(agent_daemon, tmp_path, "scripted-qwen3-coder", "qwen3-coder")
    target = tmp_path / "work" / "greet.py"
    call = qwen3_coder(("Write", {"file_path": str(target), "content": GREET}))
    prompt = f"Write greet.py. [[turns:{call}|||greet.py is written.]]"
    result, log = run_agent(agent_daemon, tmp_path, "claude", "-p", prompt, "--output-format", "json",
                            "--permission-mode", "acceptEdits", model=model)
    assert result.returncode == 0, result.stdout + result.stderr
    assert target.read_text() == GREET
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["is_error"] is False and "greet.py is written." in reply["result"]
    assert len(served(log, "POST /v1/messages")) >= 2, log[-3000:]


def test_codex_applies_a_patch_a_harmony_model_called_for(agent_daemon: Daemon, tmp_path: Path) -> None:
    """The model answers in gpt-oss's Harmony with Codex's exec_command running apply_patch; Codex applies the
    patch (its own patch tool, not a shell) and the file appears with exactly the patch's lines."""
    model = scripted_model(agent_daemon, tmp_path, "scripted-harmony", "harmony")
    patch = "*** Begin Patch\n*** Add File: greet.py\n" + "".join(f"+{line}\n" for line in GREET.splitlines()) \
        + "*** End Patch\n"
    arguments = json.dumps({"cmd": f"apply_patch <<'EOF'\n{patch}EOF\n", "workdir": str(tmp_path / "work")})
    call = ("<|channel|>analysis<|message|>Write the file with a patch.<|end|><|start|>assistant"
            f"<|channel|>commentary to=functions.exec_command <|constrain|>json<|message|>{arguments}<|call|>")
    final = "<|channel|>final<|message|>greet.py is written.<|return|>"
    last_message = tmp_path / "last-message.txt"
    result, log = run_agent(agent_daemon, tmp_path, "codex", "exec", "--skip-git-repo-check", "--ephemeral",
                            "--dangerously-bypass-approvals-and-sandbox", "-o", str(last_message),
                            f"Add greet.py. [[turns:{call}|||{final}]]", model=model)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "work" / "greet.py").read_text() == GREET
    assert last_message.read_text().strip() == "greet.py is written."
    assert [line for line in log.splitlines() if '"WebSocket /v1/responses" [accepted]' in line], log[-3000:]


# -- the Chat Completions agents, a tool round trip each: the scripted model calls the agent's own write tool in
# Qwen3-Coder's XML, the agent writes the file and sends the result back, the model's second turn ends the run ----

WRITTEN = "greet.py is written."


def write_prompt(tool: str, arguments: dict[str, str]) -> str:
    return f"Write greet.py. [[turns:{qwen3_coder((tool, arguments))}|||{WRITTEN}]]"


def check_round_trip(result: subprocess.CompletedProcess[str], log: str, target: Path) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert target.read_text() == GREET
    assert WRITTEN in result.stdout, result.stdout[-3000:]
    assert len(served(log, "POST /v1/chat/completions")) >= 2, log[-3000:]


# Each agent's headless run that writes greet.py with its own file tool, as the scripted Qwen3-Coder model calls it:
# the tool, its path and content arguments, and the command line ("{prompt}" stands for the prompt).
ROUND_TRIPS = {
    "qwen": ("write_file", "file_path", "content", ("-p", "{prompt}", "--yolo")),
    # Cline's file tool is editor: a new_text without old_text creates the file (its tools are approved by default
    # in a headless run)
    "cline": ("editor", "path", "new_text", ("--json", "{prompt}")),
    # Hermes refuses windows under 64K tokens: the scripted model has 128K
    "hermes": ("write_file", "path", "content", ("chat", "-Q", "--yolo", "-q", "{prompt}")),
    # OpenClaw's embedded agent (agent --local), on the Node.js 24 installed beside it
    "openclaw": ("write", "path", "content", ("agent", "--local", "--json", "-m", "{prompt}")),
    "pi": ("write", "path", "content", ("-p", "{prompt}")),
    # droid exec offers its file tools from --auto low on (read-only without it)
    "droid": ("Create", "file_path", "content", ("exec", "--auto", "low", "{prompt}")),
    # cn -p offers its Write tool with --auto (all tools allowed)
    "continue": ("Write", "filepath", "content", ("-p", "--auto", "{prompt}")),
}


@pytest.mark.parametrize("agent", list(ROUND_TRIPS))
def test_an_agent_writes_a_file_a_qwen3_coder_model_called_for(agent_daemon: Daemon, tmp_path: Path,
                                                               agent: str) -> None:
    tool, path_key, content_key, args = ROUND_TRIPS[agent]
    model = scripted_model(agent_daemon, tmp_path, "scripted-qwen3-coder", "qwen3-coder")
    target = tmp_path / "work" / "greet.py"
    prompt = write_prompt(tool, {path_key: str(target), content_key: GREET})
    result, log = run_agent(agent_daemon, tmp_path, agent, *(prompt if a == "{prompt}" else a for a in args),
                            model=model)
    check_round_trip(result, log, target)


# -- a small window: every agent that is told the model's window sends its request anyway, and the daemon fits it --

SMALL_WINDOW_RUNS = {  # the headless run of each agent with a plain prompt, and the window it gets
    "claude": (8192, "-p", PROMPT, "--output-format", "json"),
    "codex": (8192, "exec", "--skip-git-repo-check", "--ephemeral", PROMPT),
    "cline": (8192, "--json", PROMPT),
    "qwen": (16384, "-p", PROMPT),
    "openclaw": (16384, "agent", "--local", "--json", "-m", PROMPT),
}


@pytest.mark.parametrize("agent", list(SMALL_WINDOW_RUNS))
def test_an_agent_on_a_small_window_sends_its_request_and_the_daemon_fits_it(agent_daemon: Daemon, tmp_path: Path,
                                                                            agent: str) -> None:
    """A window smaller than the agent's first request: on 8,192 tokens Claude Code 2.1.332 refuses its request
    itself ("Prompt is too long", terminal_reason blocking_limit) unless launch lifts its limit (on 16,384 it
    does not refuse). The scripted engine's tokens are bytes, so a window is a quarter of what it is on a real
    tokenizer: Qwen Code's and OpenClaw's system prompts alone are more bytes than 8,192 (the daemon cannot fit
    those; they get 16,384), and OpenCode's are more than 16,384 once its reply is reserved (it is answered
    context_length_exceeded and compacts again and again; test_opencode runs it on smollm2's 8k window, where its
    prompt fits). Hermes refuses windows under 64K by design (launch says so). The scripted engine answers at
    once: the cost is the agent's own start."""
    num_ctx, *args = SMALL_WINDOW_RUNS[agent]
    name = f"scripted-{num_ctx // 1024}k"
    model = scripted_model(agent_daemon, tmp_path, name, "qwen3-coder", num_ctx=int(num_ctx))
    result, log = run_agent(agent_daemon, tmp_path, agent, *map(str, args), model=model)
    assert result.returncode == 0, result.stdout + result.stderr
    assert DEFAULT_REPLY in result.stdout, result.stdout[-3000:]
    assert f"fitted a conversation for {name}" in log, log[-3000:]


# -- the agent tree: Claude Code's own sub-agents, on a 128k scripted model ----------------------------------------

# the daemon's debug line for each request a local worker admitted (runtime.py)
CACHED = re.compile(r"session (?P<session>.+?): (?P<cached>\d+) of (?P<prompt>\d+) prompt tokens cached "
                    r"\((?P<source>\w+)\)")


def agent_call(kind: str, task: str) -> str:
    return qwen3_coder(("Agent", {"description": "Explore the repository", "subagent_type": kind, "prompt": task,
                                  "run_in_background": False}))


def test_claude_code_runs_sub_agents_cached_under_their_parent(agent_daemon: Daemon, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The model calls Claude Code's Agent tool three times: two general-purpose sub-agents (a system prompt of
    their own: they share their prefix with each other, not with the parent), then a fork (the parent's whole
    conversation, then its task). Each runs under the parent's session id with an agent id of its own; its answer
    comes back as the tool's result, and the model's fourth turn ends the run. Each sub-agent is filed under the
    parent (``PARENT > agent:ID``); the second general-purpose one and the fork reuse what they share (at least 90%
    of the tokens before their task); every parent turn after a sub-agent finds its slot live; nothing reads as a
    divergence."""
    model = scripted_model(agent_daemon, tmp_path, "scripted-qwen3-coder", "qwen3-coder")
    script = "|||".join([agent_call("general-purpose", "List the files of the repository."),
                         agent_call("general-purpose", "Say what the repository is for."),
                         agent_call("fork", "Check the repository's tests."), "The sub-agents are done."])
    result, log = run_agent(agent_daemon, tmp_path, "claude", "-p", f"Explore with sub-agents. [[turns:{script}]]",
                            "--output-format", "json", "--permission-mode", "acceptEdits", model=model)
    assert result.returncode == 0, result.stdout + result.stderr
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["result"] == "The sub-agents are done.", reply
    assert reply["subagent_stats"]["completed"] == 3, reply["subagent_stats"]
    turns = [m.groupdict() for m in CACHED.finditer(log)]
    parent = turns[0]["session"]
    mains = [t for t in turns if t["session"] == parent]
    subs = [t for t in turns if t["session"] != parent]
    with capsys.disabled():  # the figures for the notes
        print("\n" + "\n".join(f"  {t['session']}: {t['cached']} of {t['prompt']} cached ({t['source']})"
                               for t in turns))
    assert len(mains) == 4 and len(subs) == 3, turns
    assert all(t["session"].startswith(parent + " > agent:") for t in subs), turns
    assert len({t["session"] for t in subs}) == 3  # a session each
    assert [t["source"] for t in mains[1:]] == ["live"] * 3, mains  # the parent's slot, as it left it
    # what each sub-agent shares: the first general-purpose one only the opening line of the system prompt with
    # its parent (its own system prompt follows); the second what the first had before its task (its system
    # prompt, tools and context: about three quarters of its prompt; without the cache, the opening line); the
    # fork its parent's conversation, its task after it
    first, second, fork = ({key: int(t[key]) for key in ("cached", "prompt")} for t in subs)
    assert first["cached"] < 1000, subs
    assert second["cached"] >= 0.6 * second["prompt"], subs
    assert fork["cached"] >= 0.9 * fork["prompt"], subs
    with agent_daemon.http(timeout=60) as http:
        assert reported_divergences(http, parent, model=model) == []
