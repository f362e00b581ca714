"""The serving loop's bridge to the prompt cache: which part of a prompt a sequence can keep (its KV cut back, a
checkpoint returned to), a longer prefix restored from RAM or disk or copied from another sequence, the checkpoints a
prefill takes, and what is saved after a request (its sequence, the shared system segment, pins). The only code of
the serving loop that touches the store (``promptcache.store.PromptStore``)."""

from __future__ import annotations

import logging

from localai.engines.engine import Engine
from localai.engines.sequences import Checkpoint, Request, Slot, checkpoint_before
from localai.promptcache.store import MIN_TOKENS, PromptStore, Restored, StateBytes
from localai.schema import parent_session
from localai.text import common_prefix_length

log = logging.getLogger("localai.worker")

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
# ...and, in RAM only, right before the prompt's last token (which is evaluated in a step of its own anyway, so this
# costs a copy of the state, not a step): the same prompt sent again (a retry, a regenerate, a second choice after
# the first) evaluates one token, not CHECKPOINT_MARGIN in two steps (a real-shaped Qwen3.5 hybrid: about 100 ms of a
# 2-core CPU's time per request). Not saved: a turn writes no third recurrent state.
LIVE_CHECKPOINTS = 4  # kept in RAM per sequence (the newest); older ones are in the prompt cache once saved


def live_point(request: Request) -> int:
    """Where a cold prompt's RAM-only checkpoint goes: before its last token, which a retry of the same prompt
    replays for fresh logits (so it evaluates that one token, not the ``CHECKPOINT_MARGIN`` before it)."""
    return len(request.prompt) - 1


class SlotCache:
    """The prompt cache as the serving loop's slots see it (``cache`` is None with the cache off)."""

    def __init__(self, engine: Engine, cache: PromptStore | None, slots: list[Slot]) -> None:
        self.engine = engine
        self.cache = cache
        self.slots = slots


    def reachable(self, slot: Slot, wanted: int) -> int:
        """How many of its tokens a slot keeps when cut back to ``wanted``: all of them when nothing is cut or the
        engine cuts anywhere, else the latest checkpoint at or before ``wanted``."""
        if wanted >= len(slot.tokens) or not self.engine.checkpoints:
            return min(wanted, len(slot.tokens))
        point = checkpoint_before(slot, wanted)
        return point.n_tokens if point else 0

    def cut(self, slot: Slot, wanted: int) -> int:
        """Cut a slot back to ``wanted`` tokens, or, where its state cannot be cut there, to the latest checkpoint
        before it; a sequence is never continued from a point its state cannot return to. Returns what it keeps."""
        engine = self.engine
        kept = min(wanted, len(slot.tokens))
        if kept < len(slot.tokens) and not engine.seq_keep(slot.seq, kept):
            point = checkpoint_before(slot, kept)  # only a checkpoint engine's slots have any
            if point is not None and engine.seq_rollback(slot.seq, point.data, point.n_tokens):
                kept = point.n_tokens
            else:
                engine.seq_clear(slot.seq)
                kept = 0
        slot.tokens = slot.tokens[:kept]
        slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= kept]
        return kept

    def next_checkpoint(self, request: Request) -> int | None:
        """The next prompt length at which a checkpoint engine takes a checkpoint: every ``CHECKPOINT_EVERY``
        tokens, and near the prompt's end: ``CHECKPOINT_MARGIN`` tokens before it (where a retried prompt and a
        reply's follow-up return), or, for a follow-up (a kept reply), after its last token that no next turn
        tokenizes otherwise (where the next turn returns)."""
        if not self.engine.checkpoints:
            return None
        at = request.next_prompt
        targets = [(at // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY]
        if not request.warm:
            targets += [len(request.prompt) - CHECKPOINT_MARGIN, live_point(request)]
        elif request.stable < len(request.prompt):  # else saved whole: its own end is its checkpoint
            targets.append(request.stable)
        return min((n for n in targets if at < n < len(request.prompt) and n >= MIN_TOKENS), default=None)

    def take_checkpoint(self, request: Request) -> None:
        slot = request.slot
        n_tokens = len(slot.tokens)
        data = self.engine.seq_checkpoint(slot.seq)
        if data:
            # every checkpoint goes to the store with the sequence (the prompt-end one of a request whose reply is
            # prefilled again too, saved by that follow-up): a retry of the prompt after a restart, or after the
            # session went elsewhere, returns there (two recurrent states a turn on disk: the prompt's end and the
            # kept reply's)
            live = not request.warm and n_tokens == live_point(request)
            slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens != n_tokens]
            slot.checkpoints.append(Checkpoint(n_tokens, data, live=live))
            del slot.checkpoints[:-LIVE_CHECKPOINTS]
        request.checkpoint_at = self.next_checkpoint(request)

    def restore_if_better(self, prompt: list[int], slot: Slot, live_common: int, limit: int,
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

    def fork_if_better(self, prompt: list[int], slot: Slot, common: int, limit: int, partition: str = "",
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

    def system_boundary(self, prefix: list[int], prompt: list[int], common: int, partition: str = "") -> int | None:
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

    def save(self, request: Request) -> None:
        """Store the sequence's KV state (its new blocks) after the response is done."""
        slot = request.slot
        if self.cache is None or len(slot.tokens) < MIN_TOKENS:
            return
        state = self.engine.seq_state(slot.seq)
        if not state:
            return
        kept = [c for c in slot.checkpoints if not c.saved and not c.live and c.n_tokens < len(slot.tokens)]
        end = max(kept, key=lambda c: c.n_tokens) if request.warm and kept else None
        if end is not None and end.n_tokens == request.stable:
            # a kept reply ends where its checkpoint is: the next turn may tokenize the last few tokens otherwise,
            # and restores there (one recurrent state a turn, no second copy of the reply's tail)
            kept.remove(end)
            self.store(slot.tokens[:end.n_tokens], state, request, request.session, "history", kept,
                        state_tokens=len(slot.tokens), end=end)
        else:
            self.store(list(slot.tokens), state, request, request.session, "history", kept)

    def save_deferred(self, slot: Slot) -> None:
        """Save a sequence whose reply's follow-up will not come (the worker stops, or the slot is needed): as
        generated, with every checkpoint it has."""
        if slot.deferred is None:
            return
        self.save(slot.deferred)
        slot.deferred = None

    def snapshot_system(self, request: Request) -> None:
        request.snapshot_at = None
        slot = request.slot
        if self.cache is None:
            return
        state = self.engine.seq_state(slot.seq)
        if state:
            self.store(list(slot.tokens), state, request, None, "system")

    def store(self, tokens: list[int], state: StateBytes, request: Request, session: str | None, kind: str,
               checkpoints: list[Checkpoint] | None = None, *, state_tokens: int | None = None,
               end: Checkpoint | None = None) -> None:
        """Save (and pin) a state. The cache only saves work: a disk that is full or gone costs the cache an entry,
        never the request or the worker."""
        assert self.cache is not None
        try:
            head = self.cache.save(tokens, state, session, kind=kind,
                                   checkpoints=[(c.n_tokens, c.data) for c in checkpoints or []],
                                   state_tokens=state_tokens, end=end.data if end else None,
                                   partition=request.slot.partition)
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
