from localai.runtime.fitting import FitMemory, apply, conversation_key, next_cut, protected_bounds, slim_tools
from localai.schema import Message, TextBlock, Tool, ToolCallBlock, ToolResultBlock


def msg(role: str, text: str) -> Message:
    return Message(role, [TextBlock(text)])  # type: ignore[arg-type]


CONVERSATION = [msg("system", "rules " * 50), msg("user", "u1 " * 100), msg("assistant", "a1 " * 100),
                msg("user", "u2 " * 100), msg("assistant", "a2 " * 100), msg("user", "LAST question"),
                msg("tool", "result after the last user message")]


def test_protected_bounds_keep_system_and_the_tail_from_the_last_user_message() -> None:
    assert protected_bounds(CONVERSATION) == (1, 5)


def test_dropping_removes_the_oldest_middle_messages_only() -> None:
    fitted = apply(CONVERSATION, 2, 0)
    assert [m.text()[:2] for m in fitted] == ["ru", "u2", "a2", "LA", "re"]
    everything = apply(CONVERSATION, 99, 0)
    assert [m.role for m in everything] == ["system", "user", "tool"]
    assert everything[1].text() == "LAST question"


def test_next_cut_drops_with_slack_then_shortens() -> None:
    step = next_cut(CONVERSATION, 0, 0, prompt_tokens=1000, budget=800, n_ctx=1000)
    assert step is not None and step[0] >= 1 and step[1] == 0
    step = next_cut(CONVERSATION, 4, 0, prompt_tokens=900, budget=800, n_ctx=1000)
    assert step is not None and step[0] == 4 and step[1] > 0
    shortened = apply(CONVERSATION, 4, step[1])
    assert "omitted by localai" in shortened[0].text()
    assert shortened[1].text() == "LAST question"
    assert next_cut([msg("user", "tiny")], 0, 0, prompt_tokens=900, budget=800, n_ctx=1000) is None


def test_the_cut_is_remembered_per_conversation() -> None:
    memory = FitMemory(capacity=2)
    key = conversation_key("m", "", None, CONVERSATION)
    longer = [*CONVERSATION, msg("user", "more")]
    assert key == conversation_key("m", "", None, longer)
    assert key != conversation_key("m", "", "session-1", CONVERSATION)
    memory.put(key, CONVERSATION, 3, 1)
    assert memory.get(key, longer) == (3, 1)  # the next turn drops the same messages
    memory.put("b", CONVERSATION, 1)
    memory.put("c", CONVERSATION, 1)
    assert memory.get(key, CONVERSATION) == (0, 0)  # evicted beyond capacity


def test_a_remembered_cut_stays_in_its_partition_and_with_its_messages() -> None:
    """Two API keys (partitions) with the same opening messages or session id are two conversations; and a cut is
    reused only where it drops the very messages it dropped (those that made the prompt too long)."""
    assert conversation_key("m", "key-a", None, CONVERSATION) != conversation_key("m", "key-b", None, CONVERSATION)
    assert conversation_key("m", "key-a", "s", CONVERSATION) != conversation_key("m", "key-b", "s", CONVERSATION)
    memory = FitMemory()
    key = conversation_key("m", "key-a", None, CONVERSATION)
    memory.put(key, CONVERSATION, 3)
    other = [*CONVERSATION[:3], msg("user", "another question"), *CONVERSATION[4:]]
    assert conversation_key("m", "key-a", None, other) == key  # the same opening
    assert memory.get(key, other) == (0, 0)  # but not the messages the cut dropped
    assert memory.get(key, CONVERSATION) == (3, 0)


def test_slim_tools_steps() -> None:
    tool = Tool("read", "Read a file. " * 40, {"type": "object", "description": "args", "properties": {
        "path": {"type": "string", "description": "the path", "title": "Path"}}, "required": ["path"]})
    one = slim_tools([tool], 1)[0]
    assert len(one.description) == 200
    assert one.parameters == {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    assert slim_tools([tool], 2)[0].description == ""
    assert slim_tools([tool], 3) == []
    assert slim_tools([tool], 0) == [tool]


def test_tool_results_are_shortened_and_calls_kept() -> None:
    conversation = [
        msg("user", "read it"),
        Message("assistant", [ToolCallBlock("c1", "read", {"path": "big.txt"})]),
        Message("tool", [ToolResultBlock("c1", "x" * 5000, "read")]),
    ]
    fitted = apply(conversation, 0, 3000)
    result = fitted[2].content[0]
    assert isinstance(result, ToolResultBlock) and result.tool_call_id == "c1" and result.name == "read"
    assert len(result.content) < 2100 and "omitted by localai" in result.content
    assert fitted[1].content == conversation[1].content


def test_many_small_text_blocks_are_shortened_as_one_text() -> None:
    from localai.runtime.fitting import cuttable

    blocks = [TextBlock(f"block {i} " + "x" * 140) for i in range(400)]  # none long enough on its own
    turn = [Message("user", blocks)]  # type: ignore[arg-type]
    assert cuttable(turn) > 50_000
    step = next_cut(turn, 0, 0, prompt_tokens=15_000, budget=800, n_ctx=1024)
    assert step is not None and step[1] > 0
    fitted = apply(turn, *step)
    assert len(fitted[0].text()) < len(turn[0].text()) and fitted[0].text().startswith("block 0")


def test_nothing_left_to_cut_ends_fitting() -> None:
    from localai.runtime.fitting import cuttable

    tail = [msg("user", "Run the tools.")]
    for i in range(100):
        tail.append(Message("assistant", [ToolCallBlock(f"t{i}", "probe", {"n": i})]))
        tail.append(Message("tool", [ToolResultBlock(f"t{i}", "short result " * 8)]))
    assert cuttable(tail) == 0
    assert next_cut(tail, 0, 0, prompt_tokens=5000, budget=800, n_ctx=1024) is None
    step = next_cut(CONVERSATION, 4, 0, prompt_tokens=900, budget=800, n_ctx=1000)
    assert step is not None
    assert next_cut(CONVERSATION, 4, cuttable(apply(CONVERSATION, 4, 0)), 900, 800, 1000) is None
