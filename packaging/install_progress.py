"""``pip install`` that says what it is doing: ``make demo``/``make test`` run their installs through this.

pip's ``--quiet`` hides a 6-minute compile of llama.cpp (llama-cpp-python builds from source) and then shows
setuptools' boxed editable-install warning, which reads like an error. This runs ``pip install -v`` instead, keeps
its whole output in a log file, and prints a few lines of its own: each step as it starts, with how long it usually
takes; download progress; the compile's progress (ninja's ``[n/N]`` or make's ``[ 45%]`` lines); and a line at
least every 20 seconds, so the screen never looks hung. Warnings are not shown (they are in the log); on a failure
the log's last lines are.

    python packaging/install_progress.py --log .venv/install.log --about "localai (the demo)" -- -e '.[demo]'

Standard library only: it runs in a fresh virtualenv, before anything is installed.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

QUIET_AFTER = 20.0  # seconds without a line of ours before a "still ..." line
DETAIL_EVERY = 10.0  # at most one download or compile progress line this often
# What a long build usually costs, said when it starts (2-core machines are this project's measure).
SLOW_BUILDS = {
    "llama-cpp-python": "compiles llama.cpp from source: about 6-7 minutes on 2 cores (up to 20 on a busy "
                        "machine), once; pip keeps the wheel for next time",
}
COLLECTING = re.compile(r"^\s*Collecting (\S+)")
DOWNLOADING = re.compile(r"^\s*Downloading (\S+?)(?:\.metadata)? \(([^)]+)\)")
RAW_PROGRESS = re.compile(r"^\s*Progress (\d+) of (\d+)")
BUILDING = re.compile(r"^\s*Building (?:editable|wheel) for (\S+) \(pyproject\.toml\)(?::| \.\.\.)?\s*(started)?")
BUILT = re.compile(r"^\s*(?:Created wheel|Created editable) for (\S+?):")
CACHED_WHEEL = re.compile(r"^\s*Using cached (\S+\.whl)")
NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)")
MAKE = re.compile(r"^\s*\[\s*(\d+)%\]\s+(.*)")
INSTALLING = re.compile(r"^Installing collected packages: (.*)")
INSTALLED = re.compile(r"^Successfully installed (.*)")
ERROR = re.compile(r"^\s*(ERROR|error):")


def elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class Progress:
    """Turns pip's verbose output, line by line, into the few lines a person needs; ``tick`` keeps it alive."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.say_line = say
        self.clock = clock
        self.started = self.last_said = self.last_detail = clock()
        self.doing = "resolving dependencies"
        self.doing_since = self.started
        self.collected = 0
        self.building: str | None = None  # the package being built from source
        self.compiled = ""  # the build's last progress, e.g. "45% (312/690)"
        self.downloading = ""
        self.errors: list[str] = []

    def say(self, text: str) -> None:
        self.say_line(text)
        self.last_said = self.clock()

    def step(self, doing: str, text: str) -> None:
        self.doing, self.doing_since = doing, self.clock()
        self.say(text)

    def feed(self, line: str) -> None:
        line = line.rstrip()
        now = self.clock()
        if match := COLLECTING.match(line):
            self.collected += 1
            if self.doing.startswith("downloading"):  # that download is done: back to resolving
                self.doing, self.doing_since = "resolving dependencies", now
            if self.building is None and now - self.last_detail >= DETAIL_EVERY:
                self.last_detail = now
                self.say(f"    {self.collected} packages so far ({match.group(1)})")
        elif match := DOWNLOADING.match(line):
            self.downloading = f"{match.group(1).rsplit('/', 1)[-1]} ({match.group(2)})"
            if _megabytes(match.group(2)) >= 10 and self.building is None:  # a big one: say so at once
                self.last_detail = now
                self.step(f"downloading {self.downloading}", f"    downloading {self.downloading}")
        elif match := RAW_PROGRESS.match(line):
            done, total = int(match.group(1)), int(match.group(2))
            if total and now - self.last_detail >= DETAIL_EVERY:
                self.last_detail = now
                self.say(f"    downloading {self.downloading or 'a package'}: {done * 100 // total}%")
        elif match := CACHED_WHEEL.match(line):
            name = match.group(1).split("-", 1)[0].replace("_", "-")
            if name in SLOW_BUILDS:
                self.say(f"    {name}: using the wheel pip built before (no compile)")
        elif (match := BUILDING.match(line)) and "finished" not in line and self.building != _name(match.group(1)):
            name = _name(match.group(1))
            self.building, self.compiled = name, ""
            usual = SLOW_BUILDS.get(name, "from source; usually seconds")
            self.step(f"building {name}", f"==> Building {name}: {usual}")
        elif (match := BUILT.match(line)) and self.building is not None:
            name = self.building
            self.building = None
            self.step("installing", f"    built {name} in {elapsed(now - self.doing_since)}")
        elif (match := NINJA.match(line) or MAKE.match(line)) and self.building is not None:
            if match.re is NINJA:
                done, total = int(match.group(1)), int(match.group(2))
                self.compiled = f"{done * 100 // max(total, 1)}% ({done}/{total} steps)"
            else:
                self.compiled = f"{match.group(1)}%"
            if now - self.last_detail >= DETAIL_EVERY:
                self.last_detail = now
                self.say(f"    compiling {self.building}: {self.compiled}, {elapsed(now - self.doing_since)}")
        elif match := INSTALLING.match(line):
            count = len(match.group(1).split(","))
            self.step("installing", f"==> Installing {count} packages into the virtualenv (usually under a minute)")
        elif match := INSTALLED.match(line):
            self.say(f"==> Installed in {elapsed(now - self.started)}")
        elif ERROR.match(line):
            self.errors.append(line.strip())
            self.say(line.strip())

    def tick(self) -> None:
        """Called every second or so: when nothing was said for a while, say what is still going on."""
        now = self.clock()
        if now - self.last_said < QUIET_AFTER:
            return
        if self.building is not None:
            done = f", {self.compiled} compiled" if self.compiled else ""
            self.say(f"    still building {self.building}: {elapsed(now - self.doing_since)}{done}")
        else:
            self.say(f"    still {self.doing}: {elapsed(now - self.doing_since)}"
                     + (f" ({self.collected} packages so far)" if self.doing == "resolving dependencies" else ""))


def _name(requirement: str) -> str:
    return requirement.lower().replace("_", "-")


def _megabytes(size: str) -> float:
    number, _, unit = size.partition(" ")
    try:
        value = float(number)
    except ValueError:
        return 0.0
    return value * {"kB": 0.001, "MB": 1.0, "GB": 1000.0}.get(unit, 0.0)


def run(command: list[str], log: Path, say: Callable[[str], None], tail: int = 40) -> int:
    """Run ``command`` (pip), its output into ``log``, ``Progress`` lines to ``say``; returns its exit status."""
    progress = Progress(say)
    lines: queue.Queue[str | None] = queue.Queue()
    last: collections.deque[str] = collections.deque(maxlen=tail)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PIP_NO_COLOR": "1"}
    with open(log, "w", encoding="utf-8", errors="replace") as written, \
            subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace", env=env, bufsize=1) as process:
        assert process.stdout is not None

        def read(stream: Iterable[str]) -> None:
            for line in stream:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, args=(process.stdout,), daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                progress.tick()
                continue
            if line is None:
                break
            written.write(line)
            last.append(line.rstrip())
            progress.feed(line)
            progress.tick()
        status = process.wait()
    if status != 0:
        say(f"==> pip failed (exit status {status}); its last lines (the whole output is in {log}):")
        for line in last:
            say(f"    {line}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="Where pip's whole output goes.")
    parser.add_argument("--about", default="the packages", help="What is being installed, in words.")
    parser.add_argument("pip_args", nargs=argparse.REMAINDER, help="pip install's arguments, after --.")
    args = parser.parse_args(argv)
    pip_args = args.pip_args[1:] if args.pip_args[:1] == ["--"] else args.pip_args

    def say(text: str) -> None:
        print(text, flush=True)

    say(f"==> Installing {args.about} with pip: usually 1-2 minutes, plus a one-time compile of llama.cpp "
        f"(about 6-7 minutes on 2 cores) when pip has not built it before; pip's whole output: {args.log}")
    command = [sys.executable, "-m", "pip", "install", "-v", "--progress-bar", "raw", *pip_args]
    return run(command, args.log, say)


if __name__ == "__main__":
    sys.exit(main())
