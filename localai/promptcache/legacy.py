"""Reading the whole-sequence cache entries (``<fingerprint>/<id>.kv``) written before token blocks, to convert
them (a worker loading that fingerprint does so at start) or to list and remove them (``localai cache``)."""

from __future__ import annotations

import array
import json
import struct
import zlib
from pathlib import Path
from typing import Any

from localai.promptcache.blocks import CorruptEntry

MAGIC = b"LAIKV002"
HEADER_LEN = struct.Struct("<I")


def read_entry(path: Path, fingerprint_hex: str) -> tuple[dict[str, Any], list[int], bytes]:
    """An old entry's header, tokens and checksum-verified payload; raises ``CorruptEntry``/``OSError``."""
    with open(path, "rb") as handle:
        return _read(handle, fingerprint_hex, with_payload=True)


def read_header(path: Path, fingerprint_hex: str) -> tuple[dict[str, Any], list[int]]:
    with open(path, "rb") as handle:
        header, tokens, _ = _read(handle, fingerprint_hex, with_payload=False)
    return header, tokens


def _read(handle: Any, fingerprint_hex: str, *, with_payload: bool) -> tuple[dict[str, Any], list[int], bytes]:
    if handle.read(len(MAGIC)) != MAGIC:
        raise CorruptEntry("not a localai cache file")
    raw_length = handle.read(HEADER_LEN.size)
    if len(raw_length) != HEADER_LEN.size:
        raise CorruptEntry("truncated header")
    (length,) = HEADER_LEN.unpack(raw_length)
    try:
        header = json.loads(handle.read(length))
        n_tokens, payload_bytes = int(header["n_tokens"]), int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"bad header: {exc}") from exc
    if header.get("fingerprint") != fingerprint_hex:
        raise CorruptEntry("made by another model or engine configuration")
    token_bytes = handle.read(4 * n_tokens)
    if len(token_bytes) != 4 * n_tokens:
        raise CorruptEntry("truncated tokens")
    tokens = array.array("i")
    tokens.frombytes(token_bytes)
    payload = b""
    if with_payload:
        payload = handle.read(payload_bytes + 1)
        if len(payload) != payload_bytes:
            raise CorruptEntry("truncated or padded payload")
        expected = f"crc32:{zlib.crc32(payload, zlib.crc32(token_bytes)):08x}"
        if expected != header.get("checksum"):
            raise CorruptEntry("checksum mismatch")
    return header, tokens.tolist(), payload
