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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localai.engines.engine import BatchItem, DecodeFailed, Engine, LoadOptions
from localai.engines.grammars import GrammarError
from localai.engines.speculative import Drafter
from localai.engines.token_ids import ForeignTokens, check_own
from localai.engines.token_logprobs import TokenLogprobs
from localai.promptcache.blocks import fingerprint
from localai.promptcache.store import MIN_TOKENS, PromptStore, Restored, StateBytes
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
# An engine whose state cannot be cut by token (recurrent layers, a sliding window) takes a checkpoint every this many
# tokens of a long prefill, beside the one before each prompt's last token. On the hybrid models agents run, 2048
# tokens of the attention layers' KV weigh about one recurrent state (Qwen3-Next: ~25 KB a token against ~75 MB;
# Nemotron-3-Nano: ~6 KB against ~48 MB; gpt-oss's window state is smaller still), so periodic checkpoints at most
# about double a long prefill's bytes, and a prompt that parts from a long prefill recomputes at most 2048 tokens.
CHECKPOINT_EVERY = 2048
# ...and this many tokens before a prompt's end, as llama-server does: the last tokens of a prompt may be tokenized
# otherwise once the next turn extends it, and a reply as the history renders it may part from the generation prompt
# right after the assistant's header (a thinking model's "<think>", a tool call's wrapper).
CHECKPOINT_MARGIN = 4
# A prompt of more characters than this many a context token is first tokenized in part, that many characters a token:
# when that part alone is over the context, the prompt is refused with its length estimated from it (fitting cuts it
# and tries again), not tokenized whole on the loop, which the other sequences' steps wait for (a 4 M-character
# document, the most a request may bring: about 1 s of llama.cpp's tokenizer here; its first 64 k characters: 20 ms).
SAMPLE_CHARS_PER_TOKEN = 8
LIVE_CHECKPOINTS = 4  # kept in RAM per sequence (the newest); older ones are in the prompt cache once saved


@dataclass
class Checkpoint:
    """A sequence's uncuttable state (``Engine.seq_checkpoint``) when it held ``n_tokens`` tokens."""

    n_tokens: int
    data: bytes
    saved: bool = False


@dataclass
class Slot:
    """One engine sequence and the tokens its KV state holds."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False
    session: str | None = None  # whose conversation it holds: its own session may cut it back
    deferred: Request | None = None  # its last request left the save to a follow-up that has not come yet
    checkpoints: list[Checkpoint] = field(default_factory=list)  # where it can return to (checkpoint engines)
    partition: str = ""  # whose KV it holds (a principal, a cache_salt): never reused for another partition


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
    checkpoint_at: int | None = None  # the next prompt length at which to take a checkpoint
    stable: int = 0  # a follow-up's tokens that no next turn tokenizes otherwise: its last checkpoint
    warm: bool = False  # a follow-up prefill (the reply as the next turn renders it): no output, then saved
    follow_up: bool = False  # a warm request follows this one and saves the sequence: do not save it here
    source: str = "miss"  # where the reused prefix came from: live, ram, disk or miss
    restored: int = 0
    restore_ms: float = 0.0
    pin_ttl: float = 0.0  # pin what is saved for this long (Anthropic cache_control), seconds
    text: str = ""  # the prompt as sent (a warm prefill without a session is recognised by it)
    drafter: Drafter | None = None  # speculative decoding from the context (engines/speculative.py)
    draft: list[int] = field(default_factory=list)  # the tokens guessed in this step, after the pending one
    chunk_step: int = 0  # the step that last evaluated a chunk of its prompt
    logprobs: TokenLogprobs | None = None  # the request asked for its tokens' logprobs


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

    def info(self) -> ModelInfo:
        return self.engine.info()

    # -- the loop --------------------------------------------------------------------------------

    def serve(self, inbox: queue.Queue[WorkOp | None], emit: Emit) -> None:
        """Run until ``None`` arrives in the inbox: admit, batch, decode, sample, emit. Replies being prefilled
        (warm requests) are finished and saved first; other requests are cancelled."""
        stopping = False
        while True:
            if stopping and not self.requests and not self.waiting:
                for slot in self.slots:  # replies whose follow-ups will not come now: saved as generated
                    self._save_deferred(slot)
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

    def _handle(self, op: WorkOp, emit: Emit) -> None:
        if (op["op"] == "generate" or op["op"] == "tokenize") and op.get("media"):
            # images a vision projector reads, named by the prompt's marks (engines/llama_vision)
            remember = getattr(self.engine, "remember_media", None)
            if remember is None:
                raise ValueError(f"the {self.engine.backend} engine reads no images")
            remember(op.get("media"))
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
        too_long = over_context(engine.tokenize, op["prompt"], engine.n_ctx)
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
                self._save_deferred(slot)
            slot.deferred = None
        limit = len(prompt) if warm else len(prompt) - 1  # else the last token is replayed for fresh logits
        common = self._reachable(slot, min(common, limit))
        source = "live" if common else "miss"
        slot, common, restored = self._restore_if_better(prompt, slot, common, limit, partition)
        if restored is not None:
            source = restored.tier
        forked = self._fork_if_better(prompt, slot, common, limit, partition, session)  # a busy one's, when longer
        if forked > common:
            common, source, restored = forked, "live", None
        common = self._cut(slot, min(common, limit))
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
            pin_ttl=float(op.get("pin_ttl") or 0.0), text=op["prompt"] if warm else "",
            logprobs=None if warm else TokenLogprobs.asked(op.get("logprobs")),
        )
        prefix_text = op.get("system_prefix")
        system = engine.tokenize(prefix_text) if self.cache is not None and prefix_text else []
        system = prompt[:common_prefix_length(system, prompt)]  # its last tokens may merge with what follows
        request.snapshot_at = self._system_boundary(system, prompt, common, partition)
        if warm and engine.checkpoints:
            request.stable = engine.stable_prefix(op["prompt"], prompt)
        request.checkpoint_at = self._next_checkpoint(request)
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

    # -- the prompt cache ------------------------------------------------------------------------

    def _reachable(self, slot: Slot, wanted: int) -> int:
        """How many of its tokens a slot keeps when cut back to ``wanted``: all of them when nothing is cut or the
        engine cuts anywhere, else the latest checkpoint at or before ``wanted``."""
        if wanted >= len(slot.tokens) or not self.engine.checkpoints:
            return min(wanted, len(slot.tokens))
        point = _checkpoint_before(slot, wanted)
        return point.n_tokens if point else 0

    def _cut(self, slot: Slot, wanted: int) -> int:
        """Cut a slot back to ``wanted`` tokens, or, where its state cannot be cut there, to the latest checkpoint
        before it; a sequence is never continued from a point its state cannot return to. Returns what it keeps."""
        engine = self.engine
        kept = min(wanted, len(slot.tokens))
        if kept < len(slot.tokens) and not engine.seq_keep(slot.seq, kept):
            point = _checkpoint_before(slot, kept)  # only a checkpoint engine's slots have any
            if point is not None and engine.seq_rollback(slot.seq, point.data, point.n_tokens):
                kept = point.n_tokens
            else:
                engine.seq_clear(slot.seq)
                kept = 0
        slot.tokens = slot.tokens[:kept]
        slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= kept]
        return kept

    def _next_checkpoint(self, request: Request) -> int | None:
        """The next prompt length at which a checkpoint engine takes a checkpoint: every ``CHECKPOINT_EVERY``
        tokens, and near the prompt's end: ``CHECKPOINT_MARGIN`` tokens before it (where a retried prompt and a
        reply's follow-up return), or, for a follow-up (a kept reply), after its last token that no next turn
        tokenizes otherwise (where the next turn returns)."""
        if not self.engine.checkpoints:
            return None
        at = request.next_prompt
        targets = [(at // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY]
        if not request.warm:
            targets.append(len(request.prompt) - CHECKPOINT_MARGIN)
        elif request.stable < len(request.prompt):  # else saved whole: its own end is its checkpoint
            targets.append(request.stable)
        return min((n for n in targets if at < n < len(request.prompt) and n >= MIN_TOKENS), default=None)

    def _take_checkpoint(self, request: Request) -> None:
        slot = request.slot
        n_tokens = len(slot.tokens)
        data = self.engine.seq_checkpoint(slot.seq)
        if data:
            # every checkpoint goes to the store with the sequence (the prompt-end one of a request whose reply is
            # prefilled again too, saved by that follow-up): a retry of the prompt after a restart, or after the
            # session went elsewhere, returns there (two recurrent states a turn on disk: the prompt's end and the
            # kept reply's)
            slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens != n_tokens]
            slot.checkpoints.append(Checkpoint(n_tokens, data))
            del slot.checkpoints[:-LIVE_CHECKPOINTS]
        request.checkpoint_at = self._next_checkpoint(request)

    def _restore_if_better(self, prompt: list[int], slot: Slot, live_common: int, limit: int,
                           partition: str = "") -> tuple[Slot, int, Restored | None]:
        """Load the longest cached prefix from RAM/disk into the chosen slot when it beats its live KV."""
        if self.cache is None:
            return slot, live_common, None
        match = self.cache.lookup(prompt, limit, partition)
        if match is None or match.common <= live_common + 16:
            if live_common < MIN_TOKENS:
                self.cache.count("misses")
            return slot, live_common, None
        restored = self.cache.restore(match)
        if restored is None:
            self.cache.count("misses")
            return slot, live_common, None
        self.engine.seq_clear(slot.seq)
        slot.checkpoints = []
        if not self.engine.seq_restore(slot.seq, restored.state, list(restored.tokens)):
            log.warning("the engine refused a cached state of %d tokens; recomputing", restored.n_tokens)
            self.engine.seq_clear(slot.seq)
            slot.tokens = []
            self.cache.count("misses")
            return slot, 0, None
        slot.tokens = list(restored.tokens)
        self.cache.count("hits")
        self.cache.count("tokens_restored", restored.common)
        return slot, restored.common, restored

    def _fork_if_better(self, prompt: list[int], slot: Slot, common: int, limit: int, partition: str = "",
                        session: str | None = None) -> int:
        """Copy the prefix a busy slot of the same partition shares with the prompt into the chosen slot, when it
        beats what that slot holds: requests that run at once with the same start (a request's ``n`` choices,
        sub-agents sent together) compute it once; a child session (a sub-agent, a side request) copies from its
        parent's slot, busy or not, and leaves it as it was. Only where a state can be cut anywhere (the source has
        gone on past the shared part). Returns the tokens the slot now holds."""
        if not self.engine.can_trim:
            return common
        parent = parent_session(session)
        shared, source = max(((min(common_prefix_length(other.tokens, prompt), limit), other) for other in self.slots
                              if (other.busy or (parent is not None and other.session == parent))
                              and other is not slot and other.partition == partition),
                             key=lambda pair: pair[0], default=(0, None))
        if source is None or shared < MIN_TOKENS or shared <= common + 16:
            return common
        state = self.engine.seq_state(source.seq)
        self.engine.seq_clear(slot.seq)
        slot.checkpoints = []
        if not state or not self.engine.seq_restore(slot.seq, state, list(source.tokens)) \
                or not self.engine.seq_keep(slot.seq, shared):
            self.engine.seq_clear(slot.seq)
            slot.tokens = []
            return 0
        slot.tokens = list(source.tokens[:shared])
        log.info("sequence %d starts from %d tokens of sequence %d's live state", slot.seq, shared, source.seq)
        return shared

    def _system_boundary(self, prefix: list[int], prompt: list[int], common: int, partition: str = "") -> int | None:
        """Where the system-and-tools segment (``prefix``: the tokens the prompt shares with it tokenized alone) ends,
        when prefill will cross it and it is not stored yet."""
        if self.cache is None or not prefix:
            return None
        boundary = len(prefix)
        if boundary < MIN_TOKENS or boundary <= common or boundary >= len(prompt) - 1:
            return None
        if prompt[:boundary] != prefix or self.cache.has(prefix, partition):
            return None
        return boundary

    def _save(self, request: Request) -> None:
        """Store the sequence's KV state (its new blocks) after the response is done."""
        slot = request.slot
        if self.cache is None or len(slot.tokens) < MIN_TOKENS:
            return
        state = self.engine.seq_state(slot.seq)
        if not state:
            return
        kept = [c for c in slot.checkpoints if not c.saved and c.n_tokens < len(slot.tokens)]
        end = max(kept, key=lambda c: c.n_tokens) if request.warm and kept else None
        if end is not None and end.n_tokens == request.stable:
            # a kept reply ends where its checkpoint is: the next turn may tokenize the last few tokens otherwise,
            # and restores there (one recurrent state a turn, no second copy of the reply's tail)
            kept.remove(end)
            self._store(slot.tokens[:end.n_tokens], state, request, request.session, "history", kept,
                        held=len(slot.tokens), end=end)
        else:
            self._store(list(slot.tokens), state, request, request.session, "history", kept)

    def _save_deferred(self, slot: Slot) -> None:
        """Save a sequence whose reply's follow-up will not come (the worker stops, or the slot is needed): as
        generated, with every checkpoint it has."""
        if slot.deferred is None:
            return
        self._save(slot.deferred)
        slot.deferred = None

    def _snapshot_system(self, request: Request) -> None:
        request.snapshot_at = None
        slot = request.slot
        if self.cache is None:
            return
        state = self.engine.seq_state(slot.seq)
        if state:
            self._store(list(slot.tokens), state, request, None, "system")

    def _store(self, tokens: list[int], state: StateBytes, request: Request, session: str | None, kind: str,
               checkpoints: list[Checkpoint] | None = None, *, held: int | None = None,
               end: Checkpoint | None = None) -> None:
        """Save (and pin) a state. The cache only saves work: a disk that is full or gone costs the cache an entry,
        never the request or the worker."""
        assert self.cache is not None
        try:
            head = self.cache.save(tokens, state, session, kind=kind,
                                   checkpoints=[(c.n_tokens, c.data) for c in checkpoints or []], held=held,
                                   end=end.data if end else None, partition=request.slot.partition)
            for checkpoint in [*(checkpoints or []), *([end] if end else [])]:
                checkpoint.saved = True
            if head is not None and request.pin_ttl > 0:
                self.cache.pin(head.id, request.pin_ttl)
        except OSError as exc:
            self.cache.count("dropped_writes")
            log.warning("could not save %d tokens to the prompt cache (%s); the reply is unaffected", len(tokens), exc)
        except Exception:  # a cache bug costs the cache an entry, never every request on the model
            self.cache.count("dropped_writes")
            log.exception("saving %d tokens to the prompt cache failed; the reply is unaffected", len(tokens))

    # -- decoding --------------------------------------------------------------------------------

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
        # Each prefilling request evaluates one chunk a step, of the engine's prefill_chunk tokens (fewer only where
        # its prompt, system segment or next checkpoint ends): a long prompt delays the others' next token by one
        # chunk, and a request's chunks are the same whatever runs beside it (the kernels' arithmetic depends on a
        # chunk's size, so greedy replies do not depend on what else the daemon serves). When the step's room does
        # not hold every chunk, the request that waited longest for one goes first.
        room = self.engine.n_batch - len(batch)
        for request in sorted(prefilling, key=lambda r: r.chunk_step):
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
            if len(chunk) > room:
                continue  # the next step (never a smaller chunk: that would change its arithmetic)
            room -= len(chunk)
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
                    self._snapshot_system(request)
                if request.next_prompt == request.checkpoint_at:
                    self._take_checkpoint(request)
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
            self._save(request)
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


def _checkpoint_before(slot: Slot, n_tokens: int) -> Checkpoint | None:
    """The slot's latest checkpoint at or before ``n_tokens``."""
    return max((c for c in slot.checkpoints if c.n_tokens <= n_tokens), key=lambda c: c.n_tokens, default=None)


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


def over_context(tokenize: Callable[[str], list[int]], text: str, n_ctx: int) -> int:
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
