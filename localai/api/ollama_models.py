"""Ollama-native model administration: version, tags, ps, show, create, copy and delete (the inference routes
are in api/ollama.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from localai import __version__
from localai.api.common import (
    ParsedBodyRoute,
    remote_descriptions,
    runtime_of,
)
from localai.api.validation import json_typed
from localai.engines.descriptions import speculative_support, state_kind
from localai.errors import InvalidRequest, ModelNotFound
from localai.models.gguf_meta import AttentionShape
from localai.models.loading import attention_of, chosen_engine, gguf_metadata, is_reranker, kv_bytes, window
from localai.models.modelfile import (
    Modelfile,
    anchored_adapters,
    check_template,
    coerce_parameter,
    parse,
)
from localai.models.registry import ModelRecord
from localai.runtime.prompt import Template, format_choice
from localai.settings import Settings

router = APIRouter(route_class=ParsedBodyRoute)


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    verbose: bool = False

    def model_name(self) -> str:
        value = self.model or self.name
        if not value:
            raise InvalidRequest("'model' is required", param="model")
        return value


class CopyBody(BaseModel):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class CreateBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    modelfile: str | None = None
    path: str | None = Field(default=None, description="Directory that relative FROM paths resolve against.")
    from_: str | None = Field(default=None, alias="from")
    parameters: dict[str, Any] | None = None
    template: str | None = None
    system: str | None = None
    stream: bool = False



@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def details(record: ModelRecord) -> dict[str, Any]:
    return {"parent_model": "", "format": record.format, "family": record.family, "families": [record.family],
            "parameter_size": record.parameter_size, "quantization_level": record.quantization}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    settings: Settings = request.app.state.settings
    runtime = runtime_of(request)
    records = await runtime.registry.off_loop(lambda registry: registry.all())
    remote = await remote_descriptions(request, records)
    models = []
    for record in records:
        models.append({
            "name": record.name, "model": record.name, "modified_at": record.modified_at, "size": record.size,
            "digest": record.sha256, "details": details(record),
            "context_length": remote[record.name]["context_length"] if record.remote else record.context_length,
            "engine": chosen_engine(record, settings.engine),  # localai extension
            **({"remote": remote[record.name]} if record.remote else {}),  # localai extension
        })
    return {"models": models}



@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    models = []
    running = list(runtime_of(request).scheduler.loaded.values())
    # each model's attention shape comes from its GGUF header (a stat, a parse when the file changed): off the loop
    shapes = await asyncio.to_thread(lambda: [attention_of(loaded.record) for loaded in running])
    for loaded, shape in zip(running, shapes, strict=True):
        record, info = loaded.record, loaded.worker.info
        expires = (dt.datetime.fromtimestamp(loaded.expires_at, dt.UTC).isoformat()
                   if loaded.expires_at is not None else None)
        options = loaded.worker.options
        placed = _placement_of(request, loaded.name) or {}
        kv = kv_bytes(shape, int(options.get("num_ctx") or 0), int(options.get("n_parallel") or 1),
                      str(options.get("kv_type") or "f16"))
        models.append({
            "name": loaded.name, "model": loaded.name, "size": record.size + kv, "digest": record.sha256,
            "kv_bytes": kv, "kv_type": options.get("kv_type", "f16"),  # localai extensions: the KV cache's part
            "details": details(record), "expires_at": expires,
            "size_vram": placed["device_bytes"] if placed.get("layers") else 0,
            "context_length": info["n_ctx"] if info else None, "active_requests": loaded.active,
            "processor": placed.get("processor", "100% CPU"),
            "placement": placed,  # localai extension: layers on the GPU, the devices, and why
            "experts": placed.get("experts", ""),  # localai extension: where a mixture of experts' experts are
            "pid": loaded.worker.pid, "keep_alive": loaded.keep_alive,
            # localai extension: the models served by the same worker (one copy of the weights, one prompt cache)
            "shared_with": loaded.sharing_with(),
            "engine": loaded.worker.backend, "queued": runtime_of(request).scheduler.queued.get(loaded.name, 0),
        })
    for name, pool in runtime_of(request).remotes.pools.items():  # remote models in use: no process here
        if not pool.in_use:
            continue  # only listed, or idle long enough that its health checks stopped
        models.append({
            "name": name, "model": name, "size": 0, "digest": pool.spec.digest(), "expires_at": None,
            "details": {"parent_model": "", "format": "remote", "family": "remote", "families": ["remote"],
                        "parameter_size": "", "quantization_level": ""}, "size_vram": 0,
            "context_length": pool.context_length() or None, "active_requests": pool.active, "processor": "remote",
            "pid": None, "keep_alive": None, "engine": "remote", "queued": 0, "replicas": pool.status(),
        })
    return {"models": models}


async def _template_of(record: ModelRecord) -> Template:
    template = record.template
    if template is None and record.path and not record.remote:
        meta = await asyncio.to_thread(gguf_metadata, record.path)
        template = meta.chat_template if meta is not None else None
    return Template(template)


async def capabilities(record: ModelRecord) -> list[str]:
    """What the model can do, as Ollama clients read it: completion, tools, thinking, vision (a projector); a
    reranker only ``rerank``."""
    if await asyncio.to_thread(is_reranker, record):
        return ["rerank"]  # scores documents (POST /v1/rerank); it does not complete
    template = await _template_of(record)
    found = ["completion", "tools"]  # tools work with every template (described in the prompt when not native)
    if template.thinks or template.tool_format == "harmony":
        found.append("thinking")
    if record.projector:
        found.append("vision")
    return found


async def parser_of(record: ModelRecord) -> dict[str, str]:
    """How the model's tool calls are read: its Modelfile's PARSER, else what its chat template shows."""
    if record.remote and "parser" not in record.parameters:
        return {"name": "upstream", "from": "the upstream parses its own output"}
    name, source = format_choice(record.parameters, await _template_of(record))
    return {"name": name, "from": source}


@router.post("/api/show")
async def show(body: ModelRef, request: Request) -> dict[str, Any]:
    record = await runtime_of(request).record(body.model_name())
    modelfile = record.modelfile()
    parameters = "\n".join(
        f"{name:<20} {json.dumps(item) if isinstance(item, str) else item}"
        for name, value in record.parameters.items()
        for item in (value if isinstance(value, list) else [value])
    )
    remote = (await remote_descriptions(request, [record])).get(record.name)
    settings = request.app.state.settings
    fitted = None if remote else await asyncio.to_thread(window, record, settings)
    num_ctx = remote["context_length"] if remote else fitted.num_ctx  # type: ignore[union-attr]
    return {
        "modelfile": modelfile.render(), "parameters": parameters, "template": record.template or "",
        "system": record.system or "", "license": record.license or "", "details": details(record),
        "model_info": {"general.architecture": record.family,
                       f"{record.family}.context_length": num_ctx if remote else record.context_length},
        "capabilities": await capabilities(record), "modified_at": record.modified_at,
        "path": record.path,  # localai extension: the weights file (benchmarks run llama.cpp tools on it)
        **({"projector": record.projector} if record.projector else {}),  # localai extension: the mmproj file
        # localai extension: the context the daemon loads the model with (launch gives it to agents)
        "num_ctx": num_ctx,
        "engine": chosen_engine(record, request.app.state.settings.engine),  # localai extension
        # localai extension: what the prompt cache keeps of a sequence, and whether speculative decoding runs
        **_state_of(request, record, await asyncio.to_thread(attention_of, record)),
        "parser": await parser_of(record),  # localai extension: the tool-call format and where it came from
        # localai extension: the memory the model takes at that window, and how the window was chosen
        **({"memory": {"num_ctx": fitted.num_ctx, "kv_type": fitted.kv_type, "weights_bytes": fitted.weights_bytes,
                       "kv_bytes": fitted.kv_bytes, "total_bytes": fitted.total_bytes(),
                       "sequences": settings.num_parallel, "available_bytes": fitted.available_bytes,
                       "chosen_by": fitted.chosen_by, "advice": fitted.advice}} if fitted else {}),
        **({"remote": remote} if remote else {}),  # localai extension: upstream model, kind, replicas' health
        **({"placement": placement} if (placement := _placement_of(request, record.name)) else {}),
    }


def _state_of(request: Request, record: ModelRecord, shape: AttentionShape | None) -> dict[str, str]:
    """``state`` and ``speculative`` as the loaded worker reports them, else as the GGUF header says (``shape``,
    read off the loop)."""
    loaded = runtime_of(request).scheduler.loaded.get(record.name)
    info = loaded.worker.info if loaded is not None else None
    if info and info.get("speculative"):
        return {"state": str(info.get("state", "")), "speculative": str(info["speculative"])}
    if shape is None or chosen_engine(record, request.app.state.settings.engine) != "llama.cpp":
        return {}
    recurrent, window = shape.recurrent_bytes > 0, shape.sliding_window if shape.sliding_share else 0
    return {"state": state_kind(recurrent, window),
            "speculative": speculative_support(not recurrent and not window, recurrent, window)}


def _placement_of(request: Request, name: str) -> dict[str, Any] | None:
    """Where a loaded model's layers run (engines/placement.py), as its worker reported it; None when not loaded."""
    loaded = runtime_of(request).scheduler.loaded.get(name)
    info = loaded.worker.info if loaded is not None else None
    return dict(info["placement"]) if info and info.get("placement") else None


@router.delete("/api/delete")
async def delete(body: ModelRef, request: Request) -> JSONResponse:
    runtime = runtime_of(request)
    name = body.model_name()
    record = await runtime.record(name)
    removed = await runtime.registry.off_loop(lambda registry: registry.remove(name))  # deletes GB-sized blobs
    if record.name in removed:  # removing only an alias leaves the model loaded
        await runtime.unload(record.name)
    return JSONResponse({"deleted": removed})


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request) -> JSONResponse:
    source, destination = body.source, body.destination
    await runtime_of(request).registry.off_loop(lambda registry: registry.copy(source, destination))
    return JSONResponse({})


def _modelfile_of(body: CreateBody) -> Modelfile:
    """The Modelfile a create asks for (its text parsed, or built from ``from`` and its fields), templates checked."""
    if body.modelfile:
        modelfile = parse(body.modelfile, source="Modelfile")
        if body.path and not Path(modelfile.from_).is_absolute() and modelfile.from_.startswith("."):
            modelfile.from_ = str((Path(body.path) / modelfile.from_).resolve())
        if body.path:
            modelfile.adapters = anchored_adapters(modelfile.adapters, Path(body.path))
    elif body.from_:
        modelfile = Modelfile(from_=body.from_, template=body.template, system=body.system)
        for key, value in (body.parameters or {}).items():
            json_typed(key, value, f"parameters.{key}")
            modelfile.parameters[key] = coerce_parameter(key, value, f"parameters.{key}")
    else:
        raise InvalidRequest("give 'modelfile' text or 'from'", param="modelfile")
    if body.template is not None:
        check_template(body.template, "template")
    return modelfile


@router.post("/api/create")
async def create(body: CreateBody, request: Request) -> JSONResponse:
    name = body.model or body.name
    if not name:
        raise InvalidRequest("'model' is required", param="model")
    # Jinja parses a TEMPLATE in pure Python (a second for a large one): off the event loop, or every stream and
    # /health waited for it
    modelfile = await asyncio.to_thread(_modelfile_of, body)
    try:  # hashing a new GGUF reads every byte: off the event loop
        record = await runtime_of(request).registry.off_loop(lambda registry: registry.create(name, modelfile))
    except ModelNotFound as exc:
        raise InvalidRequest(exc.message, param="from") from exc
    return JSONResponse({"status": "success", "model": record.name})
