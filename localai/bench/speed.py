"""``localai bench``: the repetitions of ``api.py``'s measurements against localai and an anchor (llama-server,
mlx-lm's server, llama-bench or mlx-lm in-process), interleaved, and the table of their medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from localai.bench import api as measure
from localai.bench.servers import LlamaServer, MlxLmServer, ReferenceServer
from localai.errors import DaemonUnavailable


@dataclass(frozen=True)
class SpeedPlan:
    """What ``localai bench`` measures (its options)."""
    model: str
    prompt_tokens: int
    gen_tokens: int
    repetitions: int
    threads: int
    streams: int
    edit_tokens: int
    depth: int
    llama_bench_path: str | None = None
    with_mlx_lm: bool = False
    llama_server_path: str | None = None
    llama_server_args: tuple[str, ...] = ()
    with_mlx_lm_server: bool = False
    cold: tuple[int, ...] = ()  # how many cold prompts arrive together beside a decoding stream, per measurement
    cold_tokens: int = 1500  # each cold prompt's size


@dataclass
class Side:
    """One server's measurements over the repetitions."""
    speed: measure.SpeedResult = field(default_factory=measure.SpeedResult)
    streams: measure.StreamsResult = field(default_factory=measure.StreamsResult)
    edit: measure.EditResult = field(default_factory=measure.EditResult)
    edit_spec: measure.EditResult = field(default_factory=measure.EditResult)  # localai's, speculative decoding on
    cold: measure.ColdResult = field(default_factory=measure.ColdResult)
    rss: list[dict[str, int]] = field(default_factory=list)  # resident bytes by process, after each repetition
    context: int = 0  # the context the server was given (tokens, all sequences together)


@dataclass
class SpeedReport:
    plan: SpeedPlan
    anchor: str  # "llama-server", "mlx_lm.server", "llama-bench", "mlx-lm" or "" (none)
    ours: Side = field(default_factory=Side)
    theirs: Side = field(default_factory=Side)


class Connection:
    """The API measured: the local daemon's (started if needed) or any OpenAI-compatible /v1 URL."""

    def __init__(self, base_url: str | None, model: str) -> None:
        self.client: Any = None
        self.model_path: str | None = None
        if base_url is None:
            from localai import paths
            from localai.client import Client

            self.client = Client()
            self.client.ensure_running()
            self.http = httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.socket_path())),
                                     base_url="http://localhost/v1", timeout=600)
            self.model_path = self.client.request("POST", "/api/show", {"model": model})["path"]
        else:
            self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=600)

    def unload(self, model: str) -> None:
        self.client.request("POST", "/api/generate", {"model": model, "keep_alive": 0})


def run(plan: SpeedPlan, base_url: str | None, progress: Callable[[str], None]) -> SpeedReport:
    """Every repetition on localai, then on the anchor; ``progress`` hears a line after each."""
    connection = Connection(base_url, plan.model)
    server: ReferenceServer | None = None
    if plan.llama_server_path and connection.model_path:
        server = LlamaServer(plan.llama_server_path, connection.model_path,
                             max(4096, plan.depth + plan.prompt_tokens + plan.gen_tokens + 512),
                             threads=plan.threads, parallel=max(1, plan.streams, *(n + 1 for n in plan.cold)),
                             extra=plan.llama_server_args)
    elif plan.with_mlx_lm_server and connection.model_path:
        # its BatchGenerator decodes as many sequences at once as the streams measured
        server = MlxLmServer(connection.model_path, decode_concurrency=max(1, plan.streams))
    anchor = ("llama-server" if isinstance(server, LlamaServer) else "mlx_lm.server" if server
              else "llama-bench" if plan.llama_bench_path else "mlx-lm" if plan.with_mlx_lm else "")
    report = SpeedReport(plan, anchor)
    # With llama-server, only one of the two holds the model at a time: localai's is unloaded while llama-server
    # runs, and llama-server is stopped while localai runs (two resident servers' threads contend on a small CPU:
    # one run with both up saw a decode at 0.7 tok/s and a 1.7 s inter-token p99 that neither shows alone)
    with connection.http as http:
        anchor_http = httpx.Client(base_url=server.base_url, timeout=600) if server else None
        words = measure.calibrate_words(http, plan.model, plan.prompt_tokens)  # also loads the model
        measure.warm_up(http, plan.model, words)
        depth_words = round(words * plan.depth / plan.prompt_tokens) if plan.depth else 0
        for index in range(plan.repetitions):
            if index and server is not None:
                measure.warm_up(http, plan.model, words)  # loads it again, outside the measurement
            measure_side(http, plan, words, depth_words, report.ours, ours=True)
            if connection.client is not None:
                report.ours.rss.append(localai_rss(connection.client, plan.model))
                report.ours.context = localai_context(connection.client, plan.model)
            if server is not None and anchor_http is not None:
                connection.unload(plan.model)
                run_anchor_server(server, anchor_http, plan, words, depth_words, report.theirs)
            elif plan.llama_bench_path and connection.model_path:
                pp, tg = measure.llama_bench(plan.llama_bench_path, connection.model_path, plan.threads,
                                             plan.prompt_tokens, plan.gen_tokens, report.ours.speed.depth[-1])
                report.theirs.speed.prefill.append(pp)
                report.theirs.speed.decode.append(tg)
            elif plan.with_mlx_lm and connection.model_path:
                pp, tg = measure.mlx_lm_reference(connection.model_path, report.ours.speed.prompt_tokens[-1],
                                                  plan.gen_tokens)
                report.theirs.speed.prefill.append(pp)
                report.theirs.speed.decode.append(tg)
            ours = report.ours.speed
            progress(f"  run {index + 1}/{plan.repetitions}: pp {ours.prefill[-1]:.1f} tok/s, "
                     f"tg {ours.decode[-1] if ours.decode else 0:.1f} tok/s")
        if anchor_http is not None:
            anchor_http.close()
        if server is not None:
            server.__exit__()
    return report


def measure_side(http: httpx.Client, plan: SpeedPlan, words: int, depth_words: int, side: Side, *,
                 ours: bool) -> None:
    """One repetition on one server: speed, then streams and the edit workload where asked (localai's twice,
    speculative decoding off and on; the anchor's as started)."""
    measure.measure_once(http, plan.model, words, plan.gen_tokens, side.speed, depth_words)
    side.speed.fixed_ms.append(measure.fixed_cost_ms(http, plan.model))
    if plan.streams > 1:
        measure.measure_streams(http, plan.model, plan.streams, plan.gen_tokens, side.streams)
    for cold in plan.cold:
        measure.measure_cold_beside(http, plan.model, cold, round(words * plan.cold_tokens / plan.prompt_tokens),
                                    side.cold)
    if plan.edit_tokens and ours:
        measure.measure_edit(http, plan.model, plan.edit_tokens, side.edit, "off")
        measure.measure_edit(http, plan.model, plan.edit_tokens, side.edit_spec, "on")
    elif plan.edit_tokens:
        measure.measure_edit(http, plan.model, plan.edit_tokens, side.edit)


def run_anchor_server(server: ReferenceServer, http: httpx.Client, plan: SpeedPlan, words: int, depth_words: int,
                      side: Side) -> None:
    """One repetition on the anchor's server, started for it and stopped after (its requests name the model as it
    knows it: mlx_lm.server loads the folder a request names)."""
    plan = replace(plan, model=server.request_model() or plan.model)
    server.start()
    try:
        measure.warm_up(http, plan.model, words)  # the same way
        measure_side(http, plan, words, depth_words, side, ours=False)
        if server.process is not None:
            side.rss.append({"server": rss_bytes(server.process.pid)})
            side.context = getattr(server, "n_ctx", 0) * getattr(server, "parallel", 1)
    except httpx.HTTPError as exc:
        failure = anchor_died(server, exc)
        server.__exit__()
        if failure is exc:
            raise
        raise failure from exc
    finally:
        server.stop()


def rss_bytes(pid: int) -> int:
    """A process's resident memory (``ps``: Linux and macOS), 0 when it cannot be read."""
    import subprocess

    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=10).stdout
        return int(out.strip() or 0) * 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def _loaded(client: Any, model: str) -> dict[str, Any]:
    """The model's /api/ps entry, or {}: asked for as ``smollm2``, it is listed under its tag (``smollm2:135m``)."""
    models = client.request("GET", "/api/ps").get("models", [])
    return (next((m for m in models if m.get("name") == model), None)
            or next((m for m in models if ":" not in model and str(m.get("name")).split(":")[0] == model), {}))


def localai_rss(client: Any, model: str) -> dict[str, int]:
    """The daemon's and the model's worker's resident memory."""
    daemon = (client.health() or {}).get("pid")
    worker = _loaded(client, model).get("pid")
    return {name: rss_bytes(pid) for name, pid in (("daemon", daemon), ("worker", worker)) if isinstance(pid, int)}


def localai_context(client: Any, model: str) -> int:
    return int(_loaded(client, model).get("context_length") or 0)


def anchor_died(server: Any, exc: Exception) -> Exception:
    """An HTTP error from an anchor server that has exited: its own last words, not a traceback."""
    if server.process is None or server.process.poll() is None:
        return exc
    last = (server.stderr().strip().splitlines() or [""])[-1]
    name = "llama-server" if isinstance(server, LlamaServer) else "mlx_lm.server"
    return DaemonUnavailable(f"{name} exited (code {server.process.returncode}) during the benchmark: {last}")


def table(report: SpeedReport) -> list[str]:
    """The medians (min-max) of each column, localai's beside the anchor's, then latency and the edit answers."""
    plan, ours, theirs, anchor = report.plan, report.ours, report.theirs, report.anchor
    lines = [f"model {plan.model}  threads {plan.threads}  prompt {ours.speed.prompt_tokens[-1]} tokens  output "
             f"{plan.gen_tokens} tokens" + (f"  after {ours.speed.depth[-1]} tokens of context" if plan.depth else "")
             + f"  repetitions {plan.repetitions} (median, min-max)"]
    columns = [("prefill (pp) tok/s", ours.speed.prefill, theirs.speed.prefill),
               ("decode (tg) tok/s", ours.speed.decode, theirs.speed.decode)]
    if plan.streams > 1:
        columns.append((f"{plan.streams} streams, tok/s in all", ours.streams.aggregate, theirs.streams.aggregate))
    if plan.edit_tokens:
        columns.append(("edit: decode tok/s", ours.edit.decode, theirs.edit.decode))
        columns.append(("edit, speculative on", ours.edit_spec.decode, theirs.edit.decode))
    lines.append(f"{'':24}" + "".join(f"{title:<34}" for title, _, _ in columns))
    lines.append(f"{'localai (API)':<24}" + "".join(f"{measure.summary(mine):<34}" for _, mine, _ in columns))
    if anchor and theirs.speed.prefill:
        lines.append(f"{anchor:<24}" + "".join(f"{measure.summary(other):<34}" for _, _, other in columns))
        lines.append(f"{'localai / ' + anchor:<24}"
                     + "".join(f"{measure.percent(mine, other):<34}" for _, mine, other in columns))
    if ours.speed.fixed_ms:
        line = ("fixed cost per request (a cached 64-word prompt, one token): localai "
                f"{measure.summary(ours.speed.fixed_ms)} ms")
        if anchor and theirs.speed.fixed_ms:
            difference = statistics.median(ours.speed.fixed_ms) - statistics.median(theirs.speed.fixed_ms)
            line += f", {anchor} {measure.summary(theirs.speed.fixed_ms)} ms ({difference:+.1f} ms)"
        lines.append(line)
    return lines + latency_and_edits(report) + cold_lines(report) + memory_lines(report)


def memory_lines(report: SpeedReport) -> list[str]:
    """Resident memory after the measurements (the largest over the repetitions), localai's daemon and worker
    beside the anchor server's, with the context each was given."""
    ours, theirs = report.ours, report.theirs
    if not ours.rss:
        return []
    mib = 1 << 20
    peak = max(ours.rss, key=lambda r: sum(r.values()))
    line = (f"memory (resident, after the measurements): localai {sum(peak.values()) / mib:.0f} MiB ("
            + " + ".join(f"{name} {value / mib:.0f}" for name, value in peak.items())
            + f"; context {ours.context} tokens)")
    if theirs.rss:
        other = max(sum(r.values()) for r in theirs.rss)
        line += (f", {report.anchor} {other / mib:.0f} MiB (context {theirs.context} tokens; "
                 f"{sum(peak.values()) / max(other, 1):.2f}x)")
    return [line]


def cold_lines(report: SpeedReport) -> list[str]:
    """Each count of cold prompts: their times to first token (sorted, medians over the repetitions) and the
    decoding stream's longest gap, localai's beside the anchor's."""
    lines = []
    for cold in report.plan.cold:
        parts = []
        for name, side in (("localai", report.ours), (report.anchor, report.theirs)):
            times = side.cold.ttft.get(cold)
            if not times:
                continue
            ranked = [statistics.median(times[i::cold]) for i in range(cold)]  # the i-th to start, over repetitions
            parts.append(f"{name} TTFT {' / '.join(f'{t:.2f}' for t in ranked)} s, longest gap "
                         f"{1000 * statistics.median(side.cold.longest_gap[cold]):.0f} ms")
        lines.append(f"{cold} cold ~{report.plan.cold_tokens}-token prompts beside a decoding stream: "
                     + "; ".join(parts))
    return lines


def latency_and_edits(report: SpeedReport) -> list[str]:
    lines = []
    for name, result in (("localai", report.ours.streams), (report.anchor, report.theirs.streams)):
        if result.gaps:
            lines.append(f"{name}: {report.plan.streams} streams, inter-token latency p50 "
                         f"{1000 * measure.quantile(result.gaps, 0.5):.1f} ms, p99 "
                         f"{1000 * measure.quantile(result.gaps, 0.99):.1f} ms")
    ours, theirs = report.ours, report.theirs
    for name, edit in (("localai", ours.edit), ("localai, speculative on", ours.edit_spec),
                       (report.anchor, theirs.edit)):
        if edit.tokens:
            kept = f"; guessed {edit.drafted}, kept {edit.kept} ({100 * edit.kept / edit.drafted:.0f}%)" \
                if edit.drafted else ""
            lines.append(f"{name}: edit answer {edit.tokens[-1]} tokens, "
                         f"{'the function renamed' if 'read_header' in edit.text else 'no rename in it'}{kept}")
    if ours.edit.text and ours.edit_spec.text:
        lines.append(f"edit answers with speculative decoding on and off the same: "
                     f"{ours.edit.text == ours.edit_spec.text}")
    return lines
