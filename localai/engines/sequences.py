"""What the serving loop knows of each engine sequence and of each generation on one: the tokens a sequence's KV
holds, where its uncuttable state can return to (checkpoints), and a request's progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from localai.engines.speculative import Drafter
from localai.engines.token_logprobs import TokenLogprobs
from localai.text import StopMatcher


@dataclass
class Checkpoint:
    """A sequence's uncuttable state (``Engine.seq_checkpoint``) when it held ``n_tokens`` tokens."""

    n_tokens: int
    data: bytes
    saved: bool = False
    live: bool = False  # kept in RAM only, never saved: the state before a prompt's last token (a retry's return)


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


def checkpoint_before(slot: Slot, n_tokens: int) -> Checkpoint | None:
    """The slot's latest checkpoint at or before ``n_tokens``."""
    return max((c for c in slot.checkpoints if c.n_tokens <= n_tokens), key=lambda c: c.n_tokens, default=None)
