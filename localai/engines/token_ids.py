"""Token ids a client sent in place of text (an embeddings request may): are they this model's own?

Ids are this model's when its tokenizer would write them: each is in its vocabulary, and the text they spell
tokenizes back to the same ids (control tokens such as BOS and EOS, which spell nothing, aside). Ids made by another
tokenizer (LangChain sends OpenAI's tiktoken ids by default) fail one or the other: they run past a smaller
vocabulary, or spell text this tokenizer cuts differently. One id that happens to stand for a whole word in both
vocabularies cannot be told apart; a sentence almost always can.
"""

from __future__ import annotations

from collections.abc import Callable


class ForeignTokens(ValueError):
    """The ids are not this model's: the request gets a 400 saying so (and the dialect says what to send)."""


def check_own(inputs: list[list[int]], n_vocab: int, tokenize: Callable[[str], list[int]],
              token_bytes: Callable[[int], bytes]) -> None:
    """Raise ``ForeignTokens`` naming the first input whose ids this model's tokenizer would not write."""
    for index, ids in enumerate(inputs):
        if not ids:
            raise ForeignTokens(f"input {index} is an empty list of token ids")
        outside = next((token for token in ids if not 0 <= token < n_vocab), None)
        if outside is not None:
            raise ForeignTokens(f"input {index} holds token id {outside}, outside this model's vocabulary of "
                                f"{n_vocab} ids: the ids were made by another tokenizer")
        spelled = [(token, token_bytes(token)) for token in ids]
        try:
            text = b"".join(piece for _, piece in spelled).decode("utf-8")
        except UnicodeDecodeError:
            text = None
        wanted = [token for token, piece in spelled if piece]
        candidates = [text, text[1:] if text and text.startswith(" ") else None] if text is not None else []
        if not any(candidate is not None and [t for t in tokenize(candidate) if token_bytes(t)] == wanted
                   for candidate in candidates):
            raise ForeignTokens(f"input {index}'s token ids are not how this model's tokenizer writes any text: "
                                "they were made by another tokenizer")
