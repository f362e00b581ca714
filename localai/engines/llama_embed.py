"""Embeddings and rerank scores from llama.cpp contexts of their own on the same weights.

A separate context (embeddings on, mean or rank pooling) means an embedding or rerank request never touches the
chat sequences' KV cells, so every session's prompt cache survives it.
"""

from __future__ import annotations

import math
from typing import Any

import llama_cpp as L

MAX_EMBED_CTX = 2048  # longer inputs are truncated (or refused); the pooled batch must fit in one ubatch
MAX_RANK_CTX = 4096  # a query-document pair's tokens at most (the document is cut to fit, or refused)
RANK_SEQUENCES = 8  # pairs evaluated in one batch


class PooledContext:
    """A context whose output is one pooled vector per sequence: whole sequences go in one batch (a non-causal
    model reads a sequence whole in one ubatch), the memory cleared before each."""

    def __init__(self, model: Any, vocab: Any, *, n_ctx: int, n_seq: int, pooling: int, n_threads: int,
                 what: str) -> None:
        self.n_ctx = n_ctx
        params = L.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = n_ctx
        params.n_seq_max = n_seq
        params.kv_unified = True  # any sequence may use the whole context
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.embeddings = True
        params.pooling_type = pooling
        params.no_perf = True
        self.ctx = L.llama_init_from_model(model, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not create {what} context (out of memory?)")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_ctx, 0, 1)
        self.vocab = vocab

    def _pooled(self, group: list[list[int]], what: str) -> list[Any]:
        """Evaluate ``group`` (sequences whose tokens fit the context together) and return each one's pooled
        output (a pointer to its floats)."""
        L.llama_memory_clear(self.memory, True)
        batch = self.batch
        at = 0
        for seq, tokens in enumerate(group):
            for position, token in enumerate(tokens):
                batch.token[at] = token
                batch.pos[at] = position
                batch.n_seq_id[at] = 1
                batch.seq_id[at][0] = seq
                batch.logits[at] = True
                at += 1
        batch.n_tokens = at
        if L.llama_decode(self.ctx, batch) != 0:
            raise ValueError(f"llama.cpp failed to evaluate the {what}")
        pointers = []
        for seq in range(len(group)):
            pointer = L.llama_get_embeddings_seq(self.ctx, seq)
            if not pointer:
                raise ValueError(f"this model produced no pooled output for the {what}")
            pointers.append(pointer)
        return pointers

    def close(self) -> None:
        """Free the context and batch (the weights belong to the chat engine)."""
        free_context(self)


def free_context(holder: Any) -> None:
    """Free ``holder.batch`` and ``holder.ctx`` (a llama.cpp batch and context) once; both are None after."""
    if holder.batch is not None:
        L.llama_batch_free(holder.batch)
        holder.batch = None
    if holder.ctx:
        L.llama_free(holder.ctx)
        holder.ctx = None


class EmbeddingContext(PooledContext):
    """Embeds token sequences one at a time (mean pooling); vectors are L2-normalised."""

    def __init__(self, model: Any, vocab: Any, *, n_ctx: int, n_threads: int) -> None:
        super().__init__(model, vocab, n_ctx=min(n_ctx, MAX_EMBED_CTX), n_seq=1, pooling=L.LLAMA_POOLING_TYPE_MEAN,
                         n_threads=n_threads, what="an embedding")
        self.n_embd = int(L.llama_model_n_embd(model))

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
            pointer = self._pooled([tokens], "input for embedding")[0]
            values = [float(pointer[i]) for i in range(self.n_embd)]
            norm = math.sqrt(sum(v * v for v in values)) or 1.0
            vectors.append([v / norm for v in values])
            counted += len(tokens)
        return vectors, counted


class RankContext(PooledContext):
    """Scores query-document pairs with a reranker's classifier head (rank pooling). A pair is the model's
    ``rerank`` prompt with the query and document put in (Qwen3-Reranker), else ``[BOS] query [EOS] [SEP] document
    [EOS]`` as the vocabulary asks (bge-reranker, jina): llama-server's forms. The score is the head's first output
    as llama-server reports it (a logit for bge, P(yes) for Qwen3)."""

    def __init__(self, model: Any, vocab: Any, tokenize: Any, *, n_ctx: int, n_threads: int, causal: bool) -> None:
        super().__init__(model, vocab, n_ctx=min(n_ctx, MAX_RANK_CTX), n_seq=RANK_SEQUENCES,
                         pooling=L.LLAMA_POOLING_TYPE_RANK, n_threads=n_threads, what="a rerank")
        # A non-causal model's pairs go one a batch: several in one ubatch scored up to 0.036 off on the BERT
        # fixture (flash attention on; 0.003 off), one alone exactly as llama-server's one-slot scores
        self.per_batch = RANK_SEQUENCES if causal else 1
        self.tokenize = tokenize  # (text, add_special, parse_special) -> token ids
        prompt = L.llama_model_chat_template(model, b"rerank")
        self.prompt = prompt.decode() if prompt else None

    def pair(self, query: str, document: str, *, truncate: bool, index: int) -> list[int]:
        """A pair's tokens; over the context, the document is cut to fit (``truncate``) or refused."""
        vocab = self.vocab
        if self.prompt is not None:
            tokens = self.tokenize(self.prompt.replace("{query}", query).replace("{document}", document), False, True)
            if len(tokens) <= self.n_ctx:
                return list(tokens)
            head, _, tail = self.prompt.partition("{document}")
            before = list(self.tokenize(head.replace("{query}", query), False, True))
            after = list(self.tokenize(tail.replace("{query}", query), False, True))
            body = list(self.tokenize(document, False, False))
        else:
            end = int(L.llama_vocab_eos(vocab))
            if end < 0:
                end = int(L.llama_vocab_sep(vocab))
            before = [int(L.llama_vocab_bos(vocab))] if L.llama_vocab_get_add_bos(vocab) else []
            before += self.tokenize(query, False, False)
            if L.llama_vocab_get_add_eos(vocab):
                before.append(end)
            if L.llama_vocab_get_add_sep(vocab):
                before.append(int(L.llama_vocab_sep(vocab)))
            body = list(self.tokenize(document, False, False))
            after = [end] if L.llama_vocab_get_add_eos(vocab) else []
        room = self.n_ctx - len(before) - len(after)
        if len(body) > room:
            if not truncate or room < 1:
                raise ValueError(f"document {index} with the query is {len(before) + len(body) + len(after)} "
                                 f"tokens, over the rerank context of {self.n_ctx}; shorten it or allow truncation")
            body = body[:room]
        return before + body + after

    def score(self, pairs: list[list[int]]) -> list[float]:
        """Each pair's score, up to ``per_batch`` pairs (that fit the context together) a batch."""
        scores: list[float] = []
        start = 0
        while start < len(pairs):
            group: list[list[int]] = []
            used = 0
            while start + len(group) < len(pairs) and len(group) < self.per_batch \
                    and used + len(pairs[start + len(group)]) <= self.n_ctx:
                used += len(pairs[start + len(group)])
                group.append(pairs[start + len(group)])
            scores.extend(float(pointer[0]) for pointer in self._pooled(group, "documents for reranking"))
            start += len(group)
        return scores
