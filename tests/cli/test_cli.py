"""The CLI end to end: real subprocesses talking to a real daemon over its Unix socket."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from localai.cli.run import Chat
from tests.conftest import Daemon, scripted_model


def test_help_is_fast_and_imports_no_engine() -> None:
    code = "import sys; from localai.cli import cli; print('llama_cpp' in sys.modules, 'fastapi' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
    started = time.monotonic()
    help_text = subprocess.run([sys.executable, "-m", "localai", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "serve" in help_text.stdout and "create" in help_text.stdout
    assert time.monotonic() - started < 30  # generous: only catches an engine import, not a slow machine


def test_run_one_shot_and_from_stdin(daemon: Daemon) -> None:
    """The words after the model are the prompt, joined by spaces; without them the prompt is read from stdin; the
    reply is printed (the scripted engine on smollm2's weights: the prompt's ``[[say:...]]`` is its reply)."""
    model = scripted_model(daemon, "scripted-run")
    one_shot = daemon.cli("run", model, "Say [[say:hello", "from", "the", "words]]")
    assert one_shot.returncode == 0, one_shot.stderr
    assert one_shot.stdout.strip() == "hello from the words"
    piped = daemon.cli("run", model, "--verbose", input="What is 2+2? [[say:4, from stdin]]\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip() == "4, from stdin" and "eval count" in piped.stderr
    real = daemon.cli("run", "smollm2", "Say", "hello")  # and the real model answers
    assert real.returncode == 0 and real.stdout.strip(), real.stderr


def test_run_unknown_model(daemon: Daemon) -> None:
    result = daemon.cli("run", "nothing-here", "hi")
    assert result.returncode == 1
    assert "not installed" in result.stderr and "not in the library either" in result.stderr
    assert "localai pull nothing-here" not in result.stderr  # it would fail: pull does not know the name
    shown = daemon.cli("show", "nosuch")
    assert shown.returncode == 1 and "localai list --library" in shown.stderr and "pull nosuch" not in shown.stderr
    sized = daemon.cli("show", "qwen3")  # a library family: pick a size
    assert "qwen3 comes in" in sized.stderr and "localai pull qwen3:" in sized.stderr


def test_list_show_create_cp_rm_ps_stop(daemon: Daemon, tmp_path: Path) -> None:
    listed = daemon.cli("list")
    assert listed.returncode == 0 and "smollm2:135m" in listed.stdout and "Q4_1" in listed.stdout

    assert "num_predict" in daemon.cli("show", "smollm2", "--parameters").stdout
    assert daemon.cli("show", "smollm2", "--modelfile").stdout.startswith("FROM /")
    summary = daemon.cli("show", "smollm2").stdout
    assert "8192" in summary and "llama" in summary

    modelfile = tmp_path / "Modelfile"
    modelfile.write_text('FROM smollm2\nPARAMETER temperature 0\nSYSTEM """You are a pirate."""\n')
    created = daemon.cli("create", "pirate", "-f", str(modelfile))
    assert created.returncode == 0, created.stderr
    assert daemon.cli("show", "pirate", "--system").stdout.strip() == "You are a pirate."
    assert "temperature" in daemon.cli("show", "pirate", "--parameters").stdout
    assert daemon.cli("show", "pirate", "--template").returncode == 0
    answer = daemon.cli("run", "pirate", "Hello")
    assert answer.returncode == 0 and answer.stdout.strip()

    assert daemon.cli("cp", "pirate", "parrot").returncode == 0
    assert "parrot:latest" in daemon.cli("list").stdout
    assert "pirate:latest" in daemon.cli("ps").stdout
    assert daemon.cli("stop", "pirate").returncode == 0
    assert "pirate:latest" not in daemon.cli("ps").stdout

    assert daemon.cli("rm", "pirate", "parrot").returncode == 0
    listed = daemon.cli("list").stdout
    assert "pirate" not in listed and "parrot" not in listed
    assert daemon.cli("rm", "pirate").returncode == 1


def test_create_from_a_gguf_path_relative_to_the_modelfile(daemon: Daemon, tmp_path: Path,
                                                           smollm2_path: Path) -> None:
    (tmp_path / "model.gguf").symlink_to(smollm2_path)
    (tmp_path / "Modelfile").write_text("FROM ./model.gguf\nPARAMETER num_ctx 2048\n")
    created = daemon.cli("create", "local-file", "-f", str(tmp_path / "Modelfile"))
    assert created.returncode == 0, created.stderr
    assert daemon.cli("run", "local-file", "Hi").returncode == 0
    assert daemon.cli("rm", "local-file").returncode == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FROM smollm2\nPARAMETER warmth 3\n", "line 2: unknown parameter 'warmth'"),
        ("PARAMETER temperature 1\n", "no FROM line"),
        ("FROM ./missing.gguf\n", "no such file"),
        ("FROM no-such-model\n", "neither a GGUF file, an http(s) URL of a remote model nor an installed model"),
    ],
)
def test_bad_modelfiles_fail_clearly(daemon: Daemon, tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "Modelfile").write_text(text)
    result = daemon.cli("create", "broken", "-f", str(tmp_path / "Modelfile"))
    assert result.returncode == 1 and message in result.stderr
    assert "broken" not in daemon.cli("list").stdout
    assert daemon.cli("list").returncode == 0  # the daemon is fine


def test_missing_modelfile(daemon: Daemon, tmp_path: Path) -> None:
    result = daemon.cli("create", "x", "-f", str(tmp_path / "nope"))
    assert result.returncode == 1 and "cannot read" in result.stderr


def test_run_starts_the_daemon_when_none_is_running(tmp_path: Path, smollm2_path: Path) -> None:
    import os

    from tests.conftest import free_port

    home = tmp_path / "auto"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    env.update({"LOCALAI_HOME": str(home), "LOCALAI_HOST": f"127.0.0.1:{free_port()}"})
    result = subprocess.run([sys.executable, "-m", "localai", "run", "smollm2", "Hi"], env=env,
                            capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    try:
        assert result.returncode == 0, result.stderr
        assert (home / "localai.sock").exists() and result.stdout.strip()
    finally:
        pid = (home / "localai.pid").read_text()
        os.kill(int(pid), 15)


class FakeClient:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def stream(self, path: str, body: dict[str, Any]) -> Any:
        self.bodies.append(body)
        yield {"message": {"content": "ok"}, "done": False}
        yield {"message": {"content": ""}, "done": True, "total_duration": 1, "prompt_eval_count": 1,
               "prompt_eval_duration": 1, "eval_count": 1, "eval_duration": 1}


def test_repl_commands(capsys: pytest.CaptureFixture[str]) -> None:
    client = FakeClient()
    chat = Chat(client, "smollm2", None, verbose=False)
    assert chat.command("/set parameter temperature 0.3")
    assert chat.command("/set parameter nonsense 1")
    assert chat.command("/set parameter top_k lots")
    assert chat.command("/set system Be brief.")
    chat.send("hi")
    assert client.bodies[-1]["options"] == {"temperature": 0.3}
    assert client.bodies[-1]["messages"][0] == {"role": "system", "content": "Be brief."}
    chat.send("again")
    assert [m["role"] for m in client.bodies[-1]["messages"]] == ["system", "user", "assistant", "user"]
    assert chat.command("/clear") and chat.messages == []
    assert not chat.command("/bye")
    output = capsys.readouterr().out
    assert "Unknown parameter 'nonsense'" in output and "top_k must be an integer" in output


def test_bench_agents_rejects_a_restart_outside_the_trace() -> None:
    result = subprocess.run([sys.executable, "-m", "localai", "bench", "agents", "--turns", "2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--restart-at" in result.stderr


def test_bench_streams_and_edit_through_a_real_daemon(fresh_daemon: Any) -> None:
    """`localai bench` with the streams and edit workloads (speculative decoding off and on) on smollm2, prefill and
    decode measured after some context."""
    result = fresh_daemon.cli("bench", "-m", "smollm2", "-p", "48", "-n", "8", "-r", "1", "--streams", "2",
                              "--edit", "24", "--depth", "200", "--cold", "2", "--cold-tokens", "64", timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    header = re.search(r"prompt (\d+) tokens .* after (\d+) tokens of context", out)
    assert header, out  # the context went first, and the prefill counted only what came after it
    assert int(header.group(1)) < 100 and 150 <= int(header.group(2)) <= 260, out
    assert "2 streams, tok/s in all" in out and "edit, speculative on" in out and "inter-token latency" in out
    assert re.search(r"localai, speculative on: edit answer \d+ tokens", out), out
    assert "guessed" in out  # the answer copies its prompt: some tokens are guessed
    fixed = re.search(r"fixed cost per request \(a cached 64-word prompt, one token\): localai ([\d.]+) ms", out)
    assert fixed and 0 < float(fixed.group(1)) < 10_000, out
    # two cold prompts sent while a stream decodes: each one's time to first token, the stream's longest gap
    cold = re.search(r"2 cold ~64-token prompts beside a decoding stream: localai TTFT ([\d.]+) / ([\d.]+) s, "
                     r"longest gap (\d+) ms", out)
    assert cold and 0 < float(cold.group(1)) <= float(cold.group(2)) and int(cold.group(3)) > 0, out
    memory = re.search(r"memory \(resident, after the measurements\): localai (\d+) MiB "
                       r"\(daemon (\d+) \+ worker (\d+);", out)
    assert memory and int(memory.group(3)) > 50 and int(memory.group(1)) >= int(memory.group(2)), out


def test_bench_names_a_missing_llama_server(fresh_daemon: Any) -> None:
    """Said before anything is measured: the daemon never loaded the model."""
    for command, missing in ((("bench", "-m", "smollm2", "--llama-server"), "/nonexistent/llama-server"),
                             (("bench", "agents", "-m", "smollm2", "--llama-server"), "/nonexistent/llama-server"),
                             (("bench", "-m", "smollm2", "--llama-bench"), "/nonexistent/llama-bench")):
        result = fresh_daemon.cli(*command, missing)
        assert result.returncode != 0 and f"could not start {missing}" in result.stderr, result.stderr
        assert "make llama-server" in result.stderr and "Traceback" not in result.stderr
    with fresh_daemon.http() as http:
        assert http.get("/api/ps").json()["models"] == []


def in_terminal(*args: str, columns: int) -> str:
    """The command's output in a pseudo-terminal ``columns`` wide (what a person sees)."""
    import os
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb", "NO_COLOR": "1"}
    process = subprocess.Popen([sys.executable, "-m", "localai", *args], stdin=subprocess.DEVNULL, stdout=follower,
                               stderr=follower, env=env)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed: the command is done
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert process.wait(timeout=60) == 0, output
    return re.sub(r"\x1b\[[0-9;]*m", "", output.decode())


def test_list_library_shows_each_context_and_fits_the_terminal() -> None:
    shown = in_terminal("list", "--library", columns=100)
    lines = [line.rstrip() for line in shown.splitlines() if line.strip()]
    assert lines[0].split()[:3] == ["NAME", "CONTEXT", "INSTALLED"]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert rows["qwen2.5-coder:1.5b"] == "32768" and rows["smollm2:135m"].isdigit()  # its trained context
    assert all(value.isdigit() for value in rows.values()), rows
    assert max(len(line) for line in lines) <= 100
    assert "…" in shown  # the long columns were cut to fit, not the table widened
    piped = subprocess.run([sys.executable, "-m", "localai", "list", "--library"], capture_output=True, text=True)
    assert "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M" in piped.stdout  # a pipe gets it whole


def test_show_and_info_say_where_layers_and_memory_are(daemon: Daemon) -> None:
    assert daemon.cli("run", "smollm2", "Hi").returncode == 0  # loaded: show reports its placement
    shown = daemon.cli("show", "smollm2")
    assert shown.returncode == 0, shown.stderr
    processor = next(line for line in shown.stdout.splitlines() if line.strip().startswith("processor"))
    assert "100% CPU: none of its" in processor and "layers on a GPU" in processor  # the count is of GPU layers
    assert "on CPU" not in processor
    info = daemon.cli("info")
    assert info.returncode == 0, info.stderr
    cpu = next(line for line in info.stdout.splitlines() if line.split()[:2] == ["CPU", "cpu"])
    assert "the system's RAM (see RAM free)" in cpu and "GiB free" not in cpu  # not the total called free
    assert "RAM free" in info.stdout
