from localai.text import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[bytes]) -> str:
    out = "".join(matcher.feed(piece) for piece in pieces)
    return out + matcher.flush()


def test_passes_text_through_without_stops() -> None:
    assert feed_all(StopMatcher([]), [b"Hel", b"lo"]) == "Hello"


def test_stops_at_a_stop_string_split_across_pieces() -> None:
    matcher = StopMatcher(["</end>"])
    assert feed_all(matcher, [b"abc</", b"en", b"d> more"]) == "abc"
    assert matcher.stopped


def test_holds_back_only_a_possible_prefix() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed(b"xyS") == "xy"
    assert matcher.feed(b"a") == "Sa"


def test_reassembles_multibyte_utf8() -> None:
    data = "héllo ✓".encode()
    assert feed_all(StopMatcher([]), [data[i:i + 1] for i in range(len(data))]) == "héllo ✓"
