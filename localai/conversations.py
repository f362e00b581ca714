"""Chat conversations kept by the TUI, in the registry's SQLite database (``$LOCALAI_HOME/localai.db``).

Each conversation is also a prompt-cache session: its id goes to the daemon as ``X-Session-Id``. The table comes
from a named migration, registered here and applied by ``open_database`` like the registry's own. A row that
cannot be read (a messages column that is not JSON) is listed as broken and never stops the others loading.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils

from localai import paths
from localai.errors import LocalAIError, NotFound
from localai.models.db import migration, now, open_database

TITLE_LENGTH = 48


@migration
def m100_conversations(db: sqlite_utils.Database) -> None:
    """The TUI's conversations: messages and options as JSON, the id doubling as the cache session id."""
    db["conversations"].create(  # type: ignore[union-attr]
        {"id": str, "title": str, "model": str, "system": str, "options": str, "messages": str,
         "created_at": str, "updated_at": str},
        pk="id",
    )


class ConversationCorrupt(LocalAIError):
    """A stored conversation cannot be read; the message says which and how to get rid of it."""


@dataclass
class ChatStats:
    """What the daemon's final ``/api/chat`` object says about one reply."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    eval_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.eval_seconds if self.eval_seconds > 0 else 0.0

    @classmethod
    def from_final(cls, item: dict[str, Any]) -> ChatStats:
        return cls(prompt_tokens=int(item.get("prompt_eval_count") or 0),
                   cached_tokens=int(item.get("prompt_cache_count") or 0),
                   completion_tokens=int(item.get("eval_count") or 0),
                   eval_seconds=int(item.get("eval_duration") or 0) / 1e9)

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "eval_seconds": self.eval_seconds}

    @classmethod
    def from_json(cls, value: Any) -> ChatStats | None:
        if not isinstance(value, dict):
            return None
        try:
            return cls(int(value.get("prompt_tokens", 0)), int(value.get("cached_tokens", 0)),
                       int(value.get("completion_tokens", 0)), float(value.get("eval_seconds", 0.0)))
        except (TypeError, ValueError):
            return None


@dataclass
class ChatMessage:
    role: str
    content: str
    stats: ChatStats | None = None
    stopped: bool = False
    """The user stopped this reply before the model finished it."""
    thinking: str = ""
    """A thinking model's reasoning before its answer (Ollama's ``message.thinking``)."""

    def to_json(self) -> dict[str, Any]:
        item: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.thinking:
            item["thinking"] = self.thinking
        if self.stats is not None:
            item["stats"] = self.stats.to_json()
        if self.stopped:
            item["stopped"] = True
        return item

    @classmethod
    def from_json(cls, value: Any) -> ChatMessage:
        if not isinstance(value, dict) or not isinstance(value.get("role"), str):
            raise ValueError(f"not a message: {value!r:.60}")
        return cls(role=value["role"], content=str(value.get("content") or ""),
                   stats=ChatStats.from_json(value.get("stats")), stopped=bool(value.get("stopped")),
                   thinking=str(value.get("thinking") or ""))


@dataclass
class Conversation:
    """One chat: a model, its own system prompt and options, and the messages so far."""

    id: str
    model: str
    title: str = ""
    system: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    messages: list[ChatMessage] = field(default_factory=list)
    created_at: str = ""
    updated_at: str = ""

    @classmethod
    def new(cls, model: str, *, system: str = "", options: dict[str, Any] | None = None) -> Conversation:
        return cls(id=uuid.uuid4().hex, model=model, system=system, options=dict(options or {}))

    @property
    def display_title(self) -> str:
        return self.title or "New conversation"

    def api_messages(self) -> list[dict[str, str]]:
        """The messages as ``/api/chat`` wants them: the system prompt first, a reply's thinking beside its content
        (the model's template decides whether earlier turns' reasoning is shown to it), no localai bookkeeping."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": m.role, "content": m.content, **({"thinking": m.thinking} if m.thinking else {})}
                         for m in self.messages]

    def to_markdown(self) -> str:
        """The conversation as a Markdown document (what ``export`` writes)."""
        lines = [f"# {self.display_title}", "", f"- model: `{self.model}`", f"- session: `{self.id}`"]
        if self.options:
            lines.append("- options: " + ", ".join(f"`{k}={v}`" for k, v in sorted(self.options.items())))
        if self.system:
            lines += ["", "## System", "", self.system]
        for message in self.messages:
            lines += ["", f"## {message.role.capitalize()}", ""]
            if message.thinking:  # a collapsed block, as the terminal UI shows it
                lines += ["<details><summary>Thinking</summary>", "", message.thinking.rstrip(), "", "</details>", ""]
            lines.append(message.content.rstrip())
            if message.stopped:
                lines += ["", "*(stopped)*"]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ConversationSummary:
    """A row of the conversation list; ``error`` says why a broken row cannot be opened."""

    id: str
    title: str
    model: str
    updated_at: str
    messages: int
    error: str | None = None


def title_from(text: str) -> str:
    """A conversation's default title: its first prompt's first line, shortened."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class ConversationStore:
    """Conversations in the registry's database; ``open()`` applies the migration on first use."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db

    @classmethod
    def open(cls, path: Path | None = None) -> ConversationStore:
        return cls(open_database(path or paths.database_path()))

    def close(self) -> None:
        self.db.close()

    @property
    def _table(self) -> sqlite_utils.db.Table:
        return self.db.table("conversations")

    def save(self, conversation: Conversation) -> None:
        stamp = now()
        conversation.created_at = conversation.created_at or stamp
        conversation.updated_at = stamp
        self._table.upsert({
            "id": conversation.id, "title": conversation.title, "model": conversation.model,
            "system": conversation.system, "options": json.dumps(conversation.options),
            "messages": json.dumps([m.to_json() for m in conversation.messages], ensure_ascii=False),
            "created_at": conversation.created_at, "updated_at": conversation.updated_at,
        }, pk="id")

    def summaries(self) -> list[ConversationSummary]:
        """Every conversation, most recently used first; broken rows are listed with their error."""
        summaries = []
        for row in self._table.rows_where(order_by="updated_at desc, id"):
            error = None
            count = 0
            try:
                count = len(self._messages(row))
                self._options(row)
            except ConversationCorrupt as exc:
                error = exc.message
            summaries.append(ConversationSummary(id=row["id"], title=row["title"] or "New conversation",
                                                 model=row["model"] or "", updated_at=row["updated_at"] or "",
                                                 messages=count, error=error))
        return summaries

    def load(self, conversation_id: str) -> Conversation:
        rows = list(self._table.rows_where("id = ?", [conversation_id]))
        if not rows:
            raise NotFound(f"conversation {conversation_id} does not exist (it may have been deleted)")
        row = rows[0]
        return Conversation(id=row["id"], model=row["model"] or "", title=row["title"] or "",
                            system=row["system"] or "", options=self._options(row), messages=self._messages(row),
                            created_at=row["created_at"] or "", updated_at=row["updated_at"] or "")

    def rename(self, conversation_id: str, title: str) -> None:
        self._table.update(conversation_id, {"title": title.strip()})

    def delete(self, conversation_id: str) -> None:
        self._table.delete_where("id = ?", [conversation_id])

    def export(self, conversation_id: str, directory: Path) -> Path:
        """Write the conversation to ``<directory>/<title>-<id>.md`` atomically; returns the path."""
        conversation = self.load(conversation_id)
        stem = "-".join(re.findall(r"[^\W_]+", conversation.display_title.lower()))[:40].strip("-")
        path = directory / f"{stem or 'conversation'}-{conversation.id[:8]}.md"
        temp = path.with_name(f".{path.name}.tmp")
        temp.write_text(conversation.to_markdown(), encoding="utf-8")
        temp.replace(path)
        return path

    def _messages(self, row: dict[str, Any]) -> list[ChatMessage]:
        try:
            raw = json.loads(row["messages"] or "[]")
            if not isinstance(raw, list):
                raise ValueError("messages is not a list")
            return [ChatMessage.from_json(item) for item in raw]
        except ValueError as exc:
            raise self._corrupt(row, f"its messages cannot be read ({exc})") from exc

    def _options(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            options = json.loads(row["options"] or "{}")
        except ValueError as exc:
            raise self._corrupt(row, f"its options cannot be read ({exc})") from exc
        if not isinstance(options, dict):
            raise self._corrupt(row, "its options are not an object")
        return options

    def _corrupt(self, row: dict[str, Any], why: str) -> ConversationCorrupt:
        title = row["title"] or row["id"]
        return ConversationCorrupt(f"conversation '{title}' is damaged: {why}; delete it from the list (d)")
