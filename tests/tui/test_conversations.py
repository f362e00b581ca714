"""The conversations table: its named migration, round trips, broken rows, Markdown export."""

from __future__ import annotations

from pathlib import Path

import pytest

from localai import paths
from localai.conversations import ChatMessage, ChatStats, Conversation, ConversationCorrupt, ConversationStore
from localai.errors import NotFound
from localai.models.registry import Registry
from tests.tui.conftest import store_row


def test_migration_is_named_and_shares_the_registry_database() -> None:
    Registry.open().close()  # the daemon's side creates the database first, without the TUI's module in play
    store = ConversationStore.open()
    applied = [row["name"] for row in store.db["_migrations"].rows]
    assert "m100_conversations" in applied and "m001_models" in applied
    assert store.db["conversations"].exists() and paths.database_path().exists()
    store.close()
    ConversationStore.open().close()  # applied once, recorded, not applied again


def test_round_trip_keeps_stats_stopped_and_options() -> None:
    store = ConversationStore.open()
    conversation = Conversation.new("smollm2", system="Be brief.", options={"num_ctx": 2048, "stop": ["END"]})
    conversation.title = "Brief"
    conversation.messages = [ChatMessage("user", "Hi"),
                             ChatMessage("assistant", "Hello", ChatStats(20, 12, 3, 0.05), stopped=True)]
    store.save(conversation)
    loaded = store.load(conversation.id)
    assert loaded.messages == conversation.messages and loaded.options == conversation.options
    assert loaded.api_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "Hello"}]
    store.rename(conversation.id, "  Renamed ")
    assert store.summaries()[0].title == "Renamed"
    store.delete(conversation.id)
    with pytest.raises(NotFound):
        store.load(conversation.id)


@pytest.mark.parametrize(("messages", "options", "why"), [
    ("[{not json", "{}", "its messages cannot be read"),
    ('{"role": "user"}', "{}", "messages is not a list"),
    ('[{"content": "no role"}]', "{}", "not a message"),
    ("[]", "not json", "its options cannot be read"),
])
def test_broken_rows_are_listed_with_their_error(messages: str, options: str, why: str) -> None:
    store_row("broken", "Broken", "smollm2", messages, options=options)
    store_row("fine", "Fine", "smollm2", [{"role": "user", "content": "hi"}])
    store = ConversationStore.open()
    summaries = {s.id: s for s in store.summaries()}
    assert summaries["fine"].error is None and summaries["fine"].messages == 1
    assert why in (summaries["broken"].error or "")
    with pytest.raises(ConversationCorrupt, match="delete it from the list"):
        store.load("broken")


def test_export_writes_markdown(tmp_path: Path) -> None:
    store = ConversationStore.open()
    conversation = Conversation.new("smollm2", options={"temperature": 0.2})
    conversation.title = "Lists / tuples?"
    conversation.messages = [ChatMessage("user", "Reverse?"), ChatMessage("assistant", "`x[::-1]`", stopped=True)]
    store.save(conversation)
    exports = tmp_path / "exports"
    exports.mkdir()
    path = store.export(conversation.id, exports)
    assert path.name == f"lists-tuples-{conversation.id[:8]}.md"
    text = path.read_text()
    assert text.startswith("# Lists / tuples?\n") and "`temperature=0.2`" in text
    assert "## User\n\nReverse?" in text and "## Assistant\n\n`x[::-1]`\n\n*(stopped)*" in text
    assert [p.name for p in exports.iterdir()] == [path.name]  # no temp file left behind
