"""A request's logprobs as its text is sent: each generated token's entry goes out with the text frame that
completes the token's characters, and a token the client never sees (cut by a stop string) has none."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localai.schema import MAX_TOP_LOGPROBS, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from localai.engines.engine import Engine


def token_text(piece: bytes) -> str:
    """A token's text as the dialects show it: its bytes as UTF-8, a partial character replaced (the bytes are
    given beside it)."""
    return piece.decode("utf-8", errors="replace")


@dataclass
class TokenLogprobs:
    """The entries of one request's generated tokens, each with the characters of the reply it spans."""

    top: int  # alternatives per token (0-20)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    _chars: int = 0  # characters the generated tokens decode to so far
    _sent: int = 0  # characters of the reply sent
    _waiting: list[tuple[int, int, TokenLogprob]] = field(default_factory=list)  # (first char, end char, entry)

    @classmethod
    def asked(cls, top: int | None) -> TokenLogprobs | None:
        """For a request's ``logprobs`` field: None when it asked for none, else with its count of alternatives
        (0 to ``MAX_TOP_LOGPROBS``)."""
        return None if top is None else cls(max(0, min(int(top), MAX_TOP_LOGPROBS)))

    def add(self, engine: Engine, row: int, token: int) -> None:
        """Record ``token``, sampled from batch position ``row`` of the engine's last decode."""
        logprob, best = engine.logprobs(row, token, self.top)
        piece = engine.token_bytes(token)
        start = self._chars
        self._chars += len(self._decoder.decode(piece))
        alternatives = [_top(engine.token_bytes(other), value) for other, value in best]
        self._waiting.append((start, self._chars, TokenLogprob(**_top(piece, logprob),
                                                               top_logprobs=alternatives)))

    def sent(self, text: str, *, final: bool = False) -> list[TokenLogprob]:
        """The entries ``text``, the next part of the reply sent, completes: a token's once all its characters are
        sent (one that is part of a character, once that character is). ``final``: the reply ends with ``text``;
        a token with any character sent is reported, the rest (past a stop string) never are."""
        self._sent += len(text)
        ready = 0
        for start, end, _ in self._waiting:
            if (start < self._sent) if final else max(end, start + 1) <= self._sent:
                ready += 1
            else:
                break
        entries = [entry for _, _, entry in self._waiting[:ready]]
        del self._waiting[:ready]
        if final:
            self._waiting.clear()
        return entries


def _top(piece: bytes, logprob: float) -> TopLogprob:
    return TopLogprob(token=token_text(piece), bytes=list(piece), logprob=logprob)
