"""Draft-free speculative decoding: drafts looked up in the sequence's own context (prompt lookup, n-grams).

Coding agents' replies repeat their context (a file rewritten with one change, a patch quoting the lines around it),
so the tokens that followed the last few tokens where they appeared before are a good guess of what comes next. The
serving loop evaluates the guesses with the next token in one batch and samples each position in turn, keeping the
draft while the sample equals it: every kept token is the one the sampler chose, so output is the same with and
without drafts (greedy, seeded, grammars and penalties alike), and at a temperature it is an exact rejection
sampler for a one-token-certain draft (a draft token d is kept with probability p(d); on a miss the token is drawn
from p without d). Drafting pays only when enough of a draft is kept: the length adapts to what is kept, and a
sequence whose drafts keep missing stops drafting for a while.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM = 3  # tokens of context matched
MIN_DRAFT, MAX_DRAFT = 2, 12
COOLDOWN = 48  # tokens without drafting after a run of misses
MISSES_TO_PAUSE = 3


@dataclass
class Drafter:
    """The n-gram index of one sequence's tokens, and how well its drafts have done."""

    tokens: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where what followed it starts
    length: int = 4  # the next draft's length
    misses: int = 0  # drafts in a row with nothing kept
    paused_until: int = 0  # no drafts before this many tokens
    drafted: int = 0
    accepted: int = 0

    def extend(self, new: list[int]) -> None:
        """Add tokens (the prompt, then each kept token) to the index."""
        tokens, index = self.tokens, self.index
        for token in new:
            tokens.append(token)
            end = len(tokens) - 1  # the n-gram ending before this token is followed by it
            if end >= NGRAM:
                index[tuple(tokens[end - NGRAM:end])] = end

    def draft(self, room: int) -> list[int]:
        """Up to ``room`` tokens that followed the last n-gram the last time it appeared; [] when none did or
        drafting is paused."""
        tokens = self.tokens
        if room < 1 or len(tokens) < self.paused_until or len(tokens) <= NGRAM:
            return []
        start = self.index.get(tuple(tokens[-NGRAM:]))
        if start is None:
            return []
        return tokens[start:start + min(self.length, room)]

    def record(self, drafted: int, kept: int) -> None:
        """How a draft did: grow the next one after a full hit, shrink it after a poor one, pause after misses."""
        self.drafted += drafted
        self.accepted += kept
        if kept == drafted:
            self.length = min(MAX_DRAFT, self.length * 2)
        elif kept * 2 < drafted:
            self.length = max(MIN_DRAFT, self.length // 2)
        self.misses = self.misses + 1 if kept == 0 else 0
        if self.misses >= MISSES_TO_PAUSE:
            self.paused_until = len(self.tokens) + COOLDOWN
            self.misses = 0
