"""The GGUF engine: llama.cpp through llama-cpp-python's low-level API, inside a worker process.

One llama.cpp context holds ``n_parallel`` sequences in a unified KV cache. Requests are decoded
together (continuous batching): every step builds one batch with the next token of each
generating request plus prompt chunks of the requests still prefilling. Each sequence keeps
the tokens it holds, so a request that shares a prefix with what a sequence already holds
evaluates only the rest.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L

from localai.backends.grammars import HERMES_TRIGGER, GrammarError, grammar_for
from localai.backends.llama_embed import EmbeddingContext
from localai.backends.text import StopMatcher
from localai.protocol import Constraint, EmbedOp, GenerateOp, ModelInfo, Sampling
from localai.session_cache import MIN_TOKENS, CorruptEntry, SessionCache, fingerprint

log = logging.getLogger("localai.worker")
Emit = Callable[[dict[str, Any]], None]

# Text is sent to the daemon at most this often (the first token at once): every frame wakes the daemon
# and the client, which on a small CPU preempts llama.cpp's compute threads mid-token.
FLUSH_INTERVAL = 0.025
KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}
DEFAULT_SAMPLING: Sampling = {
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0,
    "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}


@dataclass
class LoadOptions:
    """How to load a model; a change in any of these means a reload."""

    model_path: str
    num_ctx: int
    n_parallel: int = 4
    n_threads: int = 2
    n_batch: int = 512
    num_gpu: int = -1
    use_mmap: bool = True
    flash_attention: bool = False
    kv_type: str = "f16"
    model_sha256: str = ""
    template: str | None = None
    cache_dir: str | None = None
    cache_max_bytes: int = 8 << 30


@dataclass
class Slot:
    """One llama.cpp sequence and the tokens its KV cells hold."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False


@dataclass
class Request:
    """A generation in progress on a slot."""

    id: str
    slot: Slot
    session: str | None
    prompt: list[int]
    next_prompt: int
    cached: int
    max_tokens: int
    sampler: Any
    matcher: StopMatcher
    ignore_eos: bool
    started: float
    prompt_done: float = 0.0
    generated: int = 0
    pending_token: int | None = None
    unsent: str = ""
    sent_at: float = 0.0
    snapshot_at: int | None = None  # prompt length of the system segment, to save as a shared entry


_LOG_CALLBACK: Any = None


def _quiet_llama_logs(debug: bool) -> None:
    """Route llama.cpp's logging: silence it unless debugging (it writes to stderr otherwise)."""
    global _LOG_CALLBACK

    def callback(level: int, text: bytes, _user: Any) -> None:
        if debug and text:
            log.debug("llama.cpp: %s", text.decode(errors="replace").rstrip())

    _LOG_CALLBACK = L.llama_log_callback(callback)
    L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCppEngine:
    """A loaded GGUF model serving several sequences at once."""

    backend = "llama.cpp"

    def __init__(self, options: LoadOptions, *, debug: bool = False) -> None:
        _quiet_llama_logs(debug)
        L.llama_backend_init()
        self.options = options
        model_params = L.llama_model_default_params()
        model_params.use_mmap = options.use_mmap
        if options.num_gpu >= 0:
            model_params.n_gpu_layers = options.num_gpu
        else:
            model_params.n_gpu_layers = 999  # offload everything a GPU build can take
        self.model = L.llama_model_load_from_file(options.model_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {options.model_path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.model))
        self.num_ctx = min(options.num_ctx, self.n_ctx_train) if self.n_ctx_train > 0 else options.num_ctx
        self.n_batch = options.n_batch
        ctx_params = L.llama_context_default_params()
        ctx_params.n_ctx = self.num_ctx * options.n_parallel
        ctx_params.n_batch = options.n_batch
        ctx_params.n_ubatch = options.n_batch
        ctx_params.n_seq_max = options.n_parallel
        ctx_params.kv_unified = False  # one KV stream per sequence: idle sessions do not slow active decoding
        ctx_params.n_threads = options.n_threads
        ctx_params.n_threads_batch = options.n_threads
        ctx_params.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attention else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx_params.type_k = KV_TYPES[options.kv_type]
        ctx_params.type_v = KV_TYPES[options.kv_type]
        ctx_params.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(options.n_batch, 0, 1)
        self.slots = [Slot(seq_id=index) for index in range(options.n_parallel)]
        self.requests: dict[str, Request] = {}
        self.waiting: list[GenerateOp] = []
        self._piece = ctypes.create_string_buffer(256)
        self.bos_id = int(L.llama_vocab_bos(self.vocab))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.cache: SessionCache | None = None
        self.embedder: EmbeddingContext | None = None  # created on the first embedding request
        if options.cache_dir and options.cache_max_bytes > 0:
            from pathlib import Path

            self.cache = SessionCache(Path(options.cache_dir), self.fingerprint(), max_bytes=options.cache_max_bytes)

    def fingerprint(self) -> str:
        """Everything that must match for a saved sequence state to be valid in this context."""
        import hashlib

        template = self.options.template or (L.llama_model_chat_template(self.model, None) or b"").decode()
        return fingerprint({
            "model_sha256": self.options.model_sha256 or self.options.model_path,
            "engine": f"llama-cpp-python {L.__version__}", "n_ctx": self.num_ctx,
            "n_seq_max": self.options.n_parallel, "kv_unified": False, "type_k": self.options.kv_type,
            "type_v": self.options.kv_type, "flash_attention": self.options.flash_attention,
            "chat_template": hashlib.sha256(template.encode()).hexdigest(),
        })

    # -- model facts -----------------------------------------------------------------------------

    def info(self) -> ModelInfo:
        template = L.llama_model_chat_template(self.model, None)
        return ModelInfo(
            backend=self.backend,
            engine_version=f"llama-cpp-python {L.__version__}",
            n_ctx=self.num_ctx,
            n_ctx_train=self.n_ctx_train,
            n_parallel=self.options.n_parallel,
            n_vocab=int(L.llama_vocab_n_tokens(self.vocab)),
            bos_token=self._token_text(self.bos_id),
            eos_token=self._token_text(int(L.llama_vocab_eos(self.vocab))),
            chat_template=template.decode() if template else None,
            architecture=self._meta("general.architecture") or "unknown",
            flash_attention=self.options.flash_attention,
            kv_type=self.options.kv_type,
        )

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        length = L.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode(errors="replace") if length >= 0 else None

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._piece_bytes(token, special=True).decode(errors="replace")

    def _piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        length = L.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, special)
        if length < 0:
            bigger = ctypes.create_string_buffer(-length)
            length = L.llama_token_to_piece(self.vocab, token, bigger, len(bigger), 0, special)
            return bigger.raw[:length]
        return self._piece.raw[:length]

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a rendered prompt: special tokens parsed, BOS added once when the model wants one."""
        data = text.encode()
        capacity = len(data) + 16
        buffer = (L.llama_token * capacity)()
        count = L.llama_tokenize(self.vocab, data, len(data), buffer, capacity, self.add_bos, True)
        if count < 0:
            capacity = -count
            buffer = (L.llama_token * capacity)()
            count = L.llama_tokenize(self.vocab, data, len(data), buffer, capacity, self.add_bos, True)
        tokens = list(buffer[:count])
        if self.add_bos and len(tokens) > 1 and tokens[0] == tokens[1] == self.bos_id:
            tokens = tokens[1:]  # the template already wrote BOS
        return tokens

    def tokenize_special(self, text: str) -> list[int]:
        """Tokens of ``text`` alone (special tokens parsed, no BOS)."""
        data = text.encode()
        buffer = (L.llama_token * (len(data) + 8))()
        count = L.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), False, True)
        return list(buffer[:max(count, 0)])

    # -- the serving loop ------------------------------------------------------------------------

    def serve(self, inbox: queue.Queue[dict[str, Any] | None], emit: Emit) -> None:
        """Run until ``None`` arrives in the inbox: admit, batch, decode, sample, emit."""
        while True:
            block = not self.requests and not self.waiting
            try:
                while True:
                    op = inbox.get(block=block)
                    block = False
                    if op is None:
                        if self.cache is not None:
                            self.cache.flush()
                        return
                    try:
                        self._handle(op, emit)
                    except Exception as exc:  # one bad op gets its error; the engine keeps serving the rest
                        log.exception("op %s %s failed", op.get("op"), op.get("id"))
                        emit({"ev": "error", "id": op.get("id"), "kind": "invalid", "message": str(exc)[:2000]})
            except queue.Empty:
                pass
            self._admit(emit)
            if self.requests:
                self._step(emit)

    def _handle(self, op: dict[str, Any], emit: Emit) -> None:
        kind = op.get("op")
        if kind == "generate":
            self.waiting.append(op)  # type: ignore[arg-type]
        elif kind == "cancel":
            request = self.requests.get(op["id"])
            if request is not None:
                self._finish(request, "cancelled", emit)
            self.waiting = [item for item in self.waiting if item["id"] != op["id"]]
        elif kind == "tokenize":
            tokens = self.tokenize(op["text"])
            answer: dict[str, Any] = {"ev": "tokens", "id": op["id"], "count": len(tokens)}
            if not op.get("count_only"):
                answer["tokens"] = tokens
            emit(answer)
        elif kind == "embed":
            self._embed(op, emit)  # type: ignore[arg-type]

    def _embed(self, op: EmbedOp, emit: Emit) -> None:
        try:
            if self.embedder is None:
                self.embedder = EmbeddingContext(self.model, self.vocab, n_ctx=self.num_ctx,
                                                 n_threads=self.options.n_threads)
            tokens = [self.tokenize(text) for text in op["texts"]]
            vectors, counted = self.embedder.embed(tokens, truncate=op["truncate"])
        except ValueError as exc:
            emit({"ev": "error", "id": op["id"], "kind": "invalid", "message": str(exc)})
            return
        emit({"ev": "embeddings", "id": op["id"], "vectors": vectors, "prompt_tokens": counted})

    def _admit(self, emit: Emit) -> None:
        while self.waiting:
            free = [slot for slot in self.slots if not slot.busy]
            if not free:
                return
            op = self.waiting.pop(0)
            try:
                self._start(op, free, emit)
            except GrammarError as exc:
                emit({"ev": "error", "id": op["id"], "kind": "constraint", "message": str(exc)})
            except Exception as exc:  # a bad request must not take the worker down
                log.exception("request %s failed to start", op.get("id"))
                emit({"ev": "error", "id": op["id"], "kind": "invalid", "message": str(exc)})

    def _start(self, op: GenerateOp, free: list[Slot], emit: Emit) -> None:
        started = time.perf_counter()
        prompt = self.tokenize(op["prompt"])
        if not prompt:
            prompt = [self.bos_id] if self.bos_id >= 0 else []
        reserve = max(0, int(op.get("reserve") or 0))
        if len(prompt) >= self.num_ctx or len(prompt) + reserve > self.num_ctx:
            needs = f" and its reply needs room for up to {reserve}" if len(prompt) < self.num_ctx else ""
            emit({
                "ev": "error", "id": op["id"], "kind": "context_length",
                "message": f"the prompt is {len(prompt)} tokens{needs}, but the model's context (num_ctx) is "
                           f"{self.num_ctx} tokens; shorten the conversation, ask for fewer output tokens or raise "
                           "num_ctx",
                "prompt_tokens": len(prompt), "n_ctx": self.num_ctx,
            })
            return
        sampler = self._sampler(op.get("sampling") or {}, op.get("constraint"))  # may refuse: before any slot
        slot, common = self._choose_slot(free, prompt)
        slot, common = self._restore_if_better(prompt, slot, common)
        if common >= len(prompt):
            common = len(prompt) - 1  # replay the last token to get fresh logits
        if not L.llama_memory_seq_rm(self.memory, slot.seq_id, common, -1):
            L.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
            common = 0
        slot.tokens = slot.tokens[:common]
        slot.busy = True
        slot.last_used = time.monotonic()
        room = self.num_ctx - len(prompt)
        requested = op.get("max_tokens")
        max_tokens = room if requested is None or requested < 0 else min(requested, room)
        request = Request(
            id=op["id"], slot=slot, session=op.get("session"), prompt=prompt, next_prompt=common, cached=common,
            max_tokens=max_tokens,
            sampler=sampler,
            matcher=StopMatcher(op.get("stop") or []), ignore_eos=bool(op.get("ignore_eos")), started=started,
        )
        request.snapshot_at = self._system_boundary(op.get("system_prefix"), prompt, common)
        self.requests[request.id] = request
        emit({"ev": "prompt", "id": request.id, "prompt_tokens": len(prompt), "cached_tokens": common})
        if max_tokens <= 0:
            self._finish(request, "length", emit)

    def _restore_if_better(self, prompt: list[int], slot: Slot, live_common: int) -> tuple[Slot, int]:
        """Load the longest cached prefix from RAM/disk into the chosen slot when it beats its live KV."""
        if self.cache is None:
            return slot, live_common
        entry, common = self.cache.best_prefix(prompt)
        if entry is None or common < MIN_TOKENS or common <= live_common + 16:
            self.cache.count("misses")
            return slot, live_common
        try:
            payload = self.cache.load(entry)
        except CorruptEntry:
            return slot, live_common
        L.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
        buffer = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
        if L.llama_state_seq_set_data(self.ctx, buffer, len(payload), slot.seq_id) == 0:
            log.warning("llama.cpp refused cache entry %s; recomputing", entry.id)
            L.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
            slot.tokens = []
            self.cache.remove(entry.id)
            return slot, 0
        slot.tokens = list(entry.tokens)
        self.cache.count("hits")
        self.cache.count("tokens_restored", common)
        return slot, common

    def _system_boundary(self, prefix_text: str | None, prompt: list[int], common: int) -> int | None:
        """Where the system-and-tools segment ends, when prefill will cross it and it is not stored yet."""
        if self.cache is None or not prefix_text:
            return None
        prefix = self.tokenize(prefix_text)
        boundary = len(prefix)
        if boundary < MIN_TOKENS or boundary <= common or boundary >= len(prompt) - 1:
            return None
        if prompt[:boundary] != prefix or self.cache.has(prefix):
            return None
        return boundary

    def _sequence_state(self, seq_id: int) -> bytes:
        """One sequence's serialized KV state (empty if llama.cpp could not write it)."""
        size = L.llama_state_seq_get_size(self.ctx, seq_id)
        buffer = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self.ctx, buffer, size, seq_id)
        return ctypes.string_at(buffer, written) if written else b""

    def _save(self, request: Request) -> None:
        """Snapshot the sequence's KV state and queue it for the disk (after the response is done)."""
        slot = request.slot
        if self.cache is None or len(slot.tokens) < MIN_TOKENS:
            return
        state = self._sequence_state(slot.seq_id)
        if state:
            self.cache.save_async(list(slot.tokens), state, request.session)

    def _snapshot_system(self, request: Request) -> None:
        request.snapshot_at = None
        slot = request.slot
        if self.cache is None:
            return
        state = self._sequence_state(slot.seq_id)
        if state:
            self.cache.save_async(list(slot.tokens), state, None, kind="system")

    def _choose_slot(self, free: list[Slot], prompt: list[int]) -> tuple[Slot, int]:
        """The slot for a prompt, and how many of its tokens it already holds.

        With a cache, a slot is reused only when all it holds is a prefix of the prompt (the same
        conversation continuing, or an empty slot), so another session's live state is never trimmed;
        otherwise the least recently used slot is taken (its state was saved after its last request).
        Without a cache, the slot sharing the longest prefix wins.
        """
        scored = [(slot, _common_prefix(slot.tokens, prompt)) for slot in free]
        if self.cache is not None:
            keeping = [(slot, common) for slot, common in scored if common == len(slot.tokens)]
            if keeping:
                return max(keeping, key=lambda item: (item[1], -item[0].last_used))
            lru = min(free, key=lambda slot: slot.last_used)
            return lru, _common_prefix(lru.tokens, prompt)
        return max(scored, key=lambda item: (item[1], -item[0].last_used))

    def _grammar_sampler(self, constraint: Constraint | None) -> Any:
        if constraint and constraint.get("lazy") and len(self.tokenize_special(HERMES_TRIGGER)) != 1:
            return None  # see below: a lazy grammar needs its trigger to be one token
        grammar = grammar_for(constraint)
        if grammar is None:
            return None
        if grammar.trigger:
            # Only a trigger that is one token is safe: triggered by text, llama.cpp feeds the grammar the whole
            # last piece, and a piece running past the trigger ("<tool_call" + "></") makes it throw a C++
            # exception that aborts the worker. Models without such a token get their calls parsed, unconstrained.
            trigger = self.tokenize_special(grammar.trigger)
            tokens = (L.llama_token * 1)(trigger[0])
            sampler = L.llama_sampler_init_grammar_lazy_patterns(
                self.vocab, grammar.text.encode(), b"root", None, 0, tokens, 1)
        else:
            sampler = L.llama_sampler_init_grammar(self.vocab, grammar.text.encode(), b"root")
        if not sampler:
            raise GrammarError("the grammar built for this request could not be parsed by llama.cpp")
        return sampler

    def _sampler(self, sampling: Sampling, constraint: Constraint | None) -> Any:
        options: dict[str, Any] = {**DEFAULT_SAMPLING, **{k: v for k, v in sampling.items() if v is not None}}
        grammar_sampler = self._grammar_sampler(constraint)
        params = L.llama_sampler_chain_default_params()
        chain = L.llama_sampler_chain_init(params)
        if grammar_sampler:
            L.llama_sampler_chain_add(chain, grammar_sampler)
        if (options["repeat_penalty"] != 1.0 or options["presence_penalty"] or options["frequency_penalty"]):
            last_n = int(options["repeat_last_n"])
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(
                int(L.llama_vocab_n_tokens(self.vocab)), self.num_ctx if last_n < 0 else min(last_n, self.num_ctx),
                float(options["repeat_penalty"]),
                float(options["frequency_penalty"]), float(options["presence_penalty"])))
        temperature = float(options["temperature"])
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if int(options["top_k"]) > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(int(options["top_k"])))
        if float(options["typical_p"]) < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_typical(float(options["typical_p"]), 1))
        if float(options["top_p"]) < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(options["top_p"]), 1))
        if float(options["min_p"]) > 0.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(float(options["min_p"]), 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
        seed = options.get("seed")
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(
            int(seed) & 0xFFFFFFFF if seed is not None else L.LLAMA_DEFAULT_SEED))
        return chain

    def _step(self, emit: Emit) -> None:
        """Decode one batch: every generating request's next token, then prompt chunks."""
        batch = self.batch
        entries: list[tuple[Request, bool]] = []  # (request, wants logits) per batch position
        n = 0
        for request in self.requests.values():
            if request.pending_token is not None:
                self._put(n, request.pending_token, len(request.slot.tokens), request.slot.seq_id, True)
                entries.append((request, True))
                n += 1
        for request in self.requests.values():
            if request.pending_token is not None or request.next_prompt >= len(request.prompt):
                continue
            room = self.n_batch - n
            if room <= 0:
                break
            start = request.next_prompt
            last_index = len(request.prompt) - 1
            # The last prompt token always goes in a step of its own, so its logits come from the same
            # kernel path whether the prefix was cached or not: greedy output does not depend on caching.
            end = last_index if start < last_index else len(request.prompt)
            if request.snapshot_at is not None and start < request.snapshot_at:
                end = min(end, request.snapshot_at)  # stop at the system segment's end to snapshot it
            chunk = request.prompt[start:min(start + room, end)]
            base = len(request.slot.tokens)
            for offset, token in enumerate(chunk):
                last = start + offset == len(request.prompt) - 1
                self._put(n, token, base + offset, request.slot.seq_id, last)
                entries.append((request, last))
                n += 1
        batch.n_tokens = n
        status = L.llama_decode(self.ctx, batch)
        if status == 1 and self._evict_idle():
            status = L.llama_decode(self.ctx, batch)
        if status != 0:
            self._fail_batch(entries, status, emit)
            return
        now = time.perf_counter()
        for index, (request, wants_logits) in enumerate(entries):
            if request.id not in self.requests:
                continue
            if request.pending_token is not None and wants_logits:
                request.slot.tokens.append(request.pending_token)
                request.pending_token = None
            elif request.next_prompt < len(request.prompt):
                request.slot.tokens.append(request.prompt[request.next_prompt])
                request.next_prompt += 1
                if request.next_prompt == request.snapshot_at:
                    self._snapshot_system(request)
                if not wants_logits:
                    continue
                request.prompt_done = now
            else:
                continue
            token = int(L.llama_sampler_sample(request.sampler, self.ctx, index))
            self._accept(request, token, emit)

    def _put(self, index: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        batch = self.batch
        batch.token[index] = token
        batch.pos[index] = pos
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = seq_id
        batch.logits[index] = logits

    def _accept(self, request: Request, token: int, emit: Emit) -> None:
        if not request.ignore_eos and L.llama_vocab_is_eog(self.vocab, token):
            self._finish(request, "stop", emit)
            return
        request.generated += 1
        request.unsent += request.matcher.feed(self._piece_bytes(token))
        now = time.perf_counter()
        if request.unsent and (not request.sent_at or now - request.sent_at >= FLUSH_INTERVAL):
            emit({"ev": "text", "id": request.id, "text": request.unsent})
            request.unsent, request.sent_at = "", now
        if request.matcher.stopped:
            self._finish(request, "stop", emit)
        elif request.generated >= request.max_tokens or len(request.slot.tokens) + 1 >= self.num_ctx:
            self._finish(request, "length", emit)
        else:
            request.pending_token = token

    def _finish(self, request: Request, reason: str, emit: Emit) -> None:
        tail = request.unsent + request.matcher.flush()
        if tail and reason != "cancelled":
            emit({"ev": "text", "id": request.id, "text": tail})
        now = time.perf_counter()
        prompt_done = request.prompt_done or now
        emit({
            "ev": "done", "id": request.id, "finish_reason": reason, "stop_sequence": request.matcher.matched,
            "usage": {
                "prompt_tokens": len(request.prompt), "completion_tokens": request.generated,
                "cached_tokens": request.cached,
                "prompt_ms": (prompt_done - request.started) * 1000.0,
                "decode_ms": (now - prompt_done) * 1000.0,
            },
        })
        if reason != "cancelled":
            self._save(request)
        self._release(request)
        if self.cache is not None:
            emit({"ev": "stats", "cache": self.cache.stats_snapshot()})

    def _release(self, request: Request) -> None:
        L.llama_sampler_free(request.sampler)
        request.slot.busy = False
        request.slot.last_used = time.monotonic()
        del self.requests[request.id]

    def _evict_idle(self) -> bool:
        """Free the KV cells of idle sequences (least recently used first) so a batch fits."""
        idle = sorted((slot for slot in self.slots if not slot.busy and slot.tokens), key=lambda s: s.last_used)
        for slot in idle:
            L.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
            slot.tokens = []
        return bool(idle)

    def _fail_batch(self, entries: list[tuple[Request, bool]], status: int, emit: Emit) -> None:
        message = (
            "the KV cache is full: too many long sequences at once; lower LOCALAI_NUM_PARALLEL or num_ctx"
            if status == 1 else f"llama_decode failed with status {status}"
        )
        for request in {id(r): r for r, _ in entries}.values():
            if request.id in self.requests:
                L.llama_memory_seq_rm(self.memory, request.slot.seq_id, -1, -1)
                request.slot.tokens = []
                emit({"ev": "error", "id": request.id, "kind": "engine", "message": message})
                self._release(request)


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index
