"""The record of prompts that stopped matching their session's cached prefix: ``<cache>/divergences.jsonl``.

The runtime finds them (``runtime/divergence.py``) and appends them here; ``localai cache diverged`` and
``/api/cache`` read them without a daemon or a model.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from localai import paths
from localai.promptcache.blocks import write_atomic

RECORD_FILE = "divergences.jsonl"
KEEP_RECORDS = 200  # the file is cut back to this many lines when it doubles


@dataclass
class Divergence:
    """One prompt that did not extend its session's last one."""

    model: str
    session: str
    at: float
    offset_tokens: int  # where the prompts part, in tokens of the new prompt
    previous_tokens: int  # how long the last prompt of the session was
    offset_chars: int
    cause: str
    detail: str = ""
    early: bool = True  # the last prompt itself stopped matching, not only the reply resent after it
    partition: str = ""  # the session's cache partition (an API key's id, a cache_salt's hash): whose record it is


def append(divergence: Divergence, root: Path | None = None) -> None:
    """Add one record (best effort: a cache folder that cannot be written loses the record, nothing else)."""
    path = (root or paths.cache_dir()) / RECORD_FILE
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(asdict(divergence)) + "\n"
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line)
        if path.stat().st_size > 2 * KEEP_RECORDS * len(line):
            kept = path.read_text(encoding="utf-8").splitlines()[-KEEP_RECORDS:]
            write_atomic(path, [("\n".join(kept) + "\n").encode()])


def read(root: Path | None = None, *, since: float = 0.0) -> list[Divergence]:
    """Recorded divergences, oldest first (a damaged line is skipped)."""
    path = (root or paths.cache_dir()) / RECORD_FILE
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                item = Divergence(**json.loads(line))
            except (ValueError, TypeError):
                continue
            if item.at >= since:
                found.append(item)
    return found
