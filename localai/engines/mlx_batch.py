"""The MLX sequences that decode together, in one forward pass a step.

Their caches are merged into mlx-lm's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache``:
left-padded rows, a mask over the padding, a position per row) and kept merged from step to step, so a steady decode
copies no KV. A sequence leaves the group (its row extracted into a cache of its own, the others filtered) when it
stops decoding or when anything else touches its state (a prompt chunk, a save, a cut); sequences that start
decoding join it (merged, then appended to the batch's rows).

Rows of different lengths in one pass (a token and its drafts beside single tokens) are right-padded, as mlx-lm's
BatchGenerator pads prompts; the padding, and drafts the sampler rejected, are then dropped from the end of their row
by mlx-lm's own ``prepare(right_padding=...)``/``finalize()``, which rolls each row right and counts what it rolled as
left padding (masked). The drops of a step are applied together, in one roll per layer, before the group is next
used.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache


def batchable(layers: list[Any]) -> bool:
    """Whether every layer's cache class has a batch form that mlx-lm can merge, extend, filter and split."""
    return all(callable(getattr(type(layer), "merge", None)) for layer in layers)


def ragged(layers: list[Any]) -> bool:
    """Whether rows of different lengths can share a pass: every layer a plain KV cache (its batch form drops the
    end of one row; a window or recurrent state cannot give back a token)."""
    return all(type(layer) is mlx_cache.KVCache for layer in layers)


class DecodeGroup:
    """Which sequences are merged, in row order, and their per-layer batch caches."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.cache: list[Any] = []
        self.dropped: dict[int, int] = {}  # seq -> tokens at the end of its row to drop before the next use

    def gather(self, seqs: list[int], caches: list[list[Any]]) -> DecodeGroup:
        """The group holding exactly ``seqs`` (rows in the group's order): those not decoding leave, the others
        join. ``caches``: each sequence's own caches, where a sequence that leaves is put back."""
        self.settle()
        for seq in [seq for seq in self.seqs if seq not in seqs]:
            self.release(seq, caches)
        joining = [seq for seq in seqs if seq not in self.seqs]
        if joining:
            merged = [type(layers[0]).merge(list(layers)) for layers in zip(*(caches[seq] for seq in joining),
                                                                           strict=True)]
            if self.seqs:
                for mine, new in zip(self.cache, merged, strict=True):
                    mine.extend(new)
            else:
                self.cache = merged
            self.seqs += joining
        return self

    def drop(self, seq: int, n_tokens: int) -> None:
        """Drop the last ``n_tokens`` of a sequence's row (right padding, rejected drafts), at the next use."""
        if n_tokens > 0:
            self.dropped[seq] = self.dropped.get(seq, 0) + n_tokens

    def settle(self) -> None:
        """Apply the pending drops: each row rolled right by its drop, in one pass over each layer."""
        if not self.dropped:
            return
        padding = [self.dropped.get(seq, 0) for seq in self.seqs]
        self.dropped = {}
        for layer in self.cache:
            layer.prepare(right_padding=padding)
            layer.finalize()

    def release(self, seq: int, caches: list[list[Any]]) -> None:
        """Give a sequence its own caches back (its row of each batch cache) and drop its row from the batch."""
        if seq not in self.seqs:
            return
        self.settle()
        index = self.seqs.index(seq)
        caches[seq] = [layer.extract(index) for layer in self.cache]
        del self.seqs[index]
        if not self.seqs:
            self.cache = []
            return
        keep = mx.array([row for row in range(len(self.seqs) + 1) if row != index])
        for layer in self.cache:
            layer.filter(keep)

    def state(self) -> list[Any]:
        return [layer.state for layer in self.cache]
