"""``python -m localai.tui.bench``: how fast the TUI is usable, and how fast it echoes a key while a reply
streams at full speed. Measured in a real terminal (tmux), as a person sees it: interpreter start, imports,
first paint, the daemon's answer; typing is timed from ``send-keys`` to the key on screen.

Needs tmux and a daemon that answers (started here if none runs). Numbers go in notes, never in tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from localai.client import Client

POLL = 0.005
STORY = "Write a very long story about a dragon."


class Tmux:
    def __init__(self, command: str) -> None:
        self.name = f"localai-bench-{uuid.uuid4().hex[:8]}"
        for attempt in range(20):  # the tmux server may still be exiting after the last session closed
            started = subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "120", "-y", "40", command],
                                     capture_output=True, text=True)
            if started.returncode == 0:
                return
            time.sleep(0.1 * (attempt + 1))
        raise RuntimeError(f"tmux new-session failed: {started.stderr.strip()}")

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True,
                              text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait(self, found: Callable[[str], bool], timeout: float = 60) -> float:
        """Seconds until ``found(screen)``."""
        started = time.perf_counter()
        while time.perf_counter() - started < timeout:
            if found(self.screen()):
                return time.perf_counter() - started
            time.sleep(POLL)
        raise TimeoutError(f"gave up after {timeout} s; the screen:\n{self.screen()}")

    def close(self) -> None:
        self.keys("C-q")
        time.sleep(0.3)
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def localai_command(*args: str) -> str:
    return " ".join([sys.executable, "-m", "localai", *args])


def startup(runs: int) -> tuple[list[float], list[float]]:
    """Seconds from launching ``localai tui`` to the menu drawn, and to the daemon's state shown on it."""
    drawn, usable = [], []
    for _ in range(runs):
        started = time.perf_counter()
        terminal = Tmux(localai_command("tui"))
        try:
            terminal.wait(lambda screen: "Launch an agent" in screen)
            drawn.append(time.perf_counter() - started)
            terminal.wait(lambda screen: "loaded:" in screen)
            usable.append(time.perf_counter() - started)
        finally:
            terminal.close()
    return drawn, usable


def typing_latency(model: str, samples: int, *, streaming: bool) -> list[float]:
    """Seconds from a key sent to the key shown in the input box, while a long reply streams (or not)."""
    terminal = Tmux(localai_command("tui", model, "-o", "num_predict=4000", "-o", "temperature=0"))
    latencies = []
    try:
        terminal.wait(lambda screen: "Send a message" in screen)
        if streaming:
            terminal.keys("-l", STORY)
            terminal.keys("Enter")
            terminal.wait(lambda screen: "esc Stop" in screen)  # the footer offers Stop while a reply streams
            time.sleep(1.0)  # well into the reply
        typed = ""
        for index in range(samples):
            key = "xyzw"[index % 4]
            typed += key
            sent = time.perf_counter()
            terminal.keys("-l", key)
            terminal.wait(_shows(typed), timeout=10)
            latencies.append(time.perf_counter() - sent)
            time.sleep(0.05)
        if streaming and "esc Stop" not in terminal.screen():
            raise RuntimeError("the reply ended before the measurement did; raise num_predict")
        terminal.keys("Escape")
    finally:
        terminal.close()
    return latencies


def _shows(text: str) -> Callable[[str], bool]:
    return lambda screen: text in screen


def describe(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (f"median {statistics.median(values) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
            f"max {max(values) * 1000:.0f} ms ({len(values)} samples)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runs", type=int, default=5, help="startups to time")
    parser.add_argument("--samples", type=int, default=30, help="keys to time, idle and while streaming")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("tmux is needed: apt-get install tmux")
    Client().ensure_running()
    Client().request("POST", "/api/generate", {"model": args.model})  # loaded before anything is timed
    os.environ.setdefault("TERM", "xterm-256color")
    drawn, usable = startup(args.runs)
    print(f"startup to the menu drawn:           {describe(drawn)}")
    print(f"startup to the daemon's state shown: {describe(usable)}")
    print(f"key to screen, idle:                 {describe(typing_latency(args.model, args.samples, streaming=False))}")
    print(f"key to screen, reply streaming:      {describe(typing_latency(args.model, args.samples, streaming=True))}")


if __name__ == "__main__":
    main()
