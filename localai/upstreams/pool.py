"""The replicas of remote models (vLLM, SGLang, Dynamo, llama-server, llama-cpp-python's server, another localai):
the requests to them, their health, and failover.

A replica that refuses connections, times out or answers 502-504 is taken out; the request moves to the next replica
on the ring when nothing was relayed yet (a generation has no side effects, so the retry is safe); health checks
(``GET /models``) bring it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from localai.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    LocalAIError,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from localai.metrics import Metrics
from localai.models.registry import ModelRecord
from localai.models.remote_spec import RemoteSpec
from localai.protocol import ErrorFrame, PromptFrame, RequestFrame
from localai.upstreams.ring import HashRing
from localai.upstreams.translation import RemoteOp, context_error, error_message, estimated_tokens, relay

log = logging.getLogger("localai.remote")
MODELS_TTL = 60.0  # seconds a /models answer is trusted for the model id and context length
# A pool's health checks run while its model is used: they stop this many health intervals (at least a minute)
# after its last request, and start again with the next. Merely listing a model starts none.
IDLE_INTERVALS = 6
MIN_IDLE = 60.0
# The longest a listing (`/api/tags`, show) waits for a replica to say what it serves; past it, it lists what is
# known and the question goes on in the background (one at a time a pool), so a hung upstream slows no listing
LISTING_WAIT = 1.0
MAX_ERROR_BODY = 64 << 10
# Sent with localai's own GET /models: a localai upstream answering it does not probe its own remote models, so
# models that point at each other (or at their own daemon) cannot make the listings wait on one another.
PROBE = "X-LocalAI-Probe"
CONTEXT_KEYS = ("max_model_len", "context_length", "context_window", "max_context_length")
# owned_by in /v1/models → what serves it (Dynamo's frontend and NVIDIA NIM say "nvidia"; llama-cpp-python "me")
KINDS_BY_OWNER = {"vllm": "vllm", "sglang": "sglang", "nvidia": "dynamo", "llamacpp": "llama-server",
                  "me": "llama-cpp-python", "localai": "localai"}


@dataclass
class Replica:
    url: str
    healthy: bool = True
    reason: str = ""  # why it was taken out
    failures: int = 0
    active: int = 0
    next_check: float = 0.0


def describe(exc: BaseException, timeout: float) -> str:
    """What went wrong talking to a replica, in a few words."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connection timed out"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout:g} s (PARAMETER timeout)"
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "connection refused"
            cause = cause.__cause__ or cause.__context__
        return f"cannot connect ({str(exc)[:120] or type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the connection broke ({str(exc)[:120] or 'closed'})"
    return f"{type(exc).__name__}: {str(exc)[:160]}"



class RemotePool:
    """The replicas of one remote model: routing, health, and the requests to them."""

    def __init__(self, name: str, spec: RemoteSpec, metrics: Metrics, health_interval: float) -> None:
        self.name = name
        self.spec = spec
        self.metrics = metrics
        self.interval = health_interval
        self.replicas = [Replica(url) for url in spec.replicas]
        self._by_url = {replica.url: replica for replica in self.replicas}
        self.ring = HashRing(spec.replicas)
        self._turn = itertools.count()
        self.client = httpx.AsyncClient(  # honours HTTPS_PROXY and SSL_CERT_FILE, as curl would
            timeout=httpx.Timeout(spec.timeout, connect=spec.connect_timeout),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        self.models: list[dict[str, Any]] = []
        self.models_at = 0.0
        self.active = 0
        self.last_used = 0.0  # when a request last used the pool (monotonic); 0: never, only listed
        self._health: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self.refresh_started = 0.0  # when the question in flight was asked

    @property
    def in_use(self) -> bool:
        """Whether its model is being used: its health checks run (``/api/ps`` lists it)."""
        return self._health is not None

    def start(self) -> None:
        """A request uses the pool: its health checks run until it has been idle a while."""
        self.last_used = time.monotonic()
        if self._health is None:
            for replica in self.replicas:
                self.metrics.upstream_healthy.labels(self.name, replica.url).set(1 if replica.healthy else 0)
            self._health = asyncio.create_task(self._health_loop(), name=f"health-{self.name}")

    async def close(self, *, drain: bool = False) -> None:
        """Stop health checks and close connections (``drain``: after the requests in flight, up to an hour), and
        drop the model's metric series (a deleted model leaves none behind)."""
        deadline = time.monotonic() + 3600
        while drain and self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        for task in (self._health, self._refreshing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._health = None
        self.metrics.forget_model(self.name)
        await self.client.aclose()

    # -- routing and health ------------------------------------------------------------------------

    def order(self, key: str) -> list[Replica]:
        """Replicas in the order this request tries them: the session's own first, healthy ones before others."""
        if self.spec.routing == "round_robin":
            turn = next(self._turn) % len(self.replicas)
            urls = [r.url for r in self.replicas[turn:] + self.replicas[:turn]]
        else:
            urls = self.ring.preference(key)
        replicas = [self._by_url[url] for url in urls]
        return [r for r in replicas if r.healthy] + [r for r in replicas if not r.healthy]

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("replica %s of %s taken out: %s", replica.url, self.name, reason)
        replica.healthy, replica.reason = False, reason
        replica.failures += 1
        replica.next_check = time.monotonic() + min(self.interval, 0.5 * 2 ** min(replica.failures - 1, 6))
        self.metrics.upstream_healthy.labels(self.name, replica.url).set(0)

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
            log.info("replica %s of %s is back", replica.url, self.name)
        replica.healthy, replica.reason, replica.failures = True, "", 0
        self.metrics.upstream_healthy.labels(self.name, replica.url).set(1)

    async def check(self, replica: Replica) -> bool:
        """``GET /models`` on one replica: marks it up or down; a 200 refreshes what the upstream serves."""
        replica.next_check = time.monotonic() + self.interval
        try:
            response = await self.client.get(f"{replica.url}/models", headers={**self.spec.headers(), PROBE: "1"},
                                             timeout=httpx.Timeout(min(self.spec.timeout, 10.0),
                                                                   connect=self.spec.connect_timeout))
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ReadTimeout) and replica.active:
                return False  # busy answering our requests, not dead (llama-cpp-python's holds /models meanwhile)
            self.mark_down(replica, describe(exc, min(self.spec.timeout, 10.0)))
            return False
        if response.status_code >= 500:
            self.mark_down(replica, f"GET /models answered {response.status_code}")
            return False
        self.mark_up(replica)  # it answers; a refused key is reported by the request that meets it
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                data = response.json().get("data")
                if isinstance(data, list):
                    self.models = [entry for entry in data if isinstance(entry, dict) and "id" in entry]
                    self.models_at = time.monotonic()
        return True

    async def _health_loop(self) -> None:
        idle_after = max(MIN_IDLE, IDLE_INTERVALS * self.interval)
        try:
            while self.active or time.monotonic() - self.last_used < idle_after:
                now = time.monotonic()
                # A replica busy answering is alive; some servers (llama-cpp-python's) hold /models until they
                # finish.
                due = [r for r in self.replicas if r.next_check <= now and not (r.healthy and r.active)]
                if due:
                    await asyncio.gather(*(self.check(r) for r in due), return_exceptions=True)
                await asyncio.sleep(0.25)
        finally:
            self._health = None  # idle: the next request starts the checks again
        log.info("%s has not been used for %g s: its health checks stop until its next request", self.name,
                 idle_after)

    async def refresh(self) -> None:
        """Make sure the model list is known: ask the replicas in turn until one answers. A list that is merely
        old is refreshed in the background, so no request waits on a replica's ``/models``."""
        if self.models:
            if time.monotonic() - self.models_at >= MODELS_TTL:
                self.refreshing()
            return
        await self._refresh()

    def refreshing(self) -> asyncio.Task[None]:
        """The model list being asked for in the background: one question at a time, however many wait on it."""
        if self._refreshing is None:
            self.refresh_started = time.monotonic()
            self._refreshing = asyncio.create_task(self._refresh(listing=True), name=f"models-{self.name}")
            self._refreshing.add_done_callback(self._refreshed)
        return self._refreshing

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        self._refreshing = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not ask %s's replicas what they serve", self.name, exc_info=task.exception())

    async def _refresh(self, *, listing: bool = False) -> None:
        now = time.monotonic()
        for replica in self.order(""):
            if listing and not replica.healthy and replica.next_check > now:
                continue  # taken out and not due: a listing does not wait on it again
            if await self.check(replica):
                return

    def entry(self) -> dict[str, Any] | None:
        """The upstream's /models entry for this model."""
        wanted = self.spec.upstream_model
        if wanted is None:
            return self.models[0] if len(self.models) == 1 else None
        names = {wanted, f"{wanted}:latest"} if ":" not in wanted.rsplit("/", 1)[-1] else {wanted}  # Ollama-style
        return next((m for m in self.models if m.get("id") in names), None)

    def model_id(self) -> str:
        if self.spec.upstream_model:
            return self.spec.upstream_model
        ids = [str(m["id"]) for m in self.models]
        if len(ids) == 1:
            return ids[0]
        if not ids:
            reasons = "; ".join(f"{r.url}: {r.reason or 'no model listed'}" for r in self.replicas)
            raise UpstreamUnavailable(f"no replica of '{self.name}' said which model it serves ({reasons}); "
                                      "set PARAMETER upstream_model or start a replica")
        raise UpstreamFailed(f"the upstream of '{self.name}' serves {len(ids)} models ({', '.join(ids[:8])}); "
                             "choose one with PARAMETER upstream_model")

    def context_length(self) -> int:
        """The context from the upstream's /models (vLLM's max_model_len, ...), else the Modelfile's num_ctx."""
        entry = self.entry() or {}
        for key in CONTEXT_KEYS:
            value = entry.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return self.spec.num_ctx or 0

    def kind(self) -> str:
        if self.spec.kind != "auto":
            return self.spec.kind
        entry = self.entry() or (self.models[0] if self.models else {})
        return KINDS_BY_OWNER.get(str(entry.get("owned_by", "")).lower(), "openai")

    def status(self) -> list[dict[str, Any]]:
        return [{"url": r.url, "healthy": r.healthy, "reason": r.reason, "active_requests": r.active}
                for r in self.replicas]

    # -- requests ------------------------------------------------------------------------------------

    async def generate(self, op: RemoteOp) -> AsyncIterator[RequestFrame]:
        """The frames of one request: ``prompt`` once the upstream accepted it, then events and ``done``.

        Tries the session's replicas in turn while nothing was relayed; an over-long prompt is a
        ``context_length`` error frame (the runtime fits the conversation and asks again).
        """
        failures: list[str] = []
        timeouts = 0
        previous: Replica | None = None
        for replica in self.order(op["key"]):
            if previous is not None:
                self.metrics.upstream_failovers.labels(self.name, previous.url).inc()
            previous = replica
            started = time.perf_counter()
            replica.active += 1
            self.active += 1
            response: httpx.Response | None = None
            try:
                first: str | None = None
                lines: AsyncIterator[str] | None = None
                try:
                    response = await self._post(replica, op, op["body"])
                    if response.status_code == 200:
                        # The first event, not the headers, is the first byte: servers send headers at once and
                        # then prefill, and until an event is relayed the request can still go to another replica.
                        lines = response.aiter_lines()
                        first = await _first_event(lines)
                        if first is None:
                            # An empty stream is how llama-cpp-python's server answers a prompt over its context;
                            # asked again without streaming, it says why (and fitting can act on it).
                            await response.aclose()
                            body = {k: v for k, v in op["body"].items() if k != "stream_options"}
                            response = await self._post(replica, op, {**body, "stream": False}, hung_up=True)
                            if response.status_code == 200:
                                raise UpstreamFailed(f"replica {replica.url} of '{self.name}' answered with an "
                                                     "empty stream")
                except httpx.HTTPError as exc:
                    reason = describe(exc, self.spec.timeout)
                    timeouts += isinstance(exc, httpx.TimeoutException)
                    failures.append(f"{replica.url}: {reason}")
                    self._count(replica, "failed_before_reply", started)
                    self.mark_down(replica, reason)
                    continue
                status = response.status_code
                # a 200 stream whose first event is an error (Dynamo's and vLLM's validation in a stream): as if
                # the upstream had answered with its status, since nothing was relayed yet
                early = _stream_error(first) if status == 200 else None
                if early is not None:
                    status = early[0]
                if status != 200 or lines is None:
                    body_bytes = early[1] if early is not None else await _read_some(response)
                    message = error_message(body_bytes)
                    if status in (408, 429) or status >= 500:
                        failures.append(f"{replica.url}: HTTP {status}: {message[:200]}")
                        self._count(replica, f"http_{status}", started)
                        if status in (502, 503, 504):
                            self.mark_down(replica, f"HTTP {status}: {message[:120]}")
                        continue
                    self._count(replica, f"http_{status}", started)
                    yield self._refusal(replica, status, body_bytes, message, op)
                    return
                self.metrics.upstream_ttfb.labels(self.name, replica.url).observe(time.perf_counter() - started)
                yield PromptFrame(ev="prompt", id=op["id"], prompt_tokens=0, cached_tokens=0, replica=replica.url)
                try:
                    async for frame in relay(_chain(first, lines), op, f"replica {replica.url} of '{self.name}'"):
                        if frame["ev"] == "done":  # counted first: the reader stops at this frame
                            self._count(replica, "ok", started)
                        yield frame
                except httpx.HTTPError as exc:
                    reason = describe(exc, self.spec.timeout)
                    self._count(replica, "broken_stream", started)
                    self.mark_down(replica, reason)
                    raise UpstreamFailed(f"replica {replica.url} of '{self.name}' failed during the reply: {reason}; "
                                         "the next request goes to another replica") from exc
                return
            finally:
                replica.active -= 1
                self.active -= 1
                self.last_used = time.monotonic()
                if response is not None:
                    await response.aclose()  # also what cancels the upstream request when the client went away
        error = UpstreamTimeout if failures and timeouts == len(failures) else UpstreamUnavailable
        raise error(f"no replica of '{self.name}' could take the request: {'; '.join(failures) or 'none configured'}")

    async def _post(self, replica: Replica, op: RemoteOp, body: dict[str, Any], *,
                    hung_up: bool = False) -> httpx.Response:
        """POST ``body`` to the replica (``hung_up``: its last answer ended by the server dropping the connection,
        which the pool may not have noticed yet: a reset on that connection is no answer either)."""
        request = self.client.build_request("POST", replica.url + op["path"], json=body,
                                            headers={**self.spec.headers(), **op["headers"]})
        try:
            return await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            if not (_never_answered(exc) or (hung_up and isinstance(exc, httpx.ReadError))):
                raise
            # The request never reached the server whole, or the server closed a kept-alive connection before it
            # read anything (llama-cpp-python's server drops the one of a stream whose generation failed, and
            # whether the next request on it meets a clean close or a reset is a race with the kernel): asking
            # once more on a new connection cannot generate twice. Any other read error is not retried here: the
            # server may be generating (and billing) already; the caller moves on to the next replica instead.
            return await self.client.send(request, stream=True)

    def _count(self, replica: Replica, outcome: str, started: float) -> None:
        self.metrics.upstream_requests.labels(self.name, replica.url, outcome).inc()
        self.metrics.upstream_latency.labels(self.name, replica.url).observe(time.perf_counter() - started)

    def _refusal(self, replica: Replica, status: int, body: bytes, message: str, op: RemoteOp) -> ErrorFrame:
        """A 4xx answer: an over-long prompt becomes a ``context_length`` frame; anything else is raised."""
        where = f"replica {replica.url} of '{self.name}'"
        if status in (401, 403):
            key = (f"the key in ${self.spec.api_key_env} (PARAMETER api_key_env)" if self.spec.api_key_env
                   else "no key (set PARAMETER api_key_env to the variable that holds it)")
            raise UpstreamFailed(f"{where} refused the API key (HTTP {status}: {message}); localai sent {key}")
        if status == 404:
            raise UpstreamFailed(f"{where} answered 404 for {op['path']} ({message}); check PARAMETER upstream_model "
                                 f"('{op['body'].get('model')}') and that the URL ends with the API's base, e.g. /v1")
        fit = context_error(body, status)
        if fit is not None:
            n_ctx, prompt_tokens = fit
            n_ctx = n_ctx or self.context_length()
            if not n_ctx:
                raise ContextLengthExceeded(f"{where}: {message} (the upstream does not report its context length; "
                                            "set PARAMETER num_ctx so localai can fit conversations)",
                                            param="messages")
            estimate = max(n_ctx + 1, estimated_tokens(op))
            return ErrorFrame(ev="error", id=op["id"], kind="context_length", n_ctx=n_ctx,
                              prompt_tokens=prompt_tokens or estimate, message=f"{where}: {message}")
        raise InvalidRequest(f"{where} refused the request (HTTP {status}): {message}")

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        await self.refresh()
        body = {"model": self.model_id(), "input": texts}
        failures: list[str] = []
        for replica in self.order(texts[0][:4096] if texts else ""):
            try:
                response = await self.client.post(replica.url + "/embeddings", json=body, headers=self.spec.headers())
            except httpx.HTTPError as exc:
                failures.append(f"{replica.url}: {describe(exc, self.spec.timeout)}")
                self.mark_down(replica, failures[-1])
                continue
            if response.status_code >= 500:
                failures.append(f"{replica.url}: HTTP {response.status_code}")
                continue
            if response.status_code != 200:
                raise UpstreamFailed(f"replica {replica.url} of '{self.name}' refused the embeddings request "
                                     f"(HTTP {response.status_code}): {error_message(response.content)}")
            data = response.json()
            vectors = [list(item["embedding"]) for item in sorted(data["data"], key=lambda item: item["index"])]
            return vectors, int((data.get("usage") or {}).get("prompt_tokens") or 0)
        raise UpstreamUnavailable(f"no replica of '{self.name}' could take the request: {'; '.join(failures)}")



def _never_answered(exc: httpx.TransportError) -> bool:
    """The request surely did not start a generation: no connection, a failed write, or the server hanging up on an
    idle connection before a byte of any answer (what Go's HTTP client also retries for a POST)."""
    if isinstance(exc, httpx.ConnectError | httpx.WriteError):
        return True
    return isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc)


async def _first_event(lines: AsyncIterator[str]) -> str | None:
    """The first ``data:`` line of a stream (None when it ended without one)."""
    async for line in lines:
        if line.startswith("data:"):
            return line
    return None


def _stream_error(first: str | None) -> tuple[int, bytes] | None:
    """A stream's first event when it is an error: the HTTP status it names (its ``code``, else 502) and its body."""
    if first is None:
        return None
    try:
        value = json.loads(first[5:].strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or not value.get("error"):
        return None
    error = value["error"]
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return status, json.dumps(value).encode()


async def _chain(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    if first is not None:
        yield first
    async for line in rest:
        yield line


async def _read_some(response: httpx.Response) -> bytes:
    """At most ``MAX_ERROR_BODY`` bytes of an error answer."""
    chunks: list[bytes] = []
    size = 0
    with contextlib.suppress(httpx.HTTPError):
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size >= MAX_ERROR_BODY:
                break
    return b"".join(chunks)[:MAX_ERROR_BODY]


class Remotes:
    """The daemon's remote models: one pool per model definition, made on first use and health-checked."""

    def __init__(self, metrics: Metrics, health_interval: float = 10.0) -> None:
        self.metrics = metrics
        self.health_interval = health_interval
        self.pools: dict[str, RemotePool] = {}
        self._retiring: set[asyncio.Future[None]] = set()

    def pool(self, record: ModelRecord, *, use: bool = True) -> RemotePool:
        """The model's pool; ``use``: a request is about to use it (its health checks run while it is used)."""
        spec = RemoteSpec.of(record.path, record.parameters)
        pool = self.pools.get(record.name)
        if pool is None or pool.spec != spec:
            if pool is not None:  # its Modelfile changed: new replicas, new settings; its requests finish first
                self.forget(record.name)
            pool = self.pools[record.name] = RemotePool(record.name, spec, self.metrics, self.health_interval)
        if use:
            pool.start()
        return pool

    def forget(self, name: str) -> None:
        """A deleted or replaced model: stop its health checks once its requests are done."""
        pool = self.pools.pop(name, None)
        if pool is not None:
            task = asyncio.ensure_future(pool.close(drain=True))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def describe(self, record: ModelRecord, *, probe: bool = True) -> dict[str, Any]:
        """What ``show``/``list`` report: context length, upstream model and kind, replicas (asking a replica
        first unless ``probe`` is False: a listing asked for by another daemon's probe, which could loop)."""
        pool = self.pool(record, use=False)
        if probe and (not pool.models or time.monotonic() - pool.models_at >= MODELS_TTL):
            # in the background, waited for a moment: a replica that accepts connections and never answers costs
            # the listings LISTING_WAIT in all while the question is out, and nothing once it is taken out
            question = pool.refreshing()
            waited = time.monotonic() - pool.refresh_started  # by the listings before: no one waits longer in all
            if waited < LISTING_WAIT:
                await asyncio.wait({question}, timeout=LISTING_WAIT - waited)
        try:
            upstream: str | None = pool.model_id()
        except LocalAIError:  # not known yet: no replica answered
            upstream = pool.spec.upstream_model
        return {"context_length": pool.context_length(), "upstream_model": upstream, "kind": pool.kind(),
                "replicas": pool.status()}

    async def shutdown(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools.values()), return_exceptions=True)
        self.pools.clear()
