"""Prometheus metrics for ``GET /metrics``: prompt-cache effectiveness and serving state.

Workers report cumulative cache statistics after each request; the daemon adds the increase since that
worker's previous report to its own counters, so totals stay monotonic across worker restarts.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CACHE_STATS = {
    "hits": "Requests that restored a prefix from the RAM or disk tier",
    "misses": "Requests for which no stored prefix beat the live KV",
    "tokens_restored": "Prompt tokens restored from the RAM or disk tier",
    "bytes_read": "Bytes of KV state read from disk",
    "bytes_written": "Bytes of KV state written to disk (token blocks and boundary snapshots)",
    "blocks_written": "Token blocks written to disk (each block once, however many sessions share it)",
    "snapshots_written": "Boundary snapshots and checkpoints (a recurrent or window state) written to disk",
    "evictions": "Blocks (and old-format entries) evicted by the disk quota",
    "corrupt": "Blocks or snapshots dropped because they were truncated, corrupt or foreign",
    "dropped_writes": "Cache writes given up (the write queue behind its budget, a full or vanished disk)",
    "save_races": "Saves whose state was cut again because eviction removed a block meanwhile",
    "images_encoded": "Images a vision projector encoded (an image whose positions came from the cache is not)",
}


class Metrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.cache = {
            name: Counter(f"localai_prompt_cache_{name}", help_text, ["model"], registry=self.registry)
            for name, help_text in CACHE_STATS.items()
        }
        self.prompt_tokens_cached = Counter(
            "localai_prompt_tokens_cached", "Prompt tokens not computed (live KV or restored)", ["model"],
            registry=self.registry)
        self.prompt_tokens_computed = Counter(
            "localai_prompt_tokens_computed", "Prompt tokens evaluated by the engine", ["model"],
            registry=self.registry)
        self.completion_tokens = Counter(
            "localai_completion_tokens", "Tokens generated", ["model"], registry=self.registry)
        self.requests = Counter(
            "localai_requests", "Generation requests by outcome", ["model", "outcome"], registry=self.registry)
        self.draft_tokens = Counter(
            "localai_speculative_drafted_tokens", "Tokens guessed from the context (speculative decoding)", ["model"],
            registry=self.registry)
        self.draft_accepted = Counter(
            "localai_speculative_accepted_tokens", "Guessed tokens the model agreed with (kept)", ["model"],
            registry=self.registry)
        self.websockets = Counter(
            "localai_responses_websockets", "/v1/responses WebSocket connections accepted (a client that "
            "reconnects opens another)", registry=self.registry)
        self.websocket_closes = Counter(
            "localai_responses_websocket_closes", "/v1/responses WebSocket connections ended, by who ended them "
            "(client: it closed or went away, or the daemon stopped; idle: LOCALAI_WS_IDLE_TIMEOUT)", ["reason"],
            registry=self.registry)
        self.loaded_models = Gauge("localai_loaded_models", "Models with a live worker", registry=self.registry)
        self.waiting = Gauge("localai_queue_waiting", "Requests waiting for a model", registry=self.registry)
        # Remote models: per replica (its URL), see localai.upstreams.pool.
        self.upstream_requests = Counter(
            "localai_upstream_requests", "Requests sent to a remote model's replica, by outcome (ok, "
            "failed_before_reply, broken_stream, http_<status>)", ["model", "replica", "outcome"],
            registry=self.registry)
        self.upstream_latency = Histogram(
            "localai_upstream_request_seconds", "Time a replica took for a whole request", ["model", "replica"],
            registry=self.registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.upstream_ttfb = Histogram(
            "localai_upstream_first_byte_seconds", "Time until a replica accepted a request (response headers)",
            ["model", "replica"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.upstream_failovers = Counter(
            "localai_upstream_failovers", "Requests moved to another replica after this one failed",
            ["model", "replica"], registry=self.registry)
        self.upstream_healthy = Gauge(
            "localai_upstream_healthy", "1 while a replica is in rotation, 0 while it is taken out",
            ["model", "replica"], registry=self.registry)

    def forget_model(self, model: str) -> None:
        """Drop a remote model's per-replica series (it was deleted, replaced or changed its replicas)."""
        for family in (self.upstream_requests, self.upstream_latency, self.upstream_ttfb, self.upstream_failovers,
                       self.upstream_healthy):
            family.remove_by_labels({"model": model})

    def worker_cache_stats(self, model: str, reported: dict[str, float], stats: dict[str, Any]) -> None:
        """Count a worker's cumulative stats; ``reported`` is that worker's previous report, updated here."""
        for name, counter in self.cache.items():
            value = float(stats.get(name, 0))
            if value > reported.get(name, 0.0):
                counter.labels(model).inc(value - reported.get(name, 0.0))
            reported[name] = value

    def request_done(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                     outcome: str, drafted: int = 0, accepted: int = 0) -> None:
        self.draft_tokens.labels(model).inc(drafted)
        self.draft_accepted.labels(model).inc(accepted)
        self.prompt_tokens_cached.labels(model).inc(cached_tokens)
        self.prompt_tokens_computed.labels(model).inc(max(0, prompt_tokens - cached_tokens))
        self.completion_tokens.labels(model).inc(completion_tokens)
        self.requests.labels(model, outcome).inc()

    def render(self, loaded: int, waiting: int) -> bytes:
        self.loaded_models.set(loaded)
        self.waiting.set(waiting)
        return bytes(generate_latest(self.registry))
