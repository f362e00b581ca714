"""Tokenizing a prompt that extends a recent one without tokenizing its whole length again.

An agent's prompt grows by a message or two a turn, and llama.cpp's tokenizer takes time in proportion to the
whole text (Gemma 3's vocabulary: about 70 ms for 7,000 tokens on this 2-core machine, every request). With special
tokens parsed, llama.cpp first cuts the text at every special-token string and tokenizes each piece between them
on its own (``tokenizer_st_partition``; SentencePiece's space prefix looks only at whether the piece before was a
special token). So where a control token such as ``<|im_start|>`` stands at the same place in the new text and in
a recent one, and no special-token string overlaps it there, the tokens before it are the recent prompt's tokens
before it, and only the text from it on needs tokenizing (the recent prompt's tokens are checked to have been cut
there too). Vocabularies this reasoning does not cover (WordPiece,
Unigram, RWKV, one that appends EOS, tokens that strip the whitespace beside them) are always tokenized whole.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from localai.text import common_prefix_length

MIN_CHARS = 2_000  # shorter prompts tokenize in well under a millisecond: not worth a lookup
RECENT = 8  # prompts remembered (a few sessions' last prompts per worker)


@dataclass(frozen=True)
class Vocabulary:
    """What the prefix reuse needs to know of a vocabulary (read once at load)."""

    cuttable: bool  # SentencePiece or BPE, no EOS appended, no special token strips whitespace
    control: dict[int, str]  # control token id -> its text (the candidates to cut at)
    special: dict[int, frozenset[str]]  # text length -> every special-token text of that length (the overlap check)


class PrefixTokenizer:
    """``tokenize(text)`` equal to ``whole(text)``, reusing the tokens of a recent prompt the text extends.

    ``whole(text)`` tokenizes a prompt (BOS added as the model wants); ``piece(text)`` tokenizes text that follows
    other text (no BOS), both with special tokens parsed."""

    def __init__(self, vocabulary: Callable[[], Vocabulary], whole: Callable[[str], list[int]],
                 piece: Callable[[str], list[int]]) -> None:
        self._load_vocabulary = vocabulary  # read on the first long prompt (a 262k vocabulary takes ~0.1 s)
        self._vocabulary: Vocabulary | None = None
        self.whole = whole
        self.piece = piece
        self.recent: OrderedDict[str, array[int]] = OrderedDict()  # prompt -> its tokens (4 bytes each)
        self.reused = 0  # prompts tokenized from a recent one's tokens (for tests and the debug log)

    @property
    def vocabulary(self) -> Vocabulary:
        if self._vocabulary is None:
            self._vocabulary = self._load_vocabulary()
        return self._vocabulary

    def tokenize(self, text: str, *, remember: bool = True) -> list[int]:
        """``remember``: keep the text among the recent prompts (not for a probe of how text would continue)."""
        if len(text) < MIN_CHARS or not self.vocabulary.cuttable:
            return self.whole(text)
        tokens = self._extend(text)
        if tokens is None:
            tokens = self.whole(text)
        else:
            self.reused += 1
        if not remember:
            return tokens
        self.recent[text] = array("i", tokens)
        self.recent.move_to_end(text)
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        return tokens

    def _extend(self, text: str) -> list[int] | None:
        best, shared = None, 0
        for earlier in self.recent:
            length = common_prefix_length(earlier, text)
            if length > shared:
                best, shared = earlier, length
        if best is None:
            return None
        earlier_tokens = self.recent[best]
        cut, marker = self._cut(best, earlier_tokens, shared)
        if cut <= 0:
            return None
        tail_before = self.piece(best[cut:])
        keep = len(earlier_tokens) - len(tail_before)
        if keep <= 0 or earlier_tokens[keep] != marker or earlier_tokens[keep:].tolist() != tail_before:
            return None  # the earlier prompt was not cut there by llama.cpp: tokenize whole
        return earlier_tokens[:keep].tolist() + self.piece(text[cut:])

    def _cut(self, earlier: str, earlier_tokens: array[int], shared: int) -> tuple[int, int]:
        """The last place where a control token of the earlier prompt starts, that no other special-token text
        overlaps, and that ends at least the longest special-token text before the end of the shared text:
        (offset, token id), or (-1, -1).

        No special-token text overlaps it, so llama.cpp's partition puts the token there in both prompts (nothing can
        claim its characters), and no match crosses it: the pieces before it are the same in both. The window the
        overlap check reads lies inside the shared text, so the check holds for both."""
        vocabulary = self.vocabulary
        limit = shared - max(vocabulary.special, default=0)
        best, marker = -1, -1
        for token in set(earlier_tokens):
            string = vocabulary.control.get(token)
            if not string:
                continue
            at = earlier.rfind(string, 0, max(0, limit))
            while at > best:
                if not self._overlapped(earlier, at, string):
                    best, marker = at, token
                    break
                at = earlier.rfind(string, 0, at + len(string) - 1)
        return best, marker

    def _overlapped(self, text: str, at: int, marker: str) -> bool:
        """Whether a special-token text other than ``marker`` at ``at`` overlaps ``text[at:at + len(marker)]``."""
        end = at + len(marker)
        for length, strings in self.vocabulary.special.items():
            for start in range(max(0, at - length + 1), end):
                if (start != at or length != len(marker)) and text[start:start + length] in strings:
                    return True
        return False
