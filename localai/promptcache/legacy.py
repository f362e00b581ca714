"""Reading the whole-sequence cache entries (``<fingerprint>/<id>.kv``) written before token blocks, to convert
them (a worker loading that fingerprint does so at start) or to list and remove them (``localai cache``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localai.promptcache.blocks import CorruptEntry, read_framed

MAGIC = b"LAIKV002"


def read_entry(path: Path, fingerprint_hex: str) -> tuple[dict[str, Any], list[int], bytes]:
    """An old entry's header, tokens and checksum-verified payload; raises ``CorruptEntry``/``OSError``."""
    return _read(path, fingerprint_hex, with_payload=True)


def read_header(path: Path, fingerprint_hex: str) -> tuple[dict[str, Any], list[int]]:
    header, tokens, _ = _read(path, fingerprint_hex, with_payload=False)
    return header, tokens


def _read(path: Path, fingerprint_hex: str, *, with_payload: bool) -> tuple[dict[str, Any], list[int], bytes]:
    with open(path, "rb") as handle:
        header, tokens, payload = read_framed(handle, MAGIC, with_payload=with_payload)
    if header.get("fingerprint") != fingerprint_hex:
        raise CorruptEntry("made by another model or engine configuration")
    return header, tokens, payload
