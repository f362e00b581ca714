"""``localai bench remote``: what a remote model costs and what session affinity saves.

Overhead: the same streamed requests straight to an upstream and through the daemon (a remote model on that
upstream), alternated so both see the same machine: time to first token and decode tokens/s.
Affinity: the interleaved agent trace (``bench/agents.py``) against two replicas, routed by session and then
round-robin; the replicas' own counters say how many prompt tokens each had to compute.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import httpx

from localai.bench.api import sse_events

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
