"""The repository works on any machine: nothing tracked points outside it or names where it was built."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked(*args: str) -> list[str]:
    try:
        result = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist or an installed copy)")
    return [name for name in result.stdout.decode().split("\0") if name]


def test_no_tracked_link_leaves_the_repository() -> None:
    leaving = []
    for line in tracked("-s"):
        mode, _, _, name = line.split(None, 3)
        if mode != "120000":
            continue
        target = os.readlink(ROOT / name) if (ROOT / name).is_symlink() else ""
        resolved = (ROOT / name).parent.joinpath(target).resolve()
        if not target or os.path.isabs(target) or not resolved.is_relative_to(ROOT):
            leaving.append(f"{name} -> {target or '?'}")
    assert not leaving, f"tracked links that point outside the repository (they break every other machine): {leaving}"


def test_no_tracked_file_names_this_machines_paths() -> None:
    needles = {str(ROOT)}
    home = str(Path.home())
    if home not in ("/", ""):
        needles.add(home + "/")
    found = []
    for name in tracked():
        path = ROOT / name
        if path.is_symlink() or not path.is_file():
            continue
        text = path.read_bytes()
        found += [f"{name}: {needle}" for needle in needles if needle.encode() in text]
    assert not found, f"tracked files name absolute paths of the machine they were made on: {found}"


def test_local_state_is_ignored() -> None:
    """What make writes into the checkout (.venv, .agents as a folder or a link) is ignored, never committed."""
    result = subprocess.run(["git", "check-ignore", ".agents", ".agents/", ".venv/", "x.log"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.stdout.split() == [".agents", ".agents/", ".venv/", "x.log"]
