"""The Responses API's compaction (``POST /v1/responses/compact``), done locally: the model writes a summary of the
conversation, which stands for the turns it replaces; the result is stored like a response."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from localai.api.common import (
    ParsedBodyRoute,
    collect,
    generation_headers,
    runtime_of,
)
from localai.api.response_store import ResponseStore
from localai.api.responses import (
    COMPACTED_MARK,
    MEDIA_PARTS,
    TEXT_PARTS,
    new_id,
    read_conversation,
    text_of,
    tools_of,
    usage_json,
    with_instructions,
)
from localai.api.sessions import cache_partition, cache_salt_field, session_id
from localai.errors import InvalidRequest, LocalAIError
from localai.schema import (
    GenerationRequest,
    Message,
    TextBlock,
)

router = APIRouter(route_class=ParsedBodyRoute)
COMPACT_PROMPT = (
    "Context checkpoint: the conversation above is about to be replaced by a summary. Write that summary for "
    "another instance of yourself who will continue the work from it alone: the goal and the user's requests and "
    "constraints, decisions made and why, what was done (files changed, commands run and their results), the "
    "current state, and what is left to do next. Be concrete and brief; write only the summary.")


class CompactRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # not in the spec: a client that sends them keeps its cached prefix
    prompt_cache_key: str | None = None
    cache_salt: str | None = cache_salt_field()


def compacted_items(conversation: list[dict[str, Any]], summary: str) -> list[dict[str, Any]]:
    """What a compacted conversation keeps: the user's own messages (as the spec's example keeps them), then the
    summary standing for everything else (a previous compaction's summary folds into the new one)."""
    kept = [{"type": "message", "id": new_id("msg"), "status": "completed", "role": "user",
             "content": _user_content(item.get("content"))} for item in conversation
            if item.get("type", "message") == "message" and item.get("role") == "user"]
    return [*kept, {"type": "compaction", "id": new_id("cmp"), "encrypted_content": COMPACTED_MARK + summary}]


def _user_content(content: Any) -> list[dict[str, Any]]:
    """A user message's parts as a compaction keeps them: its text, and its images and files as they were sent."""
    if not isinstance(content, list):
        return [{"type": "input_text", "text": text_of(content, "input")}]
    return [part if part.get("type") in MEDIA_PARTS else {"type": "input_text", "text": str(part.get("text", ""))}
            for part in content if isinstance(part, dict) and part.get("type") in (*TEXT_PARTS, *MEDIA_PARTS)]


@router.post("/v1/responses/compact")
async def compact_response(body: CompactRequest, request: Request) -> JSONResponse:
    """Compaction, locally: the model summarizes the conversation (``input`` after ``previous_response_id``'s) and
    the result is the user's messages and one compaction item holding the summary. It is stored, so a later request
    continues from it with ``previous_response_id`` (or by sending its output as input)."""
    store = ResponseStore(request)
    conversation, _, messages = await read_conversation(store, body.input, body.previous_response_id)
    if not messages:
        raise InvalidRequest("there is nothing to compact: give 'input' or 'previous_response_id'", param="input")
    messages = [*with_instructions(messages, body.instructions), Message("user", [TextBlock(COMPACT_PROMPT)])]
    generation = await runtime_of(request).start(GenerationRequest(
        model=body.model, messages=messages, tools=tools_of(body.tools), reasoning=False,
        session_id=session_id(request.headers, body.prompt_cache_key),
        cache_partition=cache_partition(request, body.cache_salt)))
    result = await collect(generation, request)
    summary = result.text.strip()
    if not summary:
        raise LocalAIError("the model wrote an empty summary; the conversation was not compacted")
    compact = {"id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
               "model": body.model, "previous_response_id": body.previous_response_id,
               "output": compacted_items(conversation, summary), "usage": usage_json(result.finished)}
    await store.save(compact, [], [], None)  # its output stands for the whole conversation: no parent
    return JSONResponse(compact, headers=generation_headers(generation))
