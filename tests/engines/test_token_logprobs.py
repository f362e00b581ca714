"""Logprobs from logits (the whole vocabulary's log-softmax, the top alternatives) and their alignment with the
text a request sends: a token's entry goes with the text that completes it, none past a stop string."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localai.engines.engine import top_logprobs
from localai.engines.token_logprobs import TokenLogprobs
from localai.text import StopMatcher


def test_top_logprobs_are_the_log_softmax_best_first() -> None:
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.5], dtype=np.float32)
    chosen, best = top_logprobs(logits, 4, 3)
    total = math.log(sum(math.exp(v) for v in logits.tolist()))
    assert chosen == pytest.approx(0.5 - total)
    assert [token for token, _ in best] == [1, 2, 0]  # equal values by token id
    assert [value for _, value in best] == pytest.approx([3 - total, 3 - total, 1 - total])
    assert top_logprobs(logits, 0, 0)[1] == []
    assert len(top_logprobs(logits, 0, 20)[1]) == 5  # no more than the vocabulary
    huge = np.array([1000.0, 0.0], dtype=np.float32)  # no overflow: log-sum-exp from the maximum
    assert top_logprobs(huge, 0, 1)[0] == pytest.approx(0.0)


class Pieces:
    """An engine as TokenLogprobs sees it: token i stands for PIECES[i], each at logprob -i/10."""

    PIECES = [b"He", b"llo", b" w", b"or", b"ld", b"\xe2\x82", b"\xac", b"!", b" STOP", b" more"]

    def logprobs(self, row: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        return -token / 10, [(token, -token / 10), (0, 0.0)][:top]

    def token_bytes(self, token: int) -> bytes:
        return self.PIECES[token]


def run(tokens: list[int], stop: list[str], flush_every: int) -> tuple[str, list[str]]:
    """Feed tokens through a stop matcher as the serving loop does, sending every ``flush_every`` tokens; the text
    sent and the tokens whose entries went with it."""
    engine, logprobs, matcher = Pieces(), TokenLogprobs(2), StopMatcher(stop)
    sent, entries, unsent = "", [], ""
    for count, token in enumerate(tokens, start=1):
        logprobs.add(engine, 0, token)  # type: ignore[arg-type]
        unsent += matcher.feed(engine.token_bytes(token))
        if unsent and count % flush_every == 0:
            entries += logprobs.sent(unsent)
            sent, unsent = sent + unsent, ""
            assert sent.startswith(b"".join(bytes(e["bytes"]) for e in entries).decode())  # never ahead of the text
        if matcher.stopped:
            break
    tail = unsent + matcher.flush()
    entries += logprobs.sent(tail, final=True)
    return sent + tail, [e["token"] for e in entries]


@pytest.mark.parametrize("flush_every", [1, 2, 3])
def test_each_token_goes_out_with_the_text_it_completes(flush_every: int) -> None:
    text, tokens = run([0, 1, 2, 3, 4, 5, 6, 7], [], flush_every)
    assert text == "Hello world€!"
    assert tokens == ["He", "llo", " w", "or", "ld", "\ufffd", "\ufffd", "!"]  # the euro's two tokens, bytes apart


@pytest.mark.parametrize("flush_every", [1, 2, 5])
def test_tokens_past_a_stop_string_are_never_reported(flush_every: int) -> None:
    text, tokens = run([0, 1, 2, 3, 4, 8, 9], [" ST"], flush_every)
    assert text == "Hello world"
    assert tokens == ["He", "llo", " w", "or", "ld"]  # " STOP" holds the stop string: not sent, no entry
    text, tokens = run([0, 1, 2, 3, 4], ["llo w"], flush_every)
    assert text == "He"
    assert tokens == ["He"]  # "llo" begins the stop string: none of it is sent


def test_a_token_partly_sent_before_the_stop_is_reported() -> None:
    text, tokens = run([0, 1, 2, 3, 4], ["lo w"], 1)
    assert text == "Hel" and tokens == ["He", "llo"]


def test_alternatives_carry_text_and_bytes() -> None:
    logprobs = TokenLogprobs(2)
    logprobs.add(Pieces(), 0, 5)  # type: ignore[arg-type]
    logprobs.add(Pieces(), 0, 6)  # type: ignore[arg-type]
    first, second = logprobs.sent("€", final=True)
    assert first["bytes"] == [0xE2, 0x82] and second["bytes"] == [0xAC]
    assert first["logprob"] == -0.5 and first["top_logprobs"][1] == {"token": "He", "bytes": [72, 101],
                                                                      "logprob": 0.0}
