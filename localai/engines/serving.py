"""The engine-neutral serving loop inside a worker: admission, continuous batching, the prompt cache, stops, usage.

Requests are decoded together: every step holds the next token of each generating request plus prompt chunks of
the requests still prefilling. Each sequence keeps the tokens its KV holds, so a request that shares a prefix
with a sequence (or with a cached state on RAM or disk) evaluates only the rest. The engine behind it
(``engines/engine.py``) evaluates, samples and moves KV state; everything else is here, the same for every engine.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path

from localai.engines.engine import BatchItem, DecodeFailed, Engine, LoadOptions
from localai.engines.grammars import GrammarError
from localai.engines.sequences import Request, Slot
from localai.engines.slot_cache import SlotCache
from localai.engines.speculative import Drafter
from localai.engines.token_ids import ForeignTokens, check_own
from localai.engines.token_logprobs import TokenLogprobs
from localai.promptcache.blocks import fingerprint
from localai.promptcache.store import PromptStore
from localai.protocol import (
    CacheSource,
    DoneFrame,
    EmbeddingsFrame,
    EmbedOp,
    ErrorFrame,
    ErrorKind,
    GenerateOp,
    ModelInfo,
    PromptFrame,
    RanksFrame,
    RerankOp,
    StatsFrame,
    TextFrame,
    TokensFrame,
    Usage,
    WorkerFrame,
    WorkOp,
)
from localai.schema import FinishReason, parent_session
from localai.text import StopMatcher, common_prefix_length

log = logging.getLogger("localai.worker")
Emit = Callable[[WorkerFrame], None]

# Text is sent to the daemon at most this often (the first token at once): every frame wakes the daemon
# and the client, which on a small CPU preempts the engine's compute threads mid-token. A token is held back only
# when the next one is due within the interval: with steps as long as the interval (4 streams on a CPU) every token
# goes at once, instead of every so often two at once a step late (a 52 ms p99 gap at 26 ms a step).
FLUSH_INTERVAL = 0.025
FINAL_FRAMES = frozenset({"done", "error", "tokens", "embeddings", "ranks"})  # an op's last frame
# A prompt of more characters than this many a context token is first tokenized in part, that many characters a token:
# when that part alone is over the context, the prompt is refused with its length estimated from it (fitting cuts it
# and tries again), not tokenized whole on the loop, which the other sequences' steps wait for (a 4 M-character
# document, the most a request may bring: about 1 s of llama.cpp's tokenizer here; its first 64 k characters: 20 ms).
SAMPLE_CHARS_PER_TOKEN = 8
# A prefilling request that got no chunk for this many steps goes before the shorter prompts (none starves)
STARVED_STEPS = 16


class Serving:
    """Serves one engine over the worker protocol."""

    def __init__(self, engine: Engine, options: LoadOptions) -> None:
        self.engine = engine
        self.slots = [Slot(seq=index) for index in range(engine.n_seq)]
        self.requests: dict[str, Request] = {}
        self.waiting: list[GenerateOp] = []
        self.step_seconds = 0.0  # a decode step's wall time, smoothed: when the next token is due
        self.steps = 0  # steps run (the prefilling request that waited longest for a chunk goes first)
        # prompt tokens a request evaluates a step: the engine's choice, leaving room for every sequence's next token
        self.prefill_chunk = max(1, min(engine.prefill_chunk, engine.n_batch - engine.n_seq))
        self.cache: PromptStore | None = None
        if options.cache_dir and options.cache_max_bytes > 0:
            self.cache = PromptStore(Path(options.cache_dir), fingerprint(engine.fingerprint_parts()), engine,
                                     max_bytes=options.cache_max_bytes, ram_bytes=options.cache_ram_bytes,
                                     trims=engine.can_trim)
        self.slot_cache = SlotCache(engine, self.cache, self.slots)  # what a slot keeps, restores, saves
        self.holding_media: set[str] = set()  # ops whose images the engine keeps until their final frame

    def info(self) -> ModelInfo:
        return self.engine.info()

    # -- the loop --------------------------------------------------------------------------------

    def serve(self, inbox: queue.Queue[WorkOp | None], emit: Emit) -> None:
        """Run until ``None`` arrives in the inbox: admit, batch, decode, sample, emit. Replies being prefilled
        (warm requests) are finished and saved first; other requests are cancelled."""
        if self.cache is not None:  # the cache's first failed write, for the daemon's log (from the writer thread)
            send = emit
            self.cache.on_warning = lambda message: send(StatsFrame(ev="stats", cache={}, warning=message))
        emit = self._releasing_media(emit)
        stopping = False
        while True:
            if stopping and not self.requests and not self.waiting:
                for slot in self.slots:  # replies whose follow-ups will not come now: saved as generated
                    self.slot_cache.save_deferred(slot)
                if self.cache is not None:
                    self.cache.close()
                return
            block = not self.requests and not self.waiting and not stopping
            try:
                while not stopping:
                    op = inbox.get(block=block)
                    block = False
                    if op is None:
                        stopping = True
                        for item in [item for item in self.waiting if not item.get("warm")]:
                            self._drop_waiting(item["id"], emit)
                        for request in [r for r in self.requests.values() if not r.warm]:
                            self._finish(request, "cancelled", emit)
                        break
                    try:
                        self._handle(op, emit)
                    except Exception as exc:  # one bad op gets its error; the engine keeps serving the rest
                        log.exception("op %s %s failed", op["op"], op["id"])
                        emit(ErrorFrame(ev="error", id=op["id"], kind="invalid", message=str(exc)[:2000]))
            except queue.Empty:
                pass
            self._admit(emit)
            if self.requests:
                self._step(emit)

    def _releasing_media(self, emit: Emit) -> Emit:
        """``emit``, which also lets the engine forget an op's images once its final frame is out."""
        release = getattr(self.engine, "release_media", None)

        def emit_and_release(frame: WorkerFrame) -> None:
            emit(frame)
            request_id = frame.get("id")
            if frame["ev"] in FINAL_FRAMES and request_id in self.holding_media and release is not None:
                self.holding_media.discard(str(request_id))
                release(request_id)

        return emit_and_release

    def _handle(self, op: WorkOp, emit: Emit) -> None:
        if (op["op"] == "generate" or op["op"] == "tokenize") and op.get("media"):
            # images a vision projector reads, named by the prompt's marks (engines/llama_vision): kept for this op
            # until its final frame, however many it or the ops queued before it carry
            remember = getattr(self.engine, "remember_media", None)
            if remember is None:
                raise ValueError(f"the {self.engine.backend} engine reads no images")
            remember(op.get("media"), op["id"])
            self.holding_media.add(op["id"])
        if op["op"] == "generate":
            self.waiting.append(op)
        elif op["op"] == "cancel":
            request = self.requests.get(op["id"])
            if request is not None:
                self._finish(request, "cancelled", emit)
            else:
                self._drop_waiting(op["id"], emit)
        elif op["op"] == "tokenize":
            tokens = self.engine.tokenize(op["text"])
            answer = TokensFrame(ev="tokens", id=op["id"], count=len(tokens))
            if not op.get("count_only"):
                answer["tokens"] = tokens
            emit(answer)
        elif op["op"] == "embed":
            self._embed(op, emit)
        elif op["op"] == "rerank":
            self._rerank(op, emit)

    def _rerank(self, op: RerankOp, emit: Emit) -> None:
        try:
            scores, counted = self.engine.rerank(op["query"], op["documents"], truncate=op["truncate"])
        except ValueError as exc:  # a model that is not a reranker (RerankUnsupported), a document over the context
            emit(ErrorFrame(ev="error", id=op["id"], kind="invalid", message=str(exc)))
            return
        emit(RanksFrame(ev="ranks", id=op["id"], scores=scores, prompt_tokens=counted))

    def _embed(self, op: EmbedOp, emit: Emit) -> None:
        engine = self.engine
        try:
            tokens = op.get("tokens")
            if tokens is not None:
                check_own(tokens, engine.info()["n_vocab"], engine.tokenize, engine.token_bytes)
            else:
                tokens = [engine.tokenize(text) for text in op["texts"]]
            vectors, counted = engine.embed(tokens, truncate=op["truncate"])
        except ValueError as exc:
            kind: ErrorKind = "foreign_token_ids" if isinstance(exc, ForeignTokens) else "invalid"
            emit(ErrorFrame(ev="error", id=op["id"], kind=kind, message=str(exc)))
            return
        emit(EmbeddingsFrame(ev="embeddings", id=op["id"], vectors=vectors, prompt_tokens=counted))

    def _drop_waiting(self, request_id: str, emit: Emit) -> None:
        """A request cancelled before it started (waiting for a slot, held behind a warm prefill, or the worker
        stopping): its done frame, like every op taken, so the daemon's handle stops waiting for one."""
        if not any(item["id"] == request_id for item in self.waiting):
            return  # ended already: its final frame is out
        self.waiting = [item for item in self.waiting if item["id"] != request_id]
        emit(DoneFrame(ev="done", id=request_id, finish_reason="cancelled", stop_sequence=None,
                       usage=Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0, prompt_ms=0.0,
                                   decode_ms=0.0)))

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, emit: Emit) -> None:
        held = []
        while self.waiting:
            free = [slot for slot in self.slots if not slot.busy]
            if not free:
                break
            op = self.waiting.pop(0)
            if not op.get("warm") and any(r.warm and _continues(op, r) for r in self.requests.values()):
                held.append(op)  # its conversation's reply is being prefilled: start from that, moments later
                continue
            try:
                self._start(op, free, emit)
            except GrammarError as exc:
                emit(ErrorFrame(ev="error", id=op["id"], kind="constraint", message=str(exc)))
            except Exception as exc:  # a bad request must not take the worker down
                log.exception("request %s failed to start", op.get("id"))
                emit(ErrorFrame(ev="error", id=op["id"], kind="invalid", message=str(exc)))
        self.waiting[:0] = held

    def _start(self, op: GenerateOp, free: list[Slot], emit: Emit) -> None:
        engine = self.engine
        started = time.perf_counter()
        too_long = estimated_length_if_over_context(engine.tokenize, op["prompt"], engine.n_ctx)
        prompt = [] if too_long else engine.tokenize(op["prompt"])
        if not prompt and not too_long:
            raise ValueError("the prompt is empty")
        reserve = max(0, int(op.get("reserve") or 0))
        if too_long or len(prompt) >= engine.n_ctx or len(prompt) + reserve > engine.n_ctx:
            length = f"about {too_long}" if too_long else str(len(prompt))
            needs = f" and its reply needs room for up to {reserve}" if len(prompt) < engine.n_ctx else ""
            emit(ErrorFrame(
                ev="error", id=op["id"], kind="context_length",
                message=f"the prompt is {length} tokens{needs}, but the model's context (num_ctx) is "
                        f"{engine.n_ctx} tokens; shorten the conversation, ask for fewer output tokens or raise "
                        "num_ctx",
                prompt_tokens=too_long or len(prompt), n_ctx=engine.n_ctx,
            ))
            return
        warm = bool(op.get("warm"))
        session = op.get("session")
        sampler = engine.new_sampler(op.get("sampling") or {}, op.get("constraint"))  # may refuse: before any slot
        partition = op.get("cache_partition") or ""
        slot, common = self._choose_slot(free, prompt, warm=warm, session=session, partition=partition)
        if slot.deferred is not None and (warm or common < len(slot.tokens)):
            if not warm:  # its reply's follow-up never came, and its state is about to go: keep it
                self.slot_cache.save_deferred(slot)
            slot.deferred = None
        limit = len(prompt) if warm else len(prompt) - 1  # else the last token is replayed for fresh logits
        common = self.slot_cache.reachable(slot, min(common, limit))
        source = "live" if common else "miss"
        slot, common, restored = self.slot_cache.restore_if_better(prompt, slot, common, limit, partition)
        if restored is not None:
            source = restored.tier
        forked = self.slot_cache.fork_if_better(prompt, slot, common, limit, partition, session)  # a live one
        if forked > common:
            common, source, restored = forked, "live", None
        common = self.slot_cache.cut(slot, min(common, limit))
        slot.last_used, slot.partition = time.monotonic(), partition
        slot.session = session
        room = engine.n_ctx - len(prompt)
        requested = op.get("max_tokens")
        max_tokens = room if requested is None or requested < 0 else min(requested, room)
        request = Request(
            id=op["id"], slot=slot, session=session, prompt=prompt, next_prompt=common, cached=common,
            max_tokens=max_tokens, sampler=sampler, matcher=StopMatcher(op.get("stop") or []),
            ignore_eos=bool(op.get("ignore_eos")), started=started, warm=warm,
            follow_up=bool(op.get("follow_up")) and self.cache is not None, source=source if common else "miss",
            restored=restored.n_tokens if restored else 0, restore_ms=restored.seconds * 1000 if restored else 0.0,
            pin_ttl=float(op.get("pin_ttl") or 0.0), text=op["prompt"] if warm else "", chunk_step=self.steps,
            logprobs=None if warm else TokenLogprobs.asked(op.get("logprobs")),
        )
        prefix_text = op.get("system_prefix")
        system = engine.tokenize(prefix_text) if self.cache is not None and prefix_text else []
        system = prompt[:common_prefix_length(system, prompt)]  # its last tokens may merge with what follows
        request.snapshot_at = self.slot_cache.system_boundary(system, prompt, common, partition)
        if warm and engine.checkpoints:
            request.stable = engine.stable_prefix(op["prompt"], prompt)
        request.checkpoint_at = self.slot_cache.next_checkpoint(request)
        speculative = op.get("speculative")  # None: where drafts change nothing (engine.drafts_exact)
        if engine.can_draft and not warm and (speculative or (speculative is None and engine.drafts_exact)):
            request.drafter = Drafter()
            request.drafter.extend(prompt)
        if request.pin_ttl and request.snapshot_at is None and self.cache is not None and system:
            with contextlib.suppress(OSError):  # a pin that cannot be written leaves the entry to the LRU
                self.cache.pin_prefix(system, request.pin_ttl, partition)  # already stored: keep it
        # Busy only once nothing more can fail: a slot marked busy with no request behind it is never freed, and
        # with requests waiting the loop would spin on it.
        slot.busy = True
        self.requests[request.id] = request
        emit(PromptFrame(ev="prompt", id=request.id, prompt_tokens=len(prompt), cached_tokens=common,
                         cache=CacheSource(source=request.source, restored=request.restored,
                                           restore_ms=round(request.restore_ms, 2))))
        if warm and request.next_prompt >= len(prompt):
            self._finish(request, "stop", emit)
        elif max_tokens <= 0 and not warm:
            self._finish(request, "length", emit)

    def _choose_slot(self, free: list[Slot], prompt: list[int], *, warm: bool = False,
                     session: str | None = None, partition: str = "") -> tuple[Slot, int]:
        """The slot for a prompt, and how many of its tokens it already holds.

        With a cache, a slot is reused only when all it holds is a prefix of the prompt (the same
        conversation continuing, or an empty slot) or it holds the same session (a retried or edited turn),
        so another session's live state is never trimmed; otherwise the least recently used slot is taken (its
        state was saved after its last request). Without a cache, the slot sharing the longest prefix wins.
        """
        scored = [(slot, common_prefix_length(slot.tokens, prompt) if slot.partition == partition else 0)
                  for slot in free]
        if warm:  # the conversation's own slot: its reply's tokens give way to the reply as the template renders it
            return max(scored, key=lambda item: (item[1], -item[0].last_used))
        if self.cache is not None:
            keeping = [(slot, common) for slot, common in scored
                       if common == len(slot.tokens) or (session is not None and slot.session == session
                                                               and slot.partition == partition)]
            parent = parent_session(session)
            if parent is not None and len(free) > 1:
                # a sub-agent or side request whose prompt extends its parent's never takes the parent's slot while
                # another is free: it copies the shared prefix (_fork_if_better), the parent's next turn stays live
                keeping = [(slot, common) for slot, common in keeping if slot.session != parent]
                free = [slot for slot in free if slot.session != parent or slot.partition != partition]
            if keeping:
                return max(keeping, key=lambda item: (item[1], -item[0].last_used))
            lru = min(free, key=lambda slot: slot.last_used)
            return lru, next(common for slot, common in scored if slot is lru)
        return max(scored, key=lambda item: (item[1], -item[0].last_used))

    def _step(self, emit: Emit) -> None:
        """Decode one batch: every generating request's next token, then prompt chunks."""
        started = time.perf_counter()
        self.steps += 1
        self._evaluate(emit)
        self.step_seconds += 0.25 * (time.perf_counter() - started - self.step_seconds)

    def _evaluate(self, emit: Emit) -> None:
        batch: list[BatchItem] = []
        owners: list[Request] = []
        drafts: set[int] = set()  # rows of guessed tokens: verified with their request's pending token
        prefilling = [r for r in self.requests.values() if r.pending_token is None and r.next_prompt < len(r.prompt)]
        keep = self.prefill_chunk if prefilling else 0  # drafts leave room for a prompt chunk
        for request in self.requests.values():
            if request.pending_token is not None:
                at = len(request.slot.tokens)
                batch.append(BatchItem(request.slot.seq, request.pending_token, at, True))
                owners.append(request)
                request.draft = self._draft(request, self.engine.n_batch - len(batch) - keep)
                for offset, token in enumerate(request.draft, start=1):
                    drafts.add(len(batch))
                    batch.append(BatchItem(request.slot.seq, token, at + offset, True))
                    owners.append(request)
        # A step evaluates one chunk of the engine's prefill_chunk tokens (fewer only where a prompt, system segment
        # or next checkpoint ends), of the prompt with the fewest tokens left: a long prompt delays the others' next
        # token by one chunk; prompts arriving together (sub-agents' cold prompts) finish one after another, as
        # llama-server's slots do, instead of all at the end, a short one never waits behind a long one, and a
        # request left without a chunk for STARVED_STEPS steps goes first. A request's chunks are the same whatever
        # runs beside it (the kernels' arithmetic depends on a chunk's size, so greedy replies do not depend on
        # what else the daemon serves). Another chunk joins the step only where it fits in what is left, and a
        # prompt's last token (in a step of its own) always does.
        full = budget = min(self.engine.n_batch - len(batch), self.prefill_chunk)
        order = sorted(prefilling, key=lambda r: (self.steps - r.chunk_step < STARVED_STEPS,
                                                  len(r.prompt) - r.next_prompt, r.started))
        for request in order:
            start = request.next_prompt
            last_index = len(request.prompt) - 1
            # The last prompt token always goes in a step of its own, so its logits come from the same
            # kernel path whether the prefix was cached or not: greedy output does not depend on caching.
            end = last_index if start < last_index else len(request.prompt)
            if request.snapshot_at is not None and start < request.snapshot_at:
                end = min(end, request.snapshot_at)  # stop at the system segment's end to snapshot it
            if request.checkpoint_at is not None and start < request.checkpoint_at:
                end = min(end, request.checkpoint_at)  # stop where a checkpoint is taken
            chunk = request.prompt[start:self._unbroken(request, start, min(start + self.prefill_chunk, end))]
            if len(chunk) > self.engine.n_batch - len(batch):
                continue  # a later step (never a smaller chunk: that would change its arithmetic)
            if start != last_index:  # a last token rides free
                # a run evaluated in one pass (an image) may be longer than a chunk: then the step's only one
                if len(chunk) > budget and budget < full:
                    continue
                budget = max(0, budget - len(chunk))
            request.chunk_step = self.steps
            base = len(request.slot.tokens)
            for offset, token in enumerate(chunk):
                wants = start + offset == last_index and not request.warm
                batch.append(BatchItem(request.slot.seq, token, base + offset, wants))
                owners.append(request)
        if any(a.seq > b.seq for a, b in itertools.pairwise(batch)):
            batch, owners, drafts = in_sequence_order(batch, owners, drafts)
        try:
            try:
                self.engine.decode(batch)
            except DecodeFailed as exc:
                if not (exc.no_room and self._evict_idle()):
                    raise
                self.engine.decode(batch)
        except DecodeFailed as exc:
            self._fail_batch(owners, str(exc), emit)
            return
        now = time.perf_counter()
        for row, (item, request) in enumerate(zip(batch, owners, strict=True)):
            if request.id not in self.requests or row in drafts:
                continue
            if request.pending_token is not None and item.logits:
                request.slot.tokens.append(request.pending_token)
                request.pending_token = None
                if request.draft:
                    self._verify(request, row, emit)
                    continue
            elif request.next_prompt < len(request.prompt):
                request.slot.tokens.append(request.prompt[request.next_prompt])
                request.next_prompt += 1
                if request.next_prompt == request.snapshot_at:
                    self.slot_cache.snapshot_system(request)
                if request.next_prompt == request.checkpoint_at:
                    self.slot_cache.take_checkpoint(request)
                if request.warm and request.next_prompt >= len(request.prompt):
                    self._finish(request, "stop", emit)
                    continue
                if not item.logits:
                    continue
                request.prompt_done = now
            else:
                continue
            self._accept(request, self.engine.sample(request.sampler, row), row, emit)

    def _unbroken(self, request: Request, start: int, stop: int) -> int:
        """Where a prompt chunk from ``start`` ends so that no run the engine must evaluate in one pass (an image
        attended non-causally: Gemma 3) is split: before the run, or, when the chunk begins at it, after it (a
        checkpoint or the system segment's snapshot inside the run moves to its end or is skipped)."""
        span = self.engine.span_end(request.prompt, stop)
        if span is None:
            return stop
        first, end = span
        if first > start:
            return first
        if request.checkpoint_at is not None and start < request.checkpoint_at < end:
            request.checkpoint_at = end
        if request.snapshot_at is not None and start < request.snapshot_at < end:
            request.snapshot_at = None
        return end

    def _draft(self, request: Request, room: int) -> list[int]:
        """Tokens guessed from the request's context to verify with its pending token, within the batch, the
        context and the tokens it may still generate."""
        if request.drafter is None:
            return []
        room = min(room, self.engine.n_ctx - len(request.slot.tokens) - 2,
                   request.max_tokens - request.generated - 1)
        return request.drafter.draft(room)

    def _verify(self, request: Request, row: int, emit: Emit) -> None:
        """Sample the pending token's row and each draft row after it while the sample equals the draft; keep the
        matching drafts' KV, drop the rest, and take the samples as the request's next tokens."""
        draft, request.draft = request.draft, []
        outputs: list[int] = []
        for offset in range(len(draft) + 1):
            token = self.engine.sample(request.sampler, row + offset)
            outputs.append(token)
            if offset == len(draft) or token != draft[offset]:
                break
        kept = len(outputs) - 1  # drafts the sampler agreed with: their KV is right
        assert request.drafter is not None
        request.drafter.record(len(draft), kept)
        slot = request.slot
        if not self.engine.seq_keep(slot.seq, len(slot.tokens) + kept):  # no rejected token's KV stays
            self._fail_batch([request], "the engine could not drop a rejected draft from its KV cache", emit)
            return
        for index, token in enumerate(outputs):
            self._accept(request, token, row + index, emit)
            if request.id not in self.requests:
                return  # finished: its KV was cut back to what it keeps
            if index < kept:  # evaluated already, as a draft
                slot.tokens.append(token)
                request.pending_token = None

    def _accept(self, request: Request, token: int, row: int, emit: Emit) -> None:
        """Take ``token``, sampled from batch position ``row``, as the request's next."""
        if not request.ignore_eos and self.engine.is_end(token):
            self._finish(request, "stop", emit)
            return
        request.generated += 1
        if request.logprobs is not None:
            request.logprobs.add(self.engine, row, token)
        request.unsent += request.matcher.feed(self.engine.token_bytes(token))
        now = time.perf_counter()
        if request.unsent and (not request.sent_at or now - request.sent_at + self.step_seconds >= FLUSH_INTERVAL):
            emit(text_frame(request, request.unsent))
            request.unsent, request.sent_at = "", now
        if request.matcher.stopped:
            self._finish(request, "stop", emit)
        elif request.generated >= request.max_tokens or len(request.slot.tokens) + 1 >= self.engine.n_ctx:
            self._finish(request, "length", emit)
        else:
            request.pending_token = token
            if request.drafter is not None:
                request.drafter.extend([token])

    def _finish(self, request: Request, reason: FinishReason, emit: Emit) -> None:
        tail = request.unsent + request.matcher.flush()
        if reason != "cancelled":
            frame = text_frame(request, tail, final=True)
            if tail or frame.get("logprobs"):
                emit(frame)
        now = time.perf_counter()
        prompt_done = request.prompt_done or now
        drafter = request.drafter
        if drafter is not None and drafter.drafted:
            self.engine.seq_keep(request.slot.seq, len(request.slot.tokens))  # drafts past where it stopped
        emit(DoneFrame(
            ev="done", id=request.id, finish_reason=reason, stop_sequence=request.matcher.matched,
            usage=Usage(
                prompt_tokens=len(request.prompt), completion_tokens=request.generated,
                cached_tokens=request.cached,
                prompt_ms=(prompt_done - request.started) * 1000.0,
                decode_ms=(now - prompt_done) * 1000.0,
                drafted_tokens=drafter.drafted if drafter else 0,
                accepted_tokens=drafter.accepted if drafter else 0,
            ),
        ))
        if reason != "cancelled" and not request.follow_up:
            self.slot_cache.save(request)
        elif reason != "cancelled":
            request.slot.deferred = request
        self._release(request)
        if self.cache is not None:
            emit(StatsFrame(ev="stats", cache={**self.cache.stats_snapshot(),
                                               "images_encoded": self.engine.images_encoded}))

    def _release(self, request: Request) -> None:
        self.engine.free_sampler(request.sampler)
        request.slot.busy = False
        request.slot.last_used = time.monotonic()
        del self.requests[request.id]

    def _evict_idle(self) -> bool:
        """Free the KV of idle sequences (least recently used first) so a batch fits."""
        idle = sorted((slot for slot in self.slots if not slot.busy and slot.tokens), key=lambda s: s.last_used)
        for slot in idle:
            self.engine.seq_clear(slot.seq)
            slot.tokens, slot.checkpoints = [], []
        return bool(idle)

    def _fail_batch(self, owners: list[Request], message: str, emit: Emit) -> None:
        for request in {id(r): r for r in owners}.values():
            if request.id in self.requests:
                self.engine.seq_clear(request.slot.seq)
                request.slot.tokens, request.slot.checkpoints = [], []
                emit(ErrorFrame(ev="error", id=request.id, kind="engine", message=message))
                self._release(request)


def text_frame(request: Request, text: str, *, final: bool = False) -> TextFrame:
    """The frame sending ``text``, the next part of the request's reply, with the logprobs it completes."""
    frame = TextFrame(ev="text", id=request.id, text=text)
    if request.logprobs is not None:
        frame["logprobs"] = request.logprobs.sent(text, final=final)
    return frame


def _continues(op: GenerateOp, warm: Request) -> bool:
    """Whether ``op`` should wait for the reply ``warm`` is prefilling, to start from it: the same session, or,
    without sessions, a prompt that shares at least half its text with the prefilled one (the next turn, or the same
    prompt sent again). Before, a warm prefill with no session held back every other request."""
    session = op.get("session")
    if (op.get("cache_partition") or "") != warm.slot.partition:
        return False  # another partition's reply: nothing to start from
    if warm.session is not None or session is not None:
        return warm.session == session
    prompt = op["prompt"]
    return warm.text.startswith(prompt[:(len(prompt) + 1) // 2])  # one comparison: this runs every decode step


def estimated_length_if_over_context(tokenize: Callable[[str], list[int]], text: str, n_ctx: int) -> int:
    """The estimated length of a prompt far over the context, from its first characters alone; 0 when it may fit
    (then it is tokenized whole). A prefix's tokens are the whole text's up to the last one (which may merge with what
    follows), so a prefix of more than ``n_ctx`` tokens proves the text is over it."""
    sample = max(65_536, n_ctx * SAMPLE_CHARS_PER_TOKEN)
    if len(text) <= sample:
        return 0
    count = len(tokenize(text[:sample]))
    return count * len(text) // sample if count > n_ctx else 0


def in_sequence_order(batch: list[BatchItem], owners: list[Request], drafts: set[int]
                      ) -> tuple[list[BatchItem], list[Request], set[int]]:
    """The step's rows grouped by sequence, in increasing sequence order, each sequence's rows in their order.

    With a KV stream per sequence llama.cpp cuts a batch into ubatches of consecutive, increasing sequence ids
    (``split_equal``): rows in arrival order (sequences 1, 2, 3, 0) cost a second pass over the weights each step
    (4 streams on smollm2: 31 ms a step instead of 24)."""
    order = sorted(range(len(batch)), key=lambda row: batch[row].seq)  # stable: a request's rows stay in order
    return ([batch[row] for row in order], [owners[row] for row in order],
            {new for new, old in enumerate(order) if old in drafts})
