"""Explaining why a session's prompt stopped extending its last one (the cache's divergence diagnosis)."""

from __future__ import annotations

import json
from pathlib import Path

from localai.promptcache import divergences
from localai.runtime import divergence
from localai.schema import Message, ReasoningBlock, TextBlock, Tool

READ = Tool("read", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}})
BASH = Tool("bash", "Run a command", {"type": "object", "properties": {"command": {"type": "string"}}})


def turn(messages: list[Message], tools: list[Tool], **kwargs: object) -> divergence.Turn:
    thought = {id(m): "".join(b.text for b in m.content if isinstance(b, ReasoningBlock)) for m in messages}
    prompt = "|".join(f"{m.role}:{thought[id(m)]}{m.text()}" for m in messages)
    prompt += "|tools:" + ",".join(t.name for t in tools)
    return divergence.turn_of(messages, tools, prompt, **kwargs)  # type: ignore[arg-type]


SYSTEM = Message("system", [TextBlock("You are a coding agent. Today is 2026-11-23.")])
FIRST = [SYSTEM, Message("user", [TextBlock("fix the bug")])]
REPLY = Message("assistant", [ReasoningBlock("look at main.py"), TextBlock("done")])


def cause(previous: divergence.Turn, current: divergence.Turn) -> str:
    tracker = divergence.Tracker()
    assert tracker.compare("m", "s", previous) is None
    found = tracker.compare("m", "s", current)
    assert found is not None
    return divergence.explain(found[1], current, found[0])[0]


def test_a_prompt_that_extends_the_last_one_is_no_divergence() -> None:
    tracker = divergence.Tracker()
    first = turn(FIRST, [READ])
    assert tracker.compare("m", "s", first) is None
    grown = turn([*FIRST, REPLY, Message("user", [TextBlock("and now?")])], [READ])
    grown.prompt = first.prompt + grown.prompt  # extends it
    assert tracker.compare("m", "s", grown) is None


def test_each_cause_is_named() -> None:
    base = turn(FIRST, [READ, BASH])
    dated = [Message("system", [TextBlock("You are a coding agent. Today is 2026-11-24.")]), FIRST[1]]
    assert cause(base, turn(dated, [READ, BASH])) == "system prompt changed"
    assert cause(base, turn(FIRST, [BASH, READ])) == "tools reordered"
    assert cause(base, turn(FIRST, [READ])) == "tools changed"
    long = turn([*FIRST, REPLY, Message("user", [TextBlock("more")])], [READ, BASH])
    fitted = turn([SYSTEM, Message("user", [TextBlock("more")])], [READ, BASH], fitted=(2, 0, 0))
    assert cause(long, fitted) == "context fitting cut the conversation"
    rewritten = [SYSTEM, Message("user", [TextBlock("fix the other bug")]), REPLY, Message("user", [TextBlock("x")])]
    assert cause(long, turn(rewritten, [READ, BASH])) == "history rewritten"
    no_reasoning = [*FIRST, Message("assistant", [TextBlock("done")]), Message("user", [TextBlock("more")])]
    assert cause(long, turn(no_reasoning, [READ, BASH])) == "reasoning dropped by the client"
    reminded = [*FIRST, REPLY, Message("user", [TextBlock("more")]), Message("developer", [TextBlock("note")])]
    moved = turn(reminded, [READ, BASH])
    moved.prompt = "system:note|" + moved.prompt  # the template put it first
    assert cause(long, moved) == "a new system message moved to the front by the template"


def test_side_requests_under_the_same_session_are_compared_with_their_own_thread() -> None:
    tracker = divergence.Tracker()
    main = turn(FIRST, [READ])
    title = turn([Message("system", [TextBlock("Write a title")]), FIRST[1]], [])
    assert tracker.compare("m", "s", main) is None
    assert tracker.compare("m", "s", title) is not None  # a new thread: parts from the main one
    grown = turn([*FIRST, REPLY], [READ])
    grown.prompt = main.prompt + "|more"
    assert tracker.compare("m", "s", grown) is None  # extends the main thread, not the title's


def test_records_are_kept_bounded_and_a_damaged_line_is_skipped(tmp_path: Path) -> None:
    tracker = divergence.Tracker(tmp_path)
    for index in range(3 * divergences.KEEP_RECORDS):
        tracker.record(divergences.Divergence("m", f"s{index}", 1.0 + index, 10, 100, 40, "tools reordered"))
    with open(tmp_path / divergences.RECORD_FILE, "a") as handle:
        handle.write("{not json\n" + json.dumps({"model": "m"}) + "\n")
    found = divergences.read(tmp_path)
    assert divergences.KEEP_RECORDS <= len(found) <= 2 * divergences.KEEP_RECORDS + 1
    assert found[-1].session == f"s{3 * divergences.KEEP_RECORDS - 1}"
    assert divergences.read(tmp_path / "missing") == []
