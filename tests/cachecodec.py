"""A codec for prompt-store tests without an engine: a state is 8 bytes per token, derived from the token."""

from __future__ import annotations

import struct
from typing import Any

from localai.promptcache.store import StateBytes


def state_of(tokens: list[int], rest: bytes = b"") -> bytes:
    return b"".join(struct.pack("<q", token * 7 + 1) for token in tokens) + rest


class BytesCodec:
    def __init__(self, *, rest: bytes = b"", whole: bool = False) -> None:
        self.rest = rest  # what a sliding-window engine could not cut, appended to every state
        self.whole = whole

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        if self.whole:
            return None
        body, rest = state[:8 * n_tokens], state[8 * n_tokens:]
        if len(body) != 8 * n_tokens:
            raise ValueError("state shorter than its tokens")
        return {"bytes_per_token": 8}, [body[8 * a:8 * b] for a, b in ranges], rest

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes:
        return b"".join(pieces) + rest if not self.whole else rest


class EvictingCodec(BytesCodec):
    """Cuts states like BytesCodec; the first cut also runs ``during`` (the writer thread's eviction, landing while
    the worker cuts its state outside the store's lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.during: list[Any] = []

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        while self.during:
            self.during.pop(0)()
        return super().state_split(state, n_tokens, ranges)
