"""The SQLite database under ``$LOCALAI_HOME``, opened through sqlite-utils, with named migrations.

Migrations are functions applied once each, in order, and recorded in ``_migrations`` (the
pattern of simonw/llm). Nothing opens the database at import time.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import sqlite_utils

Migration = Callable[[sqlite_utils.Database], None]
MIGRATIONS: list[tuple[str, Migration]] = []


def migration(function: Migration) -> Migration:
    """Register a migration; its name is its identity, so never rename one that shipped."""
    MIGRATIONS.append((function.__name__, function))
    return function


@migration
def m001_models(db: sqlite_utils.Database) -> None:
    db["models"].create(  # type: ignore[union-attr]
        {
            "name": str, "alias_of": str, "source": str, "path": str, "format": str, "sha256": str,
            "size": int, "family": str, "quantization": str, "parameter_size": str, "context_length": int,
            "parameters": str, "template": str, "system": str, "messages": str, "adapters": str,
            "license": str, "modelfile": str, "created_at": str, "modified_at": str,
        },
        pk="name",
    )


@migration
def m002_file_hashes(db: sqlite_utils.Database) -> None:
    db["file_hashes"].create(  # type: ignore[union-attr]
        {"path": str, "size": int, "mtime_ns": int, "sha256": str}, pk="path"
    )


@migration
def m003_responses(db: sqlite_utils.Database) -> None:
    """Stored Responses API results, so ``previous_response_id`` can continue a conversation."""
    db["responses"].create(  # type: ignore[union-attr]
        {"id": str, "created_at": int, "model": str, "previous_response_id": str, "conversation": str,
         "response": str},
        pk="id",
    )


@migration
def m004_cache_models(db: sqlite_utils.Database) -> None:
    """Which models used each prompt-cache folder (its fingerprint), so the cache's entries can be named by model
    after their workers are gone."""
    db["cache_models"].create(  # type: ignore[union-attr]
        {"fingerprint": str, "model": str, "used_at": str}, pk=("fingerprint", "model")
    )


@migration
def m005_projector(db: sqlite_utils.Database) -> None:
    """A model's vision projector (an mmproj GGUF beside its weights), when it has one."""
    db["models"].add_column("projector", str)  # type: ignore[union-attr]


@migration
def m006_response_chains(db: sqlite_utils.Database) -> None:
    """Stored responses as chains (api/response_store.py): a continued response holds only its own turn after
    ``parent``'s; ``owner`` is the key it was stored with; ``bytes`` and ``last_used`` drive retention. Rows from
    before hold their whole conversation (no parent)."""
    table = db["responses"]
    table.add_column("parent", str)  # type: ignore[union-attr]
    table.add_column("owner", str, not_null_default="")  # type: ignore[union-attr]
    table.add_column("bytes", int, not_null_default=0)  # type: ignore[union-attr]
    table.add_column("last_used", float)  # type: ignore[union-attr]
    db.execute("UPDATE responses SET bytes = length(CAST(conversation AS BLOB)) + length(CAST(response AS BLOB)), "
               "last_used = created_at")
    table.create_index(["parent"])  # type: ignore[union-attr]
    table.create_index(["last_used"])  # type: ignore[union-attr]


def open_database(path: Path) -> sqlite_utils.Database:
    """Open (creating if needed) the database and bring it to the newest schema."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA busy_timeout=5000")
    migrate(db)
    return db


def migrate(db: sqlite_utils.Database) -> None:
    table = db["_migrations"]
    if not table.exists():
        table.create({"name": str, "applied_at": str}, pk="name")  # type: ignore[union-attr]
    applied = {row["name"] for row in table.rows}
    for name, function in MIGRATIONS:
        if name in applied:
            continue
        with db.conn:
            function(db)
            table.insert({"name": name, "applied_at": now()})  # type: ignore[union-attr]


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
