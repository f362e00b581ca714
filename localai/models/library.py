"""The library: Modelfiles that ship with localai, pulled by name (``localai pull qwen2.5-coder:1.5b``).

A library (and ``$LOCALAI_HOME/modelfiles``) holds ``NAME/TAG.Modelfile`` files, or ``NAME.Modelfile``
for ``NAME:latest``. Each library Modelfile's ``FROM`` says where the weights live
(``hf.co/OWNER/REPO:QUANT``, or ``package:`` for the embedded model); its first comment line
describes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from localai import paths
from localai.errors import InvalidRequest, ModelNotFound
from localai.models.modelfile import parse_file

SUFFIX = ".Modelfile"
TRAINED = re.compile(r"Trained context:\s*(\d+)")
# ``family:TAG-mlx`` is the MLX source of ``family:TAG`` (an mlx-community build of the same model): a pull of
# ``family:TAG`` takes it where the preferred engine is MLX (Apple Silicon, or LOCALAI_ENGINE=mlx).
MLX_TAG_SUFFIX = "-mlx"
_WORD = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


RERANK_MARK = "reranker"  # a library family with this in its name scores documents (POST /v1/rerank)


@dataclass(frozen=True)
class LibraryEntry:
    name: str  # name:tag
    path: Path
    description: str

    @property
    def family(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.name.split(":", 1)[1]

    @property
    def reranker(self) -> bool:
        return RERANK_MARK in self.family


def modelfile_name(root: Path, path: Path) -> str | None:
    """``NAME:TAG`` for ``root/NAME/TAG.Modelfile``, ``NAME:latest`` for ``root/NAME.Modelfile``, else None."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return None
    if not parts or not parts[-1].endswith(SUFFIX):
        return None
    stem = parts[-1][: -len(SUFFIX)].lower()
    if len(parts) == 1:
        name, tag = stem, "latest"
    elif len(parts) == 2:
        name, tag = parts[0].lower(), stem
    else:
        return None
    return f"{name}:{tag}" if _WORD.match(name) and _WORD.match(tag) else None


def modelfiles(root: Path) -> dict[str, Path]:
    """Every well-named Modelfile under ``root``: name → path."""
    found: dict[str, Path] = {}
    if not root.is_dir():
        return found
    for path in sorted(root.rglob(f"*{SUFFIX}")):
        name = modelfile_name(root, path)
        if name is not None and path.is_file():
            found.setdefault(name, path)
    return found


def entries(root: Path | None = None) -> list[LibraryEntry]:
    """The library's models, sorted by name."""
    return [LibraryEntry(name, path, _description(path))
            for name, path in sorted(modelfiles(root or paths.library_modelfiles_dir()).items())]


def rerankers(root: Path | None = None) -> list[str]:
    """The library's rerankers (what a chat model asked to rerank is pointed to)."""
    return [entry.name for entry in entries(root) if entry.reranker]


def _description(path: Path) -> str:
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
            if line.strip():
                break
    except OSError:
        pass
    return ""


def resolve(name: str, root: Path | None = None) -> LibraryEntry:
    """The library entry for ``name`` (``family:tag``, or ``family`` when it has one tag).

    Errors list what the library has, so a typo is one step from the right name.
    """
    family, _, tag = name.strip().lower().partition(":")
    available = entries(root)
    tags = sorted(entry.tag for entry in available if entry.family == family)
    if not tags:
        families = ", ".join(sorted({entry.family for entry in available}))
        raise ModelNotFound(
            f"'{name}' is not in the library (it has: {families}); see `localai list --library`, or pull from "
            "Hugging Face with hf.co/OWNER/REPO:QUANT", param="model",
        )
    tags = [item for item in tags if not item.endswith(MLX_TAG_SUFFIX)] or tags  # TAG-mlx: a source, not a size
    if tag in ("", "latest"):
        if len(tags) > 1:
            raise InvalidRequest(
                f"{family} comes in {', '.join(tags)}; pick one, e.g. localai pull {family}:{tags[0]}",
                param="model",
            )
        tag = tags[0]
    for entry in available:
        if entry.name == f"{family}:{tag}":
            return entry
    raise ModelNotFound(f"the library has no {family}:{tag}; {family} comes in {', '.join(tags)}", param="model")


def source_for(entry: LibraryEntry, engine: str | None, root: Path | None = None) -> LibraryEntry:
    """The library Modelfile to pull for ``entry`` when ``engine`` is preferred: the ``TAG-mlx`` sibling for
    MLX where the library has one, else ``entry`` itself (a tag asked for by name is always what is pulled)."""
    if engine != "mlx" or entry.tag.endswith(MLX_TAG_SUFFIX):
        return entry
    name = f"{entry.name}{MLX_TAG_SUFFIX}"
    path = modelfiles(root or paths.library_modelfiles_dir()).get(name)
    return LibraryEntry(name, path, _description(path)) if path is not None else entry


def is_library_name(name: str) -> bool:
    """Library names have no ``/`` (hub names are ``OWNER/REPO``)."""
    return "/" not in name


def how_to_get(name: str) -> str:
    """How to get a model that is not installed: the pull command when ``localai pull`` knows the name (a library
    name, or a Hugging Face ``OWNER/REPO``), else where to look."""
    if not is_library_name(name):
        return f"run: localai pull {name}"
    try:
        entry = resolve(name)
    except InvalidRequest as exc:  # a family with several sizes: the message names them
        return exc.message
    except ModelNotFound as exc:
        if any(entry.family == name.partition(":")[0].lower() for entry in entries()):
            return exc.message  # a size the family does not come in: the message names those it does
        return ("it is not in the library either: `localai list` shows the installed models, `localai list "
                "--library` those `localai pull NAME` fetches, and `localai create NAME -f Modelfile` makes one")
    return f"run: localai pull {entry.name}"


def trained_context(path: Path) -> str:
    """The trained context a library Modelfile's comment states (its MLX source's: the GGUF sibling's), else ""."""
    found = TRAINED.search(path.read_text())
    if found is None and path.stem.endswith(MLX_TAG_SUFFIX):
        sibling = path.with_name(path.stem.removesuffix(MLX_TAG_SUFFIX) + path.suffix)
        found = TRAINED.search(sibling.read_text()) if sibling.exists() else None
    return found.group(1) if found else ""


@dataclass(frozen=True)
class LibraryRow:
    """What ``localai list --library`` and the TUI's Models screen show of a library model."""

    name: str
    source: str  # its FROM
    context: str  # its num_ctx, else the trained context its comment states ("" when neither)
    description: str


def rows(root: Path | None = None) -> list[LibraryRow]:
    """The library's models, read from the Modelfiles shipped with localai (the window a model loads with depends
    on the machine: ``localai show`` says it once installed). A broken library file is skipped."""
    found = []
    for entry in entries(root):
        try:
            modelfile = parse_file(entry.path)
        except Exception:  # a broken library file is a packaging bug; the rest of the library still lists
            continue
        context = str(modelfile.parameters.get("num_ctx") or trained_context(entry.path))
        found.append(LibraryRow(entry.name, modelfile.from_, context, entry.description))
    return found
