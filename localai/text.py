"""Text helpers every room uses: UTF-8 reassembly and stop strings for streamed completions, the common prefix of
two prompts, and how much of a stream to hold back while it may still begin a marker."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any


class StopMatcher:
    """Turns a stream of byte pieces into text, holding back what may be the start of a stop string."""

    def __init__(self, stop: list[str]) -> None:
        self._stop = [item for item in stop if item]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, piece: bytes) -> str:
        """Add a token's bytes; return the text that is now safe to emit (stops at a stop string)."""
        self._pending += self._decoder.decode(piece)
        if not self._stop:
            text, self._pending = self._pending, ""
            return text
        earliest = -1
        for stop in self._stop:
            index = self._pending.find(stop)
            if index != -1 and (earliest == -1 or index < earliest):
                earliest, self.matched = index, stop
        if earliest != -1:
            self.stopped = True
            text, self._pending = self._pending[:earliest], ""
            return text
        cut = len(self._pending) - partial_suffix(self._pending, self._stop)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def flush(self) -> str:
        """Whatever is held back once generation ends without a stop string."""
        text = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return "" if self.stopped else text


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters, tokens) ``a`` and ``b`` share. Prompts are long and mostly equal: one
    comparison when one extends the other, else a binary search on slices (each comparison runs in C)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that begins one of ``markers``: what a stream must hold back while
    the next piece may complete a marker (a stop string, a tool-call tag)."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:length]):
                best = max(best, length)
                break
    return best
