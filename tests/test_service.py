"""``localai service``: the systemd unit and the launchd agent it writes are valid, and the exact command line and
environment each holds start a daemon that answers. There is no user systemd bus on CI, so the unit is checked
with ``systemd-analyze --user verify`` and its ExecStart is run as systemd would run it."""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from localai import paths
from tests.conftest import free_port

UNIT = Path("systemd/user/localai.service")


def localai(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localai", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The installing user's environment: a config dir, a home with characters systemd treats specially, a port,
    and no user bus (so nothing can reach a real service manager by accident)."""
    home = tmp_path / "state 100% $HOME"
    base = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    return {**base, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "XDG_RUNTIME_DIR": str(tmp_path / "no-runtime"), "DBUS_SESSION_BUS_ADDRESS": "unix:path=/nonexistent",
            "LOCALAI_HOME": str(home), "LOCALAI_HOST": f"127.0.0.1:{free_port()}", "LOCALAI_DISCOVER": ""}


def systemd_unit(text: str) -> tuple[list[str], dict[str, str]]:
    """ExecStart's words and the Environment= assignments, unquoted as systemd does for these forms."""
    command: list[str] = []
    environment: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            command = [word.replace("%%", "%").replace("$$", "$") for word in shlex.split(line[len("ExecStart="):])]
        elif line.startswith("Environment="):
            key, _, value = shlex.split(line[len("Environment="):])[0].replace("%%", "%").partition("=")
            environment[key] = value
    return command, environment


def serve_until_healthy(command: list[str], environment: dict[str, str], port: str) -> subprocess.Popen[bytes]:
    """Start the service's command line with only the service's environment (plus PATH), wait for /health."""
    process = subprocess.Popen(command, env={"PATH": os.environ["PATH"], **environment},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0].decode()
        try:
            if httpx.get(f"http://{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("the service's command line never answered /health")


def stop(process: subprocess.Popen[bytes], home: Path) -> None:
    """SIGTERM, as systemd and launchd stop a service: the daemon shuts down cleanly (uvicorn re-raises the
    signal after its graceful shutdown, so the status is -SIGTERM, which systemd counts as a clean stop)."""
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    assert process.returncode in (0, -signal.SIGTERM), output.decode()
    assert not (home / "localai.pid").exists() and not (home / "localai.sock").exists(), output.decode()


def test_the_systemd_unit_verifies_and_its_command_line_serves(env: dict[str, str], tmp_path: Path) -> None:
    done = localai("service", "install", "--no-start", env=env)
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "config" / UNIT
    assert stat.S_IMODE(unit.stat().st_mode) == 0o600  # it may hold LOCALAI_API_KEY
    text = unit.read_text()
    if sys.platform.startswith("linux") and not shutil.which("systemd-analyze"):  # a failure, not a quiet pass
        pytest.fail("the unit is checked with `systemd-analyze --user verify`, which is not on PATH: install it "
                    "(Debian and Ubuntu: apt-get install systemd)")
    if shutil.which("systemd-analyze"):  # macOS has none: the rest of the test still runs there
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        verify = subprocess.run(["systemd-analyze", "--user", "verify", str(unit)], capture_output=True, text=True,
                                env={**env, "XDG_RUNTIME_DIR": str(runtime)}, timeout=60)
        assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    command, environment = systemd_unit(text)
    assert command == [sys.executable, "-m", "localai", "serve"]
    assert environment["LOCALAI_HOME"] == env["LOCALAI_HOME"]  # the odd characters survived systemd's quoting
    process = serve_until_healthy(command, environment, env["LOCALAI_HOST"])
    home = Path(env["LOCALAI_HOME"])
    try:
        assert (home / "localai.pid").read_text() == str(process.pid)  # the service runs on the installer's home
        models = httpx.get(f"http://{env['LOCALAI_HOST']}/api/tags", timeout=10).json()["models"]
        assert any(m["name"] == "smollm2:135m" for m in models)
    finally:
        stop(process, home)


def test_the_launchd_agent_parses_and_its_command_line_serves_with_a_log_file(env: dict[str, str],
                                                                               tmp_path: Path) -> None:
    done = localai("service", "install", "--manager", "launchd", "--no-start", env=env)
    assert done.returncode == 0, done.stderr
    plist = plistlib.loads((tmp_path / "Library" / "LaunchAgents" / "dev.localai.daemon.plist").read_bytes())
    assert plist["Label"] == "dev.localai.daemon" and plist["RunAtLoad"] is True
    log = Path(env["LOCALAI_HOME"]) / "logs" / "service.log"
    assert plist["ProgramArguments"] == [sys.executable, "-m", "localai", "serve", "--log-file", str(log)]
    process = serve_until_healthy(plist["ProgramArguments"], plist["EnvironmentVariables"], env["LOCALAI_HOST"])
    stop(process, Path(env["LOCALAI_HOME"]))
    assert "localai listening on" in log.read_text()  # logging went to the rotated file, not to stderr


def test_install_without_a_user_bus_writes_the_unit_and_says_how_to_start_it(env: dict[str, str],
                                                                              tmp_path: Path) -> None:
    done = localai("service", "install", env=env)
    assert done.returncode == 1
    assert "could not be started" in done.stderr and "systemctl --user enable --now localai.service" in done.stderr
    assert (tmp_path / "config" / UNIT).exists()
    status = localai("service", "status", env=env)
    assert status.returncode == 0 and "(installed)" in status.stdout and "not answering" in status.stdout


def test_a_unit_localai_did_not_write_is_never_replaced_or_removed_without_force(env: dict[str, str],
                                                                                 tmp_path: Path) -> None:
    unit = tmp_path / "config" / UNIT
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/true\n")
    done = localai("service", "install", "--no-start", env=env)
    assert done.returncode == 1 and "was not written by localai" in done.stderr
    gone = localai("service", "uninstall", env=env)
    assert gone.returncode == 1 and "not written by localai" in gone.stderr
    assert unit.read_text() == "[Service]\nExecStart=/usr/bin/true\n"
    forced = localai("service", "install", "--no-start", "--force", env=env)
    assert forced.returncode == 0 and unit.read_text().startswith("# Written by `localai service install`")
    removed = localai("service", "uninstall", env=env)  # systemctl is unreachable: a warning, the file still goes
    assert removed.returncode == 0 and not unit.exists(), removed.stderr
    again = localai("service", "uninstall", env=env)
    assert again.returncode == 0 and "not installed" in again.stdout


def test_logs_of_a_service_that_is_not_installed_is_a_clear_error(env: dict[str, str]) -> None:
    done = localai("service", "logs", env=env)
    assert done.returncode == 1 and "not installed" in done.stderr
    bad = localai("service", "install", "--manager", "upstart", env=env)
    assert bad.returncode == 2 and "upstart" in bad.stderr


def test_logs_are_rotated_before_they_are_appended_to(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    for generation in range(5):
        log.write_bytes(bytes([65 + generation]) * 20)
        paths.rotate_log(log, max_bytes=10, backups=3)
        assert not log.exists()
    assert [(tmp_path / f"server.log.{i}").read_bytes()[:1] for i in (1, 2, 3)] == [b"E", b"D", b"C"]
    assert not (tmp_path / "server.log.4").exists()
    log.write_bytes(b"small")
    paths.rotate_log(log, max_bytes=10, backups=3)
    assert log.read_bytes() == b"small"


def test_the_service_passes_the_gpu_selection_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU chosen when the service was installed stays chosen: CUDA's, Vulkan's (llama.cpp skips a CPU-type
    Vulkan device unless GGML_VK_VISIBLE_DEVICES names it) and ROCm's variables reach the unit."""
    from localai.service import environment

    chosen = {"CUDA_VISIBLE_DEVICES": "1", "GGML_VK_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0",
              "ROCR_VISIBLE_DEVICES": "GPU-1"}
    for key, value in chosen.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    env = environment()
    assert {key: env.get(key) for key in chosen} == chosen
    assert "UNRELATED_SECRET" not in env


def test_the_rpc_server_unit_lives_beside_the_daemons_and_refuses_an_open_address(env: dict[str, str],
                                                                                    tmp_path: Path) -> None:
    daemon_unit, rpc_unit = tmp_path / "config" / UNIT, tmp_path / "config" / "systemd/user/localai-rpc.service"
    assert localai("service", "install", "--no-start", env=env).returncode == 0
    done = localai("service", "install", "--no-start", "--rpc", "--rpc-port", "50070", env=env)
    assert done.returncode == 0, done.stderr
    command, environment = systemd_unit(rpc_unit.read_text())
    assert command == [sys.executable, "-m", "localai", "rpc-server", "--host", "127.0.0.1", "--port", "50070"]
    assert "Description=localai rpc-server" in rpc_unit.read_text()
    assert environment["LOCALAI_HOME"] == env["LOCALAI_HOME"]
    assert systemd_unit(daemon_unit.read_text())[0][-1] == "serve"  # the daemon's unit is untouched
    status = localai("service", "status", "--rpc", env=env)
    assert "localai-rpc.service (installed)" in status.stdout and "daemon:" not in status.stdout
    open_address = localai("service", "install", "--no-start", "--rpc", "--rpc-host", "0.0.0.0", env=env)
    assert open_address.returncode == 1 and "--rpc-host 0.0.0.0 would serve" in open_address.stderr
    exposed = localai("service", "install", "--no-start", "--rpc", "--rpc-host", "100.64.0.7", "--expose", env=env)
    assert exposed.returncode == 0 and systemd_unit(rpc_unit.read_text())[0][-5:] == [
        "--host", "100.64.0.7", "--port", "50052", "--expose"]
    stray = localai("service", "install", "--no-start", "--rpc-port", "50070", env=env)
    assert stray.returncode == 2 and "add --rpc" in stray.stderr
    plist = localai("service", "install", "--manager", "launchd", "--print", "--rpc", env=env)
    loaded = plistlib.loads(plist.stdout.encode())
    assert loaded["Label"] == "dev.localai.rpc-server" and loaded["ProgramArguments"][-5:] == [
        "rpc-server", "--host", "127.0.0.1", "--port", "50052"]
    assert localai("service", "uninstall", "--rpc", env=env).returncode == 0
    assert not rpc_unit.exists() and daemon_unit.exists()
