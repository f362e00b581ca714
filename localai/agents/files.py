"""Everything ``localai launch`` writes for one agent, recorded so ``--restore`` can undo it.

Two kinds of files: files localai owns (generated configs under ``$LOCALAI_HOME/launch/<agent>/``), simply
deleted on restore, and the user's own config files, edited only where an agent offers no per-process way.
A user file is backed up before localai first touches it; restore puts the backup back byte for byte when the
file still holds what localai wrote, and otherwise removes only localai's entries, keeping the user's changes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from localai import paths
from localai.errors import AgentError

Format = Literal["json", "yaml"]
Change = Callable[[dict[str, Any]], dict[str, Any]]
Unedit = Callable[[Path, Any, Any], Any]


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write through a temporary file in the same directory and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def parse(text: str, fmt: Format, path: Path) -> dict[str, Any]:
    """A config file's content as a mapping (empty for an empty file); AgentError naming the file otherwise."""
    try:
        data = json.loads(text) if fmt == "json" and text.strip() else yaml.safe_load(text) if text.strip() else {}
    except (ValueError, yaml.YAMLError) as exc:
        raise AgentError(f"cannot edit {path}: it is not valid {fmt.upper()} ({exc}); fix it or move it away, "
                         "then run the command again") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise AgentError(f"cannot edit {path}: expected a {fmt.upper()} object at the top level")
    return data


def dump(data: dict[str, Any], fmt: Format) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    return str(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def put_back(current: dict[str, Any], before: dict[str, Any] | None, key: str) -> None:
    """Give ``key`` in ``current`` its value from ``before``, or remove it when ``before`` had none."""
    if key in (before or {}):
        current[key] = before[key]  # type: ignore[index]
    else:
        current.pop(key, None)


def drop_empty(data: dict[str, Any], before: dict[str, Any] | None, *keys: str) -> None:
    """Remove the mappings along ``keys`` that localai's edit left empty and the original did not have."""
    for depth in range(len(keys), 0, -1):
        parent: Any = data
        for key in keys[:depth - 1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        old: Any = before or {}
        for key in keys[:depth]:
            old = old.get(key) if isinstance(old, dict) else None
        leaf = keys[depth - 1]
        if isinstance(parent, dict) and parent.get(leaf) == {} and old is None:
            del parent[leaf]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class AgentFiles:
    """The files localai wrote for one agent, under ``$LOCALAI_HOME/launch/<agent>/``."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.root = paths.launch_dir(agent)
        self.ledger_path = self.root / "edits.json"

    # -- localai's own files ----------------------------------------------------------------------

    def write(self, name: str, text: str) -> Path:
        """Write a file localai owns (mode 0600: it may hold the API key)."""
        path = self.root / name
        write_atomic(path, text.encode())
        return path

    # -- the user's files -------------------------------------------------------------------------

    def _ledger(self) -> dict[str, dict[str, Any]]:
        if not self.ledger_path.exists():
            return {}
        loaded: dict[str, dict[str, Any]] = json.loads(self.ledger_path.read_text())
        return loaded

    def _save_ledger(self, ledger: dict[str, dict[str, Any]]) -> None:
        write_atomic(self.ledger_path, (json.dumps(ledger, indent=2) + "\n").encode())

    def edit(self, path: Path, fmt: Format, change: Change) -> Path:
        """Apply ``change`` to a user's config file, backing the file up the first time localai touches it."""
        ledger = self._ledger()
        before = path.read_bytes() if path.exists() else None
        data = parse(before.decode() if before is not None else "", fmt, path)
        entry = ledger.get(str(path))
        if entry is not None and (before is None or _digest(before) != entry["written"]):
            entry["user_changed"] = True  # the backup is now older than the user's content: restore surgically
        if entry is None:
            entry = {"format": fmt, "backup": None, "mode": None}
            if before is not None:
                backup = self.root / "backups" / f"{len(ledger)}-{path.name}"
                write_atomic(backup, before)
                entry["backup"] = str(backup)
                entry["mode"] = path.stat().st_mode & 0o7777
        changed = dump(change(copy.deepcopy(data)), fmt).encode()
        mode = entry["mode"] if entry["mode"] is not None else 0o600
        write_atomic(path, changed, mode)
        entry["written"] = _digest(changed)
        ledger[str(path)] = entry
        self._save_ledger(ledger)
        return path

    def restore(self, unedit: Unedit) -> list[str]:
        """Put every edited user file back and delete localai's own files; one line per action."""
        lines: list[str] = []
        for name, entry in self._ledger().items():
            path = Path(name)
            backup = Path(entry["backup"]) if entry["backup"] else None
            original = backup.read_bytes() if backup is not None else None
            current = path.read_bytes() if path.exists() else None
            if current is None:
                lines.append(f"{path} no longer exists; nothing to restore")
                continue
            if not entry.get("user_changed") and _digest(current) == entry["written"]:
                if original is None:
                    path.unlink()
                    lines.append(f"removed {path} (localai created it)")
                else:
                    write_atomic(path, original, entry["mode"] if entry["mode"] is not None else 0o600)
                    lines.append(f"restored {path} from its backup")
                continue
            fmt: Format = entry["format"]
            data = parse(current.decode(), fmt, path)
            before = parse(original.decode(), fmt, path) if original is not None else None
            write_atomic(path, dump(unedit(path, data, before), fmt).encode(), path.stat().st_mode & 0o7777)
            lines.append(f"removed localai's entries from {path} (it changed since localai edited it, "
                         "so your other changes are kept)")
        if self.root.exists():
            shutil.rmtree(self.root)
            lines.append(f"removed {self.root}")
        return lines
