"""A full disk: the home on a small tmpfs, agent-like sessions that write more cache than fits. Every response must
still be answered, the daemon stay healthy, nothing half-written stay behind; and on a roomy disk the cache quota
(LOCALAI_CACHE_MAX_BYTES) must hold."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tests.api.stress.common import Report, daemon, damaged_cache_files, half_written

SESSIONS, TURNS = 8, 3
FILLER = " ".join(f"line {i}: the build step compiles module {i} and links it." for i in range(30))


def _sessions(http: httpx.Client, problems: list[str] | None = None) -> tuple[int, int]:
    """(answered, failed) over SESSIONS agent-like sessions of TURNS turns, each prompt ~400 tokens longer."""
    answered = failed = 0
    for session in range(SESSIONS):
        messages = [{"role": "system", "content": f"You are agent {session}. {FILLER}"}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: {FILLER}"})
            response = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                               "max_tokens": 8, "temperature": 0},
                                 headers={"x-session-id": f"s{session}"})
            if response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None:
                answered += 1
                messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
            else:
                failed += 1
                if problems is not None:
                    problems.append(f"session {session} turn {turn}: {response.status_code} {response.text[:300]}")
                messages.append({"role": "assistant", "content": "ok"})
    return answered, failed


def _cache_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in (home / "cache").rglob("*") if p.is_file() and p.suffix in (".blk", ".snp"))


def run(report: Report, workdir: Path) -> None:
    mount = workdir / "tmpfs"
    mount.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        report.finding(f"full disk: not run, cannot mount a tmpfs here ({mounted.stderr.strip()}): run as root")
    else:
        try:
            _full_disk(report, mount / "home")
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    _quota(report, workdir / "quota")


def _full_disk(report: Report, home: Path) -> None:
    problems: list[str] = []
    with daemon(home, cache_max_bytes=str(1 << 30)) as instance, instance.http() as http:
        answered, failed = _sessions(http, problems)
        free = shutil.disk_usage(home).free
        time.sleep(2)
        healthy = http.get("/health").status_code == 200
        listing = instance.cli("cache", "ls")
        checked, damaged = damaged_cache_files(home)
        log = instance.log()
        workers = home / "logs" / "workers.log"  # the cache is written by the worker: its warnings are there
        worker_log = workers.read_text(errors="replace") if workers.exists() else ""
        errors = (log + worker_log).count("No space left on device")
    temps = [p.name for p in half_written(home)]  # once stopped: no write in flight
    (home.parent.parent / "full-disk-daemon.log").write_text(log)
    report.figure(f"full disk (12 MiB tmpfs home): {answered} answered, {failed} failed of {SESSIONS * TURNS}; free "
                  f"space at the end {free >> 10} KiB; ENOSPC warnings logged {errors}; healthy {healthy}; "
                  f"`localai cache ls` exit {listing.returncode}; temp files left {len(temps)}; cache files "
                  f"{checked}, damaged {damaged}")
    if failed or not healthy or listing.returncode or temps or damaged:
        report.finding(f"full disk: failed {failed} {problems[:3]}, healthy {healthy}, cache ls {listing.returncode} "
                       f"{listing.stderr[-200:]!r}, temps {temps[:5]}, damaged {damaged}")
    if free > 4 << 20:
        report.finding(f"full disk: the disk never filled ({free >> 20} MiB free): the check proved nothing")


def _quota(report: Report, home: Path) -> None:
    quota = 16 << 20
    with daemon(home, cache_max_bytes=str(quota)) as instance, instance.http() as http:
        answered, failed = _sessions(http)
        time.sleep(3)
        used = _cache_bytes(home)
    report.figure(f"quota LOCALAI_CACHE_MAX_BYTES={quota >> 20} MiB: {answered} answered, {failed} failed; cache on "
                  f"disk {used / 2**20:.1f} MiB")
    if used > quota or failed:
        report.finding(f"quota: {used} bytes on disk over {quota}, or {failed} failed")
