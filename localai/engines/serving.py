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
from localai.promptcache.blocks import fingerprint
from localai.promptcache.store import MIN_TOKENS, PromptStore, Restored, StateBytes
from localai.protocol import EmbedOp, GenerateOp, ModelInfo
from localai.text import StopMatcher, common_prefix_length

log = logging.getLogger("localai.worker")
Emit = Callable[[dict[str, Any]], None]

# Text is sent to the daemon at most this often (the first token at once): every frame wakes the daemon
# and the client, which on a small CPU preempts the engine's compute threads mid-token. A token is held back only
# when the next one is due within the interval: with steps as long as the interval (4 streams on a CPU) every token
# goes at once, instead of every so often two at once a step late (a 52 ms p99 gap at 26 ms a step).
FLUSH_INTERVAL = 0.025


@dataclass
class Slot:
    """One engine sequence and the tokens its KV state holds."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False
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
    warm: bool = False  # a follow-up prefill (the reply as the next turn renders it): no output, then saved
    follow_up: bool = False  # a warm request follows this one and saves the sequence: do not save it here
    source: str = "miss"  # where the reused prefix came from: live, ram, disk or miss
    restored: int = 0
    restore_ms: float = 0.0
    pin_ttl: float = 0.0  # pin what is saved for this long (Anthropic cache_control), seconds
    text: str = ""  # the prompt as sent (a warm prefill without a session is recognised by it)
    drafter: Drafter | None = None  # speculative decoding from the context (engines/speculative.py)
    draft: list[int] = field(default_factory=list)  # the tokens guessed in this step, after the pending one


class Serving:
    """Serves one engine over the worker protocol."""

    def __init__(self, engine: Engine, options: LoadOptions) -> None:
        self.engine = engine
        self.slots = [Slot(seq=index) for index in range(engine.n_seq)]
        self.requests: dict[str, Request] = {}
        self.waiting: list[GenerateOp] = []
        self.step_seconds = 0.0  # a decode step's wall time, smoothed: when the next token is due
        self.cache: PromptStore | None = None
        if options.cache_dir and options.cache_max_bytes > 0:
            self.cache = PromptStore(Path(options.cache_dir), fingerprint(engine.fingerprint_parts()), engine,
                                     max_bytes=options.cache_max_bytes, ram_bytes=options.cache_ram_bytes,
                                     trims=engine.can_trim)

    def info(self) -> ModelInfo:
        return self.engine.info()

    # -- the loop --------------------------------------------------------------------------------

    def serve(self, inbox: queue.Queue[dict[str, Any] | None], emit: Emit) -> None:
        """Run until ``None`` arrives in the inbox: admit, batch, decode, sample, emit. Replies being prefilled
        (warm requests) are finished and saved first; other requests are cancelled."""
        stopping = False
        while True:
            if stopping and not self.requests and not self.waiting:
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
                        self.waiting = [item for item in self.waiting if item.get("warm")]
                        for request in [r for r in self.requests.values() if not r.warm]:
                            self._finish(request, "cancelled", emit)
                        break
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
            tokens = self.engine.tokenize(op["text"])
            answer: dict[str, Any] = {"ev": "tokens", "id": op["id"], "count": len(tokens)}
            if not op.get("count_only"):
                answer["tokens"] = tokens
            emit(answer)
        elif kind == "embed":
            self._embed(op, emit)  # type: ignore[arg-type]

    def _embed(self, op: EmbedOp, emit: Emit) -> None:
        try:
            tokens = [self.engine.tokenize(text) for text in op["texts"]]
            vectors, counted = self.engine.embed(tokens, truncate=op["truncate"])
        except ValueError as exc:
            emit({"ev": "error", "id": op["id"], "kind": "invalid", "message": str(exc)})
            return
        emit({"ev": "embeddings", "id": op["id"], "vectors": vectors, "prompt_tokens": counted})

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
                emit({"ev": "error", "id": op["id"], "kind": "constraint", "message": str(exc)})
            except Exception as exc:  # a bad request must not take the worker down
                log.exception("request %s failed to start", op.get("id"))
                emit({"ev": "error", "id": op["id"], "kind": "invalid", "message": str(exc)})
        self.waiting[:0] = held

    def _start(self, op: GenerateOp, free: list[Slot], emit: Emit) -> None:
        engine = self.engine
        started = time.perf_counter()
        prompt = engine.tokenize(op["prompt"])
        if not prompt:
            raise ValueError("the prompt is empty")
        reserve = max(0, int(op.get("reserve") or 0))
        if len(prompt) >= engine.n_ctx or len(prompt) + reserve > engine.n_ctx:
            needs = f" and its reply needs room for up to {reserve}" if len(prompt) < engine.n_ctx else ""
            emit({
                "ev": "error", "id": op["id"], "kind": "context_length",
                "message": f"the prompt is {len(prompt)} tokens{needs}, but the model's context (num_ctx) is "
                           f"{engine.n_ctx} tokens; shorten the conversation, ask for fewer output tokens or raise "
                           "num_ctx",
                "prompt_tokens": len(prompt), "n_ctx": engine.n_ctx,
            })
            return
        warm = bool(op.get("warm"))
        sampler = engine.new_sampler(op.get("sampling") or {}, op.get("constraint"))  # may refuse: before any slot
        partition = op.get("cache_partition") or ""
        slot, common = self._choose_slot(free, prompt, warm=warm, partition=partition)
        source = "live" if common else "miss"
        slot, common, restored = self._restore_if_better(prompt, slot, common, partition)
        if restored is not None:
            source = restored.tier
        if common >= len(prompt) and not warm:
            common = len(prompt) - 1  # replay the last token to get fresh logits
        if not engine.seq_keep(slot.seq, common):
            engine.seq_clear(slot.seq)
            common = 0
        slot.tokens = slot.tokens[:common]
        slot.last_used, slot.partition = time.monotonic(), partition
        room = engine.n_ctx - len(prompt)
        requested = op.get("max_tokens")
        max_tokens = room if requested is None or requested < 0 else min(requested, room)
        request = Request(
            id=op["id"], slot=slot, session=op.get("session"), prompt=prompt, next_prompt=common, cached=common,
            max_tokens=max_tokens, sampler=sampler, matcher=StopMatcher(op.get("stop") or []),
            ignore_eos=bool(op.get("ignore_eos")), started=started, warm=warm,
            follow_up=bool(op.get("follow_up")) and self.cache is not None, source=source if common else "miss",
            restored=restored.n_tokens if restored else 0, restore_ms=restored.seconds * 1000 if restored else 0.0,
            pin_ttl=float(op.get("pin_ttl") or 0.0), text=op["prompt"] if warm else "",
        )
        prefix_text = op.get("system_prefix")
        system = engine.tokenize(prefix_text) if self.cache is not None and prefix_text else []
        request.snapshot_at = self._system_boundary(system, prompt, common, partition)
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
        emit({"ev": "prompt", "id": request.id, "prompt_tokens": len(prompt), "cached_tokens": common,
              "cache": {"source": request.source, "restored": request.restored,
                        "restore_ms": round(request.restore_ms, 2)}})
        if warm and request.next_prompt >= len(prompt):
            self._finish(request, "stop", emit)
        elif max_tokens <= 0 and not warm:
            self._finish(request, "length", emit)

    def _choose_slot(self, free: list[Slot], prompt: list[int], *, warm: bool = False,
                     partition: str = "") -> tuple[Slot, int]:
        """The slot for a prompt, and how many of its tokens it already holds.

        With a cache, a slot is reused only when all it holds is a prefix of the prompt (the same
        conversation continuing, or an empty slot), so another session's live state is never trimmed;
        otherwise the least recently used slot is taken (its state was saved after its last request).
        Without a cache, the slot sharing the longest prefix wins.
        """
        scored = [(slot, common_prefix_length(slot.tokens, prompt) if slot.partition == partition else 0)
                  for slot in free]
        if warm:  # the conversation's own slot: its reply's tokens give way to the reply as the template renders it
            return max(scored, key=lambda item: (item[1], -item[0].last_used))
        if self.cache is not None:
            keeping = [(slot, common) for slot, common in scored if common == len(slot.tokens)]
            if keeping:
                return max(keeping, key=lambda item: (item[1], -item[0].last_used))
            lru = min(free, key=lambda slot: slot.last_used)
            return lru, next(common for slot, common in scored if slot is lru)
        return max(scored, key=lambda item: (item[1], -item[0].last_used))

    # -- the prompt cache ------------------------------------------------------------------------

    def _restore_if_better(self, prompt: list[int], slot: Slot, live_common: int,
                           partition: str = "") -> tuple[Slot, int, Restored | None]:
        """Load the longest cached prefix from RAM/disk into the chosen slot when it beats its live KV."""
        if self.cache is None:
            return slot, live_common, None
        match = self.cache.lookup(prompt, partition)
        if match is None or match.common <= live_common + 16:
            if live_common < MIN_TOKENS:
                self.cache.count("misses")
            return slot, live_common, None
        restored = self.cache.restore(match)
        if restored is None:
            self.cache.count("misses")
            return slot, live_common, None
        self.engine.seq_clear(slot.seq)
        if not self.engine.seq_restore(slot.seq, restored.state):
            log.warning("the engine refused a cached state of %d tokens; recomputing", restored.n_tokens)
            self.engine.seq_clear(slot.seq)
            slot.tokens = []
            self.cache.count("misses")
            return slot, 0, None
        slot.tokens = list(restored.tokens)
        self.cache.count("hits")
        self.cache.count("tokens_restored", restored.common)
        return slot, restored.common, restored

    def _system_boundary(self, prefix: list[int], prompt: list[int], common: int, partition: str = "") -> int | None:
        """Where the system-and-tools segment (``prefix``, tokenized) ends, when prefill will cross it and it is not
        stored yet."""
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
        if state:
            self._store(list(slot.tokens), state, request, request.session, "history")

    def _snapshot_system(self, request: Request) -> None:
        request.snapshot_at = None
        slot = request.slot
        if self.cache is None:
            return
        state = self.engine.seq_state(slot.seq)
        if state:
            self._store(list(slot.tokens), state, request, None, "system")

    def _store(self, tokens: list[int], state: StateBytes, request: Request, session: str | None, kind: str) -> None:
        """Save (and pin) a state. The cache only saves work: a disk that is full or gone costs the cache an entry,
        never the request or the worker."""
        assert self.cache is not None
        try:
            head = self.cache.save(tokens, state, session, kind=kind, partition=request.slot.partition)
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
        self._evaluate(emit)
        self.step_seconds += 0.25 * (time.perf_counter() - started - self.step_seconds)

    def _evaluate(self, emit: Emit) -> None:
        batch: list[BatchItem] = []
        owners: list[Request] = []
        drafts: set[int] = set()  # rows of guessed tokens: verified with their request's pending token
        for request in self.requests.values():
            if request.pending_token is not None:
                at = len(request.slot.tokens)
                batch.append(BatchItem(request.slot.seq, request.pending_token, at, True))
                owners.append(request)
                request.draft = self._draft(request, self.engine.n_batch - len(batch))
                for offset, token in enumerate(request.draft, start=1):
                    drafts.add(len(batch))
                    batch.append(BatchItem(request.slot.seq, token, at + offset, True))
                    owners.append(request)
        for request in self.requests.values():
            if request.pending_token is not None or request.next_prompt >= len(request.prompt):
                continue
            room = self.engine.n_batch - len(batch)
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
                if request.warm and request.next_prompt >= len(request.prompt):
                    self._finish(request, "stop", emit)
                    continue
                if not item.logits:
                    continue
                request.prompt_done = now
            else:
                continue
            self._accept(request, self.engine.sample(request.sampler, row), emit)

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
            self._accept(request, token, emit)
            if request.id not in self.requests:
                return  # finished: its KV was cut back to what it keeps
            if index < kept:  # evaluated already, as a draft
                slot.tokens.append(token)
                request.pending_token = None

    def _accept(self, request: Request, token: int, emit: Emit) -> None:
        if not request.ignore_eos and self.engine.is_end(token):
            self._finish(request, "stop", emit)
            return
        request.generated += 1
        request.unsent += request.matcher.feed(self.engine.token_bytes(token))
        now = time.perf_counter()
        if request.unsent and (not request.sent_at or now - request.sent_at + self.step_seconds >= FLUSH_INTERVAL):
            emit({"ev": "text", "id": request.id, "text": request.unsent})
            request.unsent, request.sent_at = "", now
        if request.matcher.stopped:
            self._finish(request, "stop", emit)
        elif request.generated >= request.max_tokens or len(request.slot.tokens) + 1 >= self.engine.n_ctx:
            self._finish(request, "length", emit)
        else:
            request.pending_token = token
            if request.drafter is not None:
                request.drafter.extend([token])

    def _finish(self, request: Request, reason: str, emit: Emit) -> None:
        tail = request.unsent + request.matcher.flush()
        if tail and reason != "cancelled":
            emit({"ev": "text", "id": request.id, "text": tail})
        now = time.perf_counter()
        prompt_done = request.prompt_done or now
        drafter = request.drafter
        if drafter is not None and drafter.drafted:
            self.engine.seq_keep(request.slot.seq, len(request.slot.tokens))  # drafts past where it stopped
        emit({
            "ev": "done", "id": request.id, "finish_reason": reason, "stop_sequence": request.matcher.matched,
            "usage": {
                "prompt_tokens": len(request.prompt), "completion_tokens": request.generated,
                "cached_tokens": request.cached,
                "prompt_ms": (prompt_done - request.started) * 1000.0,
                "decode_ms": (now - prompt_done) * 1000.0,
                "drafted_tokens": drafter.drafted if drafter else 0,
                "accepted_tokens": drafter.accepted if drafter else 0,
            },
        })
        if reason != "cancelled" and not request.follow_up:
            self._save(request)
        self._release(request)
        if self.cache is not None:
            emit({"ev": "stats", "cache": self.cache.stats_snapshot()})

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
            slot.tokens = []
        return bool(idle)

    def _fail_batch(self, owners: list[Request], message: str, emit: Emit) -> None:
        for request in {id(r): r for r in owners}.values():
            if request.id in self.requests:
                self.engine.seq_clear(request.slot.seq)
                request.slot.tokens = []
                emit({"ev": "error", "id": request.id, "kind": "engine", "message": message})
                self._release(request)


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


def in_sequence_order(batch: list[BatchItem], owners: list[Request], drafts: set[int]
                      ) -> tuple[list[BatchItem], list[Request], set[int]]:
    """The step's rows grouped by sequence, in increasing sequence order, each sequence's rows in their order.

    With a KV stream per sequence llama.cpp cuts a batch into ubatches of consecutive, increasing sequence ids
    (``split_equal``): rows in arrival order (sequences 1, 2, 3, 0) cost a second pass over the weights each step
    (4 streams on smollm2: 31 ms a step instead of 24)."""
    order = sorted(range(len(batch)), key=lambda row: batch[row].seq)  # stable: a request's rows stay in order
    return ([batch[row] for row in order], [owners[row] for row in order],
            {new for new, old in enumerate(order) if old in drafts})
