"""``localai bench remote``: what a remote model costs and what session affinity saves.

Overhead: the same streamed requests straight to an upstream and through the daemon (a remote model on that
upstream), alternated so both see the same machine: time to first token and decode tokens/s.
Affinity: the interleaved agent trace (``bench/agents.py``) against two replicas, routed by session and then
round-robin; the replicas' own counters say how many prompt tokens each had to compute.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from localai.bench import agents as trace
from localai.bench.api import sse_events
from localai.bench.servers import LlamaCppPythonServer, ManagedDaemon

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to code."}]


@dataclass
class Timing:
    ttft: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)  # tokens/s after the first token
    tokens: list[int] = field(default_factory=list)


def stream_once(http: httpx.Client, model: str, max_tokens: int) -> tuple[float, float | None, int]:
    """(TTFT, decode tokens/s or None, content chunks) of one streamed chat request; a stream the server broke
    off is asked again (up to three times): llama-cpp-python's server does that now and then, direct or not."""
    for attempt in range(3):
        try:
            return _stream_once(http, model, max_tokens)
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _stream_once(http: httpx.Client, model: str, max_tokens: int) -> tuple[float, float | None, int]:
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    stamps: list[float] = []
    for payload in sse_events(http, "/chat/completions", body):
        for choice in payload.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{http.base_url} streamed no content for {model}")
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 and stamps[-1] > stamps[0] else None
    return stamps[0] - started, decode, len(stamps)


def overhead(direct_url: str, direct_model: str, via_url: str, via_model: str, *, requests: int,
             gen_tokens: int) -> tuple[Timing, Timing]:
    """Alternating runs: TTFT with one-token replies, decode speed with ``gen_tokens`` replies."""
    direct, via = Timing(), Timing()
    with httpx.Client(base_url=direct_url, timeout=600) as straight, httpx.Client(base_url=via_url,
                                                                                 timeout=600) as hop:
        for client, model in ((straight, direct_model), (hop, via_model)):
            stream_once(client, model, 2)  # warm: the upstream holds the prompt's prefix from here on
        for _ in range(requests):
            for client, model, timing in ((straight, direct_model, direct), (hop, via_model, via)):
                ttft, _, _ = stream_once(client, model, 1)
                timing.ttft.append(ttft)
        for _ in range(max(3, requests // 4)):
            for client, model, timing in ((straight, direct_model, direct), (hop, via_model, via)):
                _, decode, tokens = stream_once(client, model, gen_tokens)
                if decode is not None:
                    timing.decode.append(decode)
                timing.tokens.append(tokens)
    return direct, via


def overhead_report(direct: Timing, via: Timing) -> list[str]:
    d_ttft, v_ttft = statistics.median(direct.ttft), statistics.median(via.ttft)
    d_dec, v_dec = statistics.median(direct.decode), statistics.median(via.decode)
    return [
        f"{'':<28}{'direct':>12}{'via localai':>14}",
        f"{'TTFT median (ms)':<28}{1000 * d_ttft:>12.1f}{1000 * v_ttft:>14.1f}   (+{1000 * (v_ttft - d_ttft):.1f} ms)",
        f"{'TTFT p90 (ms)':<28}{1000 * quantile(direct.ttft, 0.9):>12.1f}{1000 * quantile(via.ttft, 0.9):>14.1f}",
        f"{'decode median (tokens/s)':<28}{d_dec:>12.1f}{v_dec:>14.1f}   ({v_dec / d_dec:.3f}x)",
        f"{'reply tokens (median)':<28}{statistics.median(direct.tokens):>12.0f}{statistics.median(via.tokens):>14.0f}",
        f"requests: {len(direct.ttft)} TTFT pairs, {len(direct.decode)} decode pairs, alternated",
    ]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass(frozen=True)
class RemotePlan:
    """What ``localai bench remote`` runs (its options)."""
    model: str
    requests: int
    gen_tokens: int
    sessions: int
    turns: int
    reply_tokens: int
    seed: int


def run(plan: RemotePlan, echo: Callable[[str], None]) -> None:
    """The overhead of the hop, then affinity's worth on two replicas; ``echo`` hears each part's report."""
    threads = int(os.environ.get("LOCALAI_NUM_THREAD") or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="localai-bench-") as scratch, \
            ManagedDaemon(scratch + "/home", env={"LOCALAI_REMOTE_HEALTH_INTERVAL": "3600"}) as daemon:
        # (no health checks during the runs: llama-cpp-python's server can drop a stream that a concurrent
        # GET /models interrupts, which would be measured as the hop's fault)
        model_path = daemon.model_path(plan.model)  # the weights only: the daemon's own worker is never loaded
        with LlamaCppPythonServer(model_path, 4096, threads=threads, alias="upstream") as server:
            create(daemon, "hop", f"FROM {server.base_url}\n")
            direct, via = overhead(server.base_url, "upstream", daemon.base_url, "hop", requests=plan.requests,
                                   gen_tokens=plan.gen_tokens)
        echo(f"Overhead of the hop ({plan.model}, llama-cpp-python's server, {threads} threads):")
        for line in overhead_report(direct, via):
            echo("  " + line)
        evaluated: dict[str, int] = {}
        results = []
        for routing in ("session", "round_robin"):
            count, result = affinity_run(daemon, model_path, threads, routing, plan)
            results.append(result)
            evaluated[routing] = count
    echo(f"\nAffinity: {plan.sessions} sessions x {plan.turns} turns interleaved, two replicas (each keeps one "
         "sequence's prefix, as llama-cpp-python's server does)")
    for routing, count in evaluated.items():
        echo(f"  {routing:<12} prompt tokens the replicas computed: {count:>7}   median TTFT turns 1-"
             f"{plan.turns - 1}: {results[list(evaluated).index(routing)].median_ttft(range(1, plan.turns)):.3f} s")
    if evaluated.get("round_robin"):
        echo(f"  session affinity computes {evaluated['session'] / evaluated['round_robin']:.2f}x the tokens "
             "of round-robin")


def create(daemon: ManagedDaemon, name: str, modelfile: str) -> None:
    response = httpx.post(f"http://127.0.0.1:{daemon.port}/api/create", json={"model": name, "modelfile": modelfile},
                          timeout=60)
    response.raise_for_status()


def affinity_run(daemon: ManagedDaemon, model_path: str, threads: int, routing: str,
                 plan: RemotePlan) -> tuple[int, trace.TraceResult]:
    """The trace through a remote model on two fresh replicas routed by ``routing``: the prompt tokens the
    replicas computed, and the trace's result."""
    replicas = [LlamaCppPythonServer(model_path, 8192, threads=max(1, threads // 2), alias="upstream")
                for _ in range(2)]
    try:
        for replica in replicas:
            replica.start()
        name = f"trace-{routing.replace('_', '-')}"
        create(daemon, name, f"FROM {replicas[0].base_url}\nPARAMETER replica {replicas[1].base_url}\n"
                             f"PARAMETER routing {routing}\n")
        result = trace.run_trace(routing, daemon.base_url, name, sessions=plan.sessions, turns=plan.turns,
                                 reply_tokens=plan.reply_tokens, think_time=0.0, seed=plan.seed)
        return sum(replica.prompt_tokens_evaluated() for replica in replicas), result
    finally:
        for replica in replicas:
            replica.__exit__()
