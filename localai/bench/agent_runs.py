"""``localai bench agents``: the trace (``agents.py``) run against localai (with its disk writes, a long session
and sub-agents), against localai restarted mid-trace, and against the reference servers; and the report."""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localai.bench import agents as trace
from localai.bench.servers import LlamaCppPythonServer, LlamaServer, ManagedDaemon, MlxLmServer, ReferenceServer


@dataclass(frozen=True)
class AgentsPlan:
    """What ``localai bench agents`` runs (its options, --slo's aside)."""
    model: str
    source: str | None
    sessions: int
    turns: int
    reply_tokens: int
    think_time: float
    restart_at: int
    seed: int
    compare: tuple[str, ...] = ()  # NAME=URL of other servers
    long_turns: int = 0
    subagents: int = 0
    llama_bench_path: str | None = None
    with_llama_cpp_python: bool = False
    with_mlx_lm_server: bool = False
    llama_server_path: str | None = None  # llama.cpp's llama-server, 4 slots, its own context checkpoints
    system_repeats: int = 1  # the system-and-tools prompt: ~1,100 tokens this many times

    def trace_options(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "turns": self.turns, "reply_tokens": self.reply_tokens,
                "think_time": self.think_time, "seed": self.seed, "system_repeats": self.system_repeats}


@dataclass
class AgentsReport:
    plan: AgentsPlan
    results: list[trace.TraceResult] = field(default_factory=list)  # localai, localai+restart, the references
    storage: list[str] = field(default_factory=list)  # disk writes, the long session, the sub-agents
    load_after_restart: float = 0.0


def run(plan: AgentsPlan) -> AgentsReport:
    """Every run, one server holding the model at a time, each daemon in a fresh home."""
    report = AgentsReport(plan)
    options = plan.trace_options()
    with tempfile.TemporaryDirectory(prefix="localai-bench-") as scratch:
        daemon = ManagedDaemon(scratch + "/home", plan.source)
        with daemon:
            daemon.warm_up(plan.model)
            model_path = daemon.model_path(plan.model)
            options["count_tokens"] = trace.token_counter(model_path)  # for the hit ratio's ceiling
            run_localai(daemon, Path(scratch) / "home" / "cache", model_path, options, report)
        restart = ManagedDaemon(scratch + "/restart-home", plan.source)
        with restart:
            restart.warm_up(plan.model)

            def maybe_restart(turn: int) -> None:
                if turn == plan.restart_at:
                    restart.restart()
                    restart.warm_up(plan.model)  # the model load is reported separately, not in the turn's TTFT

            report.results.append(trace.run_trace("localai+restart", restart.base_url, plan.model,
                                                  before_turn=maybe_restart, **options))
        report.load_after_restart = restart.last_load_seconds
        references: list[tuple[str, ReferenceServer]] = []
        if plan.with_llama_cpp_python:
            references.append(("llama-cpp-python", LlamaCppPythonServer(model_path)))
        if plan.with_mlx_lm_server:
            references.append(("mlx_lm.server", MlxLmServer(model_path)))
        if plan.llama_server_path:
            references.append(("llama-server", LlamaServer(plan.llama_server_path, model_path, n_ctx=8192,
                                                            parallel=4)))
        for name, reference in references:
            with reference as server:
                server.warm_up()
                report.results.append(trace.run_trace(name, server.base_url, server.request_model() or plan.model,
                                                      **options))
        for item in plan.compare:
            name, _, url = item.partition("=")
            report.results.append(trace.run_trace(name, url, plan.model, **options))
    return report


def run_localai(daemon: ManagedDaemon, cache_dir: Path, model_path: str, options: dict[str, Any],
                report: AgentsReport) -> None:
    """The trace on localai, counting the bytes its cache writes after the first turn; then the long session and
    the sub-agents where asked."""
    plan, model = report.plan, report.plan.model
    written: list[float] = []
    snapshots: list[float] = []

    def count_writes(turn: int) -> None:
        if turn == 1:
            trace.settle(daemon.base_url, model)
            written.append(trace.metric(daemon.base_url, "localai_prompt_cache_bytes_written_total"))
            snapshots.append(trace.metric(daemon.base_url, "localai_prompt_cache_snapshots_written_total"))

    ours = trace.run_trace("localai", daemon.base_url, model, before_turn=count_writes, **options)
    report.results.append(ours)
    trace.settle(daemon.base_url, model)
    later_bytes = trace.metric(daemon.base_url, "localai_prompt_cache_bytes_written_total") - written[0]
    per_token = trace.kv_bytes_per_token(cache_dir)
    grown = sum(ours.samples[i].prompt_tokens for i in range(len(ours.samples)) if ours.samples[i].turn
                == plan.turns - 1) - sum(s.prompt_tokens for s in ours.samples if s.turn == 0)
    grown += plan.sessions * plan.reply_tokens  # the last turn's replies, kept too
    if per_token and grown > 0:
        report.storage.append(f"disk writes, turns 1-{plan.turns - 1}: {later_bytes / 1e6:.1f} MB for {grown} new "
                              f"tokens x {per_token} KV bytes = {later_bytes / (grown * per_token):.2f}x the new "
                              "tokens' KV")
        state = trace.checkpoint_bytes(cache_dir)
        saves = plan.sessions * (plan.turns - 1)
        if state:  # a model with checkpoints: a turn writes them beside its new KV
            states = trace.metric(daemon.base_url, "localai_prompt_cache_snapshots_written_total") - snapshots[0]
            beside = (later_bytes - states * state) / (grown * per_token)
            report.storage.append(f"  per turn: {later_bytes / saves / 1e3:.1f} KB = {states / saves:.1f} "
                                  f"checkpoints ({state / 1e3:.1f} KB each) + {beside:.2f}x the turn's new tokens' KV")
    if plan.long_turns:
        report.storage.extend(long_session(daemon, model_path, per_token, plan))
    if plan.subagents:
        report.storage.append(subagents_on_disk(daemon, cache_dir, per_token, plan))


def long_session(daemon: ManagedDaemon, model_path: str, per_token: int, plan: AgentsPlan) -> list[str]:
    """One conversation growing each turn: what it writes, and its last turn's TTFT against its second's."""
    samples, long_bytes = trace.run_long(daemon.base_url, plan.model, turns=plan.long_turns, growth_words=150,
                                         reply_tokens=plan.reply_tokens, seed=plan.seed,
                                         system_repeats=plan.system_repeats)
    final = samples[-1].prompt_tokens + plan.reply_tokens
    lines = [
        f"long session: {plan.long_turns} turns to {samples[-1].prompt_tokens} prompt tokens; bytes written "
        f"{long_bytes / 1e6:.1f} MB = {long_bytes / max(1, final * per_token):.2f}x the final KV "
        f"({final * per_token / 1e6:.1f} MB); TTFT turn 1 {samples[1].ttft:.3f} s, last "
        f"{samples[-1].ttft:.3f} s ({samples[-1].ttft / samples[1].ttft:.2f}x); hit ratio after the first "
        f"{sum(s.cached_tokens or 0 for s in samples[1:]) / sum(s.prompt_tokens for s in samples[1:]):.1%}"]
    if plan.llama_bench_path:
        lines.append(depth_reference(plan.llama_bench_path, model_path, samples[1], samples[-1]))
    return lines


def subagents_on_disk(daemon: ManagedDaemon, cache_dir: Path, per_token: int, plan: AgentsPlan) -> str:
    """Sessions sharing a long system prompt: the disk they take against one prefix plus their tails."""
    before_disk = trace.disk_bytes(cache_dir)
    subs = trace.run_subagents(daemon.base_url, plan.model, agents=plan.subagents, prefix_repeats=4,
                               reply_tokens=plan.reply_tokens, seed=plan.seed)
    used = trace.disk_bytes(cache_dir) - before_disk
    shared = min(s.cached_tokens or 0 for s in subs[1:]) if len(subs) > 1 else 0
    tails = sum(s.prompt_tokens + plan.reply_tokens - shared for s in subs)
    ideal = (shared + tails) * per_token
    return (f"sub-agents: {plan.subagents} sessions sharing a {shared}-token prefix; on disk {used / 1e6:.1f} MB = "
            f"{used / max(1, ideal):.2f}x one prefix plus the tails ({ideal / 1e6:.1f} MB)")


def depth_reference(binary: str, model_path: str, second: trace.Sample, last: trace.Sample) -> str:
    """llama-bench's time for the last turn's new tokens at the second and the last turn's cached depth."""
    from localai.bench import api as measure
    from localai.settings import Settings

    if second.cached_tokens is None or last.cached_tokens is None:
        return "long session: no cached tokens reported, so no llama-bench depth comparison"
    settings = Settings()
    new_tokens = max(1, last.prompt_tokens - last.cached_tokens)
    depths = [second.cached_tokens, last.cached_tokens]
    seconds = measure.llama_bench_depths(binary, model_path, settings.threads(), new_tokens, depths,
                                         flash_attention=settings.flash_attention, n_batch=512)
    early, late = seconds[depths[0]], seconds[depths[1]]
    return (f"long session, the compute no cache removes: llama-bench prefills {new_tokens} tokens in {early:.3f} s "
            f"after {depths[0]} and {late:.3f} s after {depths[1]} ({late / early:.2f}x; {settings.threads()} "
            f"threads, flash attention {'on' if settings.flash_attention else 'off'}, batch 512)")


def table(report: AgentsReport) -> list[str]:
    """The trace's table, the storage lines, the restart's cost and localai against each other server."""
    lines = trace.report(report.results) + report.storage
    ours, restarted = report.results[0], report.results[1]
    turns, restart_at = report.plan.turns, report.plan.restart_at
    later = range(1, turns)
    lines.append(f"restart: turn {restart_at} TTFT {statistics.median(restarted.ttft(restart_at)):.3f} s vs "
                 f"{statistics.median(ours.ttft(restart_at)):.3f} s without restart "
                 f"({statistics.median(restarted.ttft(restart_at)) / statistics.median(ours.ttft(restart_at)):.2f}x);"
                 f" model load after restart {report.load_after_restart:.2f} s")
    resumed = [s for s in restarted.samples if s.turn == restart_at]
    lines.append(f"restart: turn {restart_at}'s prefixes came from "
                 f"{', '.join(sorted({s.cache_source or '?' for s in resumed}))}; restored "
                 f"{statistics.mean(s.cached_tokens or 0 for s in resumed):.0f} tokens in "
                 f"{statistics.median(s.restore_ms for s in resumed):.1f} ms (median)")
    for other in report.results[2:]:
        lines.append(f"localai vs {other.name}: median TTFT turns 1-{turns - 1} "
                     f"{ours.median_ttft(later) / other.median_ttft(later):.2f}x")
    return lines
