"""Remote engines: a model served by OpenAI-compatible servers elsewhere (vLLM, SGLang, Dynamo, llama-server,
llama-cpp-python's server, another localai), behind every dialect localai speaks.

A request arrives in any dialect and is already the internal ``GenerationRequest``; here it becomes one chat
completions (or completions) request upstream, and the upstream's stream comes back as the same frames and events a
local worker produces, so fitting, metrics and every dialect's output work unchanged.

Routing: the requests of one session (its id, else its first messages) go to the same replica, picked on a
consistent-hash ring, so that replica's prefix cache keeps serving it and adding a replica moves few sessions.
A replica that refuses connections, times out or answers 502-504 is taken out; the request moves to the next replica
on the ring when nothing was relayed yet (a generation has no side effects, so the retry is safe); health checks
(``GET /models``) bring it back.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
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
from localai.schema import (
    Event,
    GenerationRequest,
    Message,
    ReasoningBlock,
    ReasoningDelta,
    TextBlock,
    TextDelta,
    ToolCallBlock,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResultBlock,
    new_call_id,
)

log = logging.getLogger("localai.remote")
VNODES = 64  # points per replica on the ring: sessions spread within a few percent of even
MODELS_TTL = 60.0  # seconds a /models answer is trusted for the model id and context length
MAX_ERROR_BODY = 64 << 10
# Sent with localai's own GET /models: a localai upstream answering it does not probe its own remote models, so
# models that point at each other (or at their own daemon) cannot make the listings wait on one another.
PROBE = "X-LocalAI-Probe"
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                   "typical_p")
CONTEXT_KEYS = ("max_model_len", "context_length", "context_window", "max_context_length")
# owned_by in /v1/models → what serves it (Dynamo's frontend and NVIDIA NIM say "nvidia"; llama-cpp-python "me")
KINDS_BY_OWNER = {"vllm": "vllm", "sglang": "sglang", "nvidia": "dynamo", "llamacpp": "llama-server",
                  "me": "llama-cpp-python", "localai": "localai"}
_CONTEXT_MESSAGE = re.compile(
    r"maximum context length is (\d+) tokens.*?requested (\d+) tokens(?: \((\d+) in the messages)?", re.S)


def _point(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class HashRing:
    """Consistent hashing: each replica owns ``VNODES`` points; a key belongs to the next point clockwise."""

    def __init__(self, nodes: Sequence[str], vnodes: int = VNODES) -> None:
        points = sorted((_point(f"{node}#{index}"), node) for node in nodes for index in range(vnodes))
        self._keys = [point for point, _ in points]
        self._nodes = [node for _, node in points]
        self._count = len(set(nodes))

    def preference(self, key: str) -> list[str]:
        """Every node, in the order ``key`` should try them: its owner first, then the next ones on the ring."""
        if not self._nodes:
            return []
        order: list[str] = []
        start = bisect.bisect(self._keys, _point(key))
        for offset in range(len(self._nodes)):
            node = self._nodes[(start + offset) % len(self._nodes)]
            if node not in order:
                order.append(node)
                if len(order) == self._count:
                    break
        return order


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


def error_message(body: bytes) -> str:
    """The message of an upstream's error body (OpenAI's, Anthropic's or Ollama's shape, or plain text)."""
    try:
        value = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500] or "no message"
    if isinstance(value, dict):
        error = value.get("error", value)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)[:500]
        if isinstance(error, str):
            return error[:500]
        if "detail" in value:
            return str(value["detail"])[:500]
    return str(value)[:500]


def context_error(body: bytes, status: int) -> tuple[int | None, int | None] | None:
    """(context, prompt tokens) when an upstream's 400 says the prompt is over the context (each may be unknown);
    None for other errors. Knows vLLM's and llama-cpp-python's message and llama-server's fields."""
    if status not in (400, 413, 422):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    error = value.get("error") if isinstance(value, dict) else None
    if isinstance(error, dict) and "n_ctx" in error:  # llama-server's exceed_context_size_error
        return int(error["n_ctx"]), int(error.get("n_prompt_tokens") or 0) or None
    message = error_message(body)
    match = _CONTEXT_MESSAGE.search(message)
    if match:
        prompt = int(match.group(3)) if match.group(3) else int(match.group(2))
        return int(match.group(1)), prompt
    code = error.get("code") if isinstance(error, dict) else None
    lowered = message.lower()
    if code == "context_length_exceeded" or ("context" in lowered and ("exceed" in lowered or "too long" in lowered)):
        return None, None
    return None


def openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The internal messages as chat completions messages (tool results one message per call, as OpenAI wants)."""
    result: list[dict[str, Any]] = []
    for message in messages:
        text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
        calls = [block for block in message.content if isinstance(block, ToolCallBlock)]
        results = [block for block in message.content if isinstance(block, ToolResultBlock)]
        for block in results:
            result.append({"role": "tool", "tool_call_id": block.tool_call_id, "content": block.content,
                           **({"name": block.name} if block.name else {})})
        if results and not text and message.role in ("tool", "user"):
            continue
        role = "system" if message.role == "developer" else message.role
        if role == "tool":
            role = "user"  # a tool message without results: its text is the user's
        entry: dict[str, Any] = {"role": role, "content": text}  # "" beside calls: some servers refuse null
        if message.role == "assistant":
            reasoning = "".join(b.text for b in message.content if isinstance(b, ReasoningBlock))
            if reasoning:
                entry["reasoning_content"] = reasoning
        if calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                   for call in calls]
        if message.name and role in ("user", "system"):
            entry["name"] = message.name
        result.append(entry)
    return result


def request_body(record: ModelRecord, request: GenerationRequest, messages: Sequence[Message] | None,
                 model_id: str, kind: str, priority: int | None) -> tuple[str, dict[str, Any]]:
    """The path (``/chat/completions`` or ``/completions``) and body of the upstream request."""
    params = record.parameters
    body: dict[str, Any] = {"model": model_id, "stream": True, "stream_options": {"include_usage": True}}
    if messages is None:
        path = "/completions"
        body["prompt"] = request.prompt or ""
    else:
        path = "/chat/completions"
        shaped = list(messages)
        if record.system and not any(m.role in ("system", "developer") for m in shaped):
            shaped.insert(0, Message("system", [TextBlock(record.system)]))
        extra = [Message(m["role"], [TextBlock(m["content"])]) for m in record.messages]  # type: ignore[arg-type]
        leading = 1 if shaped and shaped[0].role in ("system", "developer") else 0
        shaped[leading:leading] = extra  # the Modelfile's MESSAGEs: after the system prompt, before the talk
        body["messages"] = openai_messages(shaped)
    sampling: dict[str, Any] = {k: v for k, v in params.items() if k in SAMPLING_FIELDS}
    sampling.update({k: v for k, v in request.sampling.as_dict().items() if k in SAMPLING_FIELDS})
    body.update(sampling)
    penalty = request.sampling.repeat_penalty if request.sampling.repeat_penalty is not None \
        else params.get("repeat_penalty")
    if penalty is not None:
        body["repetition_penalty" if kind in ("vllm", "sglang", "dynamo") else "repeat_penalty"] = penalty
    max_tokens = request.max_tokens
    if max_tokens is None and isinstance(params.get("num_predict"), int) and int(params["num_predict"]) >= 0:  # type: ignore[arg-type]
        max_tokens = int(params["num_predict"])  # type: ignore[arg-type]
    if max_tokens is not None and max_tokens >= 0:
        body["max_tokens"] = max_tokens
    model_stops = params.get("stop") if isinstance(params.get("stop"), list) else []
    stops = list(dict.fromkeys([*(request.stop or []), *model_stops]))  # type: ignore[misc]
    if stops:
        body["stop"] = stops
    if request.ignore_eos:
        body["ignore_eos"] = True
    if messages is not None and request.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in request.tools]
        choice = request.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.mode == "function"
                               else choice.mode)
    if request.response_format is not None:
        if request.response_format.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "response", "schema": request.response_format.schema or {}}}
        else:
            body["response_format"] = {"type": "json_object"}
    if request.reasoning is False and messages is not None:
        body["chat_template_kwargs"] = {"enable_thinking": False}  # vLLM, SGLang and llama-server read it
    if request.session_id:
        body["prompt_cache_key"] = request.session_id
    if request.cache_partition and kind in ("vllm", "dynamo", "localai"):
        body["cache_salt"] = request.cache_partition  # the upstream's prefix cache is partitioned as this one is
    if kind == "dynamo":
        hints: dict[str, Any] = {}
        if priority is not None:
            hints["priority"] = priority
        if max_tokens:
            hints["osl"] = max_tokens
        if hints:
            body["nvext"] = {"agent_hints": hints}
    return path, body


def estimated_tokens(op: dict[str, Any]) -> int:
    """A prompt's tokens without the upstream's tokenizer: about 4 characters of its JSON a token."""
    return max(1, int(op["size"]) // 4)


def routing_key(record: ModelRecord, request: GenerationRequest) -> str:
    """The session a request belongs to: its id, else its first messages (or the prompt's start)."""
    if request.session_id:
        partition = f"{request.cache_partition}\0" if request.cache_partition else ""
        return f"session\0{partition}{request.session_id}"
    digest = hashlib.sha256(record.name.encode() + request.cache_partition.encode())
    if request.messages is not None:
        for message in request.messages[:2]:
            digest.update(message.role.encode() + b"\0" + message.text()[:4096].encode() + b"\0")
    else:
        digest.update((request.prompt or "")[:4096].encode())
    return digest.hexdigest()


@dataclass
class _Call:
    position: int
    id: str
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    started: bool = False


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
        self._health: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Task[None] | None = None
        for replica in self.replicas:
            metrics.upstream_healthy.labels(name, replica.url).set(1)

    def start(self) -> None:
        if self._health is None:
            self._health = asyncio.create_task(self._health_loop(), name=f"health-{self.name}")

    async def close(self, *, drain: bool = False) -> None:
        """Stop health checks and close connections (``drain``: after the requests in flight, up to an hour)."""
        deadline = time.monotonic() + 3600
        while drain and self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(BaseException):
                await self._health
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
        while True:
            now = time.monotonic()
            # A replica busy answering is alive; some servers (llama-cpp-python's) hold /models until they finish.
            due = [r for r in self.replicas if r.next_check <= now and not (r.healthy and r.active)]
            if due:
                await asyncio.gather(*(self.check(r) for r in due), return_exceptions=True)
            await asyncio.sleep(0.25)

    async def refresh(self) -> None:
        """Make sure the model list is known: ask the replicas in turn until one answers. A list that is merely
        old is refreshed in the background, so no request waits on a replica's ``/models``."""
        if self.models:
            if time.monotonic() - self.models_at >= MODELS_TTL and self._refreshing is None:
                self._refreshing = asyncio.create_task(self._refresh())
                self._refreshing.add_done_callback(lambda _: setattr(self, "_refreshing", None))
            return
        await self._refresh()

    async def _refresh(self) -> None:
        for replica in self.order(""):
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

    async def generate(self, op: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
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
                if status != 200 or lines is None:
                    body_bytes = await _read_some(response)
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
                yield {"ev": "prompt", "id": op["id"], "prompt_tokens": 0, "cached_tokens": 0,
                       "replica": replica.url}
                try:
                    async for frame in self._relay(replica, _chain(first, lines), op):
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
                if response is not None:
                    await response.aclose()  # also what cancels the upstream request when the client went away
        error = UpstreamTimeout if failures and timeouts == len(failures) else UpstreamUnavailable
        raise error(f"no replica of '{self.name}' could take the request: {'; '.join(failures) or 'none configured'}")

    async def _post(self, replica: Replica, op: dict[str, Any], body: dict[str, Any], *,
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

    def _refusal(self, replica: Replica, status: int, body: bytes, message: str, op: dict[str, Any]) -> dict[str, Any]:
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
            return {"ev": "error", "id": op["id"], "kind": "context_length", "n_ctx": n_ctx,
                    "prompt_tokens": prompt_tokens or estimate, "message": f"{where}: {message}"}
        raise InvalidRequest(f"{where} refused the request (HTTP {status}): {message}")

    async def _relay(self, replica: Replica, lines: AsyncIterator[str],
                     op: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The upstream's server-sent events as frames, each relayed as it arrives."""
        calls: dict[int, _Call] = {}
        usage: dict[str, Any] = {}
        reason = "stop"
        pieces = 0
        text_mode = op["path"] == "/completions"

        def event(value: Event) -> dict[str, Any]:
            return {"ev": "event", "id": op["id"], "event": value}

        complete = False
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                complete = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise UpstreamFailed(f"replica {replica.url} of '{self.name}' sent an event that is not JSON: "
                                     f"{data[:200]!r}") from None
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                raise UpstreamFailed(f"replica {replica.url} of '{self.name}' reported an error during the reply: "
                                     f"{error_message(json.dumps(chunk).encode())}")
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                if text_mode:
                    if choice.get("text"):
                        pieces += 1
                        yield event(TextDelta(str(choice["text"])))
                else:
                    delta = choice.get("delta") or {}
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        yield event(ReasoningDelta(str(thought)))
                    if delta.get("content"):
                        pieces += 1
                        yield event(TextDelta(str(delta["content"])))
                    for item in delta.get("tool_calls") or []:
                        for value in _call_events(calls, item):
                            pieces += 1
                            yield event(value)
                if choice.get("finish_reason"):
                    reason = str(choice["finish_reason"])
                    complete = True
        if not complete:  # the connection closed cleanly, but before the reply said it was finished
            raise UpstreamFailed(f"replica {replica.url} of '{self.name}' ended its stream before the reply was "
                                 "complete")
        for call in sorted(calls.values(), key=lambda c: c.position):
            if not call.started:
                call.started = True
                yield event(ToolCallStart(call.position, call.id, call.name))
            yield event(ToolCallEnd(call.position, call.id, call.name, "".join(call.arguments)))
        finish = "tool_calls" if calls else {"length": "length", "tool_calls": "tool_calls",
                                              "function_call": "tool_calls"}.get(reason, "stop")
        details = usage.get("prompt_tokens_details") or {}
        # Servers that report no usage while streaming (llama-cpp-python's): about 4 characters a token, so agents
        # that compact their context by the reported input size still see it grow.
        yield {"ev": "done", "id": op["id"], "finish_reason": finish, "stop_sequence": None, "usage": {
            "prompt_tokens": int(usage.get("prompt_tokens") or estimated_tokens(op)),
            "completion_tokens": int(usage.get("completion_tokens") or pieces),
            "cached_tokens": int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
        }}

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


def _call_events(calls: dict[int, _Call], item: dict[str, Any]) -> list[Event]:
    """Events for one tool-call delta. Some servers repeat the id and name on every delta (llama-cpp-python);
    a call starts once its name is known."""
    if not isinstance(item, dict):
        return []
    index = int(item.get("index", 0) or 0)
    function = item.get("function") or {}
    events: list[Event] = []
    call = calls.get(index)
    if call is None:
        call = calls[index] = _Call(position=len(calls), id=str(item.get("id") or new_call_id()))
    if not call.name and function.get("name"):
        call.name = str(function["name"])
    if call.name and not call.started:
        call.started = True
        events.append(ToolCallStart(call.position, call.id, call.name))
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    if arguments:
        call.arguments.append(str(arguments))
        if call.started:
            pending = "".join(call.arguments) if len(events) else str(arguments)
            events.append(ToolCallDelta(call.position, pending))
    return events


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

    def pool(self, record: ModelRecord) -> RemotePool:
        spec = RemoteSpec.of(record.path, record.parameters)
        pool = self.pools.get(record.name)
        if pool is not None and pool.spec == spec:
            return pool
        if pool is not None:  # its Modelfile changed: new replicas, new settings; its requests finish first
            self.forget(record.name)
        pool = self.pools[record.name] = RemotePool(record.name, spec, self.metrics, self.health_interval)
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
        pool = self.pool(record)
        if probe:
            with contextlib.suppress(LocalAIError, TimeoutError):
                await asyncio.wait_for(pool.refresh(), pool.spec.connect_timeout + 2)
        try:
            upstream: str | None = pool.model_id()
        except LocalAIError:  # not known yet: no replica answered
            upstream = pool.spec.upstream_model
        return {"context_length": pool.context_length(), "upstream_model": upstream, "kind": pool.kind(),
                "replicas": pool.status()}

    async def shutdown(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools.values()), return_exceptions=True)
        self.pools.clear()
