"""A remote model's replicas as a ``Target``: the request goes upstream as chat completions; events come back
parsed by the upstream (``upstreams/``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from localai.models.registry import ModelRecord
from localai.protocol import RequestFrame
from localai.runtime.fitting import output_reserve
from localai.runtime.formats import Parser
from localai.schema import GenerationRequest, Message
from localai.upstreams.pool import RemotePool
from localai.upstreams.ring import routing_key
from localai.upstreams.translation import RemoteOp, prompt_size, request_body
from localai.workers.handle import new_request_id


@dataclass
class RemoteTarget:
    """A remote model's replicas: the request goes upstream as chat completions; events come back parsed."""

    record: ModelRecord
    pool: RemotePool
    model_id: str
    kind: str
    n_ctx: int
    retries_on_crash: bool = False

    async def operation(self, request: GenerationRequest, messages: list[Message] | None) -> RemoteOp:
        return await asyncio.to_thread(self._operation, request, messages)

    def _operation(self, request: GenerationRequest, messages: list[Message] | None) -> RemoteOp:
        path, body = request_body(self.record, request, messages, self.model_id, self.kind, self.pool.spec.priority)
        headers: dict[str, str] = {}
        if request.session_id:
            headers["X-Session-Id"] = request.session_id
            if self.kind == "dynamo":
                headers["x-dynamo-session-id"] = request.session_id
        max_tokens = body.get("max_tokens")
        # The upstream counts the whole max_tokens against its context: leave exactly that room when fitting.
        reserve = min(max_tokens, self.n_ctx) if max_tokens else output_reserve(None, self.n_ctx)
        prompt = body.get("messages", body.get("prompt"))
        return RemoteOp(id=new_request_id("remote"), path=path, body=body, headers=headers,
                        key=routing_key(self.record, request), reserve=reserve,
                        size=prompt_size(prompt, body.get("tools")))

    def size(self, op: RemoteOp) -> int:
        return op["size"]

    def generate(self, op: RemoteOp) -> AsyncIterator[RequestFrame]:
        return self.pool.generate(op)

    def parser(self, request: GenerationRequest, prompt: str | None = None) -> Parser | None:
        return None  # the upstream parsed its own tool calls and reasoning


async def remote_target(pool: RemotePool, record: ModelRecord) -> RemoteTarget:
    """A remote model's pool as a target, once a replica has said what it serves (raises when none can)."""
    await pool.refresh()
    return RemoteTarget(record, pool, pool.model_id(), pool.kind(), pool.context_length())
