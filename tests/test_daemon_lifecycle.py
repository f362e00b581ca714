"""The background daemon's lifecycle from the command line: ``localai status``, ``localai daemon start|stop``, and
what a second ``localai serve`` says about whoever holds its port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port, start_daemon


def localai(home: Path, *args: str, port: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    env.update(LOCALAI_HOME=str(home), LOCALAI_DISCOVER="", LOCALAI_HOST=f"127.0.0.1:{port or free_port()}")
    return subprocess.run([sys.executable, "-m", "localai", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_stop_without_a_model_points_at_the_daemon_stop(tmp_path: Path) -> None:
    result = localai(tmp_path, "stop")
    assert result.returncode == 2 and "localai ps" in result.stderr and "localai daemon stop" in result.stderr


def test_status_and_stop_without_a_daemon(tmp_path: Path) -> None:
    status = localai(tmp_path, "status")
    assert status.returncode == 3 and f"localai is not running (home {tmp_path})" in status.stdout
    assert "localai daemon start" in status.stdout
    stop = localai(tmp_path, "daemon", "stop")
    assert stop.returncode == 0 and "localai is not running" in stop.stdout


def test_start_status_and_stop_the_background_daemon(tmp_path: Path) -> None:
    port = free_port()
    started = localai(tmp_path, "daemon", "start", port=port)
    try:
        assert started.returncode == 0, started.stderr
        assert "started localai in the background (pid " in started.stdout and "localai daemon stop" in started.stdout
        pid = int((tmp_path / "localai.pid").read_text())
        assert f"(pid {pid})" in started.stdout
        again = localai(tmp_path, "daemon", "start", port=port)
        assert again.returncode == 0 and f"localai is already running (pid {pid})" in again.stdout

        status = localai(tmp_path, "status", port=port)
        assert status.returncode == 0, status.stderr
        assert f"is running (pid {pid}, up " in status.stdout and f"home    {tmp_path}" in status.stdout
        assert f"http://127.0.0.1:{port}" in status.stdout and "stop it with: localai daemon stop" in status.stdout
        same = localai(tmp_path, "daemon", "status", port=port).stdout  # the same report (its uptime moves on)
        assert same.splitlines()[1:] == status.stdout.splitlines()[1:] and f"(pid {pid}, up " in same
    except BaseException:  # a daemon left behind by a failed check would outlive the test
        localai(tmp_path, "daemon", "stop", port=port)
        raise

    stopped = localai(tmp_path, "daemon", "stop", port=port)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped localai (pid {pid})" in stopped.stdout
    assert not (tmp_path / "localai.sock").exists() and not (tmp_path / "localai.pid").exists()
    try:
        os.kill(pid, 0)
        alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive
    assert localai(tmp_path, "status", port=port).returncode == 3


def test_serve_names_the_localai_that_holds_its_port(tmp_path: Path) -> None:
    with start_daemon(tmp_path / "first") as first:
        other_home = localai(tmp_path / "second", "serve", port=first.port, timeout=60)
        assert other_home.returncode == 1
        assert (f"127.0.0.1:{first.port} is already in use by another localai (pid {first.process.pid}, home "
                f"{first.home}); stop it with: LOCALAI_HOME={first.home} localai daemon stop") in other_home.stderr
        same_home = localai(first.home, "serve", port=first.port, timeout=60)
        assert same_home.returncode == 1
        assert f"localai is already running for this home (pid {first.process.pid}" in same_home.stderr


def test_serve_names_another_program_on_its_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = localai(tmp_path, "serve", port=port, timeout=60)
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is already in use by another program: " in result.stderr
    assert f"(pid {os.getpid()}); stop it, or run this one on another port" in result.stderr
    # this test's own process, by its command line (pytest's, or an xdist worker's)
    own = " ".join(Path("/proc/self/cmdline").read_bytes().decode().split("\0")[:2])
    assert result.stderr.split("program: ", 1)[1].startswith(own), (own, result.stderr)


def test_a_daemon_that_does_not_answer_is_stopped_by_its_pid_file_and_a_stop_that_hangs_says_how_to_end_it(
        tmp_path: Path) -> None:
    with start_daemon(tmp_path / "home") as held:
        os.kill(held.process.pid, signal.SIGSTOP)  # it answers nothing and cannot act on a SIGTERM
        try:
            result = subprocess.run([sys.executable, "-m", "localai", "daemon", "stop", "--timeout", "2"],
                                    env=held.env, capture_output=True, text=True, timeout=60)
        finally:
            os.kill(held.process.pid, signal.SIGCONT)  # the SIGTERM it was sent now stops it
        assert result.returncode == 1, result.stdout
        assert f"the daemon (pid {held.process.pid}) is still stopping after 2 s" in result.stderr
        assert f"kill -9 {held.process.pid}" in result.stderr
        assert held.process.wait(timeout=60) == 0  # it was sent the SIGTERM


def test_a_stale_pid_file_is_not_a_daemon(tmp_path: Path) -> None:
    (tmp_path / "localai.pid").write_text(str(os.getpid()))  # a live process, but not a localai serve
    stop = localai(tmp_path, "daemon", "stop")
    assert stop.returncode == 0 and "localai is not running" in stop.stdout


def test_a_pid_file_naming_a_process_that_looks_like_a_daemon_is_not_followed(tmp_path: Path) -> None:
    """``daemon stop`` signals only this home's daemon (the process holding this home's socket): not an unrelated
    process whose command line reads like ``localai serve``, nor another home's daemon."""
    lookalike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "localai", "serve"])
    try:
        (tmp_path / "localai.pid").write_text(str(lookalike.pid))
        stop = localai(tmp_path, "daemon", "stop")
        assert lookalike.poll() is None, "the look-alike process was signalled"
        assert stop.returncode == 0 and "localai is not running" in stop.stdout
        with start_daemon(tmp_path / "other") as other:
            (tmp_path / "localai.pid").write_text(str(other.process.pid))
            stop = localai(tmp_path, "daemon", "stop")
            assert other.process.poll() is None, "another home's daemon was stopped"
            assert "localai is not running" in stop.stdout
    finally:
        lookalike.kill()
        lookalike.wait()


def test_the_pid_file_is_written_without_following_a_link(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (home / "localai.pid").symlink_to(target)
    (home / "localai.addr").symlink_to(target)
    with start_daemon(home) as daemon:
        assert target.read_text() == "keep me"
        assert not (home / "localai.pid").is_symlink()
        assert (home / "localai.pid").read_text() == str(daemon.process.pid)


def test_a_daemon_open_to_the_network_tells_its_pid_and_home_only_over_its_socket(tmp_path: Path) -> None:
    import httpx

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    env.update(LOCALAI_HOME=str(tmp_path), LOCALAI_DISCOVER="", LOCALAI_HOST=f"0.0.0.0:{port}", LOCALAI_API_KEY="k")
    started = subprocess.run([sys.executable, "-m", "localai", "daemon", "start"], env=env, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert started.returncode == 0, started.stderr
    try:
        over_tcp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert over_tcp["status"] == "ok" and not {"pid", "home", "url"} & set(over_tcp)
        socket_client = httpx.HTTPTransport(uds=str(tmp_path / "localai.sock"))
        with httpx.Client(transport=socket_client, base_url="http://localhost", timeout=10) as http:
            over_socket = http.get("/health").json()
        assert over_socket["pid"] == int((tmp_path / "localai.pid").read_text())
        assert over_socket["home"] == str(tmp_path)
    finally:
        stopped = subprocess.run([sys.executable, "-m", "localai", "daemon", "stop"], env=env, capture_output=True,
                                 text=True, timeout=120)
    assert "stopped localai" in stopped.stdout  # the stop works through the socket too
