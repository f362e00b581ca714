"""A model's record, and a Modelfile made into the row the registry stores: FROM resolved (a GGUF file or an MLX
folder, a package's file, a pulled hub model, an installed model, a remote URL), and every line checked against the
weights before anything is stored (the projector's width, the adapters' shapes, the template renders), each
refusal naming its line. The registry (registry.py) keeps the rows in SQLite; nothing here touches the database.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from localai.errors import InvalidRequest, ModelfileError, ModelNotFound
from localai.models import hub, renderer, weights
from localai.models.db import now
from localai.models.gguf_meta import GGUFMetadata, lora_mismatch, read_metadata
from localai.models.modelfile import (
    REMOTE_PARAMETERS,
    Modelfile,
    ParameterValue,
    check_weights_template,
    split_adapter,
)
from localai.models.remote_spec import REMOTE_FORMAT, RemoteSpec, check_url, is_remote_url

PACKAGE_SOURCE = "package:"


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


def adapter_line(adapter: dict[str, Any]) -> str:
    """An adapter as its Modelfile line's argument (the scale only when it is not 1)."""
    scale = float(adapter.get("scale", 1.0))
    return str(adapter["path"]) + ("" if scale == 1.0 else f" {scale:g}")


class Models(Protocol):
    """What building a row reads of the registry: the model a Modelfile builds on, digests, creation times."""

    def get(self, name: str) -> ModelRecord: ...

    def digest(self, path: Path) -> str: ...

    def created_at(self, key: str) -> str | None: ...


class RowBuilder:
    """Modelfiles into rows, against one registry's installed models."""

    def __init__(self, models: Models) -> None:
        self.models = models

    def build(self, key: str, modelfile: Modelfile, source: str | None) -> dict[str, Any]:
        """The row of ``key`` made from ``modelfile``: FROM resolved (weights here, an installed model, a remote
        URL), every line checked against the weights; a refusal (ModelfileError) names the line."""
        base: ModelRecord | None = None
        if is_remote_url(modelfile.from_):
            return self._remote_row(key, modelfile, source, None)
        path = resolve_weights(modelfile.from_)
        if path is None:
            try:
                base = self.models.get(modelfile.from_)
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
        if fmt == "mlx" and modelfile.parameters.get("rpc"):
            raise ModelfileError("PARAMETER rpc: llama.cpp's RPC backend spreads GGUF models; an MLX model runs on "
                                 "this machine's own device")
        projector = self._projector(modelfile, base, fmt, meta.width if fmt == "gguf" else 0)
        adapters = self._adapters(modelfile, base, fmt, meta)
        row = self._compose_row(
            key, modelfile, base, source or (base.source if base else modelfile.from_), _parameters(base, modelfile),
            path=str(path), format=fmt, sha256=self.models.digest(path), size=size, family=meta.architecture,
            quantization=meta.quantization, parameter_size=meta.parameter_size, context_length=meta.context_length,
            projector=projector, adapters=json.dumps(adapters),
        )
        if row["template"] is not None:  # the template the model will render with: its own, or its weights'
            renderer.check_renders(row["template"], "TEMPLATE")
        else:
            where = f"FROM {modelfile.from_}: the chat template in the weights"
            if meta.chat_template is not None:
                check_weights_template(meta.chat_template, where)
            renderer.check_renders(meta.chat_template, where)
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
        return json.dumps({"path": str(path), "sha256": self.models.digest(path)})

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
            found.append({"path": str(path), "sha256": self.models.digest(path), "scale": scale})
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
        created = self.models.created_at(key)
        if created:
            row["created_at"] = created
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
