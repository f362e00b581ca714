"""Rerank: how well each document answers a query, from a reranker model (bge-reranker, Qwen3-Reranker, jina).

llama-server's endpoint and aliases (``/v1/rerank``, ``/rerank``, ``/v1/reranking``, ``/reranking``), which speak
the Jina and Cohere shape (``{model, query, documents, top_n, return_documents}`` -> ``{results: [{index,
relevance_score, document?}], usage}``; a document is a string, or Cohere's and Jina's object with ``text``), and
Hugging Face TEI's when the body has ``texts`` (a bare list of ``{index, score, text?}``). Scores are the
reranker's head as llama-server reports it: a logit for bge-reranker, P(yes) for Qwen3-Reranker.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from localai.api.common import keep_alive_seconds, runtime_of
from localai.errors import InvalidRequest

router = APIRouter()

MAX_DOCUMENTS = 1000  # a request's documents at most (Cohere's advice; llama-server sets no bound)


class DocumentObject(BaseModel):
    """Cohere's and Jina's document object; only its text is read."""

    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str | DocumentObject] | None = Field(default=None, max_length=MAX_DOCUMENTS)
    texts: list[str] | None = Field(default=None, max_length=MAX_DOCUMENTS)  # TEI's name for the documents
    top_n: StrictInt | None = Field(default=None, ge=1)
    return_documents: bool = False  # Cohere and Jina
    return_text: bool = False  # TEI
    truncate: bool = True  # a document over the context is cut to fit (False: a 400)
    keep_alive: float | str | None = None

    @field_validator("documents", "texts")
    @classmethod
    def _not_empty(cls, value: list[Any] | None) -> list[Any] | None:
        if value is not None and not value:
            raise ValueError("at least one document is required")
        return value

    @property
    def tei(self) -> bool:
        return self.texts is not None and self.documents is None

    def document_texts(self) -> list[str]:
        if self.documents is None:
            return list(self.texts or [])
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


@router.post("/v1/rerank", response_model=None)
async def rerank(body: RerankRequest, request: Request) -> Any:
    started = time.perf_counter()
    if body.documents is None and body.texts is None:
        raise InvalidRequest("documents: the texts to rank are required (a list of strings, or of objects with "
                             "\"text\")", param="documents")
    texts = body.document_texts()
    scores, tokens = await runtime_of(request).rerank(body.model, body.query, texts, truncate=body.truncate,
                                                      keep_alive=keep_alive_seconds(body.keep_alive))
    order = sorted(range(len(texts)), key=lambda index: scores[index], reverse=True)[:body.top_n or len(texts)]
    if body.tei:
        return [{"index": index, "score": scores[index], **({"text": texts[index]} if body.return_text else {})}
                for index in order]
    results = [{"index": index, "relevance_score": scores[index],
                **({"document": {"text": texts[index]}} if body.return_documents else {})} for index in order]
    return {"id": f"rerank-{uuid.uuid4().hex[:24]}", "object": "list", "model": body.model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            # Cohere's SDK reads meta; the duration is localai's
            "meta": {"billed_units": {"search_units": 1}, "total_duration_ms": round(
                (time.perf_counter() - started) * 1000, 1)}}


for _alias in ("/rerank", "/v1/reranking", "/reranking", "/v2/rerank"):  # llama-server's aliases; Cohere's v2
    router.add_api_route(_alias, rerank, methods=["POST"], response_model=None, include_in_schema=False)
