"""The MLX sequences that decode together, in one forward pass a step.

Their caches are merged into mlx-lm's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache``:
left-padded rows, a mask over the padding, a position per row) and kept merged from step to step, so a steady decode
copies no KV. A sequence leaves the group (its row extracted into a cache of its own, the others filtered) when it
stops decoding or when anything else touches its state (a prompt chunk, a save, a cut); sequences that start
decoding join it (merged, then appended to the batch's rows).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def batchable(layers: list[Any]) -> bool:
    """Whether every layer's cache class has a batch form that mlx-lm can merge, extend, filter and split."""
    return all(callable(getattr(type(layer), "merge", None)) for layer in layers)


class DecodeGroup:
    """Which sequences are merged, in row order, and their per-layer batch caches."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.cache: list[Any] = []

    def gather(self, seqs: list[int], caches: list[list[Any]]) -> DecodeGroup:
        """The group holding exactly ``seqs`` (rows in the group's order): those not decoding leave, the others
        join. ``caches``: each sequence's own caches, where a sequence that leaves is put back."""
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

    def release(self, seq: int, caches: list[list[Any]]) -> None:
        """Give a sequence its own caches back (its row of each batch cache) and drop its row from the batch."""
        if seq not in self.seqs:
            return
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
