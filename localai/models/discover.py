"""Models already on this disk, used where they are: Ollama's pulls, LM Studio's folder, GGUFs in the Hugging Face
cache.

- **Ollama** (``$OLLAMA_MODELS`` or ``~/.ollama/models``): each manifest under ``manifests/HOST/NAMESPACE/MODEL/TAG``
  lists layers by media type; the model layer is a GGUF blob (``blobs/sha256-<hex>``, its name its verified digest),
  ``params`` is JSON (sampling, ``stop``, ``num_ctx``), ``system`` and ``license`` are text. The ``template`` layer is
  a Go template, which localai does not run: the GGUF's own (Jinja) chat template applies. Models with a projector
  (vision) or an adapter layer are skipped: localai serves text only and has no LoRA yet. Names are Ollama's
  (``llama3.2:3b``; ``NAMESPACE/MODEL:TAG`` outside ``library``).
- **LM Studio** (``~/.lmstudio/models``, older ``~/.cache/lm-studio/models``, or ``$LOCALAI_LMSTUDIO_MODELS``):
  ``PUBLISHER/REPO/FILE.gguf`` becomes ``lmstudio/PUBLISHER/REPO:FILE``.
- **Hugging Face cache** (``huggingface_hub``'s cache, ``$HF_HUB_CACHE``): each GGUF in a snapshot becomes
  ``hf.co/OWNER/REPO:FILE`` unless a model already uses that file (``localai pull`` registers its own).

Vision projectors (``mmproj*``) and the later parts of split GGUFs are never models of their own. A discovered model
is registered without copying anything; it never shadows a model of the same name that the user created or pulled,
``localai rm`` forgets it without deleting the other tool's files, and it disappears from the registry when its
files do.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from localai.errors import LocalAIError, ModelfileError
from localai.models import weights
from localai.models.modelfile import PARAMETERS, REMOTE_PARAMETERS, Modelfile, coerce_parameter, parse
from localai.models.registry import FOUND_SOURCES, Registry, new_name

log = logging.getLogger("localai.discover")

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_SKIPPED = {"application/vnd.ollama.image.projector": "a vision projector",
                  "application/vnd.ollama.image.adapter": "an adapter (LoRA)"}
_UNSAFE = re.compile(r"[^a-z0-9._+-]+")


@dataclass
class Found:
    name: str
    source: str  # "<kind>:<where it was found>", the registry's source for it
    modelfile: Modelfile


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_roots() -> list[Path]:
    configured = os.environ.get("LOCALAI_LMSTUDIO_MODELS")
    if configured:
        return [Path(configured).expanduser()]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def hf_cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _part(text: str) -> str:
    """A name part from a file or folder name: lower case, letters, digits, '.', '_', '+', '-'."""
    return _UNSAFE.sub("-", text.lower()).strip("-._+") or "model"


def _is_model_file(path: Path) -> bool:
    if path.suffix.lower() != ".gguf" or path.name.lower().startswith("mmproj"):
        return False
    match = weights.SPLIT_PART.match(path.name)
    return match is None or int(match["index"]) == 1


def ollama_models(root: Path) -> list[Found]:
    found: list[Found] = []
    manifests = root / "manifests"
    for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        if not manifest.is_file():
            continue
        host, namespace, model, tag = manifest.relative_to(manifests).parts
        name = f"{model}:{tag}" if (host, namespace) == ("registry.ollama.ai", "library") else \
            f"{namespace}/{model}:{tag}" if host == "registry.ollama.ai" else f"{host}/{namespace}/{model}:{tag}"
        try:
            found.append(Found(new_name(name), f"ollama:{manifest}", _ollama_modelfile(root, manifest)))
        except (OSError, ValueError, KeyError, TypeError, LocalAIError) as exc:
            log.info("not using Ollama's %s: %s", name, getattr(exc, "message", exc))
    return found


def _ollama_modelfile(root: Path, manifest: Path) -> Modelfile:
    layers = json.loads(manifest.read_text())["layers"]
    kinds = {layer["mediaType"]: layer["digest"] for layer in layers}
    for kind, what in OLLAMA_SKIPPED.items():
        if kind in kinds:
            raise ValueError(f"it has {what}; localai serves text-only GGUFs without adapters")
    if OLLAMA_MODEL not in kinds:
        raise ValueError("no model layer")

    def blob(digest: str) -> Path:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ValueError(f"not a blob digest: {digest!r}")
        return root / "blobs" / digest.replace(":", "-")

    model = blob(kinds[OLLAMA_MODEL])
    if not model.is_file():
        raise ValueError(f"its model blob {model.name} is missing")
    modelfile = Modelfile(from_=str(model))
    params = kinds.get("application/vnd.ollama.image.params")
    for key, value in (json.loads(blob(params).read_text()) if params else {}).items():
        try:
            if key not in PARAMETERS or key in REMOTE_PARAMETERS:
                raise ModelfileError(f"localai does not take {key!r} for a local model")
            modelfile.parameters[key] = coerce_parameter(key, value, f"{manifest} params")
        except LocalAIError as exc:  # one localai does not take: the model is still usable without it
            log.info("Ollama's %s: parameter %s left out (%s)", manifest.parent.name, key, exc.message)
    if "application/vnd.ollama.image.system" in kinds:
        modelfile.system = blob(kinds["application/vnd.ollama.image.system"]).read_text(errors="replace")
    if "application/vnd.ollama.image.license" in kinds:
        modelfile.license = blob(kinds["application/vnd.ollama.image.license"]).read_text(errors="replace")
    return modelfile


def lmstudio_models(roots: list[Path]) -> list[Found]:
    found = []
    for root in roots:
        for path in sorted(root.glob("*/*/*.gguf")) if root.is_dir() else []:
            if not _is_model_file(path):
                continue
            publisher, repo = path.parent.parent.name, path.parent.name
            name = f"lmstudio/{_part(publisher)}/{_part(repo)}:{_part(path.stem)}"
            found.append(Found(new_name(name), f"lmstudio:{path}", parse(f"FROM {path}", source=str(path))))
    return found


def hf_cache_models(root: Path) -> list[Found]:
    found = []
    for repo in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        _, owner, name = repo.name.split("--", 2)
        for path in sorted((repo / "snapshots").glob("*/**/*.gguf")):
            if not _is_model_file(path) or not path.exists():
                continue
            model = f"hf.co/{_part(owner)}/{_part(name)}:{_part(path.stem)}"
            found.append(Found(new_name(model), f"hf:{path}", parse(f"FROM {path}", source=str(path))))
    return found


def discover(sources: list[str]) -> list[Found]:
    """What the enabled ``sources`` hold now."""
    found: list[Found] = []
    if "ollama" in sources:
        found += ollama_models(ollama_root())
    if "lmstudio" in sources:
        found += lmstudio_models(lmstudio_roots())
    if "hf" in sources:
        found += hf_cache_models(hf_cache_root())
    return found


def is_discovered(source: str | None) -> bool:
    return str(source or "").startswith(FOUND_SOURCES)


def sync(registry: Registry, sources: list[str]) -> list[str]:
    """Register what is found (never over a model of another origin), forget discovered models that are gone;
    the names registered or updated."""
    found = discover(sources) if sources else []
    used = {record.path for record in registry.all() if not is_discovered(record.source)}
    changed, names = [], set()
    for item in found:
        if item.source.startswith("hf:") and item.modelfile.from_ in used:
            continue  # pulled by localai (or made into a model by the user): already a model of its own
        try:
            existing = registry.get(item.name)
        except LocalAIError:
            existing = None
        if existing is not None and not is_discovered(existing.source):
            log.info("%s is found in %s but a model of that name exists; left as it is", item.name,
                     item.source.split(":", 1)[0])
            continue
        names.add(item.name)
        try:
            if registry.sync(item.name, item.modelfile, source=item.source) is not None:
                changed.append(item.name)
                log.info("found %s (%s)", item.name, item.source)
        except (OSError, ValueError, LocalAIError) as exc:
            log.info("not using %s from %s: %s", item.name, item.source, getattr(exc, "message", exc))
    for name, source in registry.sourced(FOUND_SOURCES).items():
        if name not in names:
            registry.remove(name, delete_weights=False)
            log.info("forgot %s: it is no longer in %s", name, source.split(":", 1)[0])
    return changed
