"""Model verbs: ``list``, ``ps``, ``show``, ``stop``, ``rm``, ``cp``, ``create``."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import click

from localai.cli import cli, fail_cleanly
from localai.client import human_size


def _client(start: bool = True) -> Any:
    from localai.client import Client

    client = Client()
    if start:
        client.ensure_running()
    return client


def ago(stamp: str | None) -> str:
    if not stamp:
        return ""
    try:
        then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return stamp
    seconds = (dt.datetime.now(dt.UTC) - then).total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if abs(seconds) >= size:
            count = int(abs(seconds) // size)
            return f"{count} {unit}{'s' if count != 1 else ''} {'ago' if seconds > 0 else 'from now'}"
    return "just now" if seconds >= 0 else "in a moment"


def _table(headers: list[str], rows: list[list[str]], *, shrink: tuple[str, ...] = ()) -> None:
    """A table as wide as the terminal (200 columns into a pipe, so nothing is cut for grep); the ``shrink``
    columns give way, cut with an ellipsis, when the others need the room."""
    import shutil
    import sys

    from rich.console import Console
    from rich.table import Table

    width = shutil.get_terminal_size((200, 24)).columns if sys.stdout.isatty() else 200
    widest = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]
    room = width - sum(w for w, h in zip(widest, headers, strict=True) if h not in shrink) - 2 * (len(headers) - 1)
    wanted = sum(w for w, h in zip(widest, headers, strict=True) if h in shrink)
    if shrink and wanted > room:  # each shrinking column gets its share of the room, at least 8 characters
        widest = [w if h not in shrink else max(8, room * w // wanted) for w, h in zip(widest, headers, strict=True)]
    table = Table(box=None, pad_edge=False, show_edge=False)
    for header, column_width in zip(headers, widest, strict=True):
        table.add_column(header, no_wrap=True, overflow="ellipsis", width=column_width if header in shrink else None)
    for row in rows:
        table.add_row(*row)
    # a height too: rich ignores a width alone on dumb terminals (TERM=dumb: Emacs' shell) and prints 80 wide
    Console(width=max(width, sum(widest) + 2 * len(headers)), height=24).print(table)


@cli.command("list")
@click.option("--library", "show_library", is_flag=True, help="List the models `localai pull NAME` can fetch.")
@fail_cleanly
def list_models(show_library: bool) -> None:
    """List installed models (or, with --library, the library)."""
    if show_library:
        _list_library()
        return
    models = _client().request("GET", "/api/tags")["models"]
    _table(
        ["NAME", "ID", "SIZE", "QUANT", "FAMILY", "CONTEXT", "MODIFIED"],
        [[m["name"], m["digest"][:12], "remote" if "remote" in m else human_size(m["size"]),
          m["details"]["quantization_level"],
          m["details"]["family"], str(m.get("context_length") or ""), ago(m["modified_at"])] for m in models],
    )


def _list_library() -> None:
    from localai.models import library

    client = _client(start=False)
    installed = {m["name"] for m in client.request("GET", "/api/tags")["models"]} if client.is_running() else set()
    _table(["NAME", "CONTEXT", "INSTALLED", "FROM", "DESCRIPTION"],
           [[row.name, row.context, "yes" if row.name in installed else "", row.source.removeprefix("hf.co/"),
             row.description] for row in library.rows()], shrink=("FROM", "DESCRIPTION"))


def _broken_modelfiles(client: Any) -> list[dict[str, Any]]:
    return [item for item in client.request("GET", "/api/modelfiles")["modelfiles"] if item["error"]]


def _where(item: dict[str, Any]) -> str:
    """A broken Modelfile's error, led by its path (parse errors name it already)."""
    return item["error"] if item["error"].startswith(item["path"]) else f"{item['path']}: {item['error']}"


@cli.command()
@fail_cleanly
def ps() -> None:
    """List loaded models, and user Modelfiles that are broken."""
    client = _client(start=False)
    running = client.is_running()
    models = client.request("GET", "/api/ps")["models"] if running else []
    _table(
        ["NAME", "ENGINE", "SIZE", "PROCESSOR", "WORKER", "CONTEXT", "ACTIVE", "QUEUED", "UNTIL"],
        [[m["name"], m.get("engine", ""), human_size(m["size"]) if m.get("size") else "-", m.get("processor", ""),
          _worker(m), str(m["context_length"] or "-"), str(m["active_requests"]), str(m.get("queued", 0)),
          _until(m)]
         for m in models],
    )
    for model in models:
        if "CPU" in model.get("experts", "") and model.get("processor") != "100% CPU":
            click.echo(f"{model['name']}: {model['experts']} (the rest of the model on the GPU)")
    shared = [m for m in models if m.get("shared_with")]
    if shared:
        click.echo("\nModels on one worker share its memory (one copy of the weights) and its prompt cache.")
    broken = _broken_modelfiles(client) if running else []
    if broken:
        click.echo("\nBroken Modelfiles (a model created from one earlier keeps that version):")
        for item in broken:
            click.echo(f"  {_where(item)}")


@cli.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@fail_cleanly
def info(model: str | None, as_json: bool) -> None:
    """What this machine runs models on (llama.cpp's backends and devices, MLX), and where MODEL would run."""
    import json
    import urllib.parse

    client = _client()
    query = "?refresh=true" + (f"&model={urllib.parse.quote(model)}" if model else "")  # free memory as of now
    report = client.request("GET", "/api/info" + query)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    llama = report["llama_cpp"]
    if "error" in llama:
        click.echo(f"llama.cpp      {llama['error']}")
    else:
        click.echo(f"llama.cpp      llama-cpp-python {llama['llama_cpp_python']}, backends: "
                   f"{', '.join(llama['backends'])}{'' if llama['gpu_offload'] else ' (no GPU offload)'}")
        for device in llama["devices"]:
            # llama.cpp reports a CPU device's free memory as its total: what a model gets there is "RAM free"
            memory = ("the system's RAM (see RAM free)" if device["type"] == "cpu" else
                      f"{device['free'] / 2**30:.1f} of {device['total'] / 2**30:.1f} GiB free")
            click.echo(f"  {device['name']:<12} {device['type']:<5} {device['description']}: {memory}")
        servers = report.get("rpc_servers") or []
        if not llama.get("rpc"):
            click.echo("RPC            not built in (reinstall llama-cpp-python with CMAKE_ARGS=-DGGML_RPC=ON)")
        else:
            click.echo("RPC            built in: `localai rpc-server` serves this machine's devices; "
                       + (f"every model spreads over {', '.join(servers)}" if servers
                          else "no servers for every model (LOCALAI_RPC_SERVERS; a Modelfile's PARAMETER rpc)"))
    mlx = report["mlx"]
    click.echo(f"MLX            {'installed' if mlx['installed'] else 'not installed'}"
               f"{', preferred (Apple Silicon)' if mlx['preferred'] else ''}")
    click.echo(f"RAM free       {report['host_free'] / 2**30:.1f} GiB")
    chosen = report.get("model")
    if chosen:
        click.echo(f"\n{chosen['name']}")
        click.echo(f"  engine       {chosen['engine']}: {chosen['engine_reason']}")
        if "error" in chosen:
            click.echo(f"  cannot load  {chosen['error']}")
        for label, placement in (("placement", chosen.get("placement")), ("loaded", chosen.get("loaded"))):
            if placement:
                click.echo(f"  {label:<12} {placement['processor']}: {placement['layers']}/{placement['layers_total']} "
                           f"layers, {placement['device_bytes'] / 2**30:.2f} GiB on the GPU of "
                           f"{placement['total_bytes'] / 2**30:.2f} GiB"
                           + (f", {placement['experts']}" if placement.get("experts") else "")
                           + f"; {placement['reason']}")
                if placement.get("layer_devices"):
                    click.echo("  layers       " + ", ".join(f"{span['layers']} on {span['device']}"
                                                            for span in placement["layer_devices"]))


def _worker(model: dict[str, Any]) -> str:
    """The worker process serving a model: its pid, and the other models it serves."""
    if not model.get("pid"):
        return "-"
    others = model.get("shared_with") or []
    return f"pid {model['pid']}" + (f", shared with {', '.join(others)}" if others else "")


def on_the_gpu(placement: dict[str, Any]) -> str:
    """Where a loaded model's layers are, said of the GPU (the layers counted are those offloaded to it)."""
    total = placement["layers_total"]
    if not placement["layers"]:
        return f"none of its {total} layers on a GPU"
    devices = ", ".join(f"{d['name']} ({d['description']})" for d in placement["devices"]) or "the GPU"
    return (f"{placement['layers']}/{total} layers on {devices}, {placement['device_bytes'] / 2**30:.2f} GiB there; "
            "the rest on the CPU" if placement["layers"] < total else
            f"all {total} layers on {devices}, {placement['device_bytes'] / 2**30:.2f} GiB there")


def _until(model: dict[str, Any]) -> str:
    if "replicas" in model:  # a remote model: nothing to unload, its replicas' health instead
        up = sum(1 for replica in model["replicas"] if replica["healthy"])
        return f"{up}/{len(model['replicas'])} replicas up"
    if model["expires_at"] is None:
        return "forever" if model["keep_alive"] is not None and model["keep_alive"] < 0 else "busy"
    return ago(model["expires_at"])


@cli.command()
@click.argument("model", required=False)
@fail_cleanly
def stop(model: str | None) -> None:
    """Unload a model now (`localai daemon stop` stops the daemon)."""
    if not model:  # what `ollama stop` users type, and what someone looking for the daemon's stop types
        raise click.UsageError("name the model to unload (`localai ps` lists them); to stop the daemon itself: "
                               "localai daemon stop")
    client = _client(start=False)
    if not client.is_running():
        return
    client.request("POST", "/api/generate", {"model": model, "keep_alive": 0})


@cli.command()
@click.argument("model")
@click.option("--modelfile", "part", flag_value="modelfile", help="Show the Modelfile.")
@click.option("--parameters", "part", flag_value="parameters", help="Show the parameters.")
@click.option("--template", "part", flag_value="template", help="Show the chat template.")
@click.option("--system", "part", flag_value="system", help="Show the system prompt.")
@click.option("--license", "part", flag_value="license", help="Show the license.")
@fail_cleanly
def show(model: str, part: str | None) -> None:
    """Show a model's details, Modelfile, parameters, template or system prompt."""
    from localai.errors import ModelNotFound
    from localai.models.registry import normalize

    client = _client()
    broken = [item for item in _broken_modelfiles(client) if item["name"] == normalize(model)]
    try:
        info = client.request("POST", "/api/show", {"model": model})
    except ModelNotFound:
        if broken:
            message = f"model '{model}' is not installed, its Modelfile is broken: {_where(broken[0])}"
            raise ModelNotFound(message) from None
        raise
    if part:
        click.echo(info.get(part, "").rstrip("\n"))
        return
    details = info["details"]
    click.echo("  Model")
    for label, value in (("architecture", details["family"]), ("parameters", details["parameter_size"]),
                         ("context length", info["model_info"].get(f"{details['family']}.context_length")),
                         ("quantization", details["quantization_level"]), ("engine", info.get("engine", ""))):
        click.echo(f"    {label:<16}{value}")
    if info.get("capabilities"):
        click.echo(f"    {'capabilities':<16}{', '.join(info['capabilities'])}")
    parser = info.get("parser")
    if parser and "rerank" not in info.get("capabilities", []):
        click.echo(f"    {'tool calls':<16}{parser['name']} ({parser['from']})")
    memory = info.get("memory")
    if memory:
        how = {"memory": "the largest that fits the free memory", "num_ctx": "num_ctx",
               "LOCALAI_CONTEXT_LENGTH": "LOCALAI_CONTEXT_LENGTH"}.get(memory["chosen_by"], memory["chosen_by"])
        click.echo(f"    {'window':<16}{memory['num_ctx']} tokens x {memory['sequences']} sequences ({how})")
        click.echo(f"    {'memory':<16}{memory['total_bytes'] / 2**30:.2f} GiB: weights "
                   f"{memory['weights_bytes'] / 2**30:.2f} GiB + KV cache {memory['kv_bytes'] / 2**30:.2f} GiB "
                   f"({memory['kv_type']})")
        if memory.get("advice"):
            click.echo(f"    {'note':<16}{memory['advice']}")
    placement = info.get("placement")
    if placement:
        click.echo(f"    {'processor':<16}{placement['processor']}: {on_the_gpu(placement)}"
                   + (f"; {placement['experts']}" if placement.get("experts") else ""))
    remote = info.get("remote")
    if remote:
        click.echo("\n  Remote")
        click.echo(f"    {'upstream model':<16}{remote.get('upstream_model') or '(not known yet)'}")
        click.echo(f"    {'served by':<16}{remote.get('kind', '')}")
        for replica in remote.get("replicas", []):
            state = "up" if replica["healthy"] else f"down: {replica['reason']}"
            click.echo(f"    {'replica':<16}{replica['url']}  ({state})")
    if info["parameters"]:
        click.echo("\n  Parameters")
        for line in info["parameters"].splitlines():
            click.echo(f"    {line}")
    if info["system"]:
        click.echo("\n  System")
        click.echo(f"    {info['system']}")
    for item in broken:
        click.echo("\n  Modelfile error (this is its last good version)")
        click.echo(f"    {_where(item)}")


@cli.command()
@click.argument("models", nargs=-1, required=True)
@fail_cleanly
def rm(models: tuple[str, ...]) -> None:
    """Remove models (and their pulled weights, when no other model uses them)."""
    client = _client()
    for model in models:
        client.request("DELETE", "/api/delete", {"model": model})
        click.echo(f"deleted '{model}'")


@cli.command()
@click.argument("source")
@click.argument("destination")
@fail_cleanly
def cp(source: str, destination: str) -> None:
    """Copy a model to a new name (weights are shared, not copied)."""
    _client().request("POST", "/api/copy", {"source": source, "destination": destination})
    click.echo(f"copied '{source}' to '{destination}'")


@cli.command()
@click.argument("name")
@click.option("-f", "--file", "modelfile_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("Modelfile"), show_default=True, help="The Modelfile to build from.")
@fail_cleanly
def create(name: str, modelfile_path: Path) -> None:
    """Create a model from a Modelfile."""
    from localai.errors import ModelfileError
    from localai.models.modelfile import parse

    try:
        text = modelfile_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelfileError(f"cannot read {modelfile_path}: {exc.strerror}") from exc
    parse(text, source=str(modelfile_path))  # report line errors before talking to the daemon
    result = _client().request("POST", "/api/create", {
        "model": name, "modelfile": text, "path": str(modelfile_path.resolve().parent),
    })
    click.echo(f"created '{result['model']}'")
