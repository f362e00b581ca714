"""Models on the Hugging Face Hub: references, choosing files, the cache, verified resumable downloads.

Everything goes through huggingface_hub and lands in its cache (``paths.hf_hub_cache()``), so weights
are shared with other tools and never copied. huggingface_hub 2.x does not resume a download across
processes (its temporary files are per process and deleted on failure), so a file's bytes are fetched
with its ``http_get`` into ``blobs/<etag>.incomplete``, which survives a crash or Ctrl-C and is resumed
with a Range request. Once its size and sha256 match the hub's metadata it becomes the blob, and
``hf_hub_download`` links it into the snapshot exactly as it links its own downloads.

The endpoint (``HF_ENDPOINT``), offline mode (``HF_HUB_OFFLINE``) and cache are read at call time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from localai import __version__, paths
from localai.errors import (
    DownloadCorrupt,
    GatedModel,
    HubUnreachable,
    InvalidRequest,
    LocalAIError,
    ModelNotFound,
    NotEnoughDiskSpace,
    PullCancelled,
    PullFailed,
)
from localai.models import weights

DEFAULT_ENDPOINT = "https://huggingface.co"
# How the CLI hands its HF_TOKEN to the daemon for one pull (a daemon started earlier lacks it).
TOKEN_HEADER = "X-LocalAI-HF-Token"
HUB_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
DEFAULT_QUANT = "Q4_K_M"
# Without a quantization in the name: Q4_K_M, else the nearest in size and quality.
QUANT_PREFERENCE = (DEFAULT_QUANT, "Q4_K_S", "IQ4_XS", "Q4_0", "Q5_K_M", "Q5_K_S", "Q4_1", "Q5_0", "Q6_K",
                    "Q8_0", "BF16", "F16", "F32")
_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REPO = re.compile(rf"^{_NAME_PART}/{_NAME_PART}$")
_QUANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_QUANT_IN_NAME = re.compile(r"(?:^|[-._])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|T?Q\d_\d|MXFP4|BF16|F16|F32|FP16))$",
                            re.IGNORECASE)
# An MLX model is a Hugging Face-format directory: config, safetensors and tokenizer files (never code).
MLX_SUFFIXES = (".json", ".safetensors", ".model", ".tiktoken", ".jinja")
MLX_NAMES = frozenset({"merges.txt", "vocab.txt"})


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, but at call time."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


# -- references --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubRef:
    """``hf.co/OWNER/REPO[:QUANT]``: a repository and, for GGUF repositories, a quantization."""

    repo_id: str
    quant: str | None = None

    def __str__(self) -> str:
        return f"hf.co/{self.repo_id}" + (f":{self.quant}" if self.quant else "")


def is_hub_reference(text: str) -> bool:
    """True for names that say they are on the hub (``hf.co/...``, ``huggingface.co/...``)."""
    return text.strip().lower().startswith(HUB_PREFIXES)


def parse_reference(text: str) -> HubRef:
    """``hf.co/OWNER/REPO:QUANT``, ``OWNER/REPO:QUANT`` or ``OWNER/REPO``; ``:latest`` means no quant."""
    raw = text.strip()
    for prefix in HUB_PREFIXES:
        if raw.lower().startswith(prefix):
            raw = raw[len(prefix):]
            break
    repo, _, quant = raw.partition(":")
    repo = repo.rstrip("/")  # a leading slash is a path (/etc/passwd), never a repository
    if not _REPO.match(repo) or ".." in repo:
        raise InvalidRequest(
            f"invalid model name '{text}': use a library name (see `localai list --library`), "
            "hf.co/OWNER/REPO:QUANT or OWNER/REPO", param="model",
        )
    if quant and not _QUANT.match(quant):
        raise InvalidRequest(f"invalid quantization '{quant}' in '{text}' (e.g. Q4_K_M)", param="model")
    return HubRef(repo, None if quant.lower() in ("", "latest") else quant)


# -- choosing files ----------------------------------------------------------------------------------


def quant_label(filename: str) -> str:
    """The quantization a GGUF's file name carries (``Q4_K_M``), else its name without extension."""
    stem = filename.rsplit("/", 1)[-1]
    split = weights.SPLIT_PART.match(stem)
    stem = split["prefix"] if split else stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    match = _QUANT_IN_NAME.search(stem)
    return (match.group(1) if match else stem).upper()


def gguf_choices(filenames: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Quantization → the files to fetch (a split GGUF's parts in order, first part first).

    Multimodal projectors (mmproj) are not models; an incomplete split is left out.
    """
    singles: dict[str, list[str]] = {}
    splits: dict[tuple[str, int], dict[int, str]] = {}
    for name in filenames:
        base = name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or "mmproj" in base.lower():
            continue
        match = weights.SPLIT_PART.match(base)
        if match is None:
            singles.setdefault(quant_label(name), []).append(name)
            continue
        key = (name[: len(name) - len(base)] + match["prefix"], int(match["count"]))
        splits.setdefault(key, {})[int(match["index"])] = name
    options: dict[str, list[tuple[str, ...]]] = {}
    for label, names in singles.items():
        options.setdefault(label, []).extend((name,) for name in names)
    for (_, count), parts in splits.items():
        if sorted(parts) == list(range(1, count + 1)):
            ordered = tuple(parts[index] for index in range(1, count + 1))
            options.setdefault(quant_label(ordered[0]), []).append(ordered)
    # Two files with one label (rare: e.g. a re-upload): the shortest name is the canonical one.
    return {label: min(found, key=lambda files: (len(files[0]), files[0])) for label, found in options.items()}


def choose_gguf(filenames: Iterable[str], quant: str | None, where: str) -> tuple[str, tuple[str, ...]]:
    """The quantization and files to pull; ModelNotFound lists what exists when there is no match."""
    return _pick_gguf(gguf_choices(filenames), quant, where)


PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")  # a projector is small: the least quantized that is there


def choose_projector(filenames: Iterable[str]) -> str | None:
    """The vision projector (an ``mmproj`` GGUF) a repository ships beside its model, if any: F16 where there is
    a choice (as Ollama's and LM Studio's own vision models carry it), else the first by name."""
    found = sorted(name for name in filenames
                   if name.lower().endswith(".gguf") and "mmproj" in name.rsplit("/", 1)[-1].lower())
    for label in PROJECTOR_PREFERENCE:
        for name in found:
            if quant_label(name).lower() == label or name.lower().endswith(f"-{label}.gguf"):
                return name
    return found[0] if found else None


def choose_files(filenames: list[str], quant: str | None, where: str) -> tuple[str | None, tuple[str, ...]]:
    """What to pull from a repository: a GGUF (its quantization and files) or else an MLX model (no label).

    ModelNotFound, listing what exists, when it holds neither (or not the quantization asked for)."""
    choices = gguf_choices(filenames)
    if quant is not None or choices:
        return _pick_gguf(choices, quant, where)
    mlx = choose_mlx(filenames)
    if mlx is None:
        shown = ", ".join(filenames[:12]) + (", ..." if len(filenames) > 12 else "")
        raise ModelNotFound(
            f"{where} has neither GGUF files nor an MLX model (config.json + .safetensors); it holds: "
            f"{shown or 'no files'}", param="model",
        )
    return None, tuple(mlx)


def _pick_gguf(choices: dict[str, tuple[str, ...]], quant: str | None, where: str) -> tuple[str, tuple[str, ...]]:
    if not choices:
        raise ModelNotFound(f"{where} has no GGUF files", param="model")
    available = ", ".join(sorted(choices))
    if quant is not None:
        label = quant.upper()
        if label in choices:
            return label, choices[label]
        example = next((q for q in QUANT_PREFERENCE if q in choices), sorted(choices)[0])
        raise ModelNotFound(
            f"{where} has no {quant} GGUF; available: {available} (e.g. localai pull {where}:{example})",
            param="model",
        )
    for label in QUANT_PREFERENCE:
        if label in choices:
            return label, choices[label]
    if len(choices) == 1:
        return next(iter(choices.items()))
    raise ModelNotFound(f"{where} has several GGUFs and no {DEFAULT_QUANT}; pick one of: {available} "
                        f"(e.g. localai pull {where}:{sorted(choices)[0]})", param="model")


def choose_mlx(filenames: Iterable[str]) -> list[str] | None:
    """The files of an MLX-format model (config.json + safetensors + tokenizer), or None."""
    top = [name for name in filenames if "/" not in name]
    if "config.json" not in top or not any(name.endswith(".safetensors") for name in top):
        return None
    return sorted(name for name in top if name.endswith(MLX_SUFFIXES) or name in MLX_NAMES)


# -- the remote repository ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """A file in a repository at a commit, with what the hub says its bytes are."""

    name: str
    size: int
    sha256: str | None  # LFS files (every weights file)
    blob_id: str | None  # the git object id: sha1 of b"blob <size>\\0" + content

    @property
    def blob_name(self) -> str | None:
        """The blob's name in the cache: the etag, which is the sha256 for LFS files, else the git id."""
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class RepoListing:
    repo_id: str  # as the hub spells it
    commit: str
    files: dict[str, RemoteFile]


def list_repo(repo_id: str, revision: str = "main", token: str | None = None) -> RepoListing:
    """The repository's files with sizes and hashes (one request); errors name the fix."""
    if offline():
        raise HubUnreachable(f"offline (HF_HUB_OFFLINE is set): cannot look up hf.co/{repo_id}")
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=token, library_name="localai", library_version=__version__)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise translate(exc, repo_id, suggest=True) from exc
    files = {}
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        size = lfs.size if lfs is not None else sibling.size
        files[sibling.rfilename] = RemoteFile(
            sibling.rfilename, int(size or 0), lfs.sha256 if lfs is not None else None, sibling.blob_id
        )
    if not info.sha:
        raise PullFailed(f"{endpoint()} did not say which commit hf.co/{repo_id} is at")
    return RepoListing(info.id, info.sha, files)


def translate(exc: BaseException, repo_id: str, *, suggest: bool = False) -> LocalAIError:
    """A huggingface_hub or network exception as the localai error a user can act on."""
    import httpx2
    from huggingface_hub import errors as hf

    if isinstance(exc, LocalAIError):
        return exc
    if isinstance(exc, hf.GatedRepoError):
        return GatedModel(
            f"hf.co/{repo_id} is gated: accept its terms at https://huggingface.co/{repo_id}, then set HF_TOKEN "
            "to a token of that account (or run `hf auth login`)"
        )
    if isinstance(exc, hf.RepositoryNotFoundError):
        similar = _similar_repos(repo_id) if suggest else []
        hint = f"; similar: {', '.join(similar)}" if similar else ""
        return ModelNotFound(
            f"hf.co/{repo_id} was not found on Hugging Face{hint} (a private repository needs HF_TOKEN)",
            param="model",
        )
    if isinstance(exc, (hf.RevisionNotFoundError, hf.RemoteEntryNotFoundError)):
        return ModelNotFound(f"hf.co/{repo_id}: {str(exc).splitlines()[-1]}", param="model")
    if isinstance(exc, (hf.OfflineModeIsEnabled, httpx2.TransportError)):
        return HubUnreachable(f"cannot reach {endpoint()}: {exc}")
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return PullFailed(f"{endpoint()} answered {status} for hf.co/{repo_id}: {str(exc).splitlines()[0]}")
    return PullFailed(f"pulling hf.co/{repo_id} failed: {type(exc).__name__}: {exc}")


def _similar_repos(repo_id: str) -> list[str]:
    """Up to five repository names like this one (best effort: an empty list on any failure)."""
    from huggingface_hub import HfApi

    try:
        found = HfApi(endpoint=endpoint()).list_models(search=repo_id.split("/")[-1], limit=5)
        return [model.id for model in found]
    except Exception:
        return []


# -- the local cache ---------------------------------------------------------------------------------


def _repo_folder(repo_id: str) -> Path | None:
    """The repository's folder in the cache (matched case-insensitively, as the hub matches names)."""
    from huggingface_hub.file_download import repo_folder_name

    root = paths.hf_hub_cache()
    folder = root / repo_folder_name(repo_id=repo_id, repo_type="model")
    if folder.is_dir():
        return folder
    if root.is_dir():
        wanted = folder.name.lower()
        for candidate in root.iterdir():
            if candidate.name.lower() == wanted and candidate.is_dir():
                return candidate
    return None


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot directory of ``revision``, without any request."""
    folder = _repo_folder(repo_id)
    if folder is None:
        return None
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def snapshot_files(snapshot: Path) -> list[str]:
    """Files present in a snapshot (links whose blob is there), as repository-relative names."""
    return sorted(item.relative_to(snapshot).as_posix() for item in snapshot.rglob("*") if item.is_file())


def cached_weights(ref: HubRef) -> Path | None:
    """The weights ``ref`` names if they are all in the cache: the GGUF (first part) or the MLX directory."""
    snapshot = cached_snapshot(ref.repo_id)
    if snapshot is None:
        return None
    try:
        label, chosen = choose_files(snapshot_files(snapshot), ref.quant, str(ref))
    except ModelNotFound:
        return None
    return snapshot / chosen[0] if label is not None else snapshot


def is_cached_path(path: Path) -> bool:
    """True when ``path`` lies in a snapshot of the hub cache (weights localai may delete)."""
    try:
        relative = Path(os.path.abspath(path)).relative_to(os.path.abspath(paths.hf_hub_cache()))
    except ValueError:
        return False
    parts = relative.parts
    return len(parts) >= 3 and parts[0].startswith("models--") and parts[1] == "snapshots"


def remove_cached(path: Path) -> int:
    """Delete pulled weights: their snapshot links, and each blob no other snapshot links to.

    A repository folder with no snapshot files left goes entirely (refs, partial downloads).
    Returns the bytes freed.
    """
    if not is_cached_path(path):
        return 0
    root = Path(os.path.abspath(paths.hf_hub_cache()))
    repo = root / Path(os.path.abspath(path)).relative_to(root).parts[0]
    snapshots = repo / "snapshots"
    try:
        if path.is_dir():  # only the MLX files localai pulled, not what other tools put beside them
            doomed = [path / name for name in choose_mlx(snapshot_files(path)) or []]
        else:
            doomed = weights.files(path) if path.exists() else []
    except LocalAIError:
        doomed = [path]
    targets = {item.resolve() for item in doomed if item.is_symlink()}
    for item in doomed:
        item.unlink(missing_ok=True)
    still_linked = {item.resolve() for item in snapshots.rglob("*") if item.is_symlink()}
    freed = 0
    for blob in targets - still_linked:
        if blob.is_file():
            freed += blob.stat().st_size
            blob.unlink()
    for directory in sorted((d for d in snapshots.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        if not any(directory.iterdir()):
            directory.rmdir()
    if not any(item.is_file() or item.is_symlink() for item in snapshots.rglob("*")):
        freed += sum(item.stat().st_size for item in repo.rglob("*") if item.is_file() and not item.is_symlink())
        shutil.rmtree(repo, ignore_errors=True)
    return freed


# -- downloading -------------------------------------------------------------------------------------


def pending_bytes(listing: RepoListing, file: RemoteFile) -> int:
    """Bytes still to fetch for ``file``: 0 when cached, less when a partial download exists."""
    folder = _repo_folder(listing.repo_id)
    if folder is None:
        return file.size
    if (folder / "snapshots" / listing.commit / file.name).is_file():
        return 0
    if file.blob_name is None:
        return file.size
    blob = folder / "blobs" / file.blob_name
    if blob.is_file():
        return 0
    partial = blob.with_name(blob.name + ".incomplete")
    return max(0, file.size - (partial.stat().st_size if partial.is_file() else 0))


def free_space() -> int:
    """Free bytes on the disk the Hugging Face cache is (or will be) on."""
    target = paths.hf_hub_cache()
    while not target.exists() and target != target.parent:
        target = target.parent
    return shutil.disk_usage(target).free


def check_disk_space(needed: int, keep_free: int, what: str) -> None:
    """Refuse, before any byte is fetched, a pull that would leave less than ``keep_free`` bytes free."""
    free = free_space()
    if free - needed < keep_free:
        raise NotEnoughDiskSpace(
            f"not enough disk space for {what}: it needs {_gb(needed)} in {paths.hf_hub_cache()}, which has "
            f"{_gb(free)} free, and LOCALAI_MIN_FREE_SPACE keeps {_gb(keep_free)} free; free some space or "
            "point HF_HUB_CACHE at a larger disk"
        )


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 10**7 else f"{size / 1e6:.2f} MB"


class _Progress:
    """What huggingface_hub's ``http_get`` takes as a tqdm class: it reports bytes and honours a cancel."""

    def __init__(self, report: Callable[[int], None], cancelled: threading.Event, **kwargs: Any) -> None:
        self.report = report
        self.cancelled = cancelled
        self.n = int(kwargs.get("initial") or 0)

    def update(self, count: int) -> None:
        # Raised before the chunk is written, so the partial file holds only whole, reported chunks.
        if self.cancelled.is_set():
            raise PullCancelled("the pull was cancelled; run it again to resume")
        self.n += count
        self.report(self.n)

    def close(self) -> None:
        pass

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *_: object) -> None:
        pass


def fetch(listing: RepoListing, file: RemoteFile, *, revision: str = "main", token: str | None = None,
          report: Callable[[int], None] = lambda _: None, cancelled: threading.Event | None = None,
          verifying: Callable[[], None] = lambda: None) -> Path:
    """Bring one file into the cache, resuming a partial download, and return its snapshot path.

    ``report`` gets the bytes present so far, ``verifying`` is called before the checksum is computed;
    setting ``cancelled`` stops the download at its next chunk (PullCancelled), keeping what it has.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import WeakFileLock

    cache = paths.hf_hub_cache()
    cached = try_to_load_from_cache(listing.repo_id, file.name, cache_dir=cache, revision=listing.commit)
    if isinstance(cached, str):
        report(file.size)
        return Path(cached)
    url = hf_hub_url(listing.repo_id, file.name, revision=listing.commit, endpoint=endpoint())
    try:
        metadata = get_hf_file_metadata(url, token=token, endpoint=endpoint(), library_name="localai",
                                        library_version=__version__)
    except Exception as exc:
        raise translate(exc, listing.repo_id) from exc
    if metadata.etag is None or metadata.commit_hash is None:
        raise PullFailed(f"{endpoint()} is not a Hugging Face Hub endpoint (no ETag or X-Repo-Commit for {url})")
    folder = cache / repo_folder_name(repo_id=listing.repo_id, repo_type="model")
    blob = folder / "blobs" / metadata.etag
    partial = blob.with_name(blob.name + ".incomplete")
    lock = cache / ".locks" / folder.name / f"{metadata.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):  # one writer per blob, across threads and processes
        if not blob.is_file():
            _download(metadata.location, url, partial, file, listing.repo_id, token, report,
                      cancelled or threading.Event())
            verifying()
            _verify(partial, file)
            os.replace(partial, blob)
        else:
            report(file.size)
    try:
        linked = hf_hub_download(listing.repo_id, file.name, revision=revision, cache_dir=cache,
                                 endpoint=endpoint(), token=token, library_name="localai",
                                 library_version=__version__)
    except Exception as exc:
        raise translate(exc, listing.repo_id) from exc
    if Path(linked).resolve() != blob.resolve():
        raise PullFailed(f"hf.co/{listing.repo_id} changed while it was being pulled; pull it again")
    return Path(linked)


def _download(location: str, url: str, partial: Path, file: RemoteFile, repo_id: str, token: str | None,
              report: Callable[[int], None], cancelled: threading.Event) -> None:
    """Append the rest of ``file`` to ``partial`` with a Range request (huggingface_hub's ``http_get``)."""
    import httpx2
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=token, library_name="localai", library_version=__version__)
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
    with partial.open("ab") as handle:
        resume = handle.tell()
        if resume > file.size:  # not a prefix of this file: start again
            handle.truncate(0)
            resume = 0
        report(resume)
        progress = functools.partial(_Progress, report, cancelled)
        try:
            http_get(location, handle, resume_size=resume, headers=headers, expected_size=file.size,
                     displayed_filename=file.name, tqdm_class=cast(Any, progress))
        except PullCancelled:
            raise
        except (httpx2.TransportError, OSError) as exc:
            # A short file is a prefix worth keeping; a long one is checked (and rejected) below.
            handle.flush()
            if handle.tell() < file.size:
                raise PullFailed(
                    f"downloading {file.name} was interrupted ({str(exc).splitlines()[0]}); "
                    "run the pull again to resume"
                ) from exc
        except Exception as exc:
            raise translate(exc, repo_id) from exc


def _verify(partial: Path, file: RemoteFile) -> None:
    """Size and sha256 (or git object id) against the hub's metadata; a mismatch deletes the bytes."""
    size = partial.stat().st_size
    problem = None
    if size != file.size:
        problem = f"{size} bytes where the hub advertises {file.size}"
    else:
        digest = hashlib.sha256() if file.sha256 else hashlib.sha1(usedforsecurity=False)
        expected = file.sha256 or file.blob_id
        if file.sha256 is None:
            digest.update(f"blob {size}\0".encode())
        with partial.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        if expected is not None and digest.hexdigest() != expected:
            kind = "sha256" if file.sha256 else "git object id"
            problem = f"{kind} {digest.hexdigest()} where the hub advertises {expected}"
    if problem is not None:
        partial.unlink(missing_ok=True)
        raise DownloadCorrupt(f"the download of {file.name} is corrupt ({problem}); it was deleted, "
                              "run the pull again to fetch it anew")
