"""What the reports say of a model's state (``/api/show``, the worker's ready frame): pure, so the daemon, which
never imports an engine, says the same from a GGUF header as the loaded worker does."""

from __future__ import annotations


def state_kind(recurrent: bool, window: int) -> str:
    """What a sequence's state is, for the prompt cache: cut into blocks, plus checkpoints where it cannot be."""
    parts = ["recurrent layers (checkpoints)"] if recurrent else []
    parts += [f"a {window}-token sliding window (checkpoints)"] if window else []
    return "attention KV in blocks" + (", " + ", ".join(parts) if parts else "")


def speculative_support(can_draft: bool, recurrent: bool, window: int) -> str:
    """Whether speculative decoding runs on this model, and why not where it does not."""
    if can_draft:
        return "when asked (PARAMETER speculative on): a batch's rows are not bit-identical to one token at a time"
    why = "recurrent layers" if recurrent else f"a {window}-token sliding window"
    return f"off: {why} cannot drop a rejected draft (their state cannot return to an earlier token)"
