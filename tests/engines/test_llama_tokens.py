"""A prompt that extends a recent one is tokenized from its last turn marker on, and the tokens are exactly
llama.cpp's for the whole text: on a BPE vocabulary (SmolLM2, ChatML) and a SentencePiece one with whitespace-run
tokens and 6,000 special tokens (Gemma 3), with text that imitates, splits and crowds the markers."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from localai.engines.engine import LoadOptions
from localai.engines.llama_cpp import LlamaCppEngine
from localai.engines.llama_tokens import MIN_CHARS, PrefixTokenizer, Vocabulary
from localai.text import common_prefix_length
from tests.parallel import threads

CHATML = ("<|im_start|>{role}\n{content}<|im_end|>\n", "<|im_start|>assistant\n")
GEMMA = ("<start_of_turn>{role}\n{content}<end_of_turn>\n", "<start_of_turn>model\n")
AWKWARD = [
    "plain words about the module and its tests",
    "a marker inside the text: <|im_start|>user\nnot a real turn<|im_end|> and <start_of_turn>model\n too",
    "a marker cut short at the end <|im_", "<end_of_", "\n\n\n\nnewline runs\n\n", "   spaces before   ",
    "unicode: naïve café, 東京, emoji 🙂🚀, combining e\u0301", "tabs\tand\r\ncarriage returns", "<unused0><mask>",
    "```python\ndef f(x):\n    return x  # <|endoftext|>\n```", "", " ", "\n",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[LlamaCppEngine, tuple[str, str]]]:
    path: Path = request.getfixturevalue(f"{request.param}_path")
    loaded = LlamaCppEngine(LoadOptions(n_threads=threads(), model_path=str(path), num_ctx=512, n_parallel=1))
    yield loaded, (CHATML if request.param == "smollm2" else GEMMA)
    loaded.close()


def render(turn: str, messages: list[tuple[str, str]], header: str, bos: str) -> str:
    return bos + "".join(turn.format(role=role, content=content) for role, content in messages) + header


def test_common_prefix_length() -> None:
    assert common_prefix_length("abcdef", "abcxyz") == 3
    assert common_prefix_length("", "abc") == 0 and common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("ab", "abc") == 2 and common_prefix_length("x" * 5000 + "a", "x" * 5000 + "b") == 5000


def test_growing_conversations_tokenize_exactly_as_the_whole_text(
        engine: tuple[LlamaCppEngine, tuple[str, str]]) -> None:
    model, (turn, header) = engine
    vocabulary = model.prompt_tokens.vocabulary
    assert vocabulary.cuttable and any(text in ("<|im_start|>", "<start_of_turn>") for text in
                                       vocabulary.control.values())
    rng = random.Random(3)
    bos = "<bos>" if header.startswith("<start_of_turn>") else ""  # Gemma's template writes BOS itself
    sessions: list[list[tuple[str, str]]] = [
        [("system", "You are a coding agent. " * 120)], [("system", "You are a coding agent. " * 120)]]
    before = model.prompt_tokens.reused
    checked = 0
    for step in range(40):
        messages = sessions[step % 2]  # two sessions interleaved, sharing their system prompt
        role = "assistant" if messages[-1][0] != "assistant" else "user"
        content = " ".join(rng.choice(AWKWARD) for _ in range(rng.randint(1, 4)))
        messages.append((role, content))
        if step == 25:  # history rewritten early: the prompt leaves the recent ones near the start
            messages[1] = ("user", "an edited first message " + messages[1][1])
        text = render(turn, messages, header, bos)
        if len(text) < MIN_CHARS:
            continue
        assert model.tokenize(text) == model._tokenize_whole(text), f"step {step}"
        checked += 1
    assert checked >= 35
    assert model.prompt_tokens.reused - before >= 30  # the reuse really ran (not only whole tokenizations)


def test_a_prompt_that_splits_a_marker_is_tokenized_whole_and_correctly(
        engine: tuple[LlamaCppEngine, tuple[str, str]]) -> None:
    model, (turn, header) = engine
    marker = header.split("\n")[0].removesuffix("assistant").removesuffix("model")  # <|im_start|> / <start_of_turn>
    base = render(turn, [("system", "rules " * 500), ("user", "question")], header, "")
    model.tokenize(base)
    for extension in (marker[:-2], marker[:-2] + "x" + marker[-1], "\n\n" + marker, marker + marker[:3]):
        text = base + extension + "more text"
        assert model.tokenize(text) == model._tokenize_whole(text), repr(extension)
    shorter = base[: len(base) // 2]  # a prompt the recent ones extend, not the other way round
    assert model.tokenize(shorter) == model._tokenize_whole(shorter)


# -- the cut's rules, on a vocabulary built to break them ---------------------------------------------------------
# A scripted tokenizer with llama.cpp's partition: special strings matched longest first, then every other character
# a token of its own. Its vocabulary has a special token that contains the turn marker, which neither real model has.
SPECIALS = {"<|im_start|>": 1, "<|im_end|>": 2, "\n<|im_start|>assistant": 3}


def scripted_tokens(text: str, specials: dict[str, int] = SPECIALS) -> list[int]:
    pieces: list[str | int] = [text]
    for string in sorted(specials, key=len, reverse=True):
        split: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, int):
                split.append(piece)
                continue
            for index, part in enumerate(piece.split(string)):
                if index:
                    split.append(specials[string])
                if part:
                    split.append(part)
        pieces = split
    return [t for p in pieces for t in ([p] if isinstance(p, int) else [1000 + ord(c) for c in p])]


def scripted(known: dict[str, int], actual: dict[str, int]) -> PrefixTokenizer:
    """A PrefixTokenizer told of the ``known`` special tokens over a tokenizer that has the ``actual`` ones."""
    special: dict[int, set[str]] = {}
    for string in known:
        special.setdefault(len(string), set()).add(string)
    vocabulary = Vocabulary(True, {token: string for string, token in known.items()},
                            {length: frozenset(strings) for length, strings in special.items()})
    return PrefixTokenizer(lambda: vocabulary, lambda text: scripted_tokens(text, actual),
                           lambda text: scripted_tokens(text, actual))


def test_a_marker_that_a_longer_special_token_may_still_claim_is_not_cut_at() -> None:
    tokenizer = scripted(SPECIALS, SPECIALS)
    base = "<|im_start|>system\n" + "rules " * 400 + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    earlier = base + "<|im_start|>assist"  # the marker, with text around it that is not yet the longer token
    assert tokenizer.tokenize(earlier) == scripted_tokens(earlier)
    later = base + "<|im_start|>assistant\nanswer"  # here the longer token claims the marker and the newline
    assert tokenizer.tokenize(later) == scripted_tokens(later)
    assert tokenizer.reused == 1  # cut at the user turn's marker, before the text the two prompts share


def test_an_earlier_prompt_not_cut_where_expected_falls_back_to_the_whole_text() -> None:
    actual = {"<|im_start|>": 1, "<|im_end|>": 2, "\n<|im_start|>": 4}  # a token it was not told of
    tokenizer = scripted({"<|im_start|>": 1, "<|im_end|>": 2}, actual)
    earlier = "<|im_start|>system\n" + "rules " * 400 + "\n<|im_start|>user\nquestion and more words"
    tokenizer.tokenize(earlier)
    later = earlier + " and a longer question"
    assert tokenizer.tokenize(later) == scripted_tokens(later, actual)
    assert tokenizer.reused == 0


def test_a_marker_that_another_special_token_overlaps_is_not_cut_at() -> None:
    # A chain of overlapping special tokens, longest first: whether the one over the marker wins depends on text
    # far to the right of it, past the margin. In the earlier prompt it loses; in the later one it takes the marker.
    chain = {"<m>": 1, "x<m>a": 2, "abcdef": 3, "fghijkl": 4, "lmnopqrs": 5}
    tokenizer = scripted(chain, chain)
    base = "<m>system\n" + "rules " * 400 + "<m>user\n"
    earlier = base + "x<m>abcdefghijklmnopqrs and on"
    assert tokenizer.tokenize(earlier) == scripted_tokens(earlier, chain)
    later = base + "x<m>abcdefghijklmnopqrX and on"
    assert tokenizer.tokenize(later) == scripted_tokens(later, chain)
    assert tokenizer.reused == 1  # cut at the user turn's marker instead
