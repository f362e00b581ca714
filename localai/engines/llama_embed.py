"""Embeddings from a second llama.cpp context on the same weights.

A separate context (embeddings on, mean pooling) means an embedding request never touches the
chat sequences' KV cells, so every session's prompt cache survives it.
"""

from __future__ import annotations

import math
from typing import Any

import llama_cpp as L

MAX_EMBED_CTX = 2048  # longer inputs are truncated (or refused); the pooled batch must fit in one ubatch


class EmbeddingContext:
    """Embeds token sequences one at a time; vectors are L2-normalised."""

    def __init__(self, model: Any, vocab: Any, *, n_ctx: int, n_threads: int) -> None:
        self.n_ctx = min(n_ctx, MAX_EMBED_CTX)
        params = L.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_ctx
        params.n_ubatch = self.n_ctx
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.embeddings = True
        params.pooling_type = L.LLAMA_POOLING_TYPE_MEAN
        params.no_perf = True
        self.ctx = L.llama_init_from_model(model, params)
        if not self.ctx:
            raise ValueError("llama.cpp could not create an embedding context (out of memory?)")
        self.memory = L.llama_get_memory(self.ctx)
        self.n_embd = int(L.llama_model_n_embd(model))
        self.batch = L.llama_batch_init(self.n_ctx, 0, 1)
        self.vocab = vocab

    def embed(self, inputs: list[list[int]], *, truncate: bool) -> tuple[list[list[float]], int]:
        """One vector per input and the number of tokens evaluated."""
        vectors: list[list[float]] = []
        counted = 0
        for index, tokens in enumerate(inputs):
            if len(tokens) > self.n_ctx:
                if not truncate:
                    raise ValueError(f"input {index} is {len(tokens)} tokens, over the embedding context of "
                                     f"{self.n_ctx}; shorten it or allow truncation")
                tokens = tokens[:self.n_ctx]
            if not tokens:
                raise ValueError(f"input {index} is empty")
            vectors.append(self._one(tokens))
            counted += len(tokens)
        return vectors, counted

    def _one(self, tokens: list[int]) -> list[float]:
        L.llama_memory_clear(self.memory, True)
        batch = self.batch
        batch.n_tokens = len(tokens)
        for position, token in enumerate(tokens):
            batch.token[position] = token
            batch.pos[position] = position
            batch.n_seq_id[position] = 1
            batch.seq_id[position][0] = 0
            batch.logits[position] = True
        if L.llama_decode(self.ctx, batch) != 0:
            raise ValueError("llama.cpp failed to evaluate the input for embedding")
        pointer = L.llama_get_embeddings_seq(self.ctx, 0)
        if not pointer:
            raise ValueError("this model produced no pooled embedding")
        values = [float(pointer[i]) for i in range(self.n_embd)]
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        return [v / norm for v in values]

    def close(self) -> None:
        """Free the context and batch (the weights belong to the chat engine)."""
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
